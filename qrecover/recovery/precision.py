"""The training step's number formats: bf16 autocast where the device computes it natively, and the frozen base's
unpacked floats in bf16 alongside it (:func:`frozen_base_in`), so that activations stay bf16 between projections.

Why the second: with fp32 norm weights (and an fp32 embedding) the residual stream is fp32 under autocast, so every
projection casts its input to bf16, PEFT casts each adapter's input back to fp32 (the adapter weights' dtype) and
autocast casts it down again, and autograd mirrors each cast in backward. On an H100 (Llama-3.2-1B geometry,
rank 16, KD, 8 x 2048 tokens; ``benchmarks/train_speed.py --profile``) those copies were 18% of a step's GPU time,
and the multiplies and adds in fp32 around them another ~20%. The teacher is already bf16 on CUDA
(:func:`qrecover.recovery.objective.place_teacher`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn as nn

from ..hardware import native_bf16
from .config import RecoverConfig


def mixed_precision(cfg: RecoverConfig) -> str:
    """What ``cfg.precision`` means on this device: "bf16" (autocast) or "no" (fp32)."""
    if cfg.precision == "auto":
        return "bf16" if native_bf16() else "no"
    return "bf16" if cfg.precision == "bf16" else "no"


def base_dtype(cfg: RecoverConfig, precision: str, device: torch.device, sharded: bool, callback: bool = False
               ) -> torch.dtype | None:
    """The dtype :func:`frozen_base_in` gives the frozen base for this run, or None to leave it as loaded:
    ``cfg.base_dtype`` 'bf16', or 'auto' with bf16 autocast on CUDA, an unsharded base and no ``callback`` (a
    callback evaluates the model mid-run, and should see it as a later evaluation loads it)."""
    if cfg.base_dtype == "bf16":
        return torch.bfloat16
    if cfg.base_dtype == "auto" and precision == "bf16" and device.type == "cuda" and not sharded and not callback:
        return torch.bfloat16
    return None


@contextlib.contextmanager
def frozen_base_in(model: nn.Module, dtype: torch.dtype | None) -> Iterator[int]:
    """While active, ``model``'s frozen floating-point parameters (norm weights, an unquantized embedding or head,
    biases) are ``dtype``, the input embedding's output is cast to it, and PEFT's adapters take their input as it
    comes whenever autocast is on (it runs them in bf16 either way; outside autocast, as in a forward that checks
    the head, they cast it to their weights' dtype as usual). Trainable parameters (adapters, tuned tables) and
    buffers (the packed weights) are untouched; the original tensors are put back on exit. Yields how many
    parameters changed; ``dtype`` None changes nothing."""
    if dtype is None:
        yield 0
        return
    saved = [(p, p.data) for p in model.parameters() if not p.requires_grad and p.is_floating_point() and p.dtype != dtype]
    with contextlib.ExitStack() as scope:
        for p, data in saved:
            p.data = data.to(dtype)
        scope.callback(_restore, saved)
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        if emb is not None:
            hook = emb.register_forward_hook(lambda m, args, out: out.to(dtype) if out.is_floating_point() else out)
            scope.callback(hook.remove)
        for m in model.modules():
            if hasattr(m, "cast_input_dtype_enabled"):  # a PEFT tuner layer (peft >= 0.15; older ones always cast)
                scope.callback(setattr, m, "cast_input_dtype_enabled", m.cast_input_dtype_enabled)
                scope.callback(m.register_forward_pre_hook(_cast_outside_autocast).remove)
        yield len(saved)


def _cast_outside_autocast(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook: a PEFT layer casts its input to its weights' dtype only when autocast is off. Also right
    when a checkpointed layer is recomputed in backward (autocast's state is restored for that)."""
    x = args[0] if args and isinstance(args[0], torch.Tensor) else None
    module.cast_input_dtype_enabled = x is None or not torch.is_autocast_enabled(x.device.type)


def _restore(saved: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    for p, data in saved:
        p.data = data

"""Fewer passes over the activations in a training step: LoRA's scale and add folded into one GEMM, and Liger
Kernel's fused RMSNorm and SwiGLU on CUDA.

An H100 profile of a recovery step (Llama-3.2-1B geometry, rank 16 on every projection, KD, 4 x 2048 tokens,
bf16 base; ``benchmarks/train_speed.py --profile``, 2026-11-27) spent 38% of its GPU time in matmuls and most of
the rest in elementwise kernels over activation-sized tensors: 855 multiplies (41 ms of 243), 821 copies (24 ms),
608 adds (22 ms). Counted per decoder layer, the largest sources are:

- PEFT's ``result + lora_B(lora_A(x)) * scaling``: a multiply and an add over every projection's output, and the
  multiply again in backward. :func:`fused_lora` computes ``result.addmm_(lora_A(x), B^T, alpha=scaling)``: the
  scale and the add happen in the GEMM's epilogue (about 5 of 7 passes over each output saved).
- transformers' RMSNorm (fp32 upcast, ``pow``, ``mean``, ``rsqrt``, two multiplies, a downcast: ~10 passes where a
  fused kernel makes 2) and SwiGLU's ``act(gate) * up``. Liger Kernel's ``LigerRMSNormFunction`` and
  ``LigerSiLUMulFunction`` (well-kept Triton kernels with their own backward) replace them on CUDA where
  liger-kernel is installed (``pip install qrecover[train-gpu]``), on module instances only and only while training
  (Liger's own ``apply_liger_kernel_to_*`` patches transformers' classes for the whole process).

While gradients are recorded, a plain LoRA projection on a frozen dense or packed base runs as one autograd node
(:class:`LoraLinear`) instead of PEFT's chain of modules and casts: its backward computes the input's gradient as
``gy W + s (gy B) A`` with the adapter's part added in the second GEMM's epilogue (no output-sized add), and the host
dispatches about half as many operators per projection (counted per step by ``benchmarks/train_speed.py --tiny``):
what the host spends per step bounds a GPU step once its kernels are fast.

Both keep the numbers (the same operations, fused; tests compare outputs and gradients with the unfused layers).
"""

from __future__ import annotations

import contextlib
import itertools
import types
from collections.abc import Iterator

import torch
import torch.nn as nn

#: RMSNorm classes whose forward is Llama's (fp32 statistics, the normalised input cast back, times ``weight``)
LLAMA_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "MistralRMSNorm", "SmolLM3RMSNorm")


def _plain_lora(m: nn.Module) -> bool:
    """A PEFT LoRA ``Linear`` with one adapter, no dropout and no variant (DoRA and the like): what
    :func:`_lora_forward` computes exactly."""
    from peft.tuners.lora.layer import Linear as LoraLinear  # qrecover's QuantLoraLinear is one too

    return (isinstance(m, LoraLinear) and hasattr(m, "lora_variant") and len(m.lora_A) == 1 and not m.lora_variant
            and not getattr(m, "fan_in_fan_out", False)
            and all(isinstance(d, nn.Identity) for d in m.lora_dropout.values()))


class LoraLinear(torch.autograd.Function):
    """``y = x W^T + b + s (x A^T) B^T`` for a frozen ``W`` (and ``b``) as one autograd node, every tensor already
    in the compute dtype. Backward: ``gx = gy W + s (gy B) A`` (the second product added in its GEMM's epilogue),
    ``gA = s (gy B)^T x``, ``gB = s gy^T (x A^T)``; saves ``x`` and ``x A^T`` as PEFT's graph does."""

    @staticmethod
    def forward(ctx, x, w, bias, a, b, scale: float):
        h = x @ a.t()
        y = torch.addmm(bias, x, w.t()) if bias is not None else x @ w.t()
        y.addmm_(h, b.t(), alpha=scale)
        ctx.save_for_backward(x, w, a, b, h)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, gy):
        x, w, a, b, h = ctx.saved_tensors
        s = ctx.scale
        gh = gy @ b  # (n, r): the adapter's share of the gradient, unscaled
        gx = torch.addmm(gy @ w, gh, a, alpha=s) if ctx.needs_input_grad[0] else None
        ga = torch.mm(gh.t(), x).mul_(s) if ctx.needs_input_grad[3] else None
        gb = torch.mm(gy.t(), h).mul_(s) if ctx.needs_input_grad[4] else None
        return gx, None, None, ga, gb, None


def _frozen_weight(base: nn.Module, dtype: torch.dtype) -> torch.Tensor | None:
    """The frozen base's dense weight in ``dtype`` (a packed layer's cached dense copy), or None where :class:`LoraLinear`
    must not stand in for it: a trained weight or bias, tuned packed tensors, hooks, or ``QRECOVER_KERNELS=1``."""
    from .. import kernels
    from ..qlinear import QuantLinear

    if base._forward_hooks or base._forward_pre_hooks or (base.bias is not None and base.bias.requires_grad):
        return None
    if isinstance(base, QuantLinear):
        if base._masters or kernels.mode() == "1":
            return None
        return base.dequantize(dtype)
    if type(base) is nn.Linear and not base.weight.requires_grad:
        return base.weight.to(dtype)
    return None


def _lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """PEFT's LoRA forward as one :class:`LoraLinear` node while gradients are recorded, else with ``scaling`` and
    the add inside one ``addmm_`` (PEFT's own forward where anything else is asked: several or disabled adapters,
    merged weights, per-sample adapter names, mixed dtypes)."""
    name = next(iter(self.lora_A))
    lora_a = self.lora_A[name]
    autocast = torch.is_autocast_enabled(x.device.type)
    if (args or kwargs or self.disable_adapters or self.merged or list(self.active_adapters) != [name]
            or not (autocast or x.dtype == lora_a.weight.dtype)):
        return type(self).forward(self, x, *args, **kwargs)
    x2 = x.reshape(-1, x.shape[-1])
    lora_b = self.lora_B[name]
    if torch.is_grad_enabled() and not (lora_a._forward_hooks or lora_a._forward_pre_hooks or lora_b._forward_hooks
                                        or lora_b._forward_pre_hooks or lora_a.bias is not None or lora_b.bias is not None):
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        w = _frozen_weight(self.base_layer, dtype)
        if w is not None:
            bias = self.base_layer.bias
            with torch.autocast(x.device.type, enabled=False):
                out = LoraLinear.apply(x2.to(dtype), w, None if bias is None else bias.to(dtype),
                                       lora_a.weight.to(dtype), lora_b.weight.to(dtype), float(self.scaling[name]))
            return out.reshape(*x.shape[:-1], out.shape[-1])
    result = self.base_layer(x2)
    a = lora_a(x2)
    if result.dtype != a.dtype or result._base is not None:  # as PEFT computes it
        out = result + self.lora_B[name](a) * self.scaling[name]
    else:
        out = result.addmm_(a, self.lora_B[name].weight.to(a.dtype).t(), alpha=self.scaling[name])
    return out.reshape(*x.shape[:-1], out.shape[-1])


@contextlib.contextmanager
def _forwards(pairs: list[tuple[nn.Module, object]]) -> Iterator[int]:
    """While active, each module of ``pairs`` runs its function as its forward (an instance attribute, removed after);
    yields how many."""
    for m, fn in pairs:
        m.forward = types.MethodType(fn, m)
    try:
        yield len(pairs)
    finally:
        for m, _ in pairs:
            m.__dict__.pop("forward", None)


def fused_lora(model: nn.Module) -> contextlib.AbstractContextManager[int]:
    """While active, every plain PEFT LoRA ``Linear`` of ``model`` runs :func:`_lora_forward`; yields how many."""
    return _forwards([(m, _lora_forward) for m in model.modules() if _plain_lora(m)])


def liger_available() -> bool:
    try:
        import liger_kernel.ops.rms_norm  # noqa: F401
        import liger_kernel.ops.swiglu  # noqa: F401
    except Exception:  # not installed, or no triton/GPU build to import with
        return False
    return True


def _norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return LigerRMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon, 0.0, "llama", False)


def _mlp_forward(self, x: torch.Tensor) -> torch.Tensor:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return self.down_proj(LigerSiLUMulFunction.apply(self.gate_proj(x), self.up_proj(x)))


#: SiLU activations: torch's, and transformers' ``ACT2FN["silu"]`` (its own class; the H100 run of 2026-11-27 matched
#: only torch's, so its MLPs stayed unfused there)
SILU = ("SiLU", "SiLUActivation")


def _swiglu_mlp(m: nn.Module) -> bool:
    return (all(hasattr(m, p) for p in ("gate_proj", "up_proj", "down_proj"))
            and type(getattr(m, "act_fn", None)).__name__ in SILU and type(m).__name__.endswith("MLP"))


def liger_layers(*models: nn.Module | None) -> contextlib.AbstractContextManager[int]:
    """While active, Llama-style RMSNorms and SiLU-gated MLPs of ``models`` on CUDA run Liger Kernel's fused
    kernels (forward and backward); yields how many modules; 0 and nothing changed without liger-kernel or CUDA."""
    mods = []
    if liger_available():
        for model in (m for m in models if m is not None):
            for m in model.modules():
                if not any(t.is_cuda for t in itertools.chain(m.parameters(), m.buffers())):  # packed: buffers
                    continue
                if type(m).__name__ in LLAMA_NORMS and hasattr(m, "variance_epsilon"):
                    mods.append((m, _norm_forward))
                elif _swiglu_mlp(m):
                    mods.append((m, _mlp_forward))
    return _forwards(mods)

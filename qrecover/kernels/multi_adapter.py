"""Many LoRA adapters on one quantized base, chosen per token: ``y[m] = Wq x[m] + s[a] B[a] (A[a] x[m])``, ``a = idx[m]``.

The layout is the one vLLM's punica-style LoRA kernels take: adapters stacked along a first axis, and a
per-token adapter index (``-1``: no adapter for that token, the base output alone).

- ``lora_a``: ``(n_adapters, r, in_features)`` (PEFT's ``lora_A.weight`` of each adapter, stacked)
- ``lora_b``: ``(n_adapters, out_features, r)`` (PEFT's ``lora_B.weight``)
- ``scaling``: ``(n_adapters,)`` fp32 (PEFT's ``lora_alpha / r``)
- ``index``: ``(M,)`` int, one entry per token (row of the flattened input)

Adapters of different ranks are zero-padded to the largest (:func:`stack_adapters`); a zero row of ``A``
and column of ``B`` add nothing.

Two Triton kernels do the adapter part in two batched launches whatever the mix of adapters (BGMV, one
program per token and output block, each reading its own adapter by index):

- :func:`lora_shrink`: ``t (M, r) fp32 = A[idx] x``, split-K over ``in_features`` with fp32 atomic adds;
- :func:`lora_expand`: ``y (M, O) += scaling[idx] * B[idx] t``, in place on the base output.

:func:`lora_delta_reference` is the torch reference (adapters applied one by one over the distinct indices:
the baseline the benchmark measures against), and :class:`MultiAdapterLinear` wraps a base layer:
``MultiAdapterLinear(quant_linear, lora_a, lora_b, scaling)(x, index)``. It uses the kernels for CUDA inputs
(unless ``QRECOVER_KERNELS=0`` or triton is missing) and the reference otherwise.

:func:`attach_adapters` serves PEFT adapter directories (qrecover's recovery adapters are PEFT adapters)
on a whole model: ``set_index = attach_adapters(model, [dir0, dir1]); set_index(torch.tensor([0, 1, -1]))``
then any forward (or ``generate``) runs each sequence through its own adapter.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file
from torch import nn

from ..errors import QRecoverError
from . import enabled, triton_available


def _check(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor, index: torch.Tensor) -> None:
    n, r, i = lora_a.shape
    if lora_b.shape[0] != n or lora_b.shape[2] != r:
        raise QRecoverError(f"lora_b {tuple(lora_b.shape)} does not match lora_a {tuple(lora_a.shape)}: "
                            "expected (n_adapters, out_features, r)")
    if x.shape[-1] != i:
        raise QRecoverError(f"input {tuple(x.shape)} has {x.shape[-1]} features, the adapters take {i}")
    if scaling.shape != (n,):
        raise QRecoverError(f"scaling {tuple(scaling.shape)} must be ({n},), one factor per adapter")
    m = x.numel() // i
    if index.shape != (m,):
        raise QRecoverError(f"index {tuple(index.shape)} must be ({m},), one adapter (or -1) per token")


def stack_adapters(adapters: list[tuple[torch.Tensor, torch.Tensor, float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[(A (r_i, I), B (O, r_i), scaling_i)] -> (lora_a (n, r, I), lora_b (n, O, r), scaling (n,))``, ``r = max r_i``."""
    if not adapters:
        raise QRecoverError("stack_adapters needs at least one (A, B, scaling) adapter")
    r = max(a.shape[0] for a, _, _ in adapters)
    lora_a = torch.stack([torch.nn.functional.pad(a, (0, 0, 0, r - a.shape[0])) for a, _, _ in adapters])
    lora_b = torch.stack([torch.nn.functional.pad(b, (0, r - b.shape[1])) for _, b, _ in adapters])
    return lora_a, lora_b, torch.tensor([float(s) for _, _, s in adapters], dtype=torch.float32)


def lora_delta_reference(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
                         index: torch.Tensor) -> torch.Tensor:
    """``(M, O)`` adapter output in ``x.dtype``, one adapter at a time over the distinct entries of ``index``."""
    x2 = x.reshape(-1, x.shape[-1])
    out = x2.new_zeros(x2.shape[0], lora_b.shape[1])
    for a in index.unique().tolist():
        if a < 0:
            continue
        rows = index == a
        out[rows] = (x2[rows] @ lora_a[a].to(x.dtype).T) @ lora_b[a].to(x.dtype).T * scaling[a].to(x.dtype)
    return out


def _kernels():
    from . import multi_adapter_kernels  # lazy: pulls triton, optional (absent on CPU-only machines)

    return multi_adapter_kernels


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x (M, I)``, ``lora_a (n, r, I)``, ``index (M,)`` -> ``t (M, r)`` fp32, ``t[m] = A[index[m]] x[m]`` (0 for -1)."""
    return _kernels().shrink(x, lora_a, index)


def lora_expand(t: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor, index: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """In place: ``y (M, O) += scaling[index[m]] * lora_b[index[m]] @ t[m]`` for every ``index[m] >= 0``; returns ``y``."""
    return _kernels().expand(t, lora_b, scaling, index, y)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
             index: torch.Tensor, use_kernels: bool | None = None) -> torch.Tensor:
    """``y (M, O) + delta`` for ``x (M, I)``: the Triton shrink/expand (in place on ``y``) or the torch reference.

    ``use_kernels``: None decides by device (CUDA, triton installed, ``QRECOVER_KERNELS`` not 0); True forces
    the kernels (on CPU they need ``TRITON_INTERPRET=1``).
    """
    _check(x, lora_a, lora_b, scaling, index)
    if use_kernels is None:
        use_kernels = x.is_cuda and enabled() and triton_available()
    if not use_kernels:
        return y + lora_delta_reference(x, lora_a, lora_b, scaling, index)
    t = lora_shrink(x, lora_a, index)
    return lora_expand(t, lora_b, scaling, index, y)


class MultiAdapterLinear(nn.Module):
    """A base linear layer (e.g. a :class:`~qrecover.qlinear.QuantLinear`) serving many LoRA adapters at once.

    ``forward(x (..., I), index=None) -> (..., O)``: token ``m`` (row ``m`` of ``x`` flattened to
    ``(tokens, I)``) gets adapter ``index[m]``, or the base output alone when ``index[m] == -1``. An index of one
    entry per sequence (``x (B, T, I)``, ``index (B,)``) applies to all ``T`` tokens of the sequence. Without
    ``index`` the layer uses ``self.token_index``, set for a whole model by :func:`attach_adapters` (the way
    vLLM sets its per-batch LoRA mapping once for every layer). The stacked adapters are buffers (they move
    with ``.to``); build them from PEFT-style pairs with :func:`stack_adapters`.
    """

    def __init__(self, base: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor):
        super().__init__()
        self.base = base
        self.register_buffer("lora_a", lora_a)
        self.register_buffer("lora_b", lora_b)
        self.register_buffer("scaling", scaling.float())
        self.token_index: torch.Tensor | None = None

    @classmethod
    def from_adapters(cls, base: nn.Module, adapters: list[tuple[torch.Tensor, torch.Tensor, float]]) -> MultiAdapterLinear:
        return cls(base, *stack_adapters(adapters))

    def forward(self, x: torch.Tensor, index: torch.Tensor | None = None, use_kernels: bool | None = None) -> torch.Tensor:
        index = self.token_index if index is None else index
        if index is None:
            raise QRecoverError("MultiAdapterLinear has no adapter index: pass index=, or call the setter returned by "
                                "attach_adapters(model, adapters) with one adapter (or -1) per sequence or token")
        tokens = x.numel() // x.shape[-1]
        if x.dim() == 3 and index.numel() == x.shape[0] != tokens:  # one entry per sequence
            index = index.repeat_interleave(x.shape[1])
        y = self.base(x)
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        lora_a, lora_b = self.lora_a.to(x.dtype), self.lora_b.to(x.dtype)
        out = add_lora(y2.contiguous(), x2.contiguous(), lora_a, lora_b, self.scaling, index.to(x.device), use_kernels)
        return out.reshape(y.shape)


def read_peft_adapter(adapter_dir: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """A PEFT LoRA adapter directory as ``{module name: (A (r, I), B (O, r), scaling)}``.

    Module names are relative to the causal-LM model (``model.layers.0.self_attn.q_proj``), as
    ``model.get_submodule`` takes them. Handles ``lora_alpha / r`` and rsLoRA's ``lora_alpha / sqrt(r)``;
    per-module rank or alpha patterns are refused.
    """
    adapter_dir = Path(adapter_dir)
    cfg_path, weights = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    if not cfg_path.exists() or not weights.exists():
        raise QRecoverError(f"{str(adapter_dir)!r} is not a PEFT adapter directory (needs adapter_config.json and "
                            "adapter_model.safetensors)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise QRecoverError(f"{str(adapter_dir)!r}: only plain LoRA adapters (one rank and alpha) can be stacked; "
                            f"got peft_type={cfg.get('peft_type')!r}, rank/alpha patterns "
                            f"{bool(cfg.get('rank_pattern'))}/{bool(cfg.get('alpha_pattern'))}")
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    state = load_file(str(weights))
    out: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for key, a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key.removesuffix(".lora_A.weight").removeprefix("base_model.model.")
        out[name] = (a, state[key.replace(".lora_A.weight", ".lora_B.weight")], scaling)
    if not out:
        raise QRecoverError(f"{weights} holds no lora_A/lora_B weights")
    return out


def attach_adapters(model: nn.Module, adapter_dirs: list[str | Path]) -> Callable[[torch.Tensor], None]:
    """Serve several PEFT adapters at once on ``model``: every linear layer any adapter targets becomes a
    :class:`MultiAdapterLinear` holding all of them stacked (index ``i`` = ``adapter_dirs[i]``; an adapter that
    does not target a layer is zeros there). Returns ``set_index(index)``: call it before each forward with one
    adapter index (or -1 for the base model) per sequence ``(B,)`` or per token ``(B * T,)``.
    """
    adapters = [read_peft_adapter(d) for d in adapter_dirs]
    layers: list[MultiAdapterLinear] = []
    for name in sorted(set().union(*adapters)):
        base = model.get_submodule(name)
        pairs = []
        for a in adapters:
            if name in a:
                pairs.append(a[name])
            else:
                pairs.append((torch.zeros(1, base.in_features), torch.zeros(base.out_features, 1), 0.0))
        layer = MultiAdapterLinear.from_adapters(base, pairs)
        device = next(base.buffers(), next(base.parameters(), None))
        if device is not None:
            layer.to(device.device)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        layers.append(layer)

    def set_index(index: torch.Tensor) -> None:
        for layer in layers:
            layer.token_index = index

    return set_index

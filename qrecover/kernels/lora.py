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
"""

from __future__ import annotations

import torch
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
    from . import lora_kernels

    return lora_kernels


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

    ``forward(x (..., I), index (tokens,)) -> (..., O)``: token ``m`` (row ``m`` of ``x`` flattened to
    ``(tokens, I)``) gets adapter ``index[m]``, or the base output alone when ``index[m] == -1``. The stacked
    adapters are buffers (they move with ``.to``); build them from PEFT-style pairs with :func:`stack_adapters`.
    """

    def __init__(self, base: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor):
        super().__init__()
        self.base = base
        self.register_buffer("lora_a", lora_a)
        self.register_buffer("lora_b", lora_b)
        self.register_buffer("scaling", scaling.float())

    @classmethod
    def from_adapters(cls, base: nn.Module, adapters: list[tuple[torch.Tensor, torch.Tensor, float]]) -> MultiAdapterLinear:
        return cls(base, *stack_adapters(adapters))

    def forward(self, x: torch.Tensor, index: torch.Tensor, use_kernels: bool | None = None) -> torch.Tensor:
        y = self.base(x)
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        lora_a, lora_b = self.lora_a.to(x.dtype), self.lora_b.to(x.dtype)
        out = add_lora(y2.contiguous(), x2.contiguous(), lora_a, lora_b, self.scaling, index.to(x.device), use_kernels)
        return out.reshape(y.shape)

"""Many LoRA adapters on one quantized base, chosen per token: ``y[m] = Wq x[m] + s[a] B[a] (A[a] x[m])``, ``a = idx[m]``.

The layout is the one vLLM's punica-style LoRA kernels take: adapters stacked along a first axis, and a
per-token adapter index (``-1``: no adapter for that token, the base output alone).

- ``lora_a``: ``(n_adapters, r, in_features)`` (PEFT's ``lora_A.weight`` of each adapter, stacked)
- ``lora_b``: ``(n_adapters, out_features, r)`` (PEFT's ``lora_B.weight``)
- ``scaling``: ``(n_adapters,)`` fp32 (PEFT's ``lora_alpha / r``)
- ``index``: ``(M,)`` int, one entry per token (row of the flattened input)
- int8 adapters (qrecover's 8-bit adapter files, :mod:`qrecover.adapters.int8`): ``lora_a``/``lora_b`` int8 with
  ``a_scale (n_adapters, r)`` and ``b_scale (n_adapters, out_features)``, one scale per row (fp16 as stored); half the bytes of
  fp16, which at batch 16 are what the adapters cost beside a 3-bit base (8 rank-16 fp16 adapters on 4096x4096 read
  2.1 MB against the base's 6.3 MB)

Adapters of different ranks are zero-padded to the largest (:func:`stack_adapters`); a zero row of ``A``
and column of ``B`` add nothing.

Two Triton kernels do the adapter part in two batched launches whatever the mix of adapters (BGMV, one
program per token and output block, each reading its own adapter by index), and no other launch:

- :func:`lora_shrink`: ``t (M, r) fp32 = A[idx] x``, split-K over ``in_features``, each split's partial sums in its own
  slot of a workspace (no zero-fill, no atomics);
- :func:`lora_expand`: ``y (M, O) += scaling[idx] * B[idx] t``, the slots summed, in place on the base output.

:func:`lora_delta_reference` is the torch reference (adapters applied one by one over the distinct indices:
the baseline the benchmark measures against), and :class:`MultiAdapterLinear` wraps a base layer:
``MultiAdapterLinear(quant_linear, lora_a, lora_b, scaling)(x, index)``. It uses the kernels for CUDA inputs
(unless ``QRECOVER_KERNELS=0`` or triton is missing) and the reference otherwise.

:func:`qrecover.adapters.serve.attach_adapters` serves PEFT adapter directories (qrecover's recovery adapters are
PEFT adapters) on a whole model: ``set_index = attach_adapters(model, [dir0, dir1]); set_index(torch.tensor([0, 1, -1]))``
then any forward (or ``generate``) runs each sequence through its own adapter.
"""

from __future__ import annotations

import torch
from torch import nn

from ..errors import QRecoverError
from . import enabled, triton_available

#: one int8 adapter on one layer: ``(A codes (r, I), A scales (r,), B codes (O, r), B scales (O,), scaling)``
Int8Adapter = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float]


def _check(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor, index: torch.Tensor,
           a_scale: torch.Tensor | None = None, b_scale: torch.Tensor | None = None) -> None:
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
    if (lora_a.dtype == torch.int8) != (lora_b.dtype == torch.int8):
        raise QRecoverError(f"lora_a is {lora_a.dtype} and lora_b {lora_b.dtype}: both int8 (with their row scales) or "
                            "neither")
    if lora_a.dtype == torch.int8:
        for name, scale, shape in (("a_scale", a_scale, (n, r)), ("b_scale", b_scale, (n, lora_b.shape[1]))):
            if scale is None or tuple(scale.shape) != shape:
                raise QRecoverError(f"int8 adapters need {name} of shape {shape}, one scale per row; got "
                                    f"{None if scale is None else tuple(scale.shape)} (stack_int8 makes both)")


def stack_adapters(adapters: list[tuple[torch.Tensor, torch.Tensor, float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[(A (r_i, I), B (O, r_i), scaling_i)] -> (lora_a (n, r, I), lora_b (n, O, r), scaling (n,))``, ``r = max r_i``."""
    if not adapters:
        raise QRecoverError("stack_adapters needs at least one (A, B, scaling) adapter")
    r = max(a.shape[0] for a, _, _ in adapters)
    lora_a = torch.stack([torch.nn.functional.pad(a, (0, 0, 0, r - a.shape[0])) for a, _, _ in adapters])
    lora_b = torch.stack([torch.nn.functional.pad(b, (0, r - b.shape[1])) for _, b, _ in adapters])
    return lora_a, lora_b, torch.tensor([float(s) for _, _, s in adapters], dtype=torch.float32)


def stack_int8(adapters: list[Int8Adapter]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[(qA (r_i, I), sA (r_i,), qB (O, r_i), sB (O,), scaling_i)] -> (lora_a int8 (n, r, I), a_scale (n, r),
    lora_b int8 (n, O, r), b_scale (n, O), scaling (n,))``, ``r = max r_i``; padded rows have codes 0 and scale 1; the
    scales fp16, as 8-bit adapter files store them."""
    if not adapters:
        raise QRecoverError("stack_int8 needs at least one int8 adapter")
    r = max(qa.shape[0] for qa, *_ in adapters)
    pad = torch.nn.functional.pad
    lora_a = torch.stack([pad(qa, (0, 0, 0, r - qa.shape[0])) for qa, *_ in adapters])
    a_scale = torch.stack([pad(sa.half(), (0, r - sa.shape[0]), value=1.0) for _, sa, *_ in adapters])
    lora_b = torch.stack([pad(qb, (0, r - qb.shape[1])) for _, _, qb, _, _ in adapters])
    b_scale = torch.stack([sb.half() for _, _, _, sb, _ in adapters])
    return lora_a, a_scale, lora_b, b_scale, torch.tensor([float(a[4]) for a in adapters], dtype=torch.float32)


def dequantize_stacked(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Adapter matrices ``(..., rows, cols)`` in ``dtype``: as they are, or int8 codes times their row scales
    ``(..., rows)``."""
    if weight.dtype != torch.int8:
        return weight.to(dtype)
    return (weight.float() * scale.float()[..., None]).to(dtype)


def lora_delta_reference(x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
                         index: torch.Tensor, a_scale: torch.Tensor | None = None,
                         b_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``(M, O)`` adapter output in ``x.dtype``, one adapter at a time over the distinct entries of ``index``."""
    x2 = x.reshape(-1, x.shape[-1])
    out = x2.new_zeros(x2.shape[0], lora_b.shape[1])
    for a in index.unique().tolist():
        if a < 0:
            continue
        rows = index == a
        A = dequantize_stacked(lora_a[a], None if a_scale is None else a_scale[a], x.dtype)
        B = dequantize_stacked(lora_b[a], None if b_scale is None else b_scale[a], x.dtype)
        out[rows] = (x2[rows] @ A.T) @ B.T * scaling[a].to(x.dtype)
    return out


def _kernels():
    from . import multi_adapter_kernels  # lazy: pulls triton, optional (absent on CPU-only machines)

    return multi_adapter_kernels


def lora_shrink(x: torch.Tensor, lora_a: torch.Tensor, index: torch.Tensor, a_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x (M, I)``, ``lora_a (n, r, I)``, ``index (M,)`` -> ``t (M, r)`` fp32, ``t[m] = A[index[m]] x[m]`` (0 for -1).
    (:func:`add_lora` passes the kernel's per-split partial sums to the expand as they are, without this sum.)"""
    return _kernels().shrink(x, lora_a, index, a_scale).sum(0)


def lora_expand(t: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor, index: torch.Tensor, y: torch.Tensor,
                b_scale: torch.Tensor | None = None) -> torch.Tensor:
    """In place: ``y (M, O) += scaling[index[m]] * lora_b[index[m]] @ t[m]`` for every ``index[m] >= 0``; returns ``y``."""
    return _kernels().expand(t, lora_b, scaling, index, y, b_scale)


def add_lora(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
             index: torch.Tensor, use_kernels: bool | None = None, a_scale: torch.Tensor | None = None,
             b_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``y (M, O) + delta`` for ``x (M, I)``: the Triton shrink/expand (in place on ``y``; two launches) or the torch
    reference. int8 ``lora_a``/``lora_b`` take their row scales ``a_scale (n, r)``, ``b_scale (n, O)``.

    ``use_kernels``: None decides by device (CUDA, triton installed, ``QRECOVER_KERNELS`` not 0); True forces
    the kernels (on CPU they need ``TRITON_INTERPRET=1``).
    """
    _check(x, lora_a, lora_b, scaling, index, a_scale, b_scale)
    if use_kernels is None:
        use_kernels = x.is_cuda and enabled() and triton_available()
    if not use_kernels:
        return y + lora_delta_reference(x, lora_a, lora_b, scaling, index, a_scale, b_scale)
    partials = _kernels().shrink(x, lora_a, index, a_scale)
    return _kernels().expand(partials, lora_b, scaling, index, y, b_scale)


class MultiAdapterLinear(nn.Module):
    """A base linear layer (e.g. a :class:`~qrecover.qlinear.QuantLinear`) serving many LoRA adapters at once.

    ``forward(x (..., I), index=None) -> (..., O)``: token ``m`` (row ``m`` of ``x`` flattened to
    ``(tokens, I)``) gets adapter ``index[m]``, or the base output alone when ``index[m] == -1``. An index of one
    entry per sequence (``x (B, T, I)``, ``index (B,)``) applies to all ``T`` tokens of the sequence. Without
    ``index`` the layer uses ``self.token_index``, set for a whole model by
    :func:`qrecover.adapters.serve.attach_adapters` (the way vLLM sets its per-batch LoRA mapping once for every
    layer). The stacked adapters are buffers (they move with ``.to``); build them from PEFT-style pairs with
    :func:`stack_adapters` (``from_adapters``), or as int8 with their row scales with :func:`stack_int8`
    (``from_int8``): the kernels read int8 adapters as they are, half the bytes of fp16.
    """

    def __init__(self, base: nn.Module, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor,
                 a_scale: torch.Tensor | None = None, b_scale: torch.Tensor | None = None):
        super().__init__()
        self.base = base
        self.register_buffer("lora_a", lora_a)
        self.register_buffer("lora_b", lora_b)
        self.register_buffer("scaling", scaling.float())
        self.register_buffer("a_scale", a_scale)
        self.register_buffer("b_scale", b_scale)
        self.token_index: torch.Tensor | None = None

    @property
    def int8(self) -> bool:
        return self.lora_a.dtype == torch.int8

    @classmethod
    def from_adapters(cls, base: nn.Module, adapters: list[tuple[torch.Tensor, torch.Tensor, float]]) -> MultiAdapterLinear:
        """From float ``(A, B, scaling)`` adapters."""
        return cls(base, *stack_adapters(adapters))

    @classmethod
    def from_int8(cls, base: nn.Module, adapters: list[Int8Adapter]) -> MultiAdapterLinear:
        lora_a, a_scale, lora_b, b_scale, scaling = stack_int8(adapters)
        return cls(base, lora_a, lora_b, scaling, a_scale, b_scale)

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
        lora_a, lora_b = (self.lora_a, self.lora_b) if self.int8 else (self.lora_a.to(x.dtype), self.lora_b.to(x.dtype))
        out = add_lora(y2.contiguous(), x2.contiguous(), lora_a, lora_b, self.scaling, index.to(x.device), use_kernels,
                       self.a_scale, self.b_scale)
        return out.reshape(y.shape)

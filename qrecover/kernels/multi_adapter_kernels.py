"""Triton shrink/expand kernels for per-token multi-adapter LoRA (see :mod:`qrecover.kernels.multi_adapter` for the layout).

Both are BGMV-style: a program serves one token and reads that token's adapter by index, so a batch mixing
any number of adapters (and ``-1`` for none) is two launches, and nothing else: the shrink writes each split's
partial sums to its own slot of a workspace (no zero-fill launch, no atomics) and the expand adds the slots up.
A token with index ``-1`` loads no adapter (its loads are masked), writes zeros to its slots and leaves ``y`` as it is.

Adapter weights are fp16/bf16/fp32, or int8 with one fp16 (or fp32) scale per row (``A (n, r, I)`` per rank row, ``B (n, O, r)``
per output row; the values of qrecover's 8-bit adapters, :mod:`qrecover.adapters.int8`): half the bytes of fp16, decoded
in registers. Row scales factor out of the dot products, so each is applied once per row, after the sum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .qmatmul import SMS, interpreting


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, a_scale_ptr, idx_ptr, t_ptr, M, K, R, k_split, stride_xm, stride_an, stride_ar,
                   INT8: tl.constexpr, R_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(m, s)``: ``t[s, m, :] = A[idx[m]][:, ks] @ x[m, ks]`` over input columns ``ks`` of split ``s``
    (times the rows' scales for int8 ``A``)."""
    m = tl.program_id(0)
    s = tl.program_id(1)
    idx = tl.load(idx_ptr + m).to(tl.int64)
    a = tl.maximum(idx, 0)
    rr = tl.arange(0, R_PAD)
    r_mask = (rr < R) & (rr * 0 + idx >= 0)  # vector masks (the interpreter rejects scalar & vector)
    acc = tl.zeros((R_PAD,), dtype=tl.float32)
    k_lo = s * k_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_split, K), BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = (ks < K) & (ks * 0 + idx >= 0)
        x = tl.load(x_ptr + m.to(tl.int64) * stride_xm + ks, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(a_ptr + a * stride_an + rr[:, None] * stride_ar + ks[None, :],
                    mask=r_mask[:, None] & k_mask[None, :], other=0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    if INT8:
        acc *= tl.load(a_scale_ptr + a * R + rr, mask=r_mask, other=0.0).to(tl.float32)
    tl.store(t_ptr + (s.to(tl.int64) * M + m) * R + rr, acc, mask=rr < R)


@triton.jit
def _expand_kernel(t_ptr, b_ptr, b_scale_ptr, scale_ptr, idx_ptr, y_ptr, M, N, R, n_splits, stride_bn, stride_bo,
                   stride_ym, INT8: tl.constexpr, R_PAD: tl.constexpr, BLOCK_N: tl.constexpr, S_PAD: tl.constexpr,
                   FULL_R: tl.constexpr = False):
    """Program ``(m, j)``: ``y[m, js] += scaling[idx[m]] * B[idx[m]][js, :] @ sum_s t[s, m, :]`` for output block ``js``
    (times the rows' scales for int8 ``B``); the ``n_splits <= S_PAD`` slots are read as one tile, not one after another.
    ``FULL_R``: the rank is ``R_PAD`` (a power of two, >= 16): no mask along the rank, so that a row of ``B`` is read by
    vector loads (a mask along it made them one element each: 16 two-byte or one-byte loads per row, sm_90 SASS)."""
    m = tl.program_id(0)
    j = tl.program_id(1)
    idx = tl.load(idx_ptr + m).to(tl.int64)
    a = tl.maximum(idx, 0)
    rr = tl.arange(0, R_PAD)
    rows = j * BLOCK_N + tl.arange(0, BLOCK_N)
    rank = R_PAD if FULL_R else R  # a compile-time rank: rows of B and slots of t aligned, no mask along them
    r_ok = rr < rank
    t_mask = r_ok & (rr * 0 + idx >= 0)
    ss = tl.arange(0, S_PAD)
    t = tl.sum(tl.load(t_ptr + (ss[:, None] * M + m).to(tl.int64) * rank + rr[None, :],
                       mask=(ss < n_splits)[:, None] & t_mask[None, :], other=0.0), axis=0)
    n_mask = (rows < N) & (rows * 0 + idx >= 0)
    b = tl.load(b_ptr + a * stride_bn + rows[:, None] * stride_bo + rr[None, :],
                mask=n_mask[:, None] & r_ok[None, :], other=0).to(tl.float32)
    delta = tl.sum(b * t[None, :], axis=1) * tl.load(scale_ptr + a)
    if INT8:
        delta *= tl.load(b_scale_ptr + a * N + rows, mask=n_mask, other=0.0).to(tl.float32)
    y_ptrs = y_ptr + m.to(tl.int64) * stride_ym + rows
    y = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def _r_pad(r: int) -> int:
    return max(16, 1 << (r - 1).bit_length())


def _row_scales(weight: torch.Tensor, scale: torch.Tensor | None, shape: tuple[int, int], name: str) -> torch.Tensor:
    """The row scales (fp16 or fp32, read as they are) an int8 ``weight`` needs (``shape``), or ``weight`` itself as an
    unused pointer."""
    if weight.dtype != torch.int8:
        return weight
    if scale is None or tuple(scale.shape) != shape:
        raise ValueError(f"int8 {name} needs {name}_scale of shape {shape}, one scale per row; got "
                         f"{None if scale is None else tuple(scale.shape)}")
    return scale.contiguous()


#: the most input splits of the shrink: the expand reads their slots as one (splits, rank) tile
MAX_SPLITS = 64


def shrink_splits(m: int, k: int, block_k: int = 128) -> tuple[int, int]:
    """``(k_split, n_splits)`` of the shrink for ``m`` tokens and ``k`` inputs: split-K sized so that the
    ``m x n_splits`` programs fill the GPU's SMs twice over (at most one split per ``block_k`` columns). A split per
    1,024 columns, as before 2026-11-29, ran 4 programs at batch 1 and 64 at batch 16 on a 4096-input layer: on 132
    SMs a latency-bound chain of dependent loads per program."""
    split = max(1, min(k // block_k, triton.next_power_of_2(triton.cdiv(2 * SMS, m)), MAX_SPLITS))
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    return k_split, triton.cdiv(k, k_split)


def shrink(x: torch.Tensor, lora_a: torch.Tensor, index: torch.Tensor, a_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x (M, I)``, ``lora_a (n, r, I)`` (int8 with ``a_scale (n, r)``), ``index (M,)`` -> the fp32 partial sums
    ``(S, M, r)`` of the ``S`` input splits: ``t[m] = sum_s partial[s, m] = A[index[m]] x[m]`` (0 for -1)."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():  # triton launches on the current device
        with torch.cuda.device(x.device):
            return shrink(x, lora_a, index, a_scale)
    m, k = x.shape
    n, r, _ = lora_a.shape
    x, lora_a, index = x.contiguous(), lora_a.contiguous(), index.contiguous()
    scales = _row_scales(lora_a, a_scale, (n, r), "lora_a")
    block_k = 32 if interpreting() else 128
    k_split, n_splits = shrink_splits(m, k, block_k)
    t = torch.empty((n_splits, m, r), device=x.device, dtype=torch.float32)  # every slot is written
    _shrink_kernel[(m, n_splits)](x, lora_a, scales, index, t, m, k, r, k_split, x.stride(0), lora_a.stride(0),
                                  lora_a.stride(1), INT8=lora_a.dtype == torch.int8, R_PAD=_r_pad(r), BLOCK_K=block_k)
    return t


def expand(t: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor, index: torch.Tensor, y: torch.Tensor,
           b_scale: torch.Tensor | None = None) -> torch.Tensor:
    """In place ``y (M, O) += scaling[index] * lora_b[index] @ t``; ``t`` the shrink's fp32 partials ``(S, M, r)`` (or
    ``(M, r)``), ``lora_b (n, O, r)`` (int8 with ``b_scale (n, O)``)."""
    if y.is_cuda and y.device.index != torch.cuda.current_device():  # triton launches on the current device
        with torch.cuda.device(y.device):
            return expand(t, lora_b, scaling, index, y, b_scale)
    m, n = y.shape
    n_ad, _, r = lora_b.shape
    if y.stride(-1) != 1:
        raise ValueError(f"{y.stride()=}: expand writes y in place and needs unit stride along features")
    t = t.reshape(-1, m, r).contiguous()
    lora_b, index, scaling = lora_b.contiguous(), index.contiguous(), scaling.to(device=y.device, dtype=torch.float32)
    scales = _row_scales(lora_b, b_scale, (n_ad, n), "lora_b")
    block_n = 32 if interpreting() else 128
    _expand_kernel[(m, triton.cdiv(n, block_n))](t, lora_b, scales, scaling, index, y, m, n, r, t.shape[0],
                                                lora_b.stride(0), lora_b.stride(1), y.stride(0),
                                                INT8=lora_b.dtype == torch.int8, R_PAD=_r_pad(r), BLOCK_N=block_n,
                                                S_PAD=max(2, triton.next_power_of_2(t.shape[0])), FULL_R=r == _r_pad(r))
    return y

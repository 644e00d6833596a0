"""Triton shrink/expand kernels for per-token multi-adapter LoRA (see :mod:`qrecover.kernels.multi_adapter` for the layout).

Both are BGMV-style: a program serves one token and reads that token's adapter by index, so a batch mixing
any number of adapters (and ``-1`` for none) is two launches. A token with index ``-1`` loads nothing (its
loads are masked) and writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .qmatmul import interpreting


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, idx_ptr, t_ptr, K, R, k_split, stride_xm, stride_an, stride_ar,
                   R_PAD: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(m, s)``: ``t[m, :] += A[idx[m]][:, ks] @ x[m, ks]`` over input columns ``ks`` of split ``s``."""
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
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
    tl.atomic_add(t_ptr + m.to(tl.int64) * R + rr, acc, mask=r_mask)


@triton.jit
def _expand_kernel(t_ptr, b_ptr, scale_ptr, idx_ptr, y_ptr, N, R, stride_bn, stride_bo, stride_ym,
                   R_PAD: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program ``(m, j)``: ``y[m, js] += scaling[idx[m]] * B[idx[m]][js, :] @ t[m, :]`` for output block ``js``."""
    m = tl.program_id(0)
    j = tl.program_id(1)
    idx = tl.load(idx_ptr + m).to(tl.int64)
    a = tl.maximum(idx, 0)
    rr = tl.arange(0, R_PAD)
    rows = j * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.load(t_ptr + m.to(tl.int64) * R + rr, mask=(rr < R) & (rr * 0 + idx >= 0), other=0.0)
    n_mask = (rows < N) & (rows * 0 + idx >= 0)
    b = tl.load(b_ptr + a * stride_bn + rows[:, None] * stride_bo + rr[None, :],
                mask=n_mask[:, None] & (rr < R)[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(b * t[None, :], axis=1) * tl.load(scale_ptr + a)
    y_ptrs = y_ptr + m.to(tl.int64) * stride_ym + rows
    y = tl.load(y_ptrs, mask=n_mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=n_mask)


def _r_pad(r: int) -> int:
    return max(16, 1 << (r - 1).bit_length())


def shrink(x: torch.Tensor, lora_a: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``x (M, I)``, ``lora_a (n, r, I)``, ``index (M,)`` -> ``(M, r)`` fp32."""
    if x.is_cuda and x.device.index != torch.cuda.current_device():  # triton launches on the current device
        with torch.cuda.device(x.device):
            return shrink(x, lora_a, index)
    m, k = x.shape
    _, r, _ = lora_a.shape
    x, lora_a, index = x.contiguous(), lora_a.contiguous(), index.contiguous()
    t = torch.zeros((m, r), device=x.device, dtype=torch.float32)
    block_k = 64 if interpreting() else 256
    split = max(1, min(16, triton.cdiv(k, 4 * block_k)))  # enough programs to fill the GPU at batch 1
    k_split = triton.cdiv(triton.cdiv(k, split), block_k) * block_k
    _shrink_kernel[(m, triton.cdiv(k, k_split))](x, lora_a, index, t, k, r, k_split, x.stride(0), lora_a.stride(0),
                                                lora_a.stride(1), R_PAD=_r_pad(r), BLOCK_K=block_k)
    return t


def expand(t: torch.Tensor, lora_b: torch.Tensor, scaling: torch.Tensor, index: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """In place ``y (M, O) += scaling[index] * lora_b[index] @ t``; ``t (M, r)`` fp32, ``lora_b (n, O, r)``."""
    if y.is_cuda and y.device.index != torch.cuda.current_device():  # triton launches on the current device
        with torch.cuda.device(y.device):
            return expand(t, lora_b, scaling, index, y)
    m, n = y.shape
    r = lora_b.shape[2]
    if y.stride(-1) != 1:
        raise ValueError(f"{y.stride()=}: expand writes y in place and needs unit stride along features")
    lora_b, index, scaling = lora_b.contiguous(), index.contiguous(), scaling.to(device=y.device, dtype=torch.float32)
    block_n = 32 if interpreting() else 128
    _expand_kernel[(m, triton.cdiv(n, block_n))](t, lora_b, scaling, index, y, n, r, lora_b.stride(0),
                                                lora_b.stride(1), y.stride(0), R_PAD=_r_pad(r), BLOCK_N=block_n)
    return y

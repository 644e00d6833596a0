"""Triton kernel for r4's online rotation (:mod:`qrecover.transforms.online_r4`): rows ``x (M, n)`` times the ``fwht``
rotation ``diag(s) (H_p (x) H_b) / sqrt(n)`` of :mod:`qrecover.transforms.hadamard`, in one pass over the rows.

A Kronecker product splits into two small products: with a row viewed as ``X (P, B)`` (``n = P B``) and the
rotation written ``A (x) H_B`` (``H_B`` Sylvester's order ``B <= 128``; ``A (P, P)`` the rest: the Paley factor,
times Sylvester's order ``b / B`` where ``b > 128``, scaled by ``1 / sqrt(n)``), ``row @ R = vec(A^T X' H_B)`` with
``X' = X * s``. One program per row: it loads ``X'`` as a ``(P_PAD, B)`` tile (rows past ``P`` masked), builds
``H_B`` in registers (``(-1)^popcount(i & j)``: no memory), and runs two tensor-core ``tl.dot`` products in the
input's dtype (fp16 or bf16) with fp32 accumulation: ``X' H_B`` is exact (sums of ``+-x``), ``A^T Y`` rounds ``Y`` and
``A`` (``+-1/sqrt(n)``, exact for ``n`` a power of 4 times) to the input dtype once, so the result is within a few
units in the last place of the exact rotation (measured: relative error < 2e-3 in fp16). fp32 inputs keep the torch
reference (a fp32 ``tl.dot`` would round to TF32, and its IEEE form spills). Per row that reads and writes
the row once and does ``P_PAD B (B + P_PAD)`` multiply-adds (1536 = 12 x 128: 16 x 128 x 144 = 295k), against
``log2 b`` full passes over memory for the torch reference's butterflies.

Served: ``16 <= B`` and ``P_PAD <= 128`` (``n`` from 256 to 16384 when the factors allow); :func:`supported` says,
and :func:`qrecover.transforms.hadamard.rotate` keeps the torch reference otherwise.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

MAX_B, MAX_P = 128, 128


@triton.jit
def _fwht_rows(x_ptr, s_ptr, a_ptr, out_ptr, stride_x, stride_o,
               P: tl.constexpr, P_PAD: tl.constexpr, B: tl.constexpr, LOG_B: tl.constexpr, FP32_DOT: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rp = tl.arange(0, P_PAD)[:, None]
    cb = tl.arange(0, B)[None, :]
    mask = (rp < P) & (cb < B)
    off = rp * B + cb
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + off, mask=mask, other=0.0).to(tl.float32)
    x = (x * tl.load(s_ptr + off, mask=mask, other=0.0)).to(dt)  # a sign flip: exact
    i = tl.arange(0, B)[:, None]
    j = tl.arange(0, B)[None, :]
    v = i & j
    par = v & 1
    for k in tl.static_range(1, LOG_B):
        par = par ^ ((v >> k) & 1)
    h = 1.0 - 2.0 * par.to(tl.float32)  # Sylvester's H_B (exact in fp16/bf16)
    ra = tl.arange(0, P_PAD)
    at = tl.load(a_ptr + ra[None, :] * P + ra[:, None], mask=(ra[:, None] < P) & (ra[None, :] < P), other=0.0).to(dt)  # A^T
    if FP32_DOT:  # the interpreter mis-reads bf16 dot operands: the same rounded values, multiplied in fp32
        y = tl.dot(x.to(tl.float32), h, input_precision="ieee").to(dt)
        z = tl.dot(at.to(tl.float32), y.to(tl.float32), input_precision="ieee")
    else:
        y = tl.dot(x, h.to(dt)).to(dt)  # (P_PAD, B): exact sums of +-x in fp32, then rounded to the input dtype
        z = tl.dot(at, y)  # fp32 accumulation
    tl.store(out_ptr + row * stride_o + off, z.to(dt), mask=mask)


def split(n: int, p: int, b: int) -> tuple[int, int]:
    """``(P, B)``: the kernel's split of ``n = p b`` (``p`` the Paley factor or 1, ``b`` a power of two)."""
    B = min(b, MAX_B)
    return n // B, B


def supported(n: int, p: int, b: int, dtype: torch.dtype = torch.float16) -> bool:
    P, B = split(n, p, b)
    return dtype in (torch.float16, torch.bfloat16) and B >= 16 and max(16, triton.next_power_of_2(P)) <= MAX_P


def rotate_rows(x: torch.Tensor, signs: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    """``x (..., n) @ diag(signs) (a (x) H_B)`` by the kernel, ``(P, B) = split(...)``: ``a (P, P)`` float32 on
    ``x``'s device (:func:`qrecover.transforms.hadamard.rotate` builds it: the Paley factor times Sylvester's
    ``b / B``, over ``sqrt(n)``), ``signs (n,)``."""
    n, P = x.shape[-1], a.shape[0]
    B = n // P
    rows = x.reshape(-1, n)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty_like(rows)
    s = signs.to(x.device, torch.float32)  # (a no-op for the cached float32 signs hadamard.rotate passes)
    if rows.shape[0]:
        p_pad = max(16, triton.next_power_of_2(P))
        _fwht_rows[(rows.shape[0],)](rows, s, a, out, rows.stride(0), out.stride(0), P=P, P_PAD=p_pad, B=B,
                                     LOG_B=int(math.log2(B)), FP32_DOT=x.device.type != "cuda",
                                     num_warps=4 if p_pad <= 16 else 8)
    return out.view(x.shape)


__all__ = ["MAX_B", "MAX_P", "rotate_rows", "split", "supported"]

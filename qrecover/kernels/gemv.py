"""The batch 1-4 (decode) path of the fused dequant-matmul: few instructions per decoded weight.

Why a kernel of its own: a GEMV is memory-bound only below ~3.6-4.7 thread instructions per weight on an H100
(:mod:`.isa`). The shared ``_qmm_kernel`` spends 26-51 at batch 1 (``compile_check --isa``): its codes are
expanded by position tensors the compiler cannot fold (select chains), table look-ups are ``tl.gather`` (warp
shuffles), and each tile is reduced across lanes. Here:

- codes are extracted by an unrolled loop over a word's code positions (``tl.static_range``), so every shift
  and mask is a compile-time constant (3-bit codes straddling two words join with one more shift and or);
- the activations for code position ``j`` of every word are loaded directly (stride ``32 / bits``; they are
  shared by the ``BLOCK_N`` rows and stay in L1);
- palettize tables are read through L1 with one load per weight, or, after a one-time repack at load
  (:func:`kernel_tables`), one 64-bit load of an fp32 *pair* per two weights (2- and 4-bit: a byte of the
  packed word indexes a 256-entry table of value pairs, FLUTE's trick);
- blockwise: the tile lies in one block, so ``sum_k x_k (c_k - z) s = s (sum_k x_k c_k - z sum_k x_k)``: one FMA
  per weight, the scale applied once per word; the code becomes a float through its bits (``2**23 + c``, minus
  ``2**23``: exact), a full-rate add instead of a quarter-rate ``I2F``;
- the accumulator keeps the word axis and is reduced across lanes once, after the loop.

The packed codes are read in place (no repack of ``qdata``). Shapes: ``x (M, K)``, ``qdata`` as ``int32`` words
``(N, K * bits / 32)``; output ``(M, N)`` directly, or fp32 split-K partial sums ``(S, M, N)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .formats import Format

#: lut modes: 0 the stored fp16 tables, 1 fp32 tables, 2 fp32 pair tables (repacked once, :func:`kernel_tables`)
LUT_FP16, LUT_FP32, LUT_PAIRS = 0, 1, 2


@triton.jit
def _acc_code(part, x_ptr, xrow, kw, c, tbase, lut_ptr, SCHEME: tl.constexpr, LUT: tl.constexpr, BITS: tl.constexpr):
    """``part (BM, BN, NW) += x[:, kw] * value(c)``; ``c (BN, NW)`` codes, ``kw (NW,)`` their columns."""
    xv = tl.load(x_ptr + xrow[:, None] + kw[None, :]).to(tl.float32)
    if SCHEME == 0:
        v = tl.load(lut_ptr + tbase[:, None] * (1 << BITS) + c).to(tl.float32)
    else:  # the float 2**23 + c by its bits, minus 2**23: exact, and a full-rate add instead of a quarter-rate I2F
        v = (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
    return part + xv[:, None, :] * v[None, :, :]


@triton.jit
def _acc_pair(part, x_ptr, xrow, kw, idx, tbase, lut_ptr, BITS: tl.constexpr):
    """Two codes at once: ``idx (BN, NW)`` (code ``2i`` in the low bits) indexes the fp32 pair table."""
    p = lut_ptr + ((tbase[:, None] << (2 * BITS)) + idx) * 2  # one address, two loads at +0 and +4 bytes
    lo = tl.load(p)
    hi = tl.load(p + 1)
    x0 = tl.load(x_ptr + xrow[:, None] + kw[None, :]).to(tl.float32)
    x1 = tl.load(x_ptr + xrow[:, None] + kw[None, :] + 1).to(tl.float32)
    return part + x0[:, None, :] * lo[None, :, :] + x1[:, None, :] * hi[None, :, :]


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, lut_ptr, scale_ptr, zp_ptr, bias_ptr, out_ptr, M, N, K, row_words, n_cblocks, zp_nbytes,
                 k_split, stride_xm, stride_om, stride_os, SCHEME: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                 CBLOCK: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, LUT: tl.constexpr, DIRECT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(n, m, s)``: rows ``n*BLOCK_N..``, inputs ``m*BLOCK_M..``, columns ``[s*k_split, (s+1)*k_split)``."""
    WPG: tl.constexpr = 3 if BITS == 3 else 1  # words per group of codes
    CPG: tl.constexpr = 32 if BITS == 3 else 32 // BITS  # codes per group
    NW: tl.constexpr = BLOCK_K // CPG
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    xrow = tl.minimum(ms, M - 1).to(tl.int64) * stride_xm
    row_word = rows64 * row_words
    acc = tl.zeros((BLOCK_M, BLOCK_N, NW), dtype=tl.float32)
    k_lo = tl.program_id(2) * k_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_split, K), BLOCK_K):
        g = k0 // CPG + tl.arange(0, NW)  # word groups of this tile
        wp = qw_ptr + row_word[:, None] + (g * WPG)[None, :]
        w0 = tl.load(wp).to(tl.uint32, bitcast=True)
        if BITS == 3:
            w1 = tl.load(wp + 1).to(tl.uint32, bitcast=True)
            w2 = tl.load(wp + 2).to(tl.uint32, bitcast=True)
        cb = k0 // CBLOCK
        tbase = ((rows64 // GROUP) * n_cblocks + cb).to(tl.int32)  # table index (< 2**31): 32-bit offsets
        kw = g * CPG
        part = tl.zeros((BLOCK_M, BLOCK_N, NW), dtype=tl.float32)
        if LUT == 2:
            for j in tl.static_range(CPG // 2):
                idx = ((w0 >> (2 * BITS * j)) & ((1 << (2 * BITS)) - 1)).to(tl.int32)
                part = _acc_pair(part, x_ptr, xrow, kw + 2 * j, idx, tbase, lut_ptr, BITS)
        else:
            for j in tl.static_range(CPG):
                if BITS == 3:
                    sh = (3 * j) % 32  # constexpr: j is a static_range index
                    wi = (3 * j) // 32
                    src = w0 if wi == 0 else (w1 if wi == 1 else w2)
                    c = src >> sh
                    if sh > 29:
                        c = c | ((w1 if wi == 0 else w2) << (32 - sh))
                    c = (c & 7).to(tl.int32)
                else:
                    c = ((w0 >> (BITS * j)) & ((1 << BITS) - 1)).to(tl.int32)
                part = _acc_code(part, x_ptr, xrow, kw + j, c, tbase, lut_ptr, SCHEME, LUT, BITS)
        if SCHEME == 0:
            acc += part
        else:  # s * (sum x c - z sum x), per word: the tile lies in one block
            blk = rows64 * n_cblocks + cb
            scale = tl.load(scale_ptr + blk).to(tl.float32)
            if HAS_ZP:
                zbit = blk * BITS
                zlo = tl.load(zp_ptr + (zbit >> 3)).to(tl.int32)
                zhi = tl.load(zp_ptr + (zbit >> 3) + 1, mask=(zbit >> 3) + 1 < zp_nbytes, other=0).to(tl.int32)
                zp = ((((zhi << 8) | zlo) >> (zbit & 7).to(tl.int32)) & ((1 << BITS) - 1)).to(tl.float32)
            else:
                zp = tl.zeros_like(scale) + (1 << (BITS - 1))
            sx = tl.zeros((BLOCK_M, NW), dtype=tl.float32)
            for j in tl.static_range(CPG):
                sx += tl.load(x_ptr + xrow[:, None] + (kw + j)[None, :]).to(tl.float32)
            acc += scale[None, :, None] * (part - zp[None, :, None] * sx[:, None, :])
    y = tl.sum(acc, axis=2)
    mask = (ms < M)[:, None] & (rows < N)[None, :]
    offs = ms.to(tl.int64)[:, None] * stride_om + rows[None, :]
    if DIRECT:
        if HAS_BIAS:
            y += tl.load(bias_ptr + rows64).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + tl.program_id(2).to(tl.int64) * stride_os + offs, y, mask=mask)


def lut_mode(fmt: Format) -> int:
    """Which tables the GEMV reads: fp32 pairs (2/4-bit) or fp32 singles when they add at most 1/16 of the packed
    codes' bytes (whole-row or wide column blocks), else the stored fp16 tables."""
    if fmt.scheme != 0:
        return LUT_FP16
    tables = (fmt.out_f // fmt.group) * (fmt.in_f // fmt.cblock)
    code_bytes = fmt.out_f * fmt.in_f * fmt.bits // 8
    if fmt.bits in (2, 4) and tables * (1 << (2 * fmt.bits)) * 8 * 16 <= code_bytes:
        return LUT_PAIRS
    if tables * (1 << fmt.bits) * 4 * 16 <= code_bytes:
        return LUT_FP32
    return LUT_FP16


def kernel_tables(fmt: Format, lut: torch.Tensor) -> torch.Tensor:
    """The one-time repack of palettize tables ``lut (T, 2**bits)`` fp16 for :func:`lut_mode`: fp32 ``(T, 2**bits)``
    or fp32 pairs ``(T, 2**(2 bits), 2)`` with ``pairs[t, a | b << bits] = (lut[t, a], lut[t, b])``. Exact (fp16 -> fp32)."""
    mode = lut_mode(fmt)
    if mode == LUT_FP16:
        return lut
    table = lut.float()
    if mode == LUT_FP32:
        return table.contiguous()
    n = 1 << fmt.bits
    idx = torch.arange(n * n, device=lut.device)
    return torch.stack([table[:, idx % n], table[:, idx // n]], dim=-1).contiguous()


def launch(x: torch.Tensor, fmt: Format, qw: torch.Tensor, lut: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor,
           bias: torch.Tensor | None, target: torch.Tensor, k_split: int, grid: tuple[int, int, int], cfg) -> None:
    """Run :func:`_gemv_kernel` into ``target`` (the output, or the split-K workspace when ``grid[2] > 1``);
    ``lut``: :func:`kernel_tables` for palettize."""
    m, k = x.shape
    n = fmt.out_f
    _gemv_kernel[grid](
        x, qw, lut, scale, zp, qw if bias is None else bias, target, m, n, k, k * fmt.bits // 32, k // fmt.cblock,
        zp.numel() if fmt.has_zp else 0, k_split, x.stride(0), n, m * n, SCHEME=fmt.scheme, BITS=fmt.bits,
        GROUP=fmt.group, CBLOCK=fmt.cblock, HAS_ZP=fmt.has_zp, HAS_BIAS=bias is not None, LUT=lut_mode(fmt),
        DIRECT=grid[2] == 1, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

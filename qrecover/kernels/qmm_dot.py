"""Batch 5-64 of the fused dequant-matmul: the decode kernel's weight decode feeding a tensor-core ``tl.dot``.

The decode of a weight tile does not depend on the batch, so a tile decoded once serves ``BLOCK_M`` activation rows
through ``tl.dot``. The tile is decoded as in :mod:`.gemv` (batch 1-4): an unrolled walk over a word's code
positions, so every shift and mask is a compile-time constant (no position tensors, no ``tl.gather``); palettize
tables read per weight from L1 (fp32 singles or the stored fp16) or per *two* weights from the fp32 pair tables (one
64-bit load; 2/3/4-bit, 3-bit as 6-bit fields of a 96-bit group); ``ASM``: tables and the strided 3-bit words read
through inline PTX (``ld.global.nc``); the next tile's words prefetched. The per-position values ``(BN, NW)`` are
joined (``tl.join``, in-thread) into the tile ``(BN, NW, CPG)`` and reshaped to ``(BN, BLOCK_K)`` in column order.
Blockwise: ``(c - z) * s`` with the code made a float through its bits (exact), as the reference rounds it; 4-bit
codes with fp16 activations also as fp16 pairs (``LUT`` 5, :data:`.gemv.BLOCKWISE_H2`): nibbles ``i`` and ``i + 4``
of a word are ``(1024 + c_i, 1024 + c_i+4)`` by their bits (a shift and one ``lop3`` per two weights), then ``c - z`` and
``* s`` in fp16, the same rounding as the fp32 path's (the pairs put back in position order in-thread).

Selected by a :class:`DotDecode` config (the tuner times it beside the shared kernel's configs).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .formats import Config
from .gemv import (
    _and_or,
    _bits_at,
    _load_words,
    _lut_load,
    _octet,
    _regs_pairs,
    _regs_table,
    _scale_zero,
    _selectors,
    _store_tile,
    check_split,
    row_words,
    run,
)


@dataclass(frozen=True)
class DotDecode(Config):
    """A batch 5+ config run by :func:`_dot_decode_kernel` (``use_dot`` is True; ``lut``, ``asm`` as in
    :mod:`.gemv`: the palettize table layout, -1 its default, and inline-PTX loads)."""


@triton.jit
def _leaf(w0, w1, w2, tab, planes, P: tl.constexpr, SCHEME: tl.constexpr, BITS: tl.constexpr, LUT: tl.constexpr,
          ASM: tl.constexpr):
    """Values of code positions ``P`` and ``P + 1`` of each word group, joined: ``(BN, NW, 2)``, fp32 (fp16 from
    register tables: the looked-up pair split by its bits, no conversion); ``tab (BN,)``: each row's table
    (palettize); ``planes``: its register-table byte planes (``LUT`` 3/4, :func:`.gemv._regs_pairs`; the quad's
    look-up is shared by its two leaves: pure inline asm, merged by the compiler)."""
    if SCHEME == 1 and LUT == 5:  # blockwise 4-bit as fp16 pairs (gemv.BLOCKWISE_H2): codes i and i + 4, i = P / 2
        # (1024 + c_i, 1024 + c_i+4) by their bits, exact: a shift and one lop3 (ASM)
        pair = _and_or((w0 >> (2 * P)).to(tl.uint32, bitcast=True), 0x000F000F, 0x64006400, ASM).to(tl.int32, bitcast=True)
        va = pair.to(tl.int16).to(tl.float16, bitcast=True)
        vb = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    elif LUT >= 3:
        sel, half = _selectors(_octet(w0, w1, w2, P // 8, BITS, LUT == 4), BITS, ASM)
        SH: tl.constexpr = 16 * ((P // 4) % 2)  # the word's second four codes: selectors shifted by 16
        pp, pq = _regs_pairs(sel >> SH, half >> SH, planes[0], planes[1], planes[2], planes[3], planes[4], planes[5],
                             planes[6], planes[7], BITS, ASM)
        pair = pp if P % 4 == 0 else pq
        va = pair.to(tl.int16).to(tl.float16, bitcast=True)
        vb = (pair >> 16).to(tl.int16).to(tl.float16, bitcast=True)
    elif LUT == 2:  # one 64-bit load: the fp32 values of both codes (code P in the low half)
        idx = _bits_at(w0, w1, w2, BITS * P, 2 * BITS)
        p = _lut_load(tab[:, None] + idx, ASM, True)
        va = p.to(tl.int32).to(tl.float32, bitcast=True)
        vb = (p >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    else:
        ca = _bits_at(w0, w1, w2, BITS * P, BITS)
        cb = _bits_at(w0, w1, w2, BITS * (P + 1), BITS)
        if SCHEME == 0:
            ta = tab[:, None]
            if LUT == 1:
                va = _lut_load(ta + ca, ASM, False)
                vb = _lut_load(ta + cb, ASM, False)
            else:
                va = tl.load(ta + ca).to(tl.float32)
                vb = tl.load(ta + cb).to(tl.float32)
        else:  # the code as a float through its bits (2**23 + c), exact
            va = (ca | 0x4B000000).to(tl.float32, bitcast=True)
            vb = (cb | 0x4B000000).to(tl.float32, bitcast=True)
    return tl.join(va, vb)


@triton.jit
def _span(w0, w1, w2, tab, planes, P: tl.constexpr, COUNT: tl.constexpr, SCHEME: tl.constexpr,
          BITS: tl.constexpr, LUT: tl.constexpr, ASM: tl.constexpr):
    """Values of code positions ``P .. P + COUNT`` of each word group, ``(BN, NW, COUNT)`` in position order (the
    halves joined, then the new axis moved in front of the half's positions: in-thread, no data movement)."""
    if COUNT == 2:
        return _leaf(w0, w1, w2, tab, planes, P, SCHEME, BITS, LUT, ASM)
    else:
        a = _span(w0, w1, w2, tab, planes, P, COUNT // 2, SCHEME, BITS, LUT, ASM)
        b = _span(w0, w1, w2, tab, planes, P + COUNT // 2, COUNT // 2, SCHEME, BITS, LUT, ASM)
        j = tl.permute(tl.join(a, b), (0, 1, 3, 2))
        return tl.reshape(j, (j.shape[0], j.shape[1], COUNT))


@triton.jit
def _pairs_tile(w0, ASM: tl.constexpr):
    """Blockwise 4-bit words ``(BN, NW)`` as the fp16 values ``1024 + c`` of their eight codes, ``(BN, NW, 8)`` in
    position order: four leaves of pairs ``(c_i, c_i+4)`` joined and put in order in-thread (no data movement)."""
    a = tl.join(_leaf(w0, w0, w0, 0, 0, 0, 1, 4, 5, ASM), _leaf(w0, w0, w0, 0, 0, 2, 1, 4, 5, ASM))  # [h, j]: c_(j + 4h)
    b = tl.join(_leaf(w0, w0, w0, 0, 0, 4, 1, 4, 5, ASM), _leaf(w0, w0, w0, 0, 0, 6, 1, 4, 5, ASM))  # c_(2 + j + 4h)
    t = tl.permute(tl.join(a, b), (0, 1, 2, 4, 3))  # (BN, NW, h, g, j): c_(4h + 2g + j)
    return tl.reshape(t, (t.shape[0], t.shape[1], 8))


@triton.jit
def _dot_decode_kernel(x_ptr, qw_ptr, lut_ptr, scale_ptr, zp_ptr, bias_ptr, out_ptr, M, N, K, row_words, n_cblocks,
                       zp_nbytes, k_split, stride_xm, stride_om, stride_os, SCHEME: tl.constexpr, BITS: tl.constexpr,
                       GROUP: tl.constexpr, CBLOCK: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr,
                       LUT: tl.constexpr, DIRECT: tl.constexpr, IEEE: tl.constexpr, ASM: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       ROW_TABLES: tl.constexpr = False, PIPE: tl.constexpr = 0, SWAP: tl.constexpr = False):
    """Program ``(n, m, s)``: output tile ``(BLOCK_M, BLOCK_N)`` over input columns ``[s*k_split, (s+1)*k_split)``;
    ``DIRECT``: ``acc + bias`` in the output dtype, else fp32 partial sums to ``out_ptr[s]`` (split-K).
    ``LUT`` 3/4: register tables on stored / nibble codes (:mod:`.gemv`); ``ROW_TABLES``: whole-row tables, loaded
    once. ``PIPE`` (>= 2): the code words read plainly at each tile, issued ``PIPE - 1`` tiles ahead through shared
    memory by triton's pipeliner (as :mod:`.gemv`'s); 0: the next tile's words requested by hand, in registers.
    ``SWAP`` (``Config.swap``; 16-bit activations): the product as ``W x^T``, weights first, transposed once at the
    end, so that ``BLOCK_N`` (>= 64) is the MMA's row count: sm_90 then runs a warpgroup MMA (``wgmma``) fed from
    shared memory by ``ldmatrix``, where ``BLOCK_M`` < 64 gets the 16x8x16 MMA and its operands' register shuffles."""
    WPG: tl.constexpr = 3 if BITS == 3 else 1  # words per group of codes
    CPG: tl.constexpr = 32 if BITS == 3 else 32 // BITS  # codes per group
    NW: tl.constexpr = BLOCK_K // CPG
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    xrow = tl.minimum(ms, M - 1).to(tl.int64) * stride_xm
    row_word = rows64 * row_words
    if SWAP:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = tl.program_id(2) * k_split
    if PIPE:  # k_split is a multiple of BLOCK_K (the launch checks): the pipeliner's copies of a row's contiguous
        k_lo = tl.multiple_of(k_lo, BLOCK_K)  # words become 16-byte cp.async (by hand, vector loads would convert layouts)
    k_hi = tl.minimum(k_lo + k_split, K)
    H2: tl.constexpr = SCHEME == 1 and LUT == 5  # blockwise 4-bit codes as fp16 pairs (fp16 activations; the launch checks)
    PLANES: tl.constexpr = LUT == 4 and BITS == 3  # nibble codes: three contiguous planes per row (gemv.nibble_codes)
    plane = tl.multiple_of(row_words // 3, 4) if PLANES else 0
    planes = (0, 0, 0, 0, 0, 0, 0, 0)
    REGS: tl.constexpr = SCHEME == 0 and LUT >= 3  # palettize register tables (LUT 5 on a blockwise layer: H2)
    if REGS and ROW_TABLES:
        planes = _regs_table(lut_ptr, (rows64 // GROUP).to(tl.int32)[:, None], BITS, ASM)
    if PIPE == 0:
        w0, w1, w2 = _load_words(qw_ptr, row_word, k_lo, CPG, WPG, NW, BITS, ASM, plane, PLANES)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=PIPE if PIPE else None):
        if PIPE:  # plain loads, which the pipeliner issues PIPE - 1 tiles ahead (inline PTX cannot be pipelined)
            w0, w1, w2 = _load_words(qw_ptr, row_word, k0, CPG, WPG, NW, BITS, False, plane, PLANES)
        else:  # the next tile's words are requested before this tile is decoded (the last tile re-reads itself)
            n0, n1, n2 = _load_words(qw_ptr, row_word, tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K), CPG, WPG, NW, BITS,
                                     ASM, plane, PLANES)
        cb = k0 // CBLOCK
        tab = lut_ptr + ((rows64 // GROUP) * n_cblocks + cb) * (1 << (2 * BITS if LUT == 2 else BITS))  # row tables
        if REGS and not ROW_TABLES:  # this tile's column block's tables
            tp = _regs_table(lut_ptr, ((rows64 // GROUP) * n_cblocks + cb).to(tl.int32)[:, None], BITS, ASM)
        else:
            tp = planes
        if SCHEME == 1:
            scale, zp = _scale_zero(scale_ptr, zp_ptr, rows64 * n_cblocks + cb, zp_nbytes, BITS, HAS_ZP)
        if H2:  # (1024 + c) - (1024 + z) is c - z exactly in fp16; times s rounded once, as in fp32 then to fp16
            w = tl.reshape(_pairs_tile(w0, ASM), (BLOCK_N, BLOCK_K))
            w = (w - (zp + 1024.0).to(tl.float16)[:, None]) * scale.to(tl.float16)[:, None]
        else:
            w = tl.reshape(_span(w0, w1, w2, tab, tp, 0, CPG, SCHEME, BITS, LUT, ASM), (BLOCK_N, BLOCK_K))
            if SCHEME == 1:  # (c - z) * s: exact in fp32, rounded once to the activation dtype below
                w = (w - (zp + 8388608.0)[:, None]) * scale[:, None]
        x = tl.load(x_ptr + xrow[:, None] + (k0 + tl.arange(0, BLOCK_K))[None, :])
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), input_precision="ieee")
        elif SWAP:
            acc_t += tl.dot(w.to(x.dtype), tl.trans(x))
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        if PIPE == 0:
            w0, w1, w2 = n0, n1, n2
    if SWAP:
        acc = tl.trans(acc_t)
    _store_tile(acc, out_ptr, bias_ptr, ms, rows, rows64, M, N, stride_om, stride_os, tl.program_id(2), DIRECT, HAS_BIAS)


def interpreting() -> bool:
    """True when this module's kernel was built for triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return isinstance(_dot_decode_kernel, InterpretedFunction)


def launch(x, fmt, qw, lut, scale, zp, bias, target, k_split: int, grid: tuple[int, int, int], cfg: DotDecode,
           mode: int, ieee: bool, warmup: bool = False) -> None:
    """Run :func:`_dot_decode_kernel` into ``target`` (the output, or the split-K workspace when ``grid[2] > 1``);
    ``lut``: palettize tables in layout ``mode`` (``gemv.LUT_*``; pair tables as their int64 view). ``warmup``: compile
    it only (:func:`gemv.run`)."""
    m, k = x.shape
    check_split(k_split, cfg)
    run(_dot_decode_kernel, grid, warmup)(
        x, qw, lut, scale, zp, qw if bias is None else bias, target, m, fmt.out_f, k, row_words(fmt, qw, mode),
        k // fmt.cblock, zp.numel() if fmt.has_zp else 0, k_split, x.stride(0), fmt.out_f, m * fmt.out_f,
        SCHEME=fmt.scheme, BITS=fmt.bits, GROUP=fmt.group, CBLOCK=fmt.cblock, HAS_ZP=fmt.has_zp,
        HAS_BIAS=bias is not None, LUT=mode, DIRECT=grid[2] == 1, IEEE=ieee, ASM=cfg.asm and not interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, ROW_TABLES=fmt.scheme == 0 and fmt.cblock == k,
        PIPE=cfg.pipe, SWAP=cfg.swap and not ieee, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

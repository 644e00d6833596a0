"""Fused dequantize-matmul Triton kernels for the packed formats ``qrecover compress`` writes.

``y (M, O) = x (M, I) @ W^T + bias`` where ``W (O, I)`` is never materialised: each program decodes its
tile of codes straight from the packed buffers and multiplies it in registers.

Layout read (no repack, no extra memory). ``qdata`` is the flat little-endian bit stream of
:mod:`qrecover.packing`: code ``k = row * I + col`` occupies stream bits ``[k*bits, (k+1)*bits)``. With
``I % 32 == 0`` every row starts on a 32-bit word boundary, so the kernel reads ``qdata.view(int32)``
(a zero-copy view of the stored bytes; little-endian words keep the stream's bit order). Each word is
loaded once, contiguously along the row, and expanded in registers: 2/4/8-bit codes never straddle a
word (``32 / bits`` codes each); 3-bit codes come in groups of 32 codes per 3 words, codes 10 and 21 of
a group straddling two words, combined with a shift and an or. Layers with ``I % 32 != 0`` go to the
reference path (see :func:`qrecover.kernels.select`).

Formats (shapes as the schemes document them, ``G = group_size``, ``C = block_size or I``):

- palettize: ``lut`` fp16 ``(O/G * I/C, 2**bits)``; weight = ``lut[(row // G) * (I/C) + col // C, code]``.
  Every K-tile lies inside one column block (``BLOCK_K`` divides ``C``), so each row of the tile has one
  table: for 2/3/4 bits the tile's tables ``(BLOCK_N, 2**bits)`` are loaded into registers and looked up
  with ``tl.gather`` (lowered to warp shuffles on NVIDIA; no memory access per weight); 8-bit tables
  (256 entries) are gathered through L1.
- blockwise: ``scale`` fp16 ``(O, I/B)``; ``zero_point`` bit-packed ``(O * I/B)`` codes (asymmetric) or
  the constant ``2**(bits-1)`` (symmetric); weight = ``(code - zero_point) * scale``.

Two paths share one kernel body (``USE_DOT`` is a compile-time switch):

- GEMV (``M <= 16``): small ``BLOCK_M``, split-K over the input dimension (``SPLIT_K`` programs per output
  tile write fp32 partial sums to a workspace, one small kernel adds them, the bias, and casts); for
  ``M <= 4`` the product is a broadcast multiply-and-sum, for ``8 <= M <= 16`` a ``tl.dot`` on a 16-row tile.
- tiled (``M > 16``): ``tl.dot`` tiles of ``BLOCK_M x BLOCK_N``, weights cast to the activation dtype
  (fp16/bf16 tensor cores; fp32 activations use ``input_precision="ieee"``, as torch does by default).

Batch 1-4 runs the decode kernel (:mod:`.gemv`); batch 5-64 (fp16/bf16) is also offered :mod:`.qmm_dot`'s kernel
(:class:`DotDecode` configs: gemv's decode feeding a ``tl.dot``), timed beside this kernel's configs.

Block sizes are tuned per (format, shape, batch bucket, dtype) on first use, L2-cold (:mod:`.timing`: copies of
the layer's buffers read in turn inside one CUDA graph; ``triton.testing.do_bench`` where memory allows no copies)
over a small config list and cached in :data:`_TUNED` (not ``triton.autotune``: the split-K workspace and its
reduction depend on the chosen config, which ``autotune`` hides from the caller). Under the interpreter
(``TRITON_INTERPRET=1``) the first valid config is used without timing.

Numerics match the reference ``F.linear(x, layer.dequantize(x.dtype))``: the weight is decoded in fp32
(exact for fp16 tables and fp16 scale times small integers) and rounded to the activation dtype before a
tensor-core ``tl.dot``; accumulation is fp32.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from concurrent.futures import ThreadPoolExecutor

import torch
import triton
import triton.language as tl
from triton.errors import TritonError
from triton.runtime.errors import OutOfResources

from . import dispatch, gemv, qmm_dot
from .formats import Config, Format
from .gemv import interpreting  # re-exported: qmatmul.interpreting() is the kernels' check
from .qmm_dot import DotDecode
from .timing import cold_ms, l2_bytes, tensor_copies

# ------------------------------------------------------------------------------------------- kernels


@triton.jit
def _codes(qw_ptr, row_word, k0, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """Codes ``(BN, BLOCK_K)`` int32 of columns ``k0 .. k0 + BLOCK_K``; ``row_word (BN,)`` int64 first word of each row.

    Each 32-bit word is loaded once (contiguous along the row, so loads vectorise) and expanded in registers:
    2/4/8 bits: ``32 / bits`` codes per word; 3 bits: 32 codes per 3 words, codes 10 and 21 straddling two.
    """
    if BITS == 3:
        n_grp: tl.constexpr = BLOCK_K // 32
        base = qw_ptr + row_word[:, None] + ((k0 // 32) * 3 + tl.arange(0, n_grp) * 3)[None, :]  # (BN, n_grp)
        w0 = tl.load(base).to(tl.uint32, bitcast=True)[:, :, None]
        w1 = tl.load(base + 1).to(tl.uint32, bitcast=True)[:, :, None]
        w2 = tl.load(base + 2).to(tl.uint32, bitcast=True)[:, :, None]
        bit = tl.arange(0, 32) * 3
        wi = (bit >> 5)[None, None, :]
        shift = (bit & 31).to(tl.uint32)[None, None, :]
        lo = tl.where(wi == 0, w0, tl.where(wi == 1, w1, w2)) >> shift
        hi = tl.where(wi == 0, w1, w2) << ((32 - shift) & 31)
        code = tl.where(shift > 29, lo | hi, lo)
    else:
        CPW: tl.constexpr = 32 // BITS
        n_words: tl.constexpr = BLOCK_K // CPW
        words = tl.load(qw_ptr + row_word[:, None] + (k0 // CPW + tl.arange(0, n_words))[None, :])
        shift = (tl.arange(0, CPW) * BITS).to(tl.uint32)[None, None, :]
        code = words.to(tl.uint32, bitcast=True)[:, :, None] >> shift
    code = (code & ((1 << BITS) - 1)).to(tl.int32)
    return tl.reshape(code, (code.shape[0], BLOCK_K))


@triton.jit
def _packed_vec(ptr, idx, nbytes, BITS: tl.constexpr):
    """Codes at positions ``idx`` (int64 vector) of a byte-addressed bit stream of ``nbytes`` bytes."""
    bit = idx * BITS
    byte = bit >> 3
    lo = tl.load(ptr + byte).to(tl.int32)
    hi = tl.load(ptr + byte + 1, mask=byte + 1 < nbytes, other=0).to(tl.int32)
    return (((hi << 8) | lo) >> (bit & 7).to(tl.int32)) & ((1 << BITS) - 1)


@triton.jit
def _weight_tile(qw_ptr, lut_ptr, scale_ptr, zp_ptr, rows, k0, K, n_cblocks, zp_nbytes,
                 SCHEME: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, CBLOCK: tl.constexpr,
                 HAS_ZP: tl.constexpr, BLOCK_K: tl.constexpr):
    """The dequantized fp32 tile ``(BN, BLOCK_K)`` of rows ``rows`` and columns ``k0 .. k0 + BLOCK_K``."""
    rows64 = rows.to(tl.int64)
    code = _codes(qw_ptr, rows64 * (K * BITS // 32), k0, BITS, BLOCK_K)
    cb = k0 // CBLOCK  # the one column block this tile lies in
    if SCHEME == 0:
        table = (rows64 // GROUP) * n_cblocks + cb
        if BITS <= 4:  # the rows' tables in registers (BN, 2**bits), looked up with an in-register gather
            entries = tl.load(lut_ptr + (table * (1 << BITS))[:, None] + tl.arange(0, 1 << BITS)[None, :])
            w = tl.gather(entries.to(tl.float32), code, axis=1)
        else:  # 256-entry tables: a gather through L1
            w = tl.load(lut_ptr + (table * (1 << BITS))[:, None] + code).to(tl.float32)
    else:
        blk = rows64 * n_cblocks + cb
        scale = tl.load(scale_ptr + blk).to(tl.float32)
        if HAS_ZP:
            zp = _packed_vec(zp_ptr, blk, zp_nbytes, BITS).to(tl.float32)
        else:
            zp = tl.zeros_like(scale) + (1 << (BITS - 1))
        w = (code.to(tl.float32) - zp[:, None]) * scale[:, None]
    return w


@triton.jit
def _qmm_kernel(x_ptr, qw_ptr, lut_ptr, scale_ptr, zp_ptr, bias_ptr, out_ptr,
                M, N, K, n_cblocks, zp_nbytes, k_split, stride_xm, stride_om, stride_os,
                SCHEME: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, CBLOCK: tl.constexpr,
                HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, DIRECT: tl.constexpr, USE_DOT: tl.constexpr,
                IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(n, m, s)``: output tile ``(BLOCK_M, BLOCK_N)`` over input columns ``[s*k_split, (s+1)*k_split)``.

    ``DIRECT``: write ``acc + bias`` in the output dtype; else fp32 partial sums to ``out_ptr[s]`` (split-K).
    Rows past ``N`` / ``M`` are clamped for loads (valid memory, no masks) and masked at the store.
    """
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_c = tl.minimum(rows, N - 1)
    ms = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    ms_c = tl.minimum(ms, M - 1).to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = pid_s * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        w = _weight_tile(qw_ptr, lut_ptr, scale_ptr, zp_ptr, rows_c, k0, K, n_cblocks, zp_nbytes,
                         SCHEME, BITS, GROUP, CBLOCK, HAS_ZP, BLOCK_K)
        x = tl.load(x_ptr + ms_c[:, None] * stride_xm + (k0 + tl.arange(0, BLOCK_K))[None, :])
        if USE_DOT:
            if IEEE:
                acc += tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), input_precision="ieee")
            else:
                acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        else:
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(x.dtype).to(tl.float32)[None, :, :], axis=2)
    gemv._store_tile(acc, out_ptr, bias_ptr, ms, rows, rows_c, M, N, stride_om, stride_os, pid_s, DIRECT, HAS_BIAS)


@triton.jit
def _splitk_reduce(ws_ptr, bias_ptr, out_ptr, total, N, stride_os,
                   SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    """``out (M, N) = sum_s ws[s] (+ bias)`` in the output dtype; ``ws (SPLIT_K, M, N)`` fp32 contiguous."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * stride_os + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


# ------------------------------------------------------------------------------------------- configs


def _pow2_at_least(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def candidate_configs(fmt: Format, m: int, fp32: bool = False, fp16: bool = False) -> list[Config]:
    """The small config list for this format and batch, best guess first (used alone under the interpreter).

    ``fp32``: fp32 activations, whose full-precision ``tl.dot`` has no tensor cores and needs small tiles
    (sm_90 compile: 16x64x32 and 32x64x32 fit in registers, 64x64x32 and 64x128x64 spill). ``fp16``: fp16
    activations (blockwise 4-bit codes may then be decoded as fp16 pairs at batch 5-64).
    """
    ks = [bk for bk in (128, 64, 256, 32) if fmt.cblock % bk == 0]
    if fp32 and m > 4:
        tiles = ((16, 32), (16, 64)) if m <= 16 else ((32, 64), (16, 64), (32, 32))
        return [Config(bm, bn, 32, s, True) for bm, bn in tiles for s in ((4, 1, 2) if m <= 16 else (1, 2))]
    if m <= 16:  # GEMV path
        if m <= 4:  # the decode kernel (gemv.py)
            out = _decode_configs(fmt, m, ks)
            if m >= 2 and not fp32:  # batch 2-4: the decode-and-dot kernel's transposed product too, fourth (a
                # 16-input tile, 2-4 of them used: its decode is shared by the inputs and the tensor cores do the
                # multiplying, where the decode kernel's FMAs grow with the batch; palettize-3 nibble codes, sm_90, triton
                # 3.6: 2.5-2.9 thread instructions per weight against 3.8 at batch 2 and 6.5 at batch 4; never timed)
                out[3:3] = [c for c in _dot_decode_configs(fmt, m, ks, fp16) if c.swap]
            return out
        else:
            shapes = [(16, bn, bk, True) for bn, bk in ((32, 128), (64, 64), (64, 128), (32, 64)) if bk in ks]
        shapes = shapes or [(_pow2_at_least(min(m, 4)) if m <= 4 else 16, 32, ks[-1], m > 4)]
        out = [Config(bm, bn, bk, s, dot) for bm, bn, bk, dot in shapes for s in (4, 1, 2, 8)]
    else:  # tiled tl.dot path
        out = []
        for bm in (16, 32, 64, 128):
            if bm > 2 * _pow2_at_least(m) or (bm < 64 and m >= 128):
                continue
            for bn, bk, warps, stages in ((64, 64, 4, 3), (128, 64, 8, 3), (64, 128, 4, 2), (128, 32, 4, 4)):
                if bk in ks:
                    out += [Config(bm, bn, bk, s, True, warps, stages) for s in (1, 2)]
        out = out or [Config(16, 64, ks[-1], 1, True)]
    if m <= 64:  # the decode-and-dot kernel (qmm_dot.py) first, then the two kinds in turn
        dec = _dot_decode_configs(fmt, m, ks, fp16)
        out = [c for i in range(max(len(dec), len(out))) for c in dec[i:i + 1] + out[i:i + 1]]
    return [c for c in out if fmt.in_f >= c.block_k * c.split_k or c.split_k == 1]


def _dot_decode_configs(fmt: Format, m: int, ks: list[int], fp16: bool = False) -> list[Config]:
    """Batch 5-64 candidates of :mod:`.qmm_dot` (a weight tile decoded once for ``BLOCK_M`` rows), split-K sized to
    fill the SMs twice over; ``num_stages=1``: the words are prefetched by hand, and the pipeliner would route the
    table look-ups through shared memory (``compile_check --isa``)."""
    bm = min(_pow2_at_least(m), 64) if m > 16 else 16
    tiles = ((64, 64, 4), (64, 128, 4), (128, 64, 8)) if m <= 16 else ((128, 64, 8), (64, 64, 4), (64, 128, 4))
    shapes = [(bn, bk, w) for bn, bk, w in tiles if bk in ks] or [(64, ks[0], 4)]
    # inline-PTX table loads for 2/4/8-bit palettize (fewer instructions); 3-bit words read plainly (more instructions with them)
    asm = fmt.scheme == 0 and fmt.bits != 3 and gemv.lut_mode(fmt) != gemv.LUT_FP16

    def fill(bn: int, bk: int) -> int:
        tiles = -(-fmt.out_f // bn) * -(-m // bm)
        s = _pow2_at_least(max(min(-(-2 * SMS // tiles), fmt.in_f // bk), 1))
        return s if s * bk <= fmt.in_f else s // 2

    out = [DotDecode(bm, bn, bk, fill(bn, bk), True, w, 1, asm=asm) for bn, bk, w in shapes]
    if fmt.scheme == 0 and fmt.bits in (2, 3, 4):  # register tables on nibble codes (gemv: PRMT, no table read from
        # memory, fp16 values without a conversion) of the first tile, second: 3.2-4.7 thread instructions per weight
        # against 6.3-8.1 (sm_90, triton 3.6); never timed on a GPU yet. On the stored 2/3-bit codes they compile to a
        # layout conversion through shared memory (9.5-12.5): not a candidate; 4-bit codes are nibbles as stored
        # (4.3-5.7 against 4.4-6.0 for pair tables and 7.2-9.1 for fp32 tables, 0.1 global loads per weight against 0.6-1.1)
        mode = gemv.LUT_REGS if fmt.bits == 4 else gemv.LUT_REGS_NIBBLES
        out.insert(1, dataclasses.replace(out[0], asm=True, lut=mode))
    if fmt.scheme == 1 and fmt.bits == 4 and fp16:  # the codes as fp16 pairs (a shift and one lop3 per two weights) of
        # the first tile, second (2026-11-29, fifth session; never timed on a GPU): 4.3-5.4 thread instructions per
        # weight against 7.2-8.1 (compile_check --isa, sm_90, triton 3.6)
        out.insert(1, dataclasses.replace(out[0], asm=True, lut=gemv.BLOCKWISE_H2))
    second = len(out) > len(shapes)  # a register-table or fp16-pair candidate second
    if second:  # that second candidate with its code words through triton's pipeliner, fourth (Config.pipe; never
        # timed on a GPU): +0.2-0.5 thread instructions per weight for the nibble codes (16-byte copies since
        # 2026-11-30), fewer on the stored 3-bit codes (11.3 -> 7.4 at 16x64x64), the words PIPE_STAGES - 1 tiles ahead
        # (compile_check --pipe)
        out.insert(2, dataclasses.replace(out[1], pipe=PIPE_STAGES))
    if bm < 64:  # the second candidate (else the first) as the transposed product, right after it (Config.swap; never
        # timed on a GPU): a warpgroup MMA on sm_90 where 16-32 inputs get the small MMA and its register shuffles,
        # 2.5-4.0 thread instructions per weight against 3.9-5.7 (compile_check --isa, triton 3.6, 2026-11-30)
        i = 1 if second else 0
        out.insert(i + 1, dataclasses.replace(out[i], swap=True))
    return out


#: pipeline stages of the decode kernel's pipelined candidates (``Config.pipe``): the code words 3 tiles ahead
PIPE_STAGES = 4


def _decode_configs(fmt: Format, m: int, ks: list[int]) -> list[Config]:
    """Batch 1-4 candidates, the most different first (``--quick`` times only the first few): tile shapes with
    split-K sized to fill the SMs twice over, inline-PTX loads (fp32/pair tables, code words: ``compile_check --isa``
    counts 4.9-6.3 thread instructions per weight with them against 8.4-9.5 without, under triton 3.6), register
    tables from the second candidate on, then other split factors."""
    bm = _pow2_at_least(m)
    # every format has inline-PTX variants: table loads (fp32/pair tables) and code words (3-bit: strided; others: the
    # word tile keeps the accumulator's layout, no conversion through shared memory per tile: compile_check --isa)
    # tile order from an H100 sweep (benchmarks/decode_sweep.py, 4096x14336 batch 1, L2-cold): palettize 64x256 and
    # 128x256 first; blockwise B=64 128x64 then 64x64
    # 4-bit: at most 64x256 (32 words per thread at 128x256 spill 0.8-1.3 KB in every table layout, compile_check)
    most = 16384 if fmt.bits == 4 else 32768
    shapes = [(bn, bk) for bn, bk in ((64, 256), (128, 256), (64, 128), (128, 128), (32, 256), (32, 128), (128, 64),
                                      (64, 64), (256, 64), (32, 64)) if bk in ks and bm * bn * bk <= most]

    def fill(bn: int, bk: int) -> int:
        return _pow2_at_least(max(min(-(-2 * SMS // -(-fmt.out_f // bn)), fmt.in_f // bk), 1))

    plain = [Config(bm, bn, bk, fill(bn, bk), False) for bn, bk in shapes]
    first = plain
    if fmt.scheme == 1 and fmt.bits != 3:  # blockwise: inline PTX reads the words only (not yet timed on a GPU):
        # each tile's asm variant beside its plain one, which the H100 measured (1.2-1.4x fp16 at batch 1)
        first = [c for p in plain for c in (dataclasses.replace(p, asm=True), p)]
        if fmt.bits == 4:  # 4-bit: the codes as fp16 pairs (gemv.BLOCKWISE_H2) of the two first tiles, second and
            # third: 3.4-4.3 thread instructions per weight (symmetric; 3.9-6.8 with zero points) against 6.5-7.4
            # (compile_check --isa, sm_90); never timed on a GPU yet; dropped by _tune where fp16 chains are not
            # allowed (gemv.fp16_chains_allowed)
            h2 = [dataclasses.replace(c, asm=True, lut=gemv.BLOCKWISE_H2) for c in first[::2][:2]]
            first = first[:1] + h2 + first[1:]
    else:  # the asm variants first (the plain ones measured up to 2x slower on the H100), then the plain ones
        first = [dataclasses.replace(p, asm=True) for p in plain] + plain
    regs = gemv.register_modes(fmt) if fmt.scheme == 0 else ()
    modes = tuple(m for m in (gemv.table_modes(fmt) if fmt.scheme == 0 else ()) if m not in regs)
    lut = -1
    if fmt.bits == 4 and modes == (gemv.LUT_PAIRS, gemv.LUT_FP32):  # 4-bit: fp32 singles first (H100 sweep: every
        lut, modes = gemv.LUT_FP32, (gemv.LUT_FP32, gemv.LUT_PAIRS)  # tile ran 20-35% faster than with 2 KB pair tables)
        first = [dataclasses.replace(c, lut=lut) for c in first]
    if len(modes) > 1:  # the other table layouts of the two first tiles, fourth and fifth
        other = [dataclasses.replace(c, lut=m) for m in modes[1:] for c in first[:2]]
        first = first[:3] + other + [c for c in first[3:]]
    if regs:  # register tables (PRMT through inline PTX) of the two first tiles, from the second on: fewest
        # instructions per weight and no table look-up in memory (compile_check --isa), never timed on a GPU yet;
        # fp16 pair FMAs first (dropped by _tune where not allowed: gemv.fp16_chains_allowed), nibble codes before in place
        order = (gemv.LUT_REGS_NIBBLES_H2, gemv.LUT_REGS_NIBBLES, gemv.LUT_REGS_H2, gemv.LUT_REGS)
        reg = [dataclasses.replace(c, asm=True, lut=m) for c in first[:2] for m in order if m in regs]
        first = first[:1] + reg + first[1:]  # (4-bit too since 2026-11-28: 4.4-4.6 per weight against 7.7-8.1)
    # the first three candidates with their code words through triton's pipeliner, second to fourth (asynchronous
    # copies PIPE_STAGES - 1 tiles ahead instead of one tile in registers: the H100 measured this kernel latency-bound;
    # -0.6 to +0.2 thread instructions per weight and fewer registers, compile_check --isa --pipe 0,4, with the words
    # copied 16 bytes at a time and the activations loaded directly since 2026-11-30; never timed on a GPU yet).
    # The pipeliner reads the words plainly whatever ASM says; for blockwise, ASM there changes only the activations'
    # loads (direct instead of copied), so each twin takes it: one copy
    piped = [dataclasses.replace(c, pipe=PIPE_STAGES, asm=c.asm or (fmt.scheme == 1 and c.lut != gemv.BLOCKWISE_H2))
             for c in first[:3]]
    # the first candidate's twin whose last program per output tile sums the splits (Config.serial: no reduction
    # launch after it, one launch per layer instead of two; never run on a GPU yet), second
    serial = [dataclasses.replace(first[0], serial=True)] if first and first[0].split_k > 1 else []
    first = list(dict.fromkeys(first[:1] + serial + piped + first[1:]))
    asm = fmt.scheme == 0 or fmt.bits == 3
    rest = [Config(bm, bn, bk, s, False, asm=asm, lut=lut) for bn, bk in shapes for s in (1, 2, 4, 8, 16) if s != fill(bn, bk)]
    out = [c for c in first + rest if fmt.in_f >= c.block_k * c.split_k or c.split_k == 1]
    return out or [Config(bm, 32, ks[-1], 1, False)]


_TUNED: dict[tuple, Config] = {}

#: at most this many configs are timed per case (None: all; benchmarks/kernels.py --quick sets 6). The lists are
#: ordered best guess first and hold up to 75 candidates at batch 1 (palettize-3), each a compilation of about a
#: second and a timing: 16 keeps a layer kind's first use to seconds. ``QRECOVER_TUNE_LIMIT=N`` or ``all`` overrides.
TUNE_LIMIT: int | None = 16
TUNE_LIMIT_ENV = "QRECOVER_TUNE_LIMIT"
#: threads compiling the tuner's candidates ahead of timing them (``QRECOVER_COMPILE_THREADS``; 1: none ahead)
COMPILE_THREADS_ENV = "QRECOVER_COMPILE_THREADS"
#: per tuned case, what the tuner measured of each candidate: ms, or why it was skipped (benchmarks/kernels.py prints it)
TIMINGS: dict[tuple, dict[Config, float | str]] = {}
#: streaming multiprocessors the split-K of the decode path is sized for (H100 SXM: 132)
SMS = 132


def nibble_codes_wanted(fmt: Format) -> bool:
    """True when the tuner chose nibble codes (:func:`gemv.nibble_codes`) for ``fmt`` at some batch size: the layer
    then keeps that second copy of its codes (``kernel_tensors``); otherwise it is made only while tuning."""
    return any(k[0] == fmt and c.lut in gemv.NIBBLE_MODES for k, c in _TUNED.items())


def code_words(qdata: torch.Tensor) -> torch.Tensor:
    """The packed codes as int32 words (a copy when ``qdata`` is a view that does not start on a word)."""
    if qdata.storage_offset() % 4 or not qdata.is_contiguous():  # a view into a larger buffer: words need alignment
        qdata = qdata.contiguous().clone()
    return qdata.view(torch.int32)


def _bucket(m: int) -> int:
    return _pow2_at_least(m) if m <= 256 else 256


# ------------------------------------------------------------------------------------------- launch


#: per device, the zeroed int32 tile counters of the serial split-K (``Config.serial``); each launch leaves them zero
_COUNTERS: dict[str, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # replaced counters stay allocated: a captured CUDA graph may still point at them


def split_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """At least ``tiles`` zeroed int32 counters on ``device`` for :func:`gemv._last_split_reduces`, made once (a larger
    set replaces them when a launch needs more; launches on one stream share them, one after another)."""
    key = str(device)
    c = _COUNTERS.get(key)
    if c is None or c.numel() < tiles:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():  # a zero fill captured, not run
            raise RuntimeError(f"qrecover: the serial split-K needs {tiles} tile counters on {device}, made outside a "
                               "CUDA graph capture: run one forward of this batch size before capturing")
        if c is not None:
            _RETIRED.append(c)
        c = _COUNTERS[key] = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
    return c


def _launch(x: torch.Tensor, fmt: Format, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None,
            cfg: Config, warmup: bool = False) -> torch.Tensor:
    """``x @ W^T + bias`` by ``cfg``'s kernel. ``warmup``: compile the launch's kernels only (:func:`compile_ahead`;
    the output is then not computed)."""
    m, k = x.shape
    n = fmt.out_f
    out = torch.empty((m, n), device=x.device, dtype=x.dtype)
    qw = code_words(tensors["qdata"])
    dummy = qw
    lut = tensors.get("lut", dummy)
    scale = tensors.get("scale", dummy)
    zp = tensors.get("zero_point", dummy)
    zp_nbytes = zp.numel() if fmt.has_zp else 0
    k_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(k, k_split)
    direct = split == 1
    target = out if direct else torch.empty((split, m, n), device=x.device, dtype=torch.float32)
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    if not cfg.use_dot or isinstance(cfg, DotDecode):  # the decode kernels (gemv.py, qmm_dot.py)
        if fmt.scheme == 0:
            lut = tensors.get("lut_kernel" if cfg.lut < 0 else f"lut_kernel_{cfg.lut}")
            lut = gemv.kernel_tables(fmt, tensors["lut"], None if cfg.lut < 0 else cfg.lut) if lut is None else lut
        if cfg.lut in gemv.NIBBLE_MODES:  # the codes repacked once (gemv.nibble_codes), kept on the layer
            nib = tensors.get("qdata_nibbles")
            qw = gemv.nibble_codes(fmt, qw) if nib is None else nib
        if not cfg.use_dot:
            counters = split_counters(x.device, grid[0] * grid[1]) if cfg.serial and not direct else None
            gemv.launch(x, fmt, qw, lut, scale, zp, bias, target, k_split, grid, cfg, out, counters, warmup)
            if counters is not None:  # the kernel's last program per tile wrote the output
                return out
        else:
            mode = (gemv.lut_mode(fmt) if cfg.lut < 0 else cfg.lut) if fmt.scheme == 0 else gemv.LUT_FP16
            if fmt.scheme == 1 and cfg.lut == gemv.BLOCKWISE_H2:
                if fmt.bits != 4 or x.dtype != torch.float16:
                    raise ValueError(f"the fp16 pair mode of blockwise layers (lut {gemv.BLOCKWISE_H2}) takes 4-bit codes "
                                     f"and fp16 activations, got {fmt.bits}-bit and {x.dtype}; use lut -1")
                mode = gemv.BLOCKWISE_H2
            lut = lut.view(torch.int64) if mode == gemv.LUT_PAIRS else lut
            qmm_dot.launch(x, fmt, qw, lut, scale, zp, bias, target, k_split, grid, cfg, mode, _ieee_dot(x.dtype), warmup)
    else:
        gemv.run(_qmm_kernel, grid, warmup)(
            x, qw, lut, scale, zp, bias if bias is not None else dummy, target,
            m, n, k, k // fmt.cblock, zp_nbytes, k_split, x.stride(0), n, m * n,
            SCHEME=fmt.scheme, BITS=fmt.bits, GROUP=fmt.group, CBLOCK=fmt.cblock, HAS_ZP=fmt.has_zp,
            HAS_BIAS=bias is not None, DIRECT=direct, USE_DOT=cfg.use_dot, IEEE=_ieee_dot(x.dtype),
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if not direct:
        block = 1024
        gemv.run(_splitk_reduce, (triton.cdiv(m * n, block),), warmup)(
            target, bias if bias is not None else dummy, out, m * n, n, m * n,
            SPLIT_K=split, HAS_BIAS=bias is not None, BLOCK=block,
        )
    return out


def _ieee_dot(dtype: torch.dtype) -> bool:
    """fp32 activations multiply in full fp32 (no TF32, as torch's default). bf16 too under the interpreter, whose
    ``tl.dot`` mis-reads bf16 operands (measured: relative error 1e10); the weight is rounded to bf16 first, so
    the product is the same as a bf16 tensor-core dot with fp32 accumulation."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


#: the largest relative error (Frobenius, against the reference path's output) a candidate may show at tuning: the
#: kernels measure <= 2.8e-4 in fp16 (4.8e-4 with fp16 pair chains) and about 4e-3 in bf16, a wrongly compiled one O(1)
CHECK_TOL = 1e-2


def _agrees(y: torch.Tensor, ref: torch.Tensor) -> bool:
    """Whether a candidate's output ``y`` is the reference's ``ref`` up to the kernels' rounding (:data:`CHECK_TOL`)."""
    err = (y.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)
    return bool(torch.isfinite(err)) and float(err) <= CHECK_TOL


#: ``QRECOVER_TUNE_OFF=pipe,serial,...``: kinds of kernel variant the tuner leaves out (:func:`variant_kinds`), e.g. to
#: measure around one that faults on a GPU (a fault ends the process's CUDA context, which no check can catch)
TUNE_OFF_ENV = "QRECOVER_TUNE_OFF"
VARIANT_KINDS = ("pipe", "serial", "asm", "regs", "h2", "nibbles", "dot", "swap")


def variant_kinds(cfg: Config, fmt: Format) -> set[str]:
    """The kinds of variant ``cfg`` is: ``pipe`` (code words pipelined), ``serial`` (split-K in one launch), ``asm``
    (inline PTX), ``regs`` (palettize register tables), ``h2`` (fp16 pair FMAs), ``nibbles`` (repacked codes), ``dot``
    (the batch 5-64 decode-and-dot kernel), ``swap`` (its transposed product)."""
    palettize = fmt.scheme == 0
    return {k for k, on in (("pipe", cfg.pipe), ("serial", cfg.serial), ("asm", cfg.asm), ("dot", isinstance(cfg, DotDecode)),
                            ("swap", cfg.swap),
                            ("regs", palettize and cfg.lut >= gemv.LUT_REGS), ("h2", cfg.lut in gemv.H2_MODES),
                            ("nibbles", palettize and cfg.lut in gemv.NIBBLE_MODES)) if on}


def without_variants(configs: list[Config], fmt: Format, environ=os.environ) -> list[Config]:
    """``configs`` less the variant kinds ``QRECOVER_TUNE_OFF`` names; an unknown kind, or nothing left, is an error
    naming the value."""
    off = {k.strip() for k in environ.get(TUNE_OFF_ENV, "").split(",") if k.strip()}
    if not off:
        return configs
    if off - set(VARIANT_KINDS):
        raise ValueError(f"{TUNE_OFF_ENV}={environ[TUNE_OFF_ENV]!r}: unknown kinds {sorted(off - set(VARIANT_KINDS))}; "
                         f"choose from {', '.join(VARIANT_KINDS)}")
    kept = [c for c in configs if not variant_kinds(c, fmt) & off]
    if not kept:
        raise ValueError(f"{TUNE_OFF_ENV}={environ[TUNE_OFF_ENV]!r} leaves no kernel config for {fmt}; name fewer kinds, "
                         "or QRECOVER_KERNELS=0 for the dense path")
    return kept


def tune_limit(environ=os.environ) -> int | None:
    """How many candidates the tuner times per case: ``QRECOVER_TUNE_LIMIT`` (a positive number, or ``all``), else
    :data:`TUNE_LIMIT`. A bad value is an error naming it."""
    raw = environ.get(TUNE_LIMIT_ENV, "").strip().lower()
    if not raw:
        return TUNE_LIMIT
    if raw == "all":
        return None
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{TUNE_LIMIT_ENV}={environ[TUNE_LIMIT_ENV]!r}: give a positive number of kernel configurations "
                         f"to time per layer kind (default {TUNE_LIMIT}), or 'all'")
    return int(raw)


def compile_threads(environ=os.environ) -> int:
    """Threads for :func:`compile_ahead`: ``QRECOVER_COMPILE_THREADS``, else one per CPU core up to 16."""
    raw = environ.get(COMPILE_THREADS_ENV, "").strip()
    if not raw:
        return max(1, min(16, os.cpu_count() or 1))
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{COMPILE_THREADS_ENV}={raw!r}: give a positive number of threads (1: compile each kernel "
                         "configuration as it is first timed)")
    return int(raw)


def compile_ahead(configs: list[Config], warm, threads: int) -> None:
    """Compile every candidate before any is timed, ``threads`` at a time: ``warm(cfg)`` runs ``cfg``'s launch with
    ``warmup=True`` (the kernels compiled with the launch's own specialization, nothing launched) inside triton's
    ``AsyncCompileMode``, which hands each compilation to the thread pool. Triton's compiler leaves Python's lock for
    most of its work: on a 2-core CPU, a palettize-3 layer's 16 candidates for sm_90 compiled in 12.1 s one after
    another and 7.1 s in 2 threads (triton 3.6, ``benchmarks/tuner_compile.py``); the GPU machines have 16 cores. Nothing here can change a result: a
    kernel enters triton's cache only when its compilation succeeds, and one that fails is compiled again by the
    timing loop, which says why (:func:`_fastest`); an error of this step only costs its head start (one warning)."""
    mode = getattr(triton, "AsyncCompileMode", None)  # triton 3.4 and later
    if threads <= 1 or len(configs) <= 1 or mode is None:
        return
    try:
        with ThreadPoolExecutor(threads) as pool, mode(pool, ignore_errors=True):
            for cfg in configs:
                try:
                    warm(cfg)
                except Exception:  # noqa: BLE001 (e.g. a split a kernel refuses: the timing loop reports it)
                    pass
    except Exception as e:  # noqa: BLE001
        warnings.warn(f"qrecover: compiling the kernel candidates ahead failed ({type(e).__name__}: {str(e)[:200]}); "
                      "each compiles when it is first timed", stacklevel=2)


def _checker(ref: torch.Tensor | None, run):
    """The tuner's check of a candidate (``run(cfg)``: its output) against the reference output ``ref``; None (no
    check) without a reference or where it is not finite (inputs with inf or NaN: nothing to judge by, and the layer
    must still run)."""
    if ref is None or not bool(torch.isfinite(ref).all()):
        return None
    return lambda cfg: _agrees(run(cfg), ref)


def _tune(x: torch.Tensor, fmt: Format, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None,
          reference=None) -> Config:
    """The fastest candidate for ``x``'s shape bucket and dtype (cached). On a GPU each candidate is first run once and
    compared with ``reference(x)`` (the dequantize-then-matmul path's output; None: not checked): one whose result
    differs (a variant miscompiled on this GPU or this triton) is skipped with a warning, never kept for being fast."""
    key = (fmt, _bucket(x.shape[0]), x.dtype, x.device.type)
    if key in _TUNED:
        return _TUNED[key]
    configs = candidate_configs(fmt, x.shape[0], x.dtype == torch.float32, x.dtype == torch.float16)
    if not gemv.fp16_chains_allowed(x):  # fp16 pair FMAs: fp16 activations, and torch's reduced-precision switch on
        configs = [c for c in configs if c.use_dot or c.lut not in gemv.H2_MODES]
    if tensors["qdata"].nbytes > dispatch.DENSE_FREE_FRACTION * dispatch.free_memory(x.device):  # no room for a
        configs = [c for c in configs if c.lut not in gemv.NIBBLE_MODES]  # second copy of the codes
    configs = without_variants(configs, fmt)[:tune_limit()]
    if interpreting() or x.device.type != "cuda" or len(configs) == 1:
        best = configs[0]
    elif torch.cuda.is_current_stream_capturing():  # inside someone's graph capture nothing can be timed: not kept
        return configs[0]
    else:
        if any(c.lut in gemv.NIBBLE_MODES for c in configs) and "qdata_nibbles" not in tensors:
            tensors = {**tensors, "qdata_nibbles": gemv.nibble_codes(fmt, code_words(tensors["qdata"]))}
        compile_ahead(configs, lambda cfg: _launch(x, fmt, tensors, bias, cfg, warmup=True), compile_threads())
        check = _checker(None if reference is None else reference(x), lambda cfg: _launch(x, fmt, tensors, bias, cfg))
        if any(c.serial for c in configs):  # its counters made before the timing's graph capture
            split_counters(x.device, triton.cdiv(fmt.out_f, 16) * x.shape[0])
        sets = tensor_copies(tensors, l2_bytes(x.device))  # None: no room for copies, time warm
        best = _fastest(configs, lambda cfg: _time(x, fmt, sets or [tensors], bias, cfg, cold=sets is not None), check,
                        TIMINGS.setdefault(key, {}))
        del sets
    _TUNED[key] = best
    return best


def _fastest(configs: list[Config], time_one, check=None, record: dict | None = None) -> Config:
    """The config ``time_one(cfg)`` measures fastest. One that does not compile for this GPU is skipped: out of
    registers or shared memory silently, any other compile error (e.g. inline PTX the assembler rejects) with a
    warning naming the config, so that a kernel variant never timed on this GPU cannot stop a layer from running.
    ``check(cfg)``: False skips the config with a warning (its result differs from the reference path's).
    ``record``: filled with each config's time, or why it was skipped."""
    timings = {}
    record = {} if record is None else record
    for cfg in configs:
        try:
            if check is not None and not check(cfg):
                warnings.warn(f"qrecover: kernel config {cfg} gave a result that differs from the reference path's "
                              f"(relative error above {CHECK_TOL}) on this GPU and was skipped", stacklevel=2)
                record[cfg] = "differs from the reference"
                continue
            timings[cfg] = record[cfg] = time_one(cfg)
        except OutOfResources:
            record[cfg] = "out of resources"
            continue
        except TritonError as e:
            record[cfg] = f"did not compile: {type(e).__name__}"
            warnings.warn(f"qrecover: kernel config {cfg} did not compile on this GPU and was skipped "
                          f"({type(e).__name__}: {str(e)[:300]})", stacklevel=2)
    if not timings:
        raise RuntimeError(f"none of the {len(configs)} kernel configs compiled and agreed with the reference path for this "
                           f"layer (the first: {configs[0]}); QRECOVER_KERNELS=0 runs the dense path instead")
    return min(timings, key=timings.get)


def _time(x: torch.Tensor, fmt: Format, sets: list[dict], bias: torch.Tensor | None, cfg: Config, cold: bool) -> float:
    """One configuration's time: L2-cold over the tensor copies ``sets`` in one CUDA graph (:mod:`.timing`), or
    ``do_bench`` where there was no room for copies or the graph cannot be captured."""
    if cold:
        try:
            return cold_ms([lambda t=t: _launch(x, fmt, t, bias, cfg) for t in sets], min_calls=64, replays=3)
        except RuntimeError:  # a capture error: the warm measure below
            torch.cuda.synchronize()
    return triton.testing.do_bench(lambda: _launch(x, fmt, sets[0], bias, cfg), warmup=5, rep=20)


def quant_matmul(x: torch.Tensor, fmt: Format, tensors: dict[str, torch.Tensor], bias: torch.Tensor | None = None,
                 config: Config | None = None, reference=None) -> torch.Tensor:
    """``x (M, I) @ W^T + bias -> (M, O)`` in ``x.dtype``, ``W`` decoded from ``tensors`` (the layer's buffers).

    ``config``: force one launch configuration (tests); default: tuned per shape and cached, each candidate checked
    against ``reference(x)`` first where given (:func:`_tune`).
    """
    if x.stride(-1) != 1:
        x = x.contiguous()
    if bias is not None:
        bias = bias.to(x.dtype)
    if x.is_cuda and x.device.index != torch.cuda.current_device():  # triton launches on the current device
        with torch.cuda.device(x.device):
            return quant_matmul(x, fmt, tensors, bias, config, reference)
    cfg = config or _tune(x, fmt, tensors, bias, reference)
    if fmt.cblock % cfg.block_k or (cfg.use_dot and cfg.block_m < 16):
        raise ValueError(f"{cfg=} is invalid for {fmt=}: block_k must divide cblock (a K-tile lies in one column "
                         "block) and a tl.dot tile needs block_m >= 16")
    return _launch(x, fmt, tensors, bias, cfg)

"""The batch 1-4 (decode) path of the fused dequant-matmul: few instructions per decoded weight.

Why a kernel of its own: a GEMV is memory-bound only below ~3.6-4.7 thread instructions per weight on an H100
(:mod:`.isa`). The shared ``_qmm_kernel`` spends 26-51 at batch 1 (``compile_check --isa``): its codes are
expanded by position tensors the compiler cannot fold (select chains), table look-ups are ``tl.gather`` (warp
shuffles), and each tile is reduced across lanes. Here:

- codes are extracted by an unrolled loop over a word's code positions (``tl.static_range``), so every shift
  and mask is a compile-time constant (3-bit codes straddling two words join with one more shift and or);
- activations are read two per 32-bit load for fp16/bf16 (:func:`x_pairs`) and split in registers; they are
  shared by the ``BLOCK_N`` rows and stay in L1;
- palettize tables, repacked once at first use (:func:`kernel_tables`), are fp32 *pair* tables (2/3/4-bit: two
  codes index one entry, read as one 64-bit load and split into its fp32 halves, FLUTE's trick) or fp32 singles;
  which layout a shape uses is a tuning choice (``Config.lut``, :func:`table_modes`);
- ``Config.asm`` reads the tables and the strided 3-bit words through inline PTX (``ld.global.nc``): triton 3.6
  gives a plain gathered ``tl.load`` a register layout of its own and converts it back through shared memory;
- the next tile's code words are requested before the current tile is decoded (a register double buffer);
- blockwise: the tile lies in one block, so ``sum_k x_k (c_k - z) s = s (sum_k x_k c_k - z sum_k x_k)``: one FMA
  per weight, the scale applied once per word; the code becomes a float through its bits (``2**23 + c``, minus
  ``2**23``: exact), a full-rate add instead of a quarter-rate ``I2F``; ``sum_k x_k`` in the same pass;
- the accumulator keeps the word axis and is reduced across lanes once, after the loop.

The packed codes are read in place (no repack of ``qdata``). Shapes: ``x (M, K)``, ``qdata`` as ``int32`` words
``(N, K * bits / 32)``; output ``(M, N)`` directly, or fp32 split-K partial sums ``(S, M, N)``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .formats import Format

#: lut modes: 0 the stored fp16 tables, 1 fp32 tables, 2 fp32 pair tables read as one 64-bit word (repacked once,
#: :func:`kernel_tables`)
LUT_FP16, LUT_FP32, LUT_PAIRS = 0, 1, 2
#: activation loads: 0 one load per value; 1 / 2 one 32-bit load per pair of fp16 / bf16 values, split in registers
X_PLAIN, X_FP16_PAIRS, X_BF16_PAIRS = 0, 1, 2


@triton.jit
def _x_pair(x_ptr, xoff, i, XP: tl.constexpr):
    """Activations of code positions ``2i`` and ``2i + 1`` of each word, fp32 ``(BM, NW)`` each. ``xoff``: the
    words' first position in elements of ``x_ptr`` (for pairs, ``x_ptr`` is the 32-bit view: one load, two values)."""
    if XP == 0:
        a = tl.load(x_ptr + xoff + 2 * i).to(tl.float32)
        b = tl.load(x_ptr + xoff + 2 * i + 1).to(tl.float32)
    else:
        u = tl.load(x_ptr + xoff + i)
        if XP == 1:
            a = u.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            b = (u >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
        else:  # a bf16 is the top half of the fp32 of the same value
            a = (u << 16).to(tl.float32, bitcast=True)
            b = (u & -65536).to(tl.float32, bitcast=True)
    return a, b


@triton.jit
def _bits_at(w0, w1, w2, OFF: tl.constexpr, WIDTH: tl.constexpr):
    """``WIDTH`` bits at bit ``OFF`` of the code group ``w0 | w1 << 32 | w2 << 64`` (uint32 words), as int32;
    every shift and mask is a compile-time constant. One word per group unless the codes are 3-bit."""
    sh: tl.constexpr = OFF % 32
    wi: tl.constexpr = OFF // 32
    src = w0 if wi == 0 else (w1 if wi == 1 else w2)
    c = src >> sh
    if sh + WIDTH > 32:  # the field straddles two words (3-bit codes only)
        c = c | ((w1 if wi == 0 else w2) << (32 - sh))
    return (c & ((1 << WIDTH) - 1)).to(tl.int32)


@triton.jit
def _lut_load(ptr, ASM: tl.constexpr, WIDE: tl.constexpr):
    """A table look-up: a 64-bit pair (``WIDE``) or an fp32 entry. ``ASM``: through inline PTX (``ld.global.nc``),
    which keeps the operand's register layout; triton 3.6 gives a plain ``tl.load`` of a gathered address a layout
    of its own and converts the values back through shared memory (1-1.5 shared loads and stores per weight,
    ``compile_check --isa``)."""
    if not ASM:
        return tl.load(ptr)
    elif WIDE:
        return tl.inline_asm_elementwise("ld.global.nc.b64 $0, [$1];", "=l,l", [ptr], dtype=tl.int64, is_pure=True,
                                         pack=1)
    else:
        return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.float32, is_pure=True,
                                         pack=1)


@triton.jit
def _value(c, tbase, lut_ptr, SCHEME: tl.constexpr, BITS: tl.constexpr, ASM: tl.constexpr):
    """The decoded value of codes ``c (BN, NW)``: a table look-up (palettize) or the code as a float (blockwise:
    ``2**23 + c`` by its bits, minus ``2**23``; exact, and a full-rate add instead of a quarter-rate ``I2F``)."""
    if SCHEME == 0:
        if ASM:  # fp32 tables (the caller passes ASM only with them: a 32-bit load of a 2-byte entry is misaligned)
            return _lut_load(lut_ptr + tbase[:, None] * (1 << BITS) + c, True, False)
        return tl.load(lut_ptr + tbase[:, None] * (1 << BITS) + c).to(tl.float32)
    return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _word(ptr, ASM: tl.constexpr):
    """One code word per pointer, as uint32 (``ASM``: inline PTX, keeping the pointers' register layout)."""
    if ASM:
        return _lut_load(ptr, True, False).to(tl.uint32, bitcast=True)
    return tl.load(ptr).to(tl.uint32, bitcast=True)


@triton.jit
def _load_words(qw_ptr, row_word, k0, CPG: tl.constexpr, WPG: tl.constexpr, NW: tl.constexpr, BITS: tl.constexpr,
                ASM: tl.constexpr):
    """The tile's code words ``(BN, NW)`` per word of a group (3 for 3-bit codes; the others repeat ``w0``). The
    3-bit words are strided (3 per group), which triton 3.6 gives a layout of its own unless read through ``ASM``."""
    wp = qw_ptr + row_word[:, None] + ((k0 // CPG + tl.arange(0, NW)) * WPG)[None, :]
    if BITS == 3:
        w0 = _word(wp, ASM)
        w1 = _word(wp + 1, ASM)
        w2 = _word(wp + 2, ASM)
    else:
        w0 = tl.load(wp).to(tl.uint32, bitcast=True)
        w1 = w0
        w2 = w0
    return w0, w1, w2


@triton.jit
def _scale_zero(scale_ptr, zp_ptr, blk, zp_nbytes, BITS: tl.constexpr, HAS_ZP: tl.constexpr):
    """Blockwise: fp32 ``(scale, zero point)`` of blocks ``blk``; zero points bit-packed (``BITS`` each) or the constant
    ``2**(BITS - 1)`` (symmetric)."""
    scale = tl.load(scale_ptr + blk).to(tl.float32)
    if HAS_ZP:
        zbit = blk * BITS
        zlo = tl.load(zp_ptr + (zbit >> 3)).to(tl.int32)
        zhi = tl.load(zp_ptr + (zbit >> 3) + 1, mask=(zbit >> 3) + 1 < zp_nbytes, other=0).to(tl.int32)
        zp = ((((zhi << 8) | zlo) >> (zbit & 7).to(tl.int32)) & ((1 << BITS) - 1)).to(tl.float32)
    else:
        zp = tl.zeros_like(scale) + (1 << (BITS - 1))
    return scale, zp


@triton.jit
def _store_tile(y, out_ptr, bias_ptr, ms, rows, bias_rows, M, N, stride_om, stride_os, split, DIRECT: tl.constexpr,
                HAS_BIAS: tl.constexpr):
    """Store the fp32 tile ``y (BM, BN)`` of rows ``ms`` and outputs ``rows``: with the bias and in the output's dtype
    (``DIRECT``), or as split ``split``'s partial sums into the fp32 workspace (the split-K reduction adds the bias)."""
    mask = (ms < M)[:, None] & (rows < N)[None, :]
    offs = ms.to(tl.int64)[:, None] * stride_om + rows[None, :]
    if DIRECT:
        if HAS_BIAS:
            y += tl.load(bias_ptr + bias_rows).to(tl.float32)[None, :]
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + split.to(tl.int64) * stride_os + offs, y, mask=mask)


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, lut_ptr, scale_ptr, zp_ptr, bias_ptr, out_ptr, M, N, K, row_words, n_cblocks, zp_nbytes,
                 k_split, stride_xm, stride_om, stride_os, SCHEME: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                 CBLOCK: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, LUT: tl.constexpr, DIRECT: tl.constexpr,
                 XP: tl.constexpr, ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program ``(n, m, s)``: rows ``n*BLOCK_N..``, inputs ``m*BLOCK_M..``, columns ``[s*k_split, (s+1)*k_split)``.
    ``stride_xm``: in elements of ``x_ptr`` (halved by the caller for the 32-bit pair view, ``XP > 0``)."""
    WPG: tl.constexpr = 3 if BITS == 3 else 1  # words per group of codes
    CPG: tl.constexpr = 32 if BITS == 3 else 32 // BITS  # codes per group
    NW: tl.constexpr = BLOCK_K // CPG
    XSTEP: tl.constexpr = CPG // 2 if XP else CPG  # x_ptr elements per group
    ASM_LUT: tl.constexpr = ASM and LUT != 0  # fp16 tables read plainly: a 32-bit PTX load of a 2-byte entry is misaligned
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    xrow = tl.minimum(ms, M - 1).to(tl.int64) * stride_xm
    row_word = rows64 * row_words
    acc = tl.zeros((BLOCK_M, BLOCK_N, NW), dtype=tl.float32)
    k_lo = tl.program_id(2) * k_split
    k_hi = tl.minimum(k_lo + k_split, K)
    w0, w1, w2 = _load_words(qw_ptr, row_word, k_lo, CPG, WPG, NW, BITS, ASM)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        # the next tile's words are requested before this tile is decoded (the last tile re-reads itself)
        n0, n1, n2 = _load_words(qw_ptr, row_word, tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K), CPG, WPG, NW, BITS, ASM)
        cb = k0 // CBLOCK
        tbase = ((rows64 // GROUP) * n_cblocks + cb).to(tl.int32)  # table index (< 2**31): 32-bit offsets
        xoff = xrow[:, None] + ((k0 // CPG + tl.arange(0, NW)) * XSTEP)[None, :]
        part = tl.zeros((BLOCK_M, BLOCK_N, NW), dtype=tl.float32)
        sx = tl.zeros((BLOCK_M, NW), dtype=tl.float32)
        for i in tl.static_range(CPG // 2):
            xa, xb = _x_pair(x_ptr, xoff, i, XP)
            if LUT == 2:  # one 64-bit load: the fp32 values of both codes (code 2i in the low half)
                idx = _bits_at(w0, w1, w2, 2 * BITS * i, 2 * BITS)
                p = _lut_load(lut_ptr + ((tbase[:, None] << (2 * BITS)) + idx), ASM, True)
                va = p.to(tl.int32).to(tl.float32, bitcast=True)
                vb = (p >> 32).to(tl.int32).to(tl.float32, bitcast=True)
            else:
                va = _value(_bits_at(w0, w1, w2, BITS * 2 * i, BITS), tbase, lut_ptr, SCHEME, BITS, ASM_LUT)
                vb = _value(_bits_at(w0, w1, w2, BITS * (2 * i + 1), BITS), tbase, lut_ptr, SCHEME, BITS, ASM_LUT)
            part += xa[:, None, :] * va[None, :, :] + xb[:, None, :] * vb[None, :, :]
            if SCHEME == 1:
                sx += xa + xb
        if SCHEME == 0:
            acc += part
        else:  # s * (sum x c - z sum x), per word: the tile lies in one block
            scale, zp = _scale_zero(scale_ptr, zp_ptr, rows64 * n_cblocks + cb, zp_nbytes, BITS, HAS_ZP)
            acc += scale[None, :, None] * (part - zp[None, :, None] * sx[:, None, :])
        w0, w1, w2 = n0, n1, n2
    _store_tile(tl.sum(acc, axis=2), out_ptr, bias_ptr, ms, rows, rows64, M, N, stride_om, stride_os, tl.program_id(2),
                DIRECT, HAS_BIAS)


def lut_mode(fmt: Format) -> int:
    """Which tables the GEMV reads: fp32 pairs (2/3/4-bit) or fp32 singles when they add at most 1/16 of the packed
    codes' bytes (whole-row or wide column blocks), else the stored fp16 tables."""
    if fmt.scheme != 0:
        return LUT_FP16
    tables = (fmt.out_f // fmt.group) * (fmt.in_f // fmt.cblock)
    code_bytes = fmt.out_f * fmt.in_f * fmt.bits // 8
    if fmt.bits in (2, 3, 4) and tables * (1 << (2 * fmt.bits)) * 8 * 16 <= code_bytes:
        return LUT_PAIRS
    if tables * (1 << fmt.bits) * 4 * 16 <= code_bytes:
        return LUT_FP32
    return LUT_FP16


def table_modes(fmt: Format) -> tuple[int, ...]:
    """The table layouts the tuner times for a palettize layer, :func:`lut_mode`'s first: pair tables halve the
    look-ups, but a 4-bit pair table is 2 KB per 16 rows against 64 B of fp32 singles, so a warp's look-ups touch
    more L1 lines (on an H100, palettize-4 gained least from pairs: docs/kernels.md)."""
    mode = lut_mode(fmt)
    return (mode, LUT_FP32) if mode == LUT_PAIRS else (mode,)


def kernel_tables(fmt: Format, lut: torch.Tensor, mode: int | None = None) -> torch.Tensor:
    """The one-time repack of palettize tables ``lut (T, 2**bits)`` fp16 for ``mode`` (default :func:`lut_mode`):
    fp32 ``(T, 2**bits)`` or fp32 pairs ``(T, 2**(2 bits), 2)`` with ``pairs[t, a | b << bits] = (lut[t, a],
    lut[t, b])``. Exact (fp16 -> fp32)."""
    mode = lut_mode(fmt) if mode is None else mode
    if mode == LUT_FP16:
        return lut
    table = lut.float()
    if mode == LUT_FP32:
        return table.contiguous()
    n = 1 << fmt.bits
    idx = torch.arange(n * n, device=lut.device)
    return torch.stack([table[:, idx % n], table[:, idx // n]], dim=-1).contiguous()


def interpreting() -> bool:
    """True when these kernels were built for triton's CPU interpreter (``TRITON_INTERPRET=1`` when this module
    was imported: ``@triton.jit`` reads it at decoration time); inline PTX cannot run there."""
    return isinstance(_gemv_kernel, InterpretedFunction)


def x_pairs(x: torch.Tensor) -> int:
    """How the kernel reads ``x``: a 16-bit ``x`` whose rows start on 4-byte boundaries as 32-bit pairs (one load
    for two activations), anything else value by value."""
    if x.dtype not in (torch.float16, torch.bfloat16) or x.stride(0) % 2 or x.data_ptr() % 4 or x.stride(-1) != 1:
        return X_PLAIN
    return X_FP16_PAIRS if x.dtype == torch.float16 else X_BF16_PAIRS


def launch(x: torch.Tensor, fmt: Format, qw: torch.Tensor, lut: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor,
           bias: torch.Tensor | None, target: torch.Tensor, k_split: int, grid: tuple[int, int, int], cfg) -> None:
    """Run :func:`_gemv_kernel` into ``target`` (the output, or the split-K workspace when ``grid[2] > 1``);
    ``lut``: :func:`kernel_tables` for palettize, in ``cfg.lut``'s layout (-1: :func:`lut_mode`'s)."""
    m, k = x.shape
    n = fmt.out_f
    mode = (lut_mode(fmt) if cfg.lut < 0 else cfg.lut) if fmt.scheme == 0 else LUT_FP16
    if mode == LUT_PAIRS:
        lut = lut.view(torch.int64)  # (T, 2**(2 bits)): both fp32 values of a pair in one 64-bit load
    xp = x_pairs(x)
    xv = x.view(torch.int32) if xp else x
    _gemv_kernel[grid](
        xv, qw, lut, scale, zp, qw if bias is None else bias, target, m, n, k, k * fmt.bits // 32, k // fmt.cblock,
        zp.numel() if fmt.has_zp else 0, k_split, x.stride(0) // 2 if xp else x.stride(0), n, m * n,
        SCHEME=fmt.scheme, BITS=fmt.bits, GROUP=fmt.group, CBLOCK=fmt.cblock, HAS_ZP=fmt.has_zp,
        HAS_BIAS=bias is not None, LUT=mode, DIRECT=grid[2] == 1, XP=xp, ASM=cfg.asm and not interpreting(),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

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
- register tables (``Config.lut`` 3-6, 2/3/4-bit palettize): a row's table as byte planes in registers, four codes
  looked up by ``PRMT`` (inline PTX) with no memory access; codes in place or repacked once into nibbles
  (:func:`nibble_codes`); fp32 FMAs, or fp16 pair FMAs in short chains where torch allows reduced-precision fp16
  reductions (:func:`fp16_chains_allowed`);
- ``Config.asm`` reads the tables and the strided 3-bit words through inline PTX (``ld.global.nc``): triton 3.6
  gives a plain gathered ``tl.load`` a register layout of its own and converts it back through shared memory;
- the next tile's code words are requested before the current tile is decoded (a register double buffer), or
  (``Config.pipe``) read plainly at each tile, which triton's pipeliner turns into asynchronous copies to shared memory
  ``pipe - 1`` tiles ahead: more bytes in flight per SM, for a kernel the H100 measured latency-bound;
- blockwise: the tile lies in one block, so ``sum_k x_k (c_k - z) s = s (sum_k x_k c_k - z sum_k x_k)``: one FMA
  per weight, the scale applied once per word; the code becomes a float through its bits (``2**23 + c``, minus
  ``2**23``: exact), a full-rate add instead of a quarter-rate ``I2F``; ``sum_k x_k`` in the same pass;
- the accumulator keeps the word axis and is reduced across lanes once, after the loop.

The packed codes are read in place (no repack of ``qdata``). Shapes: ``x (M, K)``, ``qdata`` as ``int32`` words
``(N, K * bits / 32)``; output ``(M, N)`` directly, or fp32 split-K partial sums ``(S, M, N)``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from .formats import Format

#: lut modes: 0 the stored fp16 tables, 1 fp32 tables, 2 fp32 pair tables read as one 64-bit word (repacked once,
#: :func:`kernel_tables`); 3 register tables (2/3/4-bit: a row's fp16 entries as two byte planes in four or eight 32-bit
#: registers, looked up four codes at a time by ``PRMT``), the codes read in place; 4 the same on codes repacked once
#: so that each code already fills a nibble (:func:`nibble_codes`: fewer instructions, a second copy of the codes);
#: 5 and 6 the same two with fp16 pair FMAs in chains of at most 8 products (``fma.rn.f16x2``, half the instructions per
#: weight; fp16 activations only, and only where torch allows reduced-precision fp16 reductions:
#: :func:`fp16_chains_allowed`)
LUT_FP16, LUT_FP32, LUT_PAIRS, LUT_REGS, LUT_REGS_NIBBLES, LUT_REGS_H2, LUT_REGS_NIBBLES_H2 = 0, 1, 2, 3, 4, 5, 6
NIBBLE_MODES = (LUT_REGS_NIBBLES, LUT_REGS_NIBBLES_H2)
H2_MODES = (LUT_REGS_H2, LUT_REGS_NIBBLES_H2)
#: blockwise 4-bit layers (no tables) take ``Config.lut`` = this for their fp16 pair mode: two codes become an fp16
#: pair by their bits (``0x6400 | c`` is ``1024 + c``), one ``add.rn.f16x2`` makes them ``c - z`` exactly, and
#: ``fma.rn.f16x2`` multiplies them by the activation pairs (chains of 4 products, flushed to fp32 and scaled per tile)
BLOCKWISE_H2 = LUT_REGS_H2
#: activation loads: 0 one load per value; 1 / 2 one 32-bit load per pair of fp16 / bf16 values, split in registers
X_PLAIN, X_FP16_PAIRS, X_BF16_PAIRS = 0, 1, 2


@triton.jit
def _x_word(ptr, XA: tl.constexpr):
    """One 32-bit word of activations (a pair of fp16/bf16 values), int32. ``XA``: through inline PTX
    (``ld.global.nc``), which triton's pipeliner leaves alone: with ``Config.pipe`` the activations, read by every row
    of a tile and so L1 hits after the first, are then loaded directly instead of each thread copying its own into
    shared memory by 4-byte ``cp.async`` and reading them back (``compile_check --isa --pipe 4``)."""
    if XA:
        return tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32, is_pure=True,
                                         pack=1)
    return tl.load(ptr)


@triton.jit
def _x_pair(x_ptr, xoff, i, XP: tl.constexpr, XA: tl.constexpr = False):
    """Activations of code positions ``2i`` and ``2i + 1`` of each word, fp32 ``(BM, NW)`` each. ``xoff``: the
    words' first position in elements of ``x_ptr`` (for pairs, ``x_ptr`` is the 32-bit view: one load, two values;
    ``XA``: :func:`_x_word`'s)."""
    if XP == 0:
        a = tl.load(x_ptr + xoff + 2 * i).to(tl.float32)
        b = tl.load(x_ptr + xoff + 2 * i + 1).to(tl.float32)
    else:
        u = _x_word(x_ptr + xoff + i, XA)
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
                ASM: tl.constexpr, plane=0, PLANES: tl.constexpr = False, ASM_WORDS: tl.constexpr = False):
    """The tile's code words ``(BN, NW)`` per word of a group (3 for 3-bit codes; the others repeat ``w0``). The
    stored 3-bit words are strided (3 per group), which triton 3.6 gives a layout of its own unless read through
    ``ASM``; ``PLANES``: 3-bit nibble codes, word ``b`` of each group ``plane`` words after word 0 (contiguous).
    ``ASM_WORDS``: every code width through ``ASM`` (the decode kernel: a vectorised plain load of contiguous words
    takes a layout other than its accumulator's, converted back through shared memory every tile when compiled as
    the launcher specializes, aligned; not the decode-and-dot kernel, whose tiles it makes slower)."""
    if PLANES:
        wp = qw_ptr + row_word[:, None] + (k0 // CPG + tl.arange(0, NW))[None, :]
        return (tl.load(wp).to(tl.uint32, bitcast=True), tl.load(wp + plane).to(tl.uint32, bitcast=True),
                tl.load(wp + 2 * plane).to(tl.uint32, bitcast=True))
    wp = qw_ptr + row_word[:, None] + ((k0 // CPG + tl.arange(0, NW)) * WPG)[None, :]
    if BITS == 3:
        w0 = _word(wp, ASM)
        w1 = _word(wp + 1, ASM)
        w2 = _word(wp + 2, ASM)
    else:
        w0 = _word(wp, ASM and ASM_WORDS)
        w1 = w0
        w2 = w0
    return w0, w1, w2


@triton.jit
def _octet(w0, w1, w2, O: tl.constexpr, BITS: tl.constexpr, NIBBLES: tl.constexpr):
    """Codes ``8 O .. 8 O + 7`` of the group as ``PRMT`` selectors: code ``j`` in nibble ``j`` (bit 3 clear), uint32.

    Stored codes (``BITS``-bit fields one after another) are spread in three steps (halves to 16-bit lanes, pairs to
    bytes, singles to nibbles: a shift, an and and an or each); :func:`nibble_codes` codes need one mask (3-bit: the
    fourth octet is gathered from the spare bit 3 of the three words' nibbles)."""
    if BITS == 4:  # 4-bit codes are nibbles already (bit 3 included: :func:`_bytes16`)
        s = w0
    elif NIBBLES:
        if BITS == 2:
            s = (w0 >> (2 * O)) & 0x33333333
        elif O < 3:
            s = (w0 if O == 0 else (w1 if O == 1 else w2)) & 0x77777777
        else:
            s = ((w0 & 0x88888888) >> 3) | ((w1 & 0x88888888) >> 2) | ((w2 & 0x88888888) >> 1)
    else:
        OFF: tl.constexpr = 8 * BITS * O
        sh: tl.constexpr = OFF % 32
        wi: tl.constexpr = OFF // 32
        f = (w0 if wi == 0 else (w1 if wi == 1 else w2)) >> sh
        if sh + 8 * BITS > 32:  # the octet straddles two words (3-bit codes)
            f = f | ((w1 if wi == 0 else w2) << (32 - sh))
        M4: tl.constexpr = (1 << (4 * BITS)) - 1
        M2: tl.constexpr = ((1 << (2 * BITS)) - 1) * 0x00010001
        M1: tl.constexpr = ((1 << BITS) - 1) * 0x01010101
        t = (f & M4) | ((f << (16 - 4 * BITS)) & (M4 << 16))
        t = (t & M2) | ((t << (8 - 2 * BITS)) & (M2 << 8))
        s = (t & M1) | ((t << (4 - BITS)) & (M1 << 4))
    return s


@triton.jit
def _prmt(a, b, sel, ASM: tl.constexpr):
    """PTX ``prmt.b32`` (default mode) on uint32: byte ``i`` of the result is byte ``sel[4i + 2 : 4i]`` of the eight
    bytes ``b:a`` (the selectors here never set the sign-replicate bit ``4i + 3``). Interpreted: shifts and masks."""
    if ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel], dtype=tl.uint32,
                                         is_pure=True, pack=1)
    ab = a.to(tl.uint64) | (b.to(tl.uint64) << 32)  # the eight bytes b:a
    out = ((ab >> ((sel << 3) & 0x38).to(tl.uint64)) & 0xFF).to(tl.uint32)
    for i in tl.static_range(1, 4):  # the bit offset of byte sel[4i + 2 : 4i] is sel[4i + 2 : 4i] * 8
        out = out | (((ab >> ((sel >> (4 * i - 3)) & 0x38).to(tl.uint64)) & 0xFF).to(tl.uint32) << (8 * i))
    return out


@triton.jit
def _and_or(x, M: tl.constexpr, C: tl.constexpr, ASM: tl.constexpr):
    """``(x & M) | C`` on uint32 as one ``lop3`` (``ASM``): written plainly it compiles to two ``LOP3``, whose one
    immediate operand holds a single constant; here both constants are registers, set once outside the loop."""
    if ASM:
        return tl.inline_asm_elementwise("lop3.b32 $0, $1, $2, $3, 0xEA;", "=r,r,r,r",
                                         [x, tl.full(x.shape, M, tl.uint32), tl.full(x.shape, C, tl.uint32)],
                                         dtype=tl.uint32, is_pure=True, pack=1)
    return (x & M) | C


@triton.jit
def _selectors(s, BITS: tl.constexpr, ASM: tl.constexpr):
    """The ``PRMT`` selectors of the eight codes in ``s``'s nibbles (:func:`_octet`), made once per word: for 4-bit
    codes, their low 3 bits (the look-up in each 8-entry half) and the per-byte choice of half (nibble ``i + 4 *
    bit3``, the pattern of both 16-bit halves); 2/3-bit codes are selectors as they are (the second is unused).
    ``prmt`` reads a selector's low 16 bits, so the second four codes take the same selectors shifted by 16."""
    if BITS == 4:
        return s & 0x77777777, _and_or(s >> 1, 0x44444444, 0x32103210, ASM)
    return s, s


@triton.jit
def _bytes16(low, half, a0, a1, a2, a3, ASM: tl.constexpr):
    """Byte ``c`` of the 16-byte plane ``a3:a2:a1:a0`` for each of the four 4-bit codes ``c`` (:func:`_selectors`:
    ``low`` their low 3 bits, ``half`` nibble ``i + 4 * bit3``): ``PRMT`` on each 8-byte half with the low bits, then a
    third ``PRMT`` choosing per byte by bit 3."""
    return _prmt(_prmt(a0, a1, low, ASM), _prmt(a2, a3, low, ASM), half, ASM)


@triton.jit
def _interleave(lo, hi, ASM: tl.constexpr):
    """Four values' low bytes ``lo`` and high bytes ``hi`` -> two fp16 pairs (values 0, 1 and 2, 3; the first of each
    in the low half), as int32: ``PRMT`` with selectors 0x5140 and 0x7362."""
    if ASM:
        return tl.inline_asm_elementwise("prmt.b32 $0, $2, $3, 0x5140; prmt.b32 $1, $2, $3, 0x7362;", "=r,=r,r,r",
                                         [lo, hi], dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    p = (lo & 0xFF) | ((hi & 0xFF) << 8) | ((lo & 0xFF00) << 8) | ((hi & 0xFF00) << 16)
    q = ((lo >> 16) & 0xFF) | (((hi >> 16) & 0xFF) << 8) | ((lo >> 24) << 16) | ((hi >> 24) << 24)
    return p.to(tl.int32, bitcast=True), q.to(tl.int32, bitcast=True)


@triton.jit
def _h2_split(u):
    """The two fp16 halves of int32 ``u`` (low half first), as fp32."""
    return (u.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
            (u >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _h2_sum(u):
    """The sum of the two fp16 halves of int32 ``u``, in fp32 (an fp16 pair chain flushed)."""
    a, b = _h2_split(u)
    return a + b


@triton.jit
def _halves(u, ASM: tl.constexpr):
    """:func:`_h2_split` through PTX (``mov`` into two 16-bit registers, two ``cvt``: no shift for the high half)."""
    if ASM:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 ha, hb; mov.b32 {ha, hb}, $2; cvt.f32.f16 $0, ha; cvt.f32.f16 $1, hb; }", "=r,=r,r", [u],
            dtype=(tl.float32, tl.float32), is_pure=True, pack=1)
    return _h2_split(u)


@triton.jit
def _fma2(acc, w, xu, ASM: tl.constexpr):
    """``fma.rn.f16x2``: ``acc + w * xu`` on two fp16 lanes held in int32 (low half first), rounded to fp16 once.
    Interpreted: each lane in fp32, then rounded (the product of two fp16 is exact in fp32)."""
    if ASM:
        return tl.inline_asm_elementwise("fma.rn.f16x2 $0, $1, $2, $3;", "=r,r,r,r", [w, xu, acc], dtype=tl.int32,
                                         is_pure=True, pack=1)
    a, b = _h2_split(acc)
    wa, wb = _h2_split(w)
    xa, xb = _h2_split(xu)
    lo = (a + wa * xa).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    hi = (b + wb * xb).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16
    return lo | hi


@triton.jit
def _hadd2(a, b, ASM: tl.constexpr):
    """``add.rn.f16x2``: ``a + b`` on two fp16 lanes held in int32 (low half first). Interpreted: each lane in fp32,
    then rounded (exact for the integers it adds here)."""
    if ASM:
        return tl.inline_asm_elementwise("add.rn.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32, is_pure=True,
                                         pack=1)
    a0, a1 = _h2_split(a)
    b0, b1 = _h2_split(b)
    lo = (a0 + b0).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return lo | ((a1 + b1).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) << 16)


@triton.jit
def _h2_codes(w, zneg, u0, u1, u2, u3, scale, ASM: tl.constexpr):
    """Blockwise 4-bit (:data:`BLOCKWISE_H2`): ``sum_j x_j (c_j - z) s`` over each word's eight codes, fp32 ``(BM, BN,
    NW)``. ``w (BN, NW)``: the words; ``zneg (BN,)``: the fp16 pair ``-(1024 + z)`` of each row; ``u0..u3 (BM, NW)``:
    the activation pairs ``(x_2j, x_2j+1)``; ``scale (BN,)`` fp32. Codes ``i`` and ``i + 4`` of a word become one fp16
    pair by their bits (``w >> 4i & 0x000F000F | 0x64006400`` = ``(1024 + c_i, 1024 + c_i+4)``: a shift and one
    ``LOP3``, :func:`_and_or`), an ``add.rn.f16x2`` makes them ``c - z`` exactly, and ``fma.rn.f16x2`` multiplies them by the
    activations rearranged as ``(x_i, x_i+4)`` (once per word column, shared by the rows)."""
    acc = tl.zeros((u0.shape[0], w.shape[0], w.shape[1]), dtype=tl.int32)
    for i in tl.static_range(4):
        # nibbles i and i + 4 as the fp16 pair (1024 + c_i, 1024 + c_i+4): a shift and one lop3
        v = _hadd2(_and_or(w >> (4 * i), 0x000F000F, 0x64006400, ASM).to(tl.int32, bitcast=True), zneg[:, None], ASM)
        ua = u0 if i < 2 else u1  # x_i (i < 2: pair 0; else pair 1), and x_i+4 from pair 2 / 3
        ub = u2 if i < 2 else u3
        if i % 2 == 0:
            xu = (ua & 0xFFFF) | (ub << 16)
        else:
            xu = ((ua >> 16) & 0xFFFF) | (ub & -65536)
        acc = _fma2(acc, v[None, :, :], xu[:, None, :], ASM)
    return scale[None, :, None] * _h2_sum(acc)


@triton.jit
def _regs_pairs(sel, half, l0, l1, l2, l3, h0, h1, h2, h3, BITS: tl.constexpr, ASM: tl.constexpr):
    """The four codes in ``sel``'s low nibbles looked up in a table held in registers as byte planes
    (:func:`register_tables`: ``l*`` the entries' low bytes, ``h*`` their high bytes; 8 entries use ``l0, l1, h0,
    h1``), as two fp16 pairs: 4 ``PRMT`` per four weights for 2/3-bit codes, 8 for 4-bit (``sel``, ``half``: the
    selectors of :func:`_selectors`), no memory access. any4 and FLUTE keep their tables in registers / shared memory
    for the same reason: an L1 look-up per weight made the H100 kernel latency-bound."""
    if BITS == 4:
        lo = _bytes16(sel, half, l0, l1, l2, l3, ASM)
        hi = _bytes16(sel, half, h0, h1, h2, h3, ASM)
    else:
        lo = _prmt(l0, l1, sel, ASM)
        hi = _prmt(h0, h1, sel, ASM)
    return _interleave(lo, hi, ASM)


@triton.jit
def _regs_table(lut_ptr, t, BITS: tl.constexpr, ASM: tl.constexpr):
    """The byte planes of tables ``t (BN, 1)`` (:func:`register_tables`): eight uint32 (for 2/3-bit codes the last
    two of each plane are the first two again, unused)."""
    if BITS == 4:
        t8 = t * 8
        return (_word(lut_ptr + t8, ASM), _word(lut_ptr + t8 + 1, ASM), _word(lut_ptr + t8 + 2, ASM),
                _word(lut_ptr + t8 + 3, ASM), _word(lut_ptr + t8 + 4, ASM), _word(lut_ptr + t8 + 5, ASM),
                _word(lut_ptr + t8 + 6, ASM), _word(lut_ptr + t8 + 7, ASM))
    t4 = t * 4
    l0 = _word(lut_ptr + t4, ASM)
    l1 = _word(lut_ptr + t4 + 1, ASM)
    h0 = _word(lut_ptr + t4 + 2, ASM)
    h1 = _word(lut_ptr + t4 + 3, ASM)
    return l0, l1, l0, l1, h0, h1, h0, h1


@triton.jit
def _zero_code(zp_ptr, blk, zp_nbytes, BITS: tl.constexpr, HAS_ZP: tl.constexpr):
    """Blockwise: the int32 zero points of blocks ``blk``, bit-packed ``BITS`` each (a 4-bit one never straddles two
    bytes: one byte load and a shift), or the constant ``2**(BITS - 1)`` (symmetric)."""
    if not HAS_ZP:
        return tl.zeros_like(blk).to(tl.int32) + (1 << (BITS - 1))
    if BITS == 4:
        return (tl.load(zp_ptr + (blk >> 1)).to(tl.int32) >> ((blk & 1) * 4).to(tl.int32)) & 15
    zbit = blk * BITS
    zlo = tl.load(zp_ptr + (zbit >> 3)).to(tl.int32)
    zhi = tl.load(zp_ptr + (zbit >> 3) + 1, mask=(zbit >> 3) + 1 < zp_nbytes, other=0).to(tl.int32)
    return (((zhi << 8) | zlo) >> (zbit & 7).to(tl.int32)) & ((1 << BITS) - 1)


@triton.jit
def _scale_zero(scale_ptr, zp_ptr, blk, zp_nbytes, BITS: tl.constexpr, HAS_ZP: tl.constexpr):
    """Blockwise: fp32 ``(scale, zero point)`` of blocks ``blk`` (:func:`_zero_code`)."""
    return tl.load(scale_ptr + blk).to(tl.float32), _zero_code(zp_ptr, blk, zp_nbytes, BITS, HAS_ZP).to(tl.float32)


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
def _last_split_reduces(ws_ptr, final_ptr, bias_ptr, cnt_ptr, ms, rows, bias_rows, M, N, stride_om, stride_os,
                        HAS_BIAS: tl.constexpr, S_PAD: tl.constexpr):
    """Split-K without a second launch (``Config.serial``), after the program stored its partial sums: it takes a
    ticket for its output tile, and the last of the tile's programs sums every split's partials (as one
    ``(S_PAD, BM, BN)`` tile, in a fixed order: the same bits whichever program comes last), adds the bias, writes the
    output and resets the tile's counter for the next launch. ``bar.sync`` before the ticket orders every thread's
    stores before it; the ticket is an ``acq_rel`` atomic at GPU scope; the partials are read from L2 (``.cg``)."""
    tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.debug_barrier()
    ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
    if ticket == tl.num_programs(2) - 1:
        ss = tl.arange(0, S_PAD)
        mask = (ms < M)[:, None] & (rows < N)[None, :]
        offs = ms.to(tl.int64)[:, None] * stride_om + rows[None, :]
        parts = tl.load(ws_ptr + ss.to(tl.int64)[:, None, None] * stride_os + offs[None, :, :],
                        mask=(ss < tl.num_programs(2))[:, None, None] & mask[None, :, :], other=0.0, cache_modifier=".cg")
        y = tl.sum(parts, axis=0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + bias_rows).to(tl.float32)[None, :]
        tl.store(final_ptr + offs, y.to(final_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(cnt_ptr + tile, 0)


@triton.jit
def _gemv_kernel(x_ptr, qw_ptr, lut_ptr, scale_ptr, zp_ptr, bias_ptr, out_ptr, final_ptr, cnt_ptr, M, N, K, row_words,
                 n_cblocks, zp_nbytes,
                 k_split, stride_xm, stride_om, stride_os, SCHEME: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                 CBLOCK: tl.constexpr, HAS_ZP: tl.constexpr, HAS_BIAS: tl.constexpr, LUT: tl.constexpr, DIRECT: tl.constexpr,
                 XP: tl.constexpr, ASM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 ROW_TABLES: tl.constexpr = False, PIPE: tl.constexpr = 0, SERIAL: tl.constexpr = False,
                 S_PAD: tl.constexpr = 1):
    """Program ``(n, m, s)``: rows ``n*BLOCK_N..``, inputs ``m*BLOCK_M..``, columns ``[s*k_split, (s+1)*k_split)``.
    ``stride_xm``: in elements of ``x_ptr`` (halved by the caller for the 32-bit pair view, ``XP > 0``).
    ``ROW_TABLES``: one palettize table per row group for the whole row (``CBLOCK == K``): register tables are
    loaded once, before the K loop. ``PIPE`` (>= 2): the code words are read plainly at each tile and triton's
    pipeliner keeps ``PIPE - 1`` tiles of them in flight through shared memory (asynchronous copies); 0: the next tile's
    words are requested by hand, in registers, before this tile is decoded. ``SERIAL`` (split-K only): the last
    program of each output tile sums the splits into ``final_ptr`` (:func:`_last_split_reduces`; ``cnt_ptr``: one
    zeroed int32 counter per output tile), so no reduction kernel follows."""
    WPG: tl.constexpr = 3 if BITS == 3 else 1  # words per group of codes
    CPG: tl.constexpr = 32 if BITS == 3 else 32 // BITS  # codes per group
    NW: tl.constexpr = BLOCK_K // CPG
    XSTEP: tl.constexpr = CPG // 2 if XP else CPG  # x_ptr elements per group
    ASM_LUT: tl.constexpr = ASM and LUT != 0  # fp16 tables read plainly: a 32-bit PTX load of a 2-byte entry is misaligned
    XA: tl.constexpr = ASM and PIPE > 0 and XP > 0  # pipelined: activation pairs loaded directly (_x_word), not copied
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows64 = tl.minimum(rows, N - 1).to(tl.int64)
    ms = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    xrow = tl.minimum(ms, M - 1).to(tl.int64) * stride_xm
    row_word = rows64 * row_words
    acc = tl.zeros((BLOCK_M, BLOCK_N, NW), dtype=tl.float32)
    k_lo = tl.program_id(2) * k_split
    if PIPE:  # k_split is a multiple of BLOCK_K (the launch checks): the pipeliner's copies of a row's contiguous
        k_lo = tl.multiple_of(k_lo, BLOCK_K)  # words become 16-byte cp.async (by hand, vector loads would convert layouts)
    k_hi = tl.minimum(k_lo + k_split, K)
    NIB: tl.constexpr = LUT == 4 or LUT == 6  # NIBBLE_MODES
    H2: tl.constexpr = LUT >= 5  # H2_MODES: fp16 pair FMAs (the launch checks XP == 1, fp16 activation pairs)
    # tiles per fp16 chain: a tile adds CPG / 4 products to each lane (3-bit 8, 2-bit 4, 4-bit 2); at most 8 per chain
    CHAIN_TILES: tl.constexpr = 32 // CPG
    PLANES: tl.constexpr = NIB and BITS == 3  # nibble codes: three contiguous planes per row
    plane = tl.multiple_of(row_words // 3, 4) if PLANES else 0
    if LUT >= 3 and ROW_TABLES:  # register tables of whole-row tables: the same for every tile
        l0, l1, l2, l3, h0, h1, h2, h3 = _regs_table(lut_ptr, (rows64 // GROUP).to(tl.int32)[:, None], BITS, ASM)
    if H2 and SCHEME == 0:  # two fp16 pair accumulators per (input, row, word), flushed to fp32 every CHAIN_TILES tiles
        accp = tl.zeros((BLOCK_M, BLOCK_N, NW), dtype=tl.int32)
        accq = tl.zeros((BLOCK_M, BLOCK_N, NW), dtype=tl.int32)
    if PIPE == 0:
        w0, w1, w2 = _load_words(qw_ptr, row_word, k_lo, CPG, WPG, NW, BITS, ASM, plane, PLANES, True)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=PIPE if PIPE else None):
        if PIPE:  # plain loads, which the pipeliner issues PIPE - 1 tiles ahead (inline PTX cannot be pipelined)
            w0, w1, w2 = _load_words(qw_ptr, row_word, k0, CPG, WPG, NW, BITS, False, plane, PLANES, False)
        else:  # the next tile's words are requested before this tile is decoded (the last tile re-reads itself)
            n0, n1, n2 = _load_words(qw_ptr, row_word, tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K), CPG, WPG, NW, BITS,
                                     ASM, plane, PLANES, True)
        cb = k0 // CBLOCK
        tbase = ((rows64 // GROUP) * n_cblocks + cb).to(tl.int32)  # table index (< 2**31): 32-bit offsets
        xoff = xrow[:, None] + ((k0 // CPG + tl.arange(0, NW)) * XSTEP)[None, :]
        part = tl.zeros((BLOCK_M, BLOCK_N, NW), dtype=tl.float32)
        sx = tl.zeros((BLOCK_M, NW), dtype=tl.float32)
        if SCHEME == 1 and H2:  # blockwise 4-bit codes as fp16 pairs (BLOCKWISE_H2): the tile lies in one block
            scale, zp = _scale_zero(scale_ptr, zp_ptr, rows64 * n_cblocks + cb, zp_nbytes, BITS, HAS_ZP)
            zh = (-1024.0 - zp).to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
            acc += _h2_codes(w0, zh | (zh << 16), _x_word(x_ptr + xoff, XA), _x_word(x_ptr + xoff + 1, XA),
                             _x_word(x_ptr + xoff + 2, XA), _x_word(x_ptr + xoff + 3, XA), scale, ASM)
        elif LUT >= 3:  # register tables (LUT_REGS..): four codes per PRMT selector (2/3/4-bit palettize)
            if not ROW_TABLES:
                l0, l1, l2, l3, h0, h1, h2, h3 = _regs_table(lut_ptr, tbase[:, None], BITS, ASM)
            for o in tl.static_range(CPG // 8):
                sel, half = _selectors(_octet(w0, w1, w2, o, BITS, NIB), BITS, ASM)
                for h in tl.static_range(2):
                    pp, pq = _regs_pairs(sel >> (16 * h), half >> (16 * h), l0, l1, l2, l3, h0, h1, h2, h3, BITS, ASM)
                    if H2:  # the activation pairs as loaded (fp16x2), straight into the pair FMAs
                        accp = _fma2(accp, pp[None, :, :], _x_word(x_ptr + xoff + 4 * o + 2 * h, XA)[:, None, :], ASM)
                        accq = _fma2(accq, pq[None, :, :], _x_word(x_ptr + xoff + 4 * o + 2 * h + 1, XA)[:, None, :], ASM)
                    else:
                        v0, v1 = _halves(pp, ASM)
                        v2, v3 = _halves(pq, ASM)
                        xa, xb = _x_pair(x_ptr, xoff, 4 * o + 2 * h, XP, XA)
                        xc, xd = _x_pair(x_ptr, xoff, 4 * o + 2 * h + 1, XP, XA)
                        # one FFMA per weight (a sum of four products would add an FMUL and an FADD per four)
                        part += xa[:, None, :] * v0[None, :, :]
                        part += xb[:, None, :] * v1[None, :, :]
                        part += xc[:, None, :] * v2[None, :, :]
                        part += xd[:, None, :] * v3[None, :, :]
            if H2:  # the fp16 chains to fp32: after every tile (3-bit), or every CHAIN_TILES tiles and the last
                if CHAIN_TILES == 1:
                    flush = True
                else:
                    flush = (((k0 - k_lo) // BLOCK_K) % CHAIN_TILES == CHAIN_TILES - 1) | (k0 + BLOCK_K >= k_hi)
                if flush:
                    part += _h2_sum(accp) + _h2_sum(accq)
                    accp = tl.zeros_like(accp)
                    accq = tl.zeros_like(accq)
        else:
            for i in tl.static_range(CPG // 2):
                xa, xb = _x_pair(x_ptr, xoff, i, XP, XA)
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
        elif not H2:  # s * (sum x c - z sum x), per word: the tile lies in one block
            scale, zp = _scale_zero(scale_ptr, zp_ptr, rows64 * n_cblocks + cb, zp_nbytes, BITS, HAS_ZP)
            acc += scale[None, :, None] * (part - zp[None, :, None] * sx[:, None, :])
        if PIPE == 0:
            w0, w1, w2 = n0, n1, n2
    _store_tile(tl.sum(acc, axis=2), out_ptr, bias_ptr, ms, rows, rows64, M, N, stride_om, stride_os, tl.program_id(2),
                DIRECT, HAS_BIAS)
    if SERIAL:
        _last_split_reduces(out_ptr, final_ptr, bias_ptr, cnt_ptr, ms, rows, rows64, M, N, stride_om, stride_os, HAS_BIAS,
                            S_PAD)


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
    modes = (mode, LUT_FP32) if mode == LUT_PAIRS else (mode,)
    return modes + register_modes(fmt)


def register_modes(fmt: Format) -> tuple[int, ...]:
    """The register-table layouts a layer can take: 2/3/4-bit palettize (8 or 16 fp16 entries as two byte planes, as
    many bytes as the stored 3/4-bit table), codes in place or (2/3-bit) nibble codes, fp32 or fp16 pair FMAs."""
    if fmt.scheme != 0 or fmt.bits not in (2, 3, 4):
        return ()
    if fmt.bits == 4:  # 4-bit codes are nibbles already: no nibble repack
        return LUT_REGS, LUT_REGS_H2
    return LUT_REGS, LUT_REGS_NIBBLES, LUT_REGS_H2, LUT_REGS_NIBBLES_H2


def fp16_chains_allowed(x: torch.Tensor) -> bool:
    """Whether the tuner may time :data:`H2_MODES` for ``x``: fp16 activations read as pairs, and torch's own switch
    for reduced-precision fp16 reductions on (``torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction``,
    on by default; set it off for fp32 accumulation everywhere). ``benchmarks/fp16_chains.py``: 4.4-4.8e-4 relative
    error to float64 on a 64x14336 palettize-3 layer, twice the 1.9-2.5e-4 of fp32 accumulation into an fp16 output."""
    return x_pairs(x) == X_FP16_PAIRS and torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction


def kernel_tables(fmt: Format, lut: torch.Tensor, mode: int | None = None) -> torch.Tensor:
    """The one-time repack of palettize tables ``lut (T, 2**bits)`` fp16 for ``mode`` (default :func:`lut_mode`):
    fp32 ``(T, 2**bits)`` or fp32 pairs ``(T, 2**(2 bits), 2)`` with ``pairs[t, a | b << bits] = (lut[t, a],
    lut[t, b])``. Exact (fp16 -> fp32)."""
    mode = lut_mode(fmt) if mode is None else mode
    if mode == LUT_FP16:
        return lut
    if mode >= LUT_REGS:
        return register_tables(lut)
    table = lut.float()
    if mode == LUT_FP32:
        return table.contiguous()
    n = 1 << fmt.bits
    idx = torch.arange(n * n, device=lut.device)
    return torch.stack([table[:, idx % n], table[:, idx // n]], dim=-1).contiguous()


def register_tables(lut: torch.Tensor) -> torch.Tensor:
    """2/3/4-bit palettize tables ``lut (T, 2**bits)`` fp16 as the byte planes :func:`_regs_pairs` holds in
    registers: int32 ``(T, E / 2)`` for ``E`` = 8 entries (2/3-bit; 2-bit tables padded with zeros) or 16 (4-bit): the
    low bytes of entries 0-3, 4-7, ..., then their high bytes (little-endian). As many bytes as the stored table
    (3/4-bit)."""
    n = lut.shape[-1]
    if n > 16:
        raise ValueError(f"register tables hold at most 16 entries, got {n} (2/3/4-bit codes only)")
    entries = 8 if n <= 8 else 16
    padded = torch.zeros((lut.shape[0], entries), dtype=torch.float16, device=lut.device)
    padded[:, :n] = lut
    planes = padded.view(torch.uint8).view(-1, entries, 2)  # (T, entry, low/high byte)
    return torch.cat([planes[:, :, 0], planes[:, :, 1]], dim=1).contiguous().view(torch.int32)


def nibble_codes(fmt: Format, qw: torch.Tensor) -> torch.Tensor:
    """The one-time repack of 2/3-bit codes (``qw``: the stored int32 words, ``(out_f, in_f * bits / 32)``) into the
    layout :func:`_octet` reads with one mask per eight codes, the same size up to padding: 2-bit, per word of 16
    codes, nibble ``i`` holds code ``i`` (bits 0-1) and code ``8 + i`` (bits 2-3); 3-bit, per group of 32 codes in
    3 words, nibble ``i`` of word ``b`` holds code ``8 b + i`` in bits 0-2 and bit ``b`` of code ``24 + i`` in bit 3,
    and a row stores word 0 of all its groups, then word 1, then word 2 (three planes, each padded to a multiple of 4
    words), so that a tile's words of each plane are contiguous where the stored 3-bit words are strided."""
    if fmt.scheme != 0 or fmt.bits not in (2, 3):
        raise ValueError(f"nibble codes are for 2/3-bit palettize, got scheme {fmt.scheme} {fmt.bits}-bit")
    n, bits = fmt.out_f, fmt.bits
    words = qw.reshape(n, -1, bits if bits == 3 else 1).to(torch.int64) & 0xFFFFFFFF  # (rows, groups, words)
    out = torch.zeros_like(words)
    for j in range(32 if bits == 3 else 16):  # code j of each group, shifts and masks per position (vectorised)
        off = bits * j
        c = words[..., off // 32] >> off % 32
        if off % 32 + bits > 32:  # a 3-bit code across two words
            c = c | words[..., off // 32 + 1] << (32 - off % 32)
        c = c & ((1 << bits) - 1)
        if bits == 2:
            out[..., 0] |= c << (4 * j if j < 8 else 4 * (j - 8) + 2)
        elif j < 24:
            out[..., j // 8] |= c << 4 * (j % 8)
        else:  # the fourth octet: bit b of the code in the spare bit 3 of word b's nibble
            for b in range(3):
                out[..., b] |= ((c >> b) & 1) << (4 * (j - 24) + 3)
    if bits == 3:  # word b of every group together (plane b), each plane padded to 4 words: contiguous, 16-byte loads
        groups = out.shape[1]
        out = torch.nn.functional.pad(out.transpose(1, 2), (0, -groups % 4))  # (rows, 3, padded groups)
    out = out.reshape(n, -1)
    return torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32).contiguous()


def row_words(fmt: Format, qw: torch.Tensor, mode: int) -> int:
    """The int32 words per row of the codes the kernels read: :func:`nibble_codes` rows are padded (3-bit planes)."""
    return qw.shape[-1] if mode in NIBBLE_MODES else fmt.in_f * fmt.bits // 32


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


def run(kernel, grid, warmup: bool = False):
    """``kernel[grid]``, or with ``warmup`` its compilation alone (``JITFunction.warmup``: the same arguments, hence the
    same specialization as the launch that follows, and nothing launched; the tuner compiles its candidates ahead
    this way, several at a time: :func:`qrecover.kernels.qmatmul.compile_ahead`)."""
    return functools.partial(kernel.warmup, grid=grid) if warmup else kernel[grid]


def check_split(k_split: int, cfg) -> None:
    """Both decode kernels tell triton that each split starts on a ``BLOCK_K`` boundary (``Config.pipe``: the
    alignment that makes the pipeliner's copies 16 bytes wide); a launch whose ``k_split`` is not a multiple of
    ``block_k`` would read misaligned words, so it is refused (:func:`qmatmul.quant_matmul` rounds it up)."""
    if k_split % cfg.block_k:
        raise ValueError(f"k_split {k_split} is not a multiple of block_k {cfg.block_k}; round it up to one")


def launch(x: torch.Tensor, fmt: Format, qw: torch.Tensor, lut: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor,
           bias: torch.Tensor | None, target: torch.Tensor, k_split: int, grid: tuple[int, int, int], cfg,
           out: torch.Tensor | None = None, counters: torch.Tensor | None = None, warmup: bool = False) -> None:
    """Run :func:`_gemv_kernel` into ``target`` (the output, or the split-K workspace when ``grid[2] > 1``);
    ``lut``: :func:`kernel_tables` for palettize, in ``cfg.lut``'s layout (-1: :func:`lut_mode`'s). ``out`` and
    ``counters`` (``cfg.serial`` with split-K): the output the last program of each tile writes, and one zeroed int32
    counter per output tile (reset by the kernel). ``warmup``: compile it only (:func:`run`)."""
    m, k = x.shape
    n = fmt.out_f
    check_split(k_split, cfg)
    if fmt.scheme == 0:
        mode = lut_mode(fmt) if cfg.lut < 0 else cfg.lut
    elif cfg.lut == BLOCKWISE_H2:
        if fmt.bits != 4:
            raise ValueError(f"the fp16 pair mode of blockwise layers (lut {BLOCKWISE_H2}) takes 4-bit codes, got "
                             f"{fmt.bits}-bit; use lut -1")
        mode = BLOCKWISE_H2
    else:
        mode = LUT_FP16
    if mode == LUT_PAIRS:
        lut = lut.view(torch.int64)  # (T, 2**(2 bits)): both fp32 values of a pair in one 64-bit load
    xp = x_pairs(x)
    if mode in H2_MODES and xp != X_FP16_PAIRS:
        raise ValueError(f"lut mode {mode} (fp16 pair FMAs) needs fp16 activations whose rows start on 4-byte boundaries, "
                         f"got {x.dtype} with row stride {x.stride(0)}; use LUT_REGS or LUT_REGS_NIBBLES")
    xv = x.view(torch.int32) if xp else x
    run(_gemv_kernel, grid, warmup)(
        xv, qw, lut, scale, zp, qw if bias is None else bias, target, target if out is None else out,
        qw if counters is None else counters, m, n, k, row_words(fmt, qw, mode), k // fmt.cblock,
        zp.numel() if fmt.has_zp else 0, k_split, x.stride(0) // 2 if xp else x.stride(0), n, m * n,
        SCHEME=fmt.scheme, BITS=fmt.bits, GROUP=fmt.group, CBLOCK=fmt.cblock, HAS_ZP=fmt.has_zp,
        HAS_BIAS=bias is not None, LUT=mode, DIRECT=grid[2] == 1, XP=xp, ASM=cfg.asm and not interpreting(),
        ROW_TABLES=fmt.scheme == 0 and fmt.cblock == k, PIPE=cfg.pipe,
        SERIAL=counters is not None and grid[2] > 1, S_PAD=triton.next_power_of_2(grid[2]),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )

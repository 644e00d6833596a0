"""The batch 5-64 decode-and-dot kernel (qrecover.kernels.qmm_dot) against float64, under triton's interpreter on CPU.

Odd output counts (the last row tile partial), batches 5, 8, 16, 33 and 64 (partial and whole 16/32/64-row tiles),
palettize 2/3/4-bit with whole-row and per-32-column tables in each table layout, 8-bit, and blockwise symmetric
and asymmetric; split-K and the tuner's candidate lists.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_helpers import DEV, make_layer, ref64, rel_err

from qrecover import kernels
from qrecover.kernels import layer_format

BATCHES = (5, 8, 16, 33, 64)
FORMATS = ([("palettize", b, dict(block_size=c)) for b in (2, 3, 4) for c in (None, 32)]
           + [("palettize", 8, dict(block_size=64))]
           + [("blockwise", b, dict(block_size=c, symmetric=s)) for b in (2, 3, 4) for c, s in ((32, False), (64, True))]
           + [("blockwise", 4, dict(block_size=None, symmetric=False))])


def _layer(scheme, bits, params):
    return make_layer(scheme, bits, 48 if scheme == "palettize" else 40, 192, bias=bits != 3, **params)


@pytest.mark.parametrize("scheme,bits,params", FORMATS, ids=lambda v: str(v))
def test_dot_decode_matches_float64(interp, scheme, bits, params):
    from qrecover.kernels import gemv
    layer = _layer(scheme, bits, params)
    fmt = layer_format(layer)
    modes = (-1,) if scheme == "blockwise" else (-1, gemv.LUT_FP16, gemv.LUT_FP32) + ((gemv.LUT_PAIRS,) if bits < 8 else ())
    if scheme == "palettize" and bits in (2, 3):  # register tables, codes in place and nibble codes (3-bit: 6 groups
        modes += (gemv.LUT_REGS, gemv.LUT_REGS_NIBBLES)  # per row, planes padded to 8 words)
    if scheme == "palettize" and bits == 4:  # register tables on the stored codes (nibbles already)
        modes += (gemv.LUT_REGS,)
    if scheme == "blockwise" and bits == 4:  # the codes as fp16 pairs (fp16 activations only)
        modes += (gemv.BLOCKWISE_H2,)
    for i, batch in enumerate(BATCHES):
        dtype, tol = ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1.5e-2))[i % 3]
        x = torch.randn(batch, 192, device=DEV).to(dtype)
        bm = 16 if batch <= 16 else min(64, 1 << (batch - 1).bit_length())
        for j, mode in enumerate(modes):
            if scheme == "blockwise" and mode == gemv.BLOCKWISE_H2:
                if dtype != torch.float16:
                    continue
            elif mode >= gemv.LUT_REGS and i % 2:  # register tables (the interpreter's slowest): batches 5, 16 and 64
                continue
            bk = 32 if (i + j) % 2 or fmt.cblock % 64 else 64
            cfg = interp.DotDecode(bm, 32, bk, 1 + (i + j) % 3, True, 4, 1, asm=scheme == "palettize" and mode >= gemv.LUT_REGS,
                                   lut=mode)
            y = kernels.fused_linear(layer, x, config=cfg)
            assert y.shape == (batch, fmt.out_f) and y.dtype == dtype
            assert rel_err(y, ref64(layer, x)) < tol, (scheme, bits, params, batch, mode, cfg)


def test_3bit_codes_decode_exactly_in_the_dot_kernel(interp):
    """Identity tables and one-hot inputs: every 3-bit code (the straddling ones too) reads back exactly."""
    from qrecover.packing import unpack
    layer = make_layer("palettize", 3, 16, 64, bias=False)
    layer.lut.copy_(torch.arange(8, dtype=torch.float16).expand_as(layer.lut))
    codes = unpack(layer.qdata.cpu(), 3, 16 * 64).view(16, 64).float()
    for lut in (-1, 2, 3, 4):  # 3, 4: register tables (fp16 values straight from the looked-up pairs' bits)
        y = kernels.fused_linear(layer, torch.eye(64, device=DEV),
                                 config=interp.DotDecode(64, 16, 32, 2, True, asm=lut >= 3, lut=lut))
        assert torch.equal(y.cpu(), codes.T), lut


@pytest.mark.parametrize("scheme,bits,params,lut", [("palettize", 3, {}, 4), ("palettize", 3, dict(block_size=32), 2),
                                                     ("palettize", 4, {}, 3), ("blockwise", 4, dict(block_size=64), 5),
                                                     ("blockwise", 3, dict(block_size=32, symmetric=False), -1)])
def test_pipelined_word_loads_in_the_dot_kernel(interp, scheme, bits, params, lut):
    """``Config.pipe``: the code words read at each tile (issued tiles ahead by triton's pipeliner when compiled) give
    exactly the hand prefetch's results, and match float64; batch 5 and 33, split-K 1 and 2 (3 and 2 tiles per
    program, fewer than the stages)."""
    layer = _layer(scheme, bits, params)
    for batch in (5, 33):
        x = torch.randn(batch, 192, device=DEV).half()
        for split in (1, 2):
            cfg = interp.DotDecode(16 if batch <= 16 else 64, 32, 32, split, True, 4, 1, asm=True, lut=lut)
            y0 = kernels.fused_linear(layer, x, config=cfg)
            y = kernels.fused_linear(layer, x, config=dataclasses.replace(cfg, pipe=4))
            assert torch.equal(y, y0) and rel_err(y, ref64(layer, x)) < 2e-3, (scheme, bits, lut, batch, split)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernel's aligned copies run on a GPU only")
@pytest.mark.parametrize("scheme,bits,params,lut", [("palettize", 3, {}, 4), ("palettize", 4, {}, 3),
                                                     ("blockwise", 4, dict(block_size=64), 5)])
def test_pipelined_dot_kernel_at_aligned_shapes_on_the_gpu(scheme, bits, params, lut):
    """On a GPU, at 4096 inputs (rows and splits on 16-byte boundaries, so the pipelined variant's copies of the code
    words and activations are 16 bytes wide), the pipelined decode-and-dot kernel gives the hand prefetch's bits and
    float64's values, and the transposed product (``Config.swap``, batch 4 and 16) float64's; batch 4, 16 and 64,
    split-K 1 and 4, the tuner's batch-16 tiles (64 columns for blocks of 64)."""
    from qrecover.kernels import qmm_dot

    layer = make_layer(scheme, bits, 256, 4096, **params).cuda()
    for batch in (4, 16, 64):
        x = torch.randn(batch, 4096, device="cuda", dtype=torch.float16)
        for split in (1, 4):
            cfg = qmm_dot.DotDecode(16 if batch <= 16 else 64, 64, 64 if scheme == "blockwise" else 128, split, True, 4, 1,
                                        asm=True, lut=lut)
            y0 = kernels.fused_linear(layer, x, config=cfg)
            y = kernels.fused_linear(layer, x, config=dataclasses.replace(cfg, pipe=4))
            assert torch.equal(y, y0) and rel_err(y, ref64(layer, x)) < 2e-3, (scheme, bits, lut, batch, split)
            if batch <= 32:  # the transposed product (Config.swap): a warpgroup MMA on sm_90
                y = kernels.fused_linear(layer, x, config=dataclasses.replace(cfg, swap=True))
                assert rel_err(y, ref64(layer, x)) < 2e-3 and rel_err(y, y0) < 1e-3, (scheme, bits, lut, batch, split)


@pytest.mark.parametrize("scheme,bits,params,lut", [("palettize", 3, {}, 4), ("palettize", 3, dict(block_size=32), 2),
                                                     ("palettize", 4, {}, 3), ("palettize", 2, {}, -1),
                                                     ("blockwise", 4, dict(block_size=64), 5),
                                                     ("blockwise", 3, dict(block_size=32, symmetric=False), -1)])
def test_transposed_product_gives_the_same_layer(interp, scheme, bits, params, lut):
    """``Config.swap``: the decode-and-dot kernel's product as ``W x^T`` (weights first, transposed once at the end)
    matches float64 and the untransposed product to fp32 rounding: every table layout, register tables, fp16 pairs,
    blockwise with zero points; batch 2, 5, 16 and 32, split-K 1 and 2; fp16 activations, and bf16 where the product is
    the transposed one on a GPU (the interpreter takes bf16 through its IEEE path, untransposed)."""
    layer = _layer(scheme, bits, params)
    for batch in (2, 5, 16, 32):  # (batch 2-4: a 16-input tile, partly used; the tuner offers it there too)
        x = torch.randn(batch, 192, device=DEV).half()
        for split in (1, 2):
            cfg = interp.DotDecode(16 if batch <= 16 else 32, 32, 32, split, True, 4, 1, asm=True, lut=lut)
            y0 = kernels.fused_linear(layer, x, config=cfg)
            y = kernels.fused_linear(layer, x, config=dataclasses.replace(cfg, swap=True))
            assert rel_err(y, ref64(layer, x)) < 2e-3 and rel_err(y, y0) < 1e-3, (scheme, bits, lut, batch, split)
    if lut != 5:
        xb = torch.randn(16, 192, device=DEV).bfloat16()
        y = kernels.fused_linear(layer, xb, config=interp.DotDecode(16, 32, 32, 1, True, 4, 1, asm=True, lut=lut, swap=True))
        assert rel_err(y, ref64(layer, xb)) < 8e-3, (scheme, bits, lut)


_SWAP_ISA = """
import json, re
from triton.backends.compiler import GPUTarget
from qrecover.kernels import compile_check as cc, gemv, qmm_dot
cc.ALIGNED = True
out = {}
for label, sig, const, opts in cc.dot_variants("default"):
    if const["BITS"] == 3 and const["LUT"] == gemv.LUT_REGS_NIBBLES and const["ASM"] and const["BLOCK_M"] == 16:
        k = cc._compile(qmm_dot._dot_decode_kernel, sig, const, GPUTarget("cuda", 90, 32), **opts)
        sass = cc.sass(k)
        row = cc.isa_row(k, opts["num_warps"], const["BLOCK_N"] * const["BLOCK_K"])
        out[label] = [row["total"], len(re.findall(r"\\bHGMMA", sass)), len(re.findall(r"\\bHMMA", sass)),
                      cc.resources(k).get("STACK", 0)]
import triton
out["triton"] = triton.__version__
print(json.dumps(out))
"""


def test_transposed_product_compiles_to_a_warpgroup_mma():
    """Compiled for sm_90 (no GPU needed): at 16 inputs the plain product is the 16x8x16 MMA (``HMMA``), the transposed
    one (``Config.swap``) a warpgroup MMA (``HGMMA``, 64 weight rows), without spilling and with no more thread
    instructions per weight in the main loop; under triton 3.6 (the GPU machine's), whose small MMA reads its operands
    through register shuffles, at least 0.8 fewer (register tables on nibble codes, 16x64x64 and 16x64x128:
    4.66 -> 2.94 and 3.88 -> 2.53; triton 3.9, CI's: 3.16 -> 3.13 and 2.75 -> 2.72)."""
    from test_gemv import _compiled
    got = _compiled(_SWAP_ISA)
    for tile in ("16x64x64", "16x64x128"):
        plain = got[f"palettize-3 fp16 dot-decode {tile} reg-lut nibbles asm w4"]
        swap = got[f"palettize-3 fp16 dot-decode {tile} reg-lut nibbles asm swap w4"]
        assert plain[1] == 0 and plain[2] > 0 and swap[1] > 0 and swap[3] == 0, got
        assert swap[0] < plain[0] + 0.1, got
        if got["triton"].startswith("3.6"):
            assert swap[0] < plain[0] - 0.8, got


@pytest.mark.parametrize("symmetric", [True, False])
def test_blockwise_fp16_pairs_decode_the_same_weights_in_the_dot_kernel(interp, symmetric):
    """Blockwise 4-bit codes as fp16 pairs (gemv.BLOCKWISE_H2) at batch 5-64: one-hot fp16 rows read every weight back,
    bit for bit the fp32 decode's (c - z) * s rounded to fp16, through the permuted column order; other
    activations, widths or dtypes are refused with the fix named."""
    from qrecover.kernels import gemv
    layer = make_layer("blockwise", 4, 40, 192, bias=False, block_size=64, symmetric=symmetric)
    eye = torch.eye(192, device=DEV, dtype=torch.float16)
    for rows in (slice(0, 64), slice(64, 128), slice(128, 192)):
        x = eye[rows]
        want = kernels.fused_linear(layer, x, config=interp.DotDecode(64, 32, 64, 1, True, 4, 1))
        got = kernels.fused_linear(layer, x, config=interp.DotDecode(64, 32, 64, 3, True, 4, 1, lut=gemv.BLOCKWISE_H2))
        assert torch.equal(got, want) and got.abs().sum() > 0
    with pytest.raises(ValueError, match="fp16 activations.*use lut -1"):
        kernels.fused_linear(layer, eye[:16].bfloat16(), config=interp.DotDecode(16, 32, 64, 1, True, 4, 1, lut=gemv.BLOCKWISE_H2))
    fmt = layer_format(layer)
    second = [c for c in interp.candidate_configs(fmt, 16, fp16=True) if isinstance(c, interp.DotDecode)][1]
    assert second.lut == gemv.BLOCKWISE_H2 and second.asm
    assert gemv.BLOCKWISE_H2 not in {c.lut for c in interp.candidate_configs(fmt, 16) if isinstance(c, interp.DotDecode)}


_H2_PTX = """
import json
from triton.backends.compiler import GPUTarget
from qrecover.kernels import compile_check as cc, gemv, qmm_dot
out = {}
for label, sig, const, opts in cc.dot_variants("default"):
    if const["SCHEME"] == 1 and const["BITS"] == 4 and not const["HAS_ZP"] and const["BLOCK_M"] == 16 and const["BLOCK_K"] == 64:
        ptx = cc._compile(qmm_dot._dot_decode_kernel, sig, const, GPUTarget("cuda", 90, 32), **opts).asm["ptx"]
        out[label] = [ptx.count("lop3.b32"), ptx.count("cvt.rn.f16.f32") + ptx.count("cvt.rn.f16x2.f32")]
print(json.dumps(out))
"""


def test_blockwise_fp16_pairs_compile_without_a_conversion_per_weight():
    """Compiled for sm_90 (no GPU needed): the fp16 pair mode's inline ``lop3`` makes each pair of weights, and no weight
    is converted from fp32 to fp16 (the fp32 decode converts every one: a conversion per two weights at least)."""
    from test_gemv import _compiled
    counts = _compiled(_H2_PTX)
    plain = counts["blockwise-4 fp16 dot-decode 16x64x64 w4"]
    h2 = counts["blockwise-4 fp16 dot-decode 16x64x64 h2 asm w4"]
    assert h2[1] == 0 and plain[1] >= 64 * 64 // 2 // 128, counts  # a 64x64 tile over 128 threads
    assert h2[0] >= 64 * 64 // 2 // 128, counts  # one lop3 per pair of weights


@pytest.mark.parametrize("batch", [5, 8, 16, 17, 33, 64])
def test_tuner_offers_the_dot_decode_kernel_first(interp, batch):
    """Batch 5-64 (fp16/bf16): the decode-and-dot configs lead and alternate with the shared kernel's (both are timed
    on a GPU); the interpreter runs the first."""
    for out_f, in_f, cblock in ((4096, 14336, None), (48, 96, 32)):
        fmt = layer_format(make_layer("palettize", 3, 16, 64).cpu())
        fmt = type(fmt)(0, 3, out_f, in_f, 16, cblock or in_f, False)
        configs = interp.candidate_configs(fmt, batch)
        kinds = [isinstance(c, interp.DotDecode) for c in configs]
        assert kinds[0] and not all(kinds)
        # register tables on nibble codes (inline PTX): the second decode-and-dot candidate, among the first three
        dots = [c for c in configs if isinstance(c, interp.DotDecode)]
        assert dots[1].lut == 4 and dots[1].asm and dots[1] in configs[:3]
        # and the same as the transposed product (Config.swap: sm_90's warpgroup MMA) where fewer than 64 inputs,
        # among the first five; then with its code words pipelined (Config.pipe)
        if batch <= 32:
            assert dots[2] == dataclasses.replace(dots[1], swap=True) and dots[2] in configs[:5]
            dots = dots[:2] + dots[3:]
        else:
            assert not any(c.swap for c in dots)
        assert dots[2] == dataclasses.replace(dots[1], pipe=interp.PIPE_STAGES)
        for c in configs:
            assert fmt.cblock % c.block_k == 0 and c.use_dot and c.block_m >= 16
            assert fmt.in_f >= c.block_k * c.split_k or c.split_k == 1
        # 4-bit: register tables on the stored codes (nibbles already), second too
        dots4 = [c for c in interp.candidate_configs(type(fmt)(0, 4, out_f, in_f, 16, fmt.cblock, False), batch)
                 if isinstance(c, interp.DotDecode)]
        assert dots4[1].lut == 3 and dots4[1].asm
    layer = _layer("palettize", 4, {})
    x = torch.randn(batch, 192, device=DEV, dtype=torch.float16)  # fp32 activations keep the shared kernel's small tiles
    assert rel_err(kernels.fused_linear(layer, x), ref64(layer, x)) < 2e-3
    if x.device.type == "cpu":  # the interpreter runs the first candidate; a GPU keeps the fastest it timed (H100: either kind)
        assert isinstance(interp._TUNED[(layer_format(layer), interp._bucket(batch), x.dtype, x.device.type)],
                          interp.DotDecode) or interp._bucket(batch) > 64

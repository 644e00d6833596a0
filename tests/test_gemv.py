"""The decode kernel (qrecover.kernels.gemv, batch 1-4) against float64, in every table mode, and its one-time repack.

Runs under triton's interpreter without a GPU (the ``interp`` fixture). The table mode a layer gets depends on
its shape (:func:`gemv.lut_mode`: pair tables only where they are small next to the codes), so each mode is
forced here on small layers too; the repacked tables are checked entry by entry.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_helpers import DEV, make_layer, ref64, rel_err

from qrecover import kernels
from qrecover.kernels import gemv, layer_format
from qrecover.kernels.formats import Config
from qrecover.packing import unpack


@pytest.mark.parametrize("mode", [gemv.LUT_FP16, gemv.LUT_FP32, gemv.LUT_PAIRS])
@pytest.mark.parametrize("bits,block", [(2, None), (3, 32), (4, None), (4, 64), (8, 64)])
def test_decode_kernel_in_every_table_mode(interp, monkeypatch, mode, bits, block):
    if mode == gemv.LUT_PAIRS and bits not in (2, 3, 4):
        pytest.skip("pair tables are for 2-, 3- and 4-bit codes")
    monkeypatch.setattr(gemv, "lut_mode", lambda fmt: mode if fmt.scheme == 0 else gemv.LUT_FP16)
    layer = make_layer("palettize", bits, 48, 128, block_size=block)
    cases = ((1, torch.float32, 1e-5), (3, torch.float32, 1e-5), (2, torch.float16, 2e-3), (1, torch.bfloat16, 1e-2))
    for batch, dtype, tol in cases:
        x = torch.randn(batch, 128, device=DEV).to(dtype)
        y = kernels.fused_linear(layer, x, config=Config(4 if batch > 2 else batch, 32, 32, 2, False))
        assert y.dtype == dtype and rel_err(y, ref64(layer, x)) < tol, (mode, bits, block, batch)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pair_tables_hold_both_entries(monkeypatch, bits):
    monkeypatch.setattr(gemv, "lut_mode", lambda fmt: gemv.LUT_PAIRS)
    layer = make_layer("palettize", bits, 32, 64).cpu()
    n = 1 << bits
    pairs = gemv.kernel_tables(layer_format(layer), layer.lut)
    assert pairs.shape == (2, n * n, 2) and pairs.dtype == torch.float32
    for a in range(n):
        for b in range(n):
            assert torch.equal(pairs[:, a | b << bits], torch.stack([layer.lut[:, a], layer.lut[:, b]], -1).float())


def test_lut_mode_depends_on_table_bytes_next_to_codes():
    wide = layer_format(make_layer("palettize", 4, 64, 4096).cpu())  # 4 whole-row tables: 8 KB of pairs vs 128 KB of codes
    assert gemv.lut_mode(wide) == gemv.LUT_PAIRS
    small = layer_format(make_layer("palettize", 4, 32, 64, block_size=32).cpu())
    assert gemv.lut_mode(small) == gemv.LUT_FP16
    assert gemv.lut_mode(layer_format(make_layer("palettize", 3, 64, 4096).cpu())) == gemv.LUT_PAIRS
    assert gemv.lut_mode(layer_format(make_layer("palettize", 3, 64, 512).cpu())) == gemv.LUT_FP32
    assert gemv.kernel_tables(wide, torch.zeros(4, 16, dtype=torch.float16)).shape == (4, 256, 2)


def test_3bit_straddling_codes_in_the_decode_kernel(interp):
    """Identity tables and one-hot inputs, four at a time (the decode kernel): every 3-bit code reads back exactly."""
    layer = make_layer("palettize", 3, 16, 64, bias=False)
    layer.lut.copy_(torch.arange(8, dtype=torch.float16).expand_as(layer.lut))
    codes = unpack(layer.qdata.cpu(), 3, 16 * 64).view(16, 64).float()
    for c0 in range(0, 64, 4):
        x = torch.eye(64, device=DEV)[c0:c0 + 4]
        assert torch.equal(kernels.fused_linear(layer, x).cpu(), codes[:, c0:c0 + 4].T), c0


def test_repacked_tables_follow_the_layer(interp):
    """The repack is kept on the layer and redone when its tables are written."""
    layer = make_layer("palettize", 4, 32, 4096)
    x = torch.randn(1, 4096, device=DEV)
    kernels.fused_linear(layer, x)
    first = layer._kernel_repack[1]
    kernels.fused_linear(layer, x)
    assert layer._kernel_repack[1] is first
    layer.lut.mul_(2)
    assert rel_err(kernels.fused_linear(layer, x), ref64(layer, x)) < 1e-5
    assert layer._kernel_repack[1] is not first


@pytest.mark.parametrize("dtype,mode", [(torch.float16, gemv.X_FP16_PAIRS), (torch.bfloat16, gemv.X_BF16_PAIRS)])
def test_activation_pairs_split_exactly(interp, dtype, mode):
    """16-bit activations are read two per 32-bit load and split in registers: one-hot inputs at every position
    (even and odd, so both halves) read back each row's decoded weight (a swapped half would read its
    neighbour's); an odd row stride reads value by value."""
    layer = make_layer("blockwise", 4, 16, 64, bias=False, block_size=64)
    w = ref64(layer, torch.eye(64, dtype=torch.float64, device=DEV)).T  # (16, 64): the decoded weight
    for c0 in range(0, 64, 2):
        x = torch.eye(64, device=DEV)[c0:c0 + 2].to(dtype)
        assert gemv.x_pairs(x) == mode
        y = kernels.fused_linear(layer, x).double()
        # fp16: exact; bf16 within one unit of its last place (triton's interpreter truncates fp32 -> bf16)
        assert torch.allclose(y, w[:, c0:c0 + 2].T.to(dtype).double(), rtol=0 if mode == 1 else 2**-7, atol=0), c0
    odd = torch.zeros(2, 65, dtype=dtype, device=DEV)[:, :64]
    assert gemv.x_pairs(odd) == gemv.X_PLAIN


def test_the_tuner_may_pick_another_table_layout(interp):
    """A layer whose default is pair tables also keeps fp32 singles (the tuner times both); a config naming
    either layout decodes the same weights; the candidates list both among the first five."""
    layer = make_layer("palettize", 4, 64, 4096)
    fmt = layer_format(layer)
    assert gemv.table_modes(fmt) == (gemv.LUT_PAIRS, gemv.LUT_FP32, gemv.LUT_REGS, gemv.LUT_REGS_H2)
    tensors = kernels.kernel_tensors(layer, fmt)
    assert tensors["lut_kernel"] is tensors[f"lut_kernel_{gemv.LUT_PAIRS}"]
    assert tensors[f"lut_kernel_{gemv.LUT_FP32}"].shape == (4, 16)
    x = torch.randn(1, 4096, device=DEV)
    for mode in (gemv.LUT_PAIRS, gemv.LUT_FP32):
        y = kernels.fused_linear(layer, x, config=Config(1, 32, 128, 2, False, lut=mode))
        assert rel_err(y, ref64(layer, x)) < 1e-5, mode
    from qrecover.kernels.qmatmul import PIPE_STAGES, candidate_configs

    configs = candidate_configs(fmt, 1)
    # 4-bit: fp32 singles lead (20-35% faster than pairs on every tile of an H100 sweep), then the register tables
    # (never timed yet; fewer instructions per weight since the fp16 chains span four tiles) of the two first tiles;
    # pairs among the first thirteen; the first candidate's serial split-K twin second, then the first three
    # candidates with their code words pipelined
    assert configs[0].lut == gemv.LUT_FP32 and configs[0].asm and configs[0].split_k > 1
    assert configs[1] == dataclasses.replace(configs[0], serial=True)
    assert configs[2:5] == [dataclasses.replace(c, pipe=PIPE_STAGES) for c in configs[:1] + configs[5:7]]
    assert [c.lut for c in configs[5:9]] == [gemv.LUT_REGS_H2, gemv.LUT_REGS] * 2
    assert [(c.block_n, c.block_k) for c in configs[5:9:2]] == [(64, 256), (64, 128)]  # 128x256 spills at 4-bit
    assert max(c.block_m * c.block_n * c.block_k for c in configs) <= 16384
    assert [c.lut for c in configs[9:11]] == [gemv.LUT_FP32] * 2
    assert gemv.LUT_PAIRS in {c.lut for c in configs[:13]} and sum(c.serial for c in configs) == 1


def test_blockwise_decode_candidates_pair_each_tile_with_its_inline_ptx_variant():
    """Blockwise 4-bit at batch 1: each tile's inline-PTX variant (code words read through PTX, no layout conversion
    per tile) is timed just before the plain variant the H100 measured, with the fp16 pair mode of the two first tiles
    sixth and seventh, after the first candidate's serial split-K twin (``Config.serial``) and the first three with
    their code words pipelined (``Config.pipe``)."""
    from qrecover.kernels.qmatmul import PIPE_STAGES, candidate_configs

    fmt = layer_format(make_layer("blockwise", 4, 64, 4096, block_size=64))
    configs = candidate_configs(fmt, 1)
    assert [(c.asm, c.lut, c.pipe, c.serial) for c in configs[:10]] == [
        (True, -1, 0, False), (True, -1, 0, True), (True, -1, PIPE_STAGES, False),
        (True, gemv.BLOCKWISE_H2, PIPE_STAGES, False), (True, gemv.BLOCKWISE_H2, PIPE_STAGES, False),
        (True, gemv.BLOCKWISE_H2, 0, False), (True, gemv.BLOCKWISE_H2, 0, False), (False, -1, 0, False),
        (True, -1, 0, False), (False, -1, 0, False)]
    assert [(c.block_n, c.block_k) for c in configs[:8]] == [(128, 64)] * 4 + [(64, 64), (128, 64), (64, 64), (128, 64)]
    fmt3 = layer_format(make_layer("blockwise", 3, 64, 4096, block_size=64))
    assert gemv.BLOCKWISE_H2 not in {c.lut for c in candidate_configs(fmt3, 1)}  # 4-bit codes only


def _compiled(script: str) -> dict:
    """The JSON that ``script`` prints last, run in a fresh interpreter without ``TRITON_INTERPRET`` (it compiles the
    kernels for sm_90 with triton's own compiler; no GPU needed)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


_PTX_LOADS = """
import json, re
from triton.backends.compiler import GPUTarget
from qrecover.kernels import compile_check as cc, gemv
out = {}
for label, sig, const, opts in cc.gemv_variants("default"):
    if const["BITS"] == 3 and const["BLOCK_N"] == 64 and const["ASM"] and const["LUT"] == gemv.LUT_FP16:
        ptx = cc._compile(gemv._gemv_kernel, sig, const, GPUTarget("cuda", 90, 32), **opts).asm["ptx"]
        out["palettize" if const["SCHEME"] == 0 else "blockwise"] = [
            len(re.findall(p, ptx)) for p in (r"ld\\.global\\.nc\\.b32", r"ld\\.global(\\.\\w+)*\\.b16")]
print(json.dumps(out))
"""


def test_inline_ptx_never_reads_fp16_tables_32_bits_at_a_time():
    """Config.asm with 3-bit codes reads the code words through 32-bit PTX loads; a layer whose tables stay fp16 (large
    tables next to few codes: ``lut_mode`` 0) must read its entries as 16-bit values. It once read them 32 bits at a
    time (misaligned for every odd code: on an H100 the CUDA context failed, and every later test in that process).
    Compiled for sm_90 (no GPU needed): the palettize variant's 32-bit PTX loads are its code words alone, as many as
    the 3-bit blockwise variant's (which has no table), and its table entries are 16-bit loads (64 per 1x64x128
    tile; 76 32-bit loads and no 16-bit ones before the fix)."""
    counts = _compiled(_PTX_LOADS)
    assert counts["palettize"][0] == counts["blockwise"][0] > 0 and counts["palettize"][1] >= 64, counts


_SHAPES = [(2, None, 256), (3, None, 256), (3, None, 160), (3, 32, 256), (2, 64, 256)]
_SHAPES4 = [(4, None, 256), (4, 64, 256)]  # 4-bit: 16-entry tables, no nibble repack


@pytest.mark.parametrize("mode,bits,block,in_f", [(m, *c) for m in (gemv.LUT_REGS, gemv.LUT_REGS_NIBBLES) for c in _SHAPES]
                         + [(m, *c) for m in (gemv.LUT_REGS_H2, gemv.LUT_REGS_NIBBLES_H2) for c in _SHAPES[2:]]
                         + [(m, *c) for m in (gemv.LUT_REGS, gemv.LUT_REGS_H2) for c in _SHAPES4]
                         + [(gemv.LUT_REGS_NIBBLES_H2, 2, None, 160), (gemv.LUT_REGS_H2, 4, None, 384)])
def test_register_tables_in_the_decode_kernel(interp, mode, bits, block, in_f):
    """Register tables (byte planes looked up four codes at a time), on the stored codes and on nibble codes (160
    inputs: 5 groups of 32 codes, planes padded to 8 words), with fp32 or fp16 pair FMAs, against float64; the
    interpreter runs the kernel's plain-op stand-ins for ``PRMT`` and ``fma.rn.f16x2`` (compiled: inline PTX). The
    fp16 pair FMAs take fp16 activations only, and say so otherwise. 2/4-bit fp16 chains span 2/4 tiles: 160 and 384
    inputs end a program's tiles in the middle of a chain (split-K 2: 3 + 2 tiles of 2-bit codes, 6 + 6 of 4-bit)."""
    layer = make_layer("palettize", bits, 48, in_f, block_size=block)
    cases = ((1, torch.float32, 1e-5), (3, torch.float32, 1e-5), (2, torch.float16, 2e-3), (1, torch.bfloat16, 1e-2),
             (4, torch.float16, 2e-3))
    h2 = mode in gemv.H2_MODES
    if h2:
        with pytest.raises(ValueError, match="fp16 activations"):
            kernels.fused_linear(layer, torch.randn(1, in_f, device=DEV).bfloat16(),
                                 config=Config(1, 32, 32, 2, False, lut=mode))
        cases = tuple(c for c in cases if c[1] == torch.float16)
    wide = 64 if (block or in_f) % 64 == 0 else 32
    for i, (batch, dtype, tol) in enumerate(cases):
        x = torch.randn(batch, in_f, device=DEV).to(dtype)
        # the cases alternate between two tiles (split-K 2 first: the chains ending mid-chain); asm: the inline PTX
        # where compiled (a GPU), ignored by the interpreter, which runs the plain-op stand-ins
        bm = 4 if batch > 2 else batch
        cfg = Config(bm, 16, wide, 1, False, asm=True, lut=mode) if i % 2 else Config(bm, 32, 32, 2, False, lut=mode)
        y = kernels.fused_linear(layer, x, config=cfg)
        assert y.dtype == dtype and rel_err(y, ref64(layer, x)) < tol, (mode, bits, block, batch, cfg)


@pytest.mark.parametrize("scheme,bits,block,lut,symmetric", [
    ("palettize", 3, None, gemv.LUT_PAIRS, True), ("palettize", 3, 32, gemv.LUT_FP16, True),
    ("palettize", 4, None, gemv.LUT_FP32, True), ("palettize", 3, None, gemv.LUT_REGS_NIBBLES_H2, True),
    ("palettize", 2, None, gemv.LUT_REGS_NIBBLES, True), ("palettize", 4, None, gemv.LUT_REGS_H2, True),
    ("blockwise", 4, 64, gemv.BLOCKWISE_H2, True), ("blockwise", 3, 64, -1, False)])
def test_pipelined_word_loads_give_the_hand_prefetchs_results(interp, scheme, bits, block, lut, symmetric):
    """``Config.pipe``: the code words read plainly at each tile (compiled, triton's pipeliner issues them tiles ahead
    through shared memory) give exactly the results of the hand prefetch one tile ahead in registers, and match
    float64: every table layout, register tables on stored and nibble codes, fp16 pair FMAs, blockwise with zero
    points; split-K 1 and 3 (5 and 2 tiles per program, neither a multiple of the stages)."""
    params = {"symmetric": symmetric} if scheme == "blockwise" else {}
    layer = make_layer(scheme, bits, 48, 320, block_size=block, **params)
    h2 = lut in gemv.H2_MODES or (scheme == "blockwise" and lut == gemv.BLOCKWISE_H2)
    for batch in (1, 3):
        x = torch.randn(batch, 320, device=DEV).to(torch.float16 if h2 else torch.float32)
        for split in (1, 3):
            cfg = Config(4 if batch > 2 else batch, 16, 64 if block != 32 else 32, split, False, asm=True, lut=lut)
            y0 = kernels.fused_linear(layer, x, config=cfg)
            y = kernels.fused_linear(layer, x, config=dataclasses.replace(cfg, pipe=4))
            assert torch.equal(y, y0), (scheme, bits, lut, batch, split)
            assert rel_err(y, ref64(layer, x)) < (2e-3 if h2 else 1e-5), (scheme, bits, lut, batch, split)


def test_a_split_that_does_not_start_on_a_tile_is_refused():
    """The decode kernels tell triton that each split of K starts on a ``BLOCK_K`` boundary (so that the pipeliner's
    copies of the code words are 16 bytes wide); ``quant_matmul`` rounds ``k_split`` up to a multiple of ``block_k``,
    and a launch with any other split is refused before it could read misaligned words."""
    cfg = Config(1, 16, 64, 3, False)
    gemv.check_split(128, cfg)
    with pytest.raises(ValueError, match="k_split 100 is not a multiple of block_k 64"):
        gemv.check_split(100, cfg)


@pytest.mark.parametrize("scheme,bits,block,lut", [("palettize", 3, None, gemv.LUT_PAIRS), ("palettize", 4, 64, gemv.LUT_FP16),
                                                   ("palettize", 3, None, gemv.LUT_REGS_NIBBLES_H2),
                                                   ("blockwise", 4, 64, gemv.BLOCKWISE_H2)])
def test_serial_split_k_needs_no_reduction_launch(interp, monkeypatch, scheme, bits, block, lut):
    """``Config.serial``: the last program of each output tile sums the splits, adds the bias and writes the output
    (split-K 2, 3 and 5, batch 1 and 3, pipelined or not): float64-close, the same bits on a second call, no
    reduction kernel launched (its workspace filled with NaN first: no slot read before written), and every tile
    counter back at zero for the next launch."""
    layer = make_layer(scheme, bits, 48, 320, block_size=block)
    h2 = lut in gemv.H2_MODES or (scheme == "blockwise" and lut == gemv.BLOCKWISE_H2)
    empty = torch.empty  # a workspace slot read before it is written shows as NaN

    def nan_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    reduce_calls = []
    real_reduce = interp._splitk_reduce
    monkeypatch.setattr(interp, "_splitk_reduce", type("R", (), {"__getitem__": lambda self, grid: (
        lambda *a, **k: reduce_calls.append(grid) or real_reduce[grid](*a, **k))})())
    for batch, split, pipe in ((1, 2, 0), (3, 3, 4), (1, 5, 0)):
        x = torch.randn(batch, 320, device=DEV).to(torch.float16 if h2 else torch.float32)
        cfg = Config(4 if batch > 2 else batch, 16, 64, split, False, asm=True, lut=lut, pipe=pipe, serial=True)
        y = kernels.fused_linear(layer, x, config=cfg)
        assert not reduce_calls and torch.equal(kernels.fused_linear(layer, x, config=cfg), y)
        assert rel_err(y, ref64(layer, x)) < (2e-3 if h2 else 1e-5), (scheme, bits, lut, batch, split)
        assert not interp.split_counters(x.device, 1).any()
    kernels.fused_linear(layer, x, config=dataclasses.replace(cfg, serial=False))
    assert reduce_calls  # (the two-launch split-K, for comparison)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="races between programs show on a GPU only")
def test_serial_split_k_is_race_free_on_the_gpu():
    """On a GPU, 300 launches of the serial split-K (16 programs per output tile racing for the last ticket, 8
    tiles): every output bit-identical to the first and float64-close, the counters back at zero."""
    from qrecover.kernels import qmatmul

    layer = make_layer("palettize", 3, 512, 4096).cuda()
    x = torch.randn(1, 4096, device="cuda", dtype=torch.float16)
    cfg = Config(1, 64, 256, 16, False, asm=True, serial=True)
    first = kernels.fused_linear(layer, x, config=cfg)
    outs = torch.stack([kernels.fused_linear(layer, x, config=cfg) for _ in range(300)])
    assert torch.equal(outs, first.expand_as(outs)) and rel_err(first, ref64(layer, x)) < 2e-3
    assert not qmatmul.split_counters(x.device, 1).any()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the compiled kernels' aligned copies run on a GPU only")
@pytest.mark.parametrize("scheme,bits,block,lut,tile", [
    ("palettize", 3, None, gemv.LUT_REGS_NIBBLES_H2, (64, 256)), ("palettize", 3, None, gemv.LUT_PAIRS, (64, 256)),
    ("palettize", 4, None, gemv.LUT_REGS_H2, (64, 256)), ("palettize", 4, None, gemv.LUT_FP32, (64, 256)),
    ("blockwise", 4, 64, gemv.BLOCKWISE_H2, (128, 64)), ("blockwise", 4, 64, -1, (128, 64))])
def test_pipelined_variants_at_aligned_shapes_on_the_gpu(scheme, bits, block, lut, tile):
    """On a GPU, at shapes whose rows start on 16-byte boundaries (4096 inputs: the launcher specializes the strides
    as multiples of 16, so the pipelined variants copy the code words 16 bytes at a time and read the activations by
    inline PTX), the pipelined kernel gives the hand prefetch's bits and float64's values; batch 1 and 2, fp16 and bf16
    activations (fp16 only for the pair FMAs), split-K 1 and 4 (4 and 16 tiles per program)."""
    layer = make_layer(scheme, bits, 256, 4096, block_size=block).cuda()
    h2 = lut in gemv.H2_MODES or (scheme == "blockwise" and lut == gemv.BLOCKWISE_H2)
    for dtype in (torch.float16,) if h2 else (torch.float16, torch.bfloat16):
        for batch in (1, 2):
            x = torch.randn(batch, 4096, device="cuda", dtype=dtype)
            for split in (1, 4):
                cfg = Config(batch, tile[0], tile[1], split, False, asm=True, lut=lut)
                y0 = kernels.fused_linear(layer, x, config=cfg)
                y = kernels.fused_linear(layer, x, config=dataclasses.replace(cfg, pipe=4))
                assert torch.equal(y, y0), (scheme, bits, lut, dtype, batch, split)
                assert rel_err(y, ref64(layer, x)) < (8e-3 if dtype == torch.bfloat16 else 2e-3), (scheme, bits, lut, batch)


@pytest.mark.parametrize("block,symmetric", [(64, True), (32, False), (None, False)])
def test_blockwise_fp16_pair_mode_in_the_decode_kernel(interp, block, symmetric):
    """Blockwise 4-bit codes as fp16 pairs by their bits (``gemv.BLOCKWISE_H2``: ``c - z`` exact, fp16 pair FMAs in
    chains of 4, scaled per tile) against float64: symmetric and asymmetric, per-block and per-channel scales, batch
    1-4, split-K 1 and 2; fp16 activations only, and 4-bit codes only, each refused with a message."""
    layer = make_layer("blockwise", 4, 40, 256, block_size=block, symmetric=symmetric)
    bk = 32 if (block or 64) == 32 else 64
    for batch in (1, 3, 4):
        x = torch.randn(batch, 256, device=DEV).half()
        for split in (1, 2):
            cfg = Config(4 if batch > 2 else batch, 16, bk, split, False, asm=True, lut=gemv.BLOCKWISE_H2)
            y = kernels.fused_linear(layer, x, config=cfg)
            assert y.dtype == torch.float16 and rel_err(y, ref64(layer, x)) < 2e-3, (block, symmetric, batch, split)
    with pytest.raises(ValueError, match="fp16 activations"):
        kernels.fused_linear(layer, torch.randn(1, 256, device=DEV).bfloat16(), config=Config(1, 16, bk, 1, False, lut=5))
    with pytest.raises(ValueError, match="4-bit codes, got 3-bit"):
        kernels.fused_linear(make_layer("blockwise", 3, 40, 256, block_size=64), torch.randn(1, 256, device=DEV).half(),
                             config=Config(1, 16, 64, 1, False, lut=gemv.BLOCKWISE_H2))


@pytest.mark.parametrize("bits", [2, 3])
def test_register_tables_and_nibble_codes_hold_every_value(bits):
    """Byte planes give back each fp16 entry; nibble codes hold each code where the kernel's selectors read it."""
    layer = make_layer("palettize", bits, 16, 96 if bits == 3 else 64).cpu()
    fmt = layer_format(layer)
    planes = gemv.register_tables(layer.lut).view(torch.uint8).view(-1, 2, 8)  # (T, low/high byte plane, entry)
    assert planes.shape[0] == layer.lut.shape[0]
    entries = (planes[:, 0].int() | planes[:, 1].int() << 8).to(torch.int16).view(torch.float16)
    assert torch.equal(entries[:, :1 << bits], layer.lut) and not entries[:, 1 << bits:].any()
    codes = unpack(layer.qdata, bits, fmt.out_f * fmt.in_f).view(fmt.out_f, -1).long()
    nib = gemv.nibble_codes(fmt, layer.qdata.view(torch.int32)).long() & 0xFFFFFFFF
    groups = fmt.in_f // 32
    if bits == 3:  # three planes per row (word b of every group), each padded to 4 words: 3 groups -> 4
        assert nib.shape == (fmt.out_f, 3 * 4) and not nib.view(fmt.out_f, 3, 4)[:, :, groups:].any()
        nib = nib.view(fmt.out_f, 3, 4)[:, :, :groups].transpose(1, 2).reshape(fmt.out_f, -1)
    else:
        assert nib.shape == (fmt.out_f, fmt.in_f // 16)
    fields = (nib[:, :, None] >> 4 * torch.arange(8)) & 15  # (rows, word, nibble)
    if bits == 2:
        got = torch.cat([fields & 3, fields >> 2], dim=2)  # codes 0-7, then 8-15 of each word
    else:
        g = fields.view(fmt.out_f, -1, 3, 8)
        fourth = (g[:, :, 0] >> 3) | (g[:, :, 1] >> 3) << 1 | (g[:, :, 2] >> 3) << 2
        got = torch.cat([g[:, :, 0] & 7, g[:, :, 1] & 7, g[:, :, 2] & 7, fourth], dim=2)
    assert torch.equal(got.reshape(fmt.out_f, -1), codes)


def test_nibble_codes_are_kept_only_where_the_tuner_chose_them(interp, monkeypatch):
    """The tuner's first candidates for a 3-bit layer at batch 1 include register tables on both code layouts
    (inline PTX); a layer keeps its second copy of the codes only once the tuner picked nibble codes, and the
    tuned launch then reads them."""
    layer = make_layer("palettize", 3, 64, 4096)
    fmt = layer_format(layer)
    first = interp.candidate_configs(fmt, 1)[:9]
    assert first[0].lut == -1 and first[0].asm  # the pair-table kernel stays first (the interpreter runs it)
    assert first[1] == dataclasses.replace(first[0], serial=True)  # its serial split-K twin second
    assert [(c.lut, c.asm, c.pipe) for c in first[2:9]] == [
        (m, True, p) for m, p in ((-1, interp.PIPE_STAGES), (gemv.LUT_REGS_NIBBLES_H2, interp.PIPE_STAGES),
                                  (gemv.LUT_REGS_NIBBLES, interp.PIPE_STAGES),
                                  (gemv.LUT_REGS_NIBBLES_H2, 0), (gemv.LUT_REGS_NIBBLES, 0), (gemv.LUT_REGS_H2, 0),
                                  (gemv.LUT_REGS, 0))]
    x = torch.randn(1, 4096, device=DEV)
    assert "qdata_nibbles" not in kernels.kernel_tensors(layer, fmt)
    monkeypatch.setattr(interp, "_TUNED", {(fmt, 1, x.dtype, x.device.type): Config(1, 32, 128, 2, False, lut=gemv.LUT_REGS_NIBBLES)})
    tensors = kernels.kernel_tensors(layer, fmt)
    assert torch.equal(tensors["qdata_nibbles"], gemv.nibble_codes(fmt, layer.qdata.view(torch.int32)))
    assert kernels.kernel_tensors(layer, fmt)["qdata_nibbles"] is tensors["qdata_nibbles"]  # made once
    monkeypatch.setattr(gemv, "nibble_codes", lambda *a: pytest.fail("the launch re-made the nibble codes"))
    assert rel_err(kernels.fused_linear(layer, x), ref64(layer, x)) < 1e-5


def _prmt(a: int, b: int, c: int) -> int:
    """PTX ``prmt.b32 d, a, b, c`` (default mode), as the PTX ISA defines it: byte ``i`` of ``d`` is byte
    ``c[4i + 2 : 4i]`` of the 8 bytes ``b:a``, sign-replicated when ``c[4i + 3]`` is set."""
    src = (b << 32 | a).to_bytes(8, "little")
    out = bytearray(4)
    for i in range(4):
        nib = c >> 4 * i & 15
        byte = src[nib & 7]
        out[i] = (0xFF if byte & 0x80 else 0) if nib & 8 else byte
    return int.from_bytes(out, "little")


def _run_ptx(asm: str, regs: dict) -> dict:
    """Run the ``prmt``/``mov``/``cvt``/``fma.rn.f16x2`` statements of ``asm`` in order on integer registers."""
    import re

    import numpy as np

    def val(t):
        return int(t, 16) if t.startswith("0x") else regs[t]

    def halves(v):
        return np.array([v & 0xFFFF, v >> 16], dtype=np.uint16).view(np.float16).astype(np.float64)

    for stmt in (t.strip().lstrip("{").strip() for t in asm.split(";")):  # "{ .reg ...; ...; }": a block of statements
        if m := re.fullmatch(r"prmt\.b32 ([\w$]+), ([\w$]+), ([\w$]+), ([\w$]+)", stmt):
            regs[m[1]] = _prmt(val(m[2]), val(m[3]), val(m[4]))
        elif m := re.fullmatch(r"mov\.b32 \{(\w+), (\w+)\}, ([\w$]+)", stmt):
            regs[m[1]], regs[m[2]] = val(m[3]) & 0xFFFF, val(m[3]) >> 16
        elif m := re.fullmatch(r"cvt\.f32\.f16 (\$\d+), (\w+)", stmt):
            regs[m[1]] = np.array([val(m[2])], dtype=np.uint16).view(np.float16)[0]
        elif m := re.fullmatch(r"fma\.rn\.f16x2 (\$\d+), ([\w$]+), ([\w$]+), ([\w$]+)", stmt):
            r = (halves(val(m[2])) * halves(val(m[3])) + halves(val(m[4]))).astype(np.float16).view(np.uint16)
            regs[m[1]] = int(r[0]) | int(r[1]) << 16
        elif m := re.fullmatch(r"add\.rn\.f16x2 (\$\d+), ([\w$]+), ([\w$]+)", stmt):
            r = (halves(val(m[2])) + halves(val(m[3]))).astype(np.float16).view(np.uint16)
            regs[m[1]] = int(r[0]) | int(r[1]) << 16
        elif m := re.fullmatch(r"shr\.b32 ([\w$]+), ([\w$]+), (\d+)", stmt):  # .b32: a logical shift
            regs[m[1]] = (val(m[2]) & 0xFFFFFFFF) >> int(m[3])
        elif m := re.fullmatch(r"lop3\.b32 ([\w$]+), ([\w$]+), ([\w$]+), ([\w$]+), (0x[0-9A-Fa-f]+)", stmt):
            a, b, c, lut = val(m[2]), val(m[3]), val(m[4]), int(m[5], 16)  # bit i: lut[a_i << 2 | b_i << 1 | c_i]
            regs[m[1]] = sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i for i in range(32))
        elif stmt and not stmt.startswith((".reg", "}")):
            raise AssertionError(f"no model for PTX statement {stmt!r}")
    return regs


def _ptx(fn, *inputs, outs: int = 1) -> list:
    """Run the inline PTX of the triton helper ``fn`` on ``inputs`` (operands ``$outs..``); its outputs ``$0..``."""
    import inspect
    import re

    src = inspect.getsource(fn.fn if hasattr(fn, "fn") else fn)
    asm = "".join(re.findall(r'"([^"]*)"', src.split("inline_asm_elementwise(")[1].split('"=r')[0]))
    regs = _run_ptx(asm, {f"${outs + i}": v for i, v in enumerate(inputs)})
    return [regs[f"${i}"] for i in range(outs)]


@pytest.mark.parametrize("entries", [8, 16])
def test_register_lookup_ptx_selects_each_entry(entries):
    """The inline PTX of the register-table look-up (``_prmt``, ``_interleave``, ``_halves``, ``_fma2``), run
    statement by statement under a model of ``prmt``, ``mov``, ``cvt`` and ``fma.rn.f16x2`` from the PTX ISA and
    composed as ``_regs_pairs`` composes them: for four codes of a random 8- or 16-entry table, the outputs are those
    entries, and the pair FMAs add entry x activation to the right accumulator halves. (The asm itself runs only on a
    GPU; this checks its selectors and operand order, and the 4-bit selector arithmetic.)"""
    import numpy as np

    rng = np.random.default_rng(entries)
    table = rng.standard_normal(entries).astype(np.float16)
    planes = [v & 0xFFFFFFFF for v in gemv.register_tables(torch.from_numpy(table)[None])[0].tolist()]
    assert len(planes) == entries // 2

    def prmt(a, b, c):
        return _ptx(gemv._prmt, a, b, c)[0]

    def plane_bytes(sel, half, words):  # _regs_pairs: one prmt for 8 entries, three (_bytes16) for 16
        if len(words) == 2:
            return prmt(*words, sel)
        return prmt(prmt(words[0], words[1], sel), prmt(words[2], words[3], sel), half)

    quads = [(0, 1, 2, 3), (7, 6, 5, 4), (3, 3, 0, 7), (5, 2, 7, 1)] + ([(15, 8, 12, 9), (0, 15, 7, 8)] if entries == 16 else [])
    for n, (codes, h) in enumerate((c, h) for c in quads for h in (0, 1)):
        # eight codes in one word, the selectors made once per word as _selectors makes them (4-bit: the low 3 bits,
        # and the choice of half), and shifted by 16 for the second four: prmt must ignore the high half
        other = quads[(n // 2 + 1) % len(quads)]
        word = sum(c << 4 * i for i, c in enumerate(codes if h == 0 else other)) | sum(
            c << 4 * i + 16 for i, c in enumerate(other if h == 0 else codes))
        sel, half_sel = (word & 0x77777777, ((word >> 1) & 0x44444444) | 0x32103210) if entries == 16 else (word, word)
        sel, half_sel = sel >> 16 * h, half_sel >> 16 * h
        half = entries // 4
        lo, hi = plane_bytes(sel, half_sel, planes[:half]), plane_bytes(sel, half_sel, planes[half:])
        p, q = _ptx(gemv._interleave, lo, hi, outs=2)
        got = _ptx(gemv._halves, p, outs=2) + _ptx(gemv._halves, q, outs=2)
        assert got == [table[c] for c in codes], codes
        x = rng.standard_normal(4).astype(np.float16)
        acc = rng.standard_normal(4).astype(np.float16)
        sums = [_ptx(gemv._fma2, w, xu, a)[0] for w, xu, a in zip((p, q), x.view(np.uint32).tolist(), acc.view(np.uint32).tolist())]
        want = (table[list(codes)].astype(np.float64) * x + acc).astype(np.float16)
        assert np.array_equal(np.array(sums, dtype=np.uint32).view(np.float16), want), codes


def test_blockwise_pair_codes_ptx_gives_c_minus_z_exactly():
    """The inline PTX of the blockwise fp16 pair mode (``_and_or``'s ``lop3`` after the shift; ``_hadd2``) run
    under a model of the PTX ISA: nibbles ``i`` and ``i + 4`` of a word become ``(c_i - z, c_i+4 - z)`` exactly for
    every code and zero point, and the pair FMA adds them times the activations to the right halves."""
    import numpy as np

    rng = np.random.default_rng(0)
    for z in (0, 8, 15, 3):
        zh = int(np.array([-1024.0 - z], dtype=np.float16).view(np.uint16)[0])
        for word in [0x76543210, 0xFEDCBA98, 0x0F0F0F0F] + rng.integers(0, 1 << 32, 4).tolist():
            for i in range(4):
                p = _ptx(gemv._and_or, word >> 4 * i, 0x000F000F, 0x64006400)[0]  # the constants as registers
                v = _ptx(gemv._hadd2, p, zh | zh << 16)[0]
                got = np.array([v & 0xFFFF, v >> 16], dtype=np.uint16).view(np.float16)
                assert got.tolist() == [(word >> 4 * i & 15) - z, (word >> 4 * i + 16 & 15) - z], (hex(word), i, z)
                x, acc = rng.standard_normal(2).astype(np.float16), rng.standard_normal(2).astype(np.float16)
                r = _ptx(gemv._fma2, v, int(x.view(np.uint32)[0]), int(acc.view(np.uint32)[0]))[0]
                want = (got.astype(np.float64) * x + acc).astype(np.float16)
                assert np.array_equal(np.array([r], dtype=np.uint32).view(np.float16), want), (hex(word), i, z)


_REGS_ISA = """
import json
from triton.backends.compiler import GPUTarget
from qrecover.kernels import compile_check as cc, gemv
out = {}
for label, sig, const, opts in cc.gemv_variants("default"):
    if const["BITS"] == 3 and const["SCHEME"] == 0 and const["BLOCK_N"] == 128 and const["ASM"] and const["LUT"] in (
            gemv.LUT_PAIRS, gemv.LUT_REGS, gemv.LUT_REGS_NIBBLES):
        k = cc._compile(gemv._gemv_kernel, sig, const, GPUTarget("cuda", 90, 32), **opts)
        row = cc.isa_row(k, opts["num_warps"], const["BLOCK_N"] * const["BLOCK_K"])
        out[const["LUT"]] = [row["total"], row["global load"], k.asm["ptx"].count("prmt.b32"), k.asm["ptx"].count("ld.global.nc.b64")]
print(json.dumps(out))
"""


_FOUR_BIT_ISA = """
import json
from triton.backends.compiler import GPUTarget
from qrecover.kernels import compile_check as cc, gemv, isa
cc.ALIGNED = True  # as the launcher specializes at run time: the plain word loads are vectorised there
out = {}
for label, sig, const, opts in cc.gemv_variants("default", [(1, 64, 128, 4)]):
    if const["BITS"] == 4 and const["SCHEME"] == 0 and const["ASM"] and const["LUT"] in (gemv.LUT_PAIRS, gemv.LUT_REGS_H2):
        k = cc._compile(gemv._gemv_kernel, sig, const, GPUTarget("cuda", 90, 32), **opts)
        always, skipped = isa.loop_parts(cc.sass(k) or k.asm["ptx"], ptx=cc.sass(k) is None)
        row = cc.isa_row(k, opts["num_warps"], const["BLOCK_N"] * const["BLOCK_K"], cc.chain_tiles(const))
        out[const["LUT"]] = [row["shared load"] + row["shared store"], row["float"], len(skipped), cc.chain_tiles(const)]
print(json.dumps(out))
"""


def test_four_bit_decode_compiles_without_layout_conversions_and_flushes_chains_every_fourth_tile():
    """Compiled for sm_90 as at run time (aligned; no GPU needed): the 4-bit decode kernel reads its code words through
    PTX, so no tile goes through shared memory (0.25 shared loads and stores per weight with the plain load); the
    fp16 pair-FMA variant flushes its chains in a block the loop skips three tiles in four, so its float work per
    weight (HFMA2 0.5 + the flush) stays under 1 (1.62 when it flushed every tile)."""
    got = {int(k): v for k, v in _compiled(_FOUR_BIT_ISA).items()}
    assert got[gemv.LUT_PAIRS][0] == 0 and got[gemv.LUT_REGS_H2][0] == 0, got
    shared, flo, skipped, every = got[gemv.LUT_REGS_H2]
    assert every == 4 and skipped > 0 and 0.5 <= flo < 1.0, got


def test_register_tables_compile_to_prmt_without_table_loads():
    """Compiled for sm_90 (no GPU needed): the register-table variants of the 3-bit decode kernel (1x128x256, inline
    PTX) look entries up with ``prmt`` and read no 64-bit pair from memory, so they issue fewer global loads per
    weight than the pair-table kernel; with nibble codes, fewer instructions per weight too (4.24 against 4.91
    under triton 3.9 and 3.6 when written)."""
    got = {int(k): v for k, v in _compiled(_REGS_ISA).items()}
    pairs, regs, nibbles = got[gemv.LUT_PAIRS], got[gemv.LUT_REGS], got[gemv.LUT_REGS_NIBBLES]
    assert pairs[3] > 0, pairs
    for row in (regs, nibbles):  # one prmt per weight: 256 per thread per 1x128x256 tile (4 warps)
        assert row[2] >= 256 and row[3] == 0 and row[1] < pairs[1] / 2, (row, pairs)
    assert nibbles[0] < pairs[0] and nibbles[0] < regs[0], got


_PIPE_ISA = """
import json, re
from triton.backends.compiler import GPUTarget
from qrecover.kernels import compile_check as cc, gemv
cc.ALIGNED = True
out = {}
for label, sig, const, opts in cc.gemv_variants("default", [(1, 64, 256, 4)], pipes=(0, 4)):
    if const["BITS"] == 3 and const["SCHEME"] == 0 and const["ASM"] and const["LUT"] == gemv.LUT_REGS_NIBBLES_H2:
        k = cc._compile(gemv._gemv_kernel, sig, const, GPUTarget("cuda", 90, 32), **opts)
        row = cc.isa_row(k, opts["num_warps"], const["BLOCK_N"] * const["BLOCK_K"], cc.chain_tiles(const))
        ptx = k.asm["ptx"]
        out[const["PIPE"]] = [row["global load"], row["total"], ptx.count("cp.async"), k.metadata.shared,
                              cc.resources(k).get("STACK", 0),
                              len(re.findall(r"cp\\.async\\.cg\\.shared\\.global[^;]*, 0x10", ptx)),
                              len(re.findall(r"cp\\.async\\.ca\\.shared\\.global[^;]*, 0x4\\b", ptx))]
print(json.dumps(out))
"""


def test_pipelined_words_compile_to_asynchronous_copies():
    """Compiled for sm_90 as at run time (no GPU needed): with ``Config.pipe`` the code words arrive by 16-byte
    ``cp.async`` into shared memory (3 tiles ahead with 4 stages), none by 4-byte copies (each split starts on a
    ``BLOCK_K`` boundary, which the kernel tells triton), and the activations by direct loads, as in the hand prefetch
    (not copied thread by thread into shared memory); at most 0.1 more thread instructions per weight than the hand
    prefetch (3-bit nibble codes, register tables, fp16 pair FMAs, 1x64x256: 2.81 -> 2.80 under triton 3.6; 3.22
    with 4-byte copies of words and activations), without spilling."""
    got = {int(k): v for k, v in _compiled(_PIPE_ISA).items()}
    hand, piped = got[0], got[4]
    assert hand[0] > 0 and hand[2] == 0, hand
    assert piped[5] > 0 and piped[6] == 0 and piped[3] >= 3 * 64 * 256 * 3 // 8 and piped[4] == 0, piped
    assert piped[0] < hand[0], got  # the words left the loop's own loads; the activations stay
    assert piped[1] < hand[1] + 0.1, got


_SERIAL_PTX = """
import json, re
from triton.backends.compiler import GPUTarget
from qrecover.kernels import compile_check as cc, gemv
cc.ALIGNED = True
out = {}
for label, sig, const, opts in cc.gemv_variants("default", [(1, 64, 256, 4)]):
    if const["BITS"] == 3 and const["SCHEME"] == 0 and const["ASM"] and const["LUT"] == gemv.LUT_PAIRS:
        for serial in (False, True):
            k = cc._compile(gemv._gemv_kernel, sig, dict(const, SERIAL=serial, S_PAD=16), GPUTarget("cuda", 90, 32), **opts)
            ptx = k.asm["ptx"]
            row = cc.isa_row(k, opts["num_warps"], const["BLOCK_N"] * const["BLOCK_K"])
            out[int(serial)] = [sorted(set(re.findall(r"atom\\.[\\w.]+", ptx))), ptx.count("bar.sync"),
                                ptx.count("ld.global.cg"), row["total"], cc.resources(k).get("STACK", 0)]
print(json.dumps(out))
"""


def test_serial_split_k_compiles_to_a_release_acquire_ticket():
    """Compiled for sm_90 (no GPU needed): the serial split-K's ticket is an ``acq_rel`` atomic at GPU scope after a
    CTA barrier, the partials are read from L2 (``ld.global.cg``) and the counter reset is atomic too; the main loop
    is the same length as without it (the reduction is an epilogue), and at most an 8-byte stack frame (triton 3.9
    here; 3.6, the GPU machine's, none)."""
    got = {int(k): v for k, v in _compiled(_SERIAL_PTX).items()}
    plain, serial = got[0], got[1]
    assert plain[0] == [] and plain[2] == 0, plain
    assert "atom.global.gpu.acq_rel.add.u32" in serial[0] and any("exch" in a for a in serial[0]), serial
    assert serial[1] > plain[1] and serial[2] > 0 and serial[4] <= 8, serial
    assert abs(serial[3] - plain[3]) < 0.1, got

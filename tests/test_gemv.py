"""The decode kernel (qrecover.kernels.gemv, batch 1-4) against float64, in every table mode, and its one-time repack.

Runs under triton's interpreter without a GPU (the ``interp`` fixture). The table mode a layer gets depends on
its shape (:func:`gemv.lut_mode`: pair tables only where they are small next to the codes), so each mode is
forced here on small layers too; the repacked tables are checked entry by entry.
"""

from __future__ import annotations

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
    assert gemv.table_modes(fmt) == (gemv.LUT_PAIRS, gemv.LUT_FP32)
    tensors = kernels.kernel_tensors(layer, fmt)
    assert tensors["lut_kernel"] is tensors[f"lut_kernel_{gemv.LUT_PAIRS}"]
    assert tensors[f"lut_kernel_{gemv.LUT_FP32}"].shape == (4, 16)
    x = torch.randn(1, 4096, device=DEV)
    for mode in (gemv.LUT_PAIRS, gemv.LUT_FP32):
        y = kernels.fused_linear(layer, x, config=Config(1, 32, 128, 2, False, lut=mode))
        assert rel_err(y, ref64(layer, x)) < 1e-5, mode
    from qrecover.kernels.qmatmul import candidate_configs

    first = candidate_configs(fmt, 1)[:5]
    # 4-bit: fp32 singles lead (20-35% faster than pairs on every tile of an H100 sweep), pairs among the first five
    assert first[0].lut == gemv.LUT_FP32 and {c.lut for c in first} == {gemv.LUT_PAIRS, gemv.LUT_FP32}


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
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _PTX_LOADS], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    counts = json.loads(r.stdout.strip().splitlines()[-1])
    assert counts["palettize"][0] == counts["blockwise"][0] > 0 and counts["palettize"][1] >= 64, counts

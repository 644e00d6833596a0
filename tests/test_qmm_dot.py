"""The batch 5-64 decode-and-dot kernel (qrecover.kernels.qmm_dot) against float64, under triton's interpreter on CPU.

Odd output counts (the last row tile partial), batches 5, 8, 16, 33 and 64 (partial and whole 16/32/64-row tiles),
palettize 2/3/4-bit with whole-row and per-32-column tables in each table layout, 8-bit, and blockwise symmetric
and asymmetric; split-K and the tuner's candidate lists.
"""

from __future__ import annotations

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
    for i, batch in enumerate(BATCHES):
        dtype, tol = ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1.5e-2))[i % 3]
        x = torch.randn(batch, 192, device=DEV).to(dtype)
        bm = 16 if batch <= 16 else min(64, 1 << (batch - 1).bit_length())
        for j, mode in enumerate(modes):
            if mode >= gemv.LUT_REGS and i % 2:  # register tables (the interpreter's slowest): batches 5, 16 and 64
                continue
            bk = 32 if (i + j) % 2 or fmt.cblock % 64 else 64
            cfg = interp.DotDecode(bm, 32, bk, 1 + (i + j) % 3, True, 4, 1, asm=mode >= gemv.LUT_REGS, lut=mode)
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

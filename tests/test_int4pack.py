"""torch's int4 matmul on repacked blockwise 4-bit layers (qrecover.kernels.int4pack) against float64, on CPU
(``aten._weight_int4pack_mm_for_cpu``): the repack reads the same numbers, symmetric and with zero points."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import make_layer, ref64, rel_err

from qrecover.kernels import int4pack, layer_format, reference

needs_op = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="torch has no CPU int4 matmul")


@needs_op
@pytest.mark.parametrize("scheme,block,symmetric", [("blockwise", 32, True), ("blockwise", 64, True), ("blockwise", 64, False),
                                                    ("blockwise", 128, False), ("gptq", 64, False), ("gptq", 32, True)])
def test_int4pack_reads_the_same_weights(scheme, block, symmetric):
    key = "block_size" if scheme == "blockwise" else "group_size"
    layer = make_layer(scheme, 4, 48, 256, **{key: block, "symmetric": symmetric}).cpu()
    fmt = layer_format(layer)
    assert int4pack.supported(fmt)
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        w = int4pack.repack(layer, fmt, dtype)
        x = torch.randn(3, 256).to(dtype)
        y = int4pack.linear(w, x, layer.bias)
        ref = ref64(layer, x)
        assert y.dtype == dtype and y.shape == (3, 48)
        assert rel_err(y, ref) < tol, (block, symmetric, dtype)
        assert rel_err(y, ref) < 3 * rel_err(reference.linear(layer, x), ref) + 1e-6


def test_int4pack_refuses_other_geometry():
    assert not int4pack.supported(layer_format(make_layer("blockwise", 3, 40, 256, block_size=64).cpu()))
    assert not int4pack.supported(layer_format(make_layer("blockwise", 4, 48, 512, block_size=None).cpu()))  # per channel, K 512
    assert not int4pack.supported(layer_format(make_layer("blockwise", 4, 40, 256, block_size=64).cpu()))  # N % 16
    assert not int4pack.supported(layer_format(make_layer("blockwise", 4, 40, 96, block_size=32).cpu()))
    assert not int4pack.supported(layer_format(make_layer("palettize", 4, 48, 256).cpu()))
    assert not int4pack.supported("in_features=48 is not a multiple of 32")

"""``qrecover.calibrate.xtx``: the tiled CPU product (upper-triangle tiles, mirrored) is the full ``x^T x`` to the bit,
so the Hessians, and every checkpoint made from them, are what the full product gives; and it is the float64
product within float32 rounding."""

from __future__ import annotations

import pytest
import torch

from qrecover.calibrate import XTX_TILE, xtx


@pytest.mark.parametrize("tokens,cols", [(512, 576), (512, 1536), (700, 1536), (64, 4096), (33, 1000), (512, 300)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("threads", [1, 2])
def test_tiled_xtx_is_the_full_product_to_the_bit(tokens, cols, dtype, threads):
    torch.manual_seed(cols + tokens)
    x = torch.randn(tokens, cols) * 3
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, full = xtx(x, dtype), (x.to(dtype).T @ x.to(dtype)).double()
    finally:
        torch.set_num_threads(before)
    assert got.dtype == torch.float64 and torch.equal(got, full)
    assert torch.equal(got, got.T)
    ref = x.double().T @ x.double()
    assert ((got - ref).abs().max() / ref.abs().max()) < (1e-5 if dtype == torch.float32 else 1e-13)


def test_tiles_cover_every_column_once():
    x = torch.eye(XTX_TILE * 3 + 7)  # x^T x of the identity is the identity: a missed or doubled tile shows
    assert torch.equal(xtx(x, torch.float32), torch.eye(XTX_TILE * 3 + 7, dtype=torch.float64))

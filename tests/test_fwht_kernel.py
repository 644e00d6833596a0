"""The online R4 rotation's Triton kernel (qrecover.kernels.fwht) against the float64 dense rotation, under triton's
interpreter on the CPU (on CUDA when there is a GPU), for the sizes it serves; and what it does not serve."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from qrecover import kernels
from qrecover.transforms.hadamard import fast_factors, fwht_operands, kernel_factor, rotate, rotation

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="module")
def fwht():
    if not kernels.triton_available():
        pytest.skip("triton is not installed: pip install 'qrecover[kernels]'")
    old = os.environ.get("TRITON_INTERPRET")
    if DEV == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    if "qrecover.kernels.fwht" in sys.modules:
        importlib.reload(sys.modules["qrecover.kernels.fwht"])
    yield importlib.import_module("qrecover.kernels.fwht")
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


@pytest.mark.parametrize("n,rows", [(1536, 3), (576, 2), (256, 1), (4096, 2), (3584, 1), (14336, 1)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_matches_the_dense_rotation(fwht, n, rows, dtype):
    p, b = fast_factors(n)
    assert fwht.supported(n, p, b)
    x = torch.randn(rows, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    want = x @ rotation(n, "fwht", 2000)
    s, _ = fwht_operands(n, 2000, DEV, torch.float32)
    got = fwht.rotate_rows(x.to(DEV, dtype), s, kernel_factor(n, DEV))
    assert got.dtype == dtype and got.shape == x.shape
    tol = 2e-3 if dtype == torch.float16 else 1.5e-2  # the intermediate's and the stored result's rounding
    assert float((got.double().cpu() - want).abs().max() / want.abs().max()) < tol
    lead = torch.randn(2, 3, n, generator=torch.Generator().manual_seed(1))  # leading dimensions kept
    got = fwht.rotate_rows(lead.to(DEV, dtype), s, kernel_factor(n, DEV)).cpu().double()
    want = rotate(lead.double(), n, "fwht", 2000)
    assert float((got - want).abs().max() / want.abs().max()) < tol


def test_sizes_and_dtypes_not_served(fwht):
    assert not fwht.supported(1536, 12, 128, torch.float32)  # fp32: the torch reference
    assert not fwht.supported(96, *fast_factors(96))  # H_8: below tl.dot's 16
    assert not fwht.supported(1 << 15, *fast_factors(1 << 15))  # 256 x 128: the small factor past 128

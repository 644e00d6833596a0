"""Helpers shared by the kernel tests (test_kernels.py, test_dispatch.py): packed layers, float64 references, and the
kernel modules built for triton's interpreter (the ``interp`` fixture in conftest.py)."""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from qrecover import kernels
from qrecover.qlinear import QuantLinear
from qrecover.schemes import get_quantizer

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


KERNEL_MODULES = ("qrecover.kernels.gemv", "qrecover.kernels.qmm_dot", "qrecover.kernels.qmatmul",
                  "qrecover.kernels.multi_adapter_kernels")  # (in import order: each reads the ones before)


def interpreted_kernels(names: tuple[str, ...] = KERNEL_MODULES, main: str = "qrecover.kernels.qmatmul"):
    """Yield the kernel module ``main``, ``names`` built for the interpreter when there is no GPU; restore the
    environment after."""
    if not kernels.triton_available():
        pytest.skip("triton is not installed: pip install 'qrecover[kernels]'")
    old = os.environ.get("TRITON_INTERPRET")
    if not CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    for name in names:
        if name in sys.modules:  # imported earlier without the interpreter: rebuild the kernels for it
            importlib.reload(sys.modules[name])
    module = importlib.import_module(main)
    if main == "qrecover.kernels.qmatmul":
        assert module.interpreting() == (not CUDA)
    yield module
    if old is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = old


def make_layer(scheme: str, bits: int, out_f: int, in_f: int, bias: bool = True, seed: int = 0, **params) -> QuantLinear:
    """A packed ``QuantLinear (out_f, in_f)`` of a seeded random weight, on the test device, in eval mode (inference);
    GPTQ layers quantized against a seeded Hessian."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g)
    stats = {}
    if scheme == "gptq":  # GPTQ needs a Hessian: inputs with uneven column scales
        x = torch.randn(4 * in_f, in_f, generator=g, dtype=torch.float64) * torch.linspace(0.2, 2.0, in_f, dtype=torch.float64)
        stats = {"hessian": x.T @ x / x.shape[0]}
    qw = get_quantizer(scheme, **params).quantize(w, bits, stats)
    return QuantLinear(qw, bias=torch.randn(out_f, generator=g) if bias else None).to(DEV).eval()


def ref64(layer: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """``x @ W^T + b`` in float64 from the layer's dequantized weight."""
    y = x.double() @ layer.dequantize(torch.float64).T
    return y + layer.bias.double() if layer.bias is not None else y


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm())

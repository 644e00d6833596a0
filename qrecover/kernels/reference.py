"""The reference path every kernel is checked against: dequantize the whole weight, then a dense matmul.

This is exactly what :meth:`qrecover.qlinear.QuantLinear.forward` computes on CPU, and what
:func:`qrecover.kernels.select` falls back to (CPU tensors, unsupported formats or shapes, autograd
through the input, ``QRECOVER_KERNELS=0``, triton not installed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(layer, x: torch.Tensor) -> torch.Tensor:
    """``x (..., I) -> (..., O)``: ``F.linear(x, layer.dequantize(x.dtype), bias)`` for a ``QuantLinear`` ``layer``."""
    weight = layer.linear_weight(x) if hasattr(layer, "linear_weight") else layer.dequantize(x.dtype)
    return F.linear(x, weight, None if layer.bias is None else layer.bias.to(x.dtype))

"""Fused kernels for packed layers, and the one place that decides whether to use them.

:func:`select` picks, for a :class:`~qrecover.qlinear.QuantLinear`, a device and a batch size:

- ``"gemv"``: the fused dequantize-matmul kernel's split-K path (batch <= 16, decoding),
- ``"tiled"``: its ``tl.dot`` tile path (batch > 16, prefill),
- ``"reference"``: ``F.linear(x, layer.dequantize(x.dtype), bias)`` (:mod:`.reference`), when the device
  is not CUDA, ``QRECOVER_KERNELS=0``, triton is not installed (``pip install 'qrecover[kernels]'``), or the
  layer's format/shape is not one the kernel reads (see :func:`layer_format`).

Each distinct decision is logged once (logger ``qrecover.kernels``, level INFO).
:meth:`QuantLinear.forward` calls :func:`linear` for CUDA inputs, so ``model = qrecover.load(ckpt);
model.to("cuda")`` decodes with the fused kernels without any other change (the packed tensors are
buffers and move with ``.to``). The kernels themselves live in :mod:`.qmatmul` (imported only when first
used, so importing qrecover never needs triton) and the multi-adapter LoRA kernels in :mod:`.multi_adapter`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import os
from dataclasses import dataclass

import torch

from ..errors import QRecoverError
from . import reference
from .formats import BLOCKWISE, PALETTIZE, Format

logger = logging.getLogger("qrecover.kernels")

#: bit widths the fused kernel decodes (codes never straddle a 32-bit word, or straddle at fixed offsets for 3)
KERNEL_BITS = {"palettize": (2, 3, 4, 8), "blockwise": (2, 3, 4, 8)}
GEMV_MAX_BATCH = 16

_logged: set[tuple] = set()


@dataclass(frozen=True)
class KernelChoice:
    """What :func:`select` decided: ``name`` in {"gemv", "tiled", "reference"}, and why."""

    name: str
    reason: str

    @property
    def fused(self) -> bool:
        return self.name != "reference"


def enabled() -> bool:
    """False when the environment variable ``QRECOVER_KERNELS`` is ``0`` (force the reference path)."""
    return os.environ.get("QRECOVER_KERNELS", "1").strip() != "0"


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def layer_format(layer) -> Format | str:
    """The kernel :class:`~qrecover.kernels.qmatmul.Format` of a packed layer, or a string saying why it has none.

    Pure: reads ``layer.scheme/bits/shape/params`` and which buffers it has; needs no triton and no GPU.
    """
    scheme, bits, (out_f, in_f), params = layer.scheme, layer.bits, tuple(layer.shape), layer.params
    if scheme not in KERNEL_BITS:
        return f"scheme {scheme!r} has no fused kernel"
    if bits not in KERNEL_BITS[scheme]:
        return f"{scheme} {bits=} has no fused kernel (supported: {KERNEL_BITS[scheme]})"
    if in_f % 32:
        return f"in_features={in_f} is not a multiple of 32 (rows must start on a 32-bit word)"
    if scheme == "palettize":
        group, cblock, has_zp = int(params.get("group_size", 16)), int(params.get("block_size") or in_f), False
    else:
        group, cblock, has_zp = 1, int(params.get("block_size") or in_f), not params.get("symmetric", True)
    if cblock % 32:
        return f"block_size={cblock} is not a multiple of 32"
    return Format(PALETTIZE if scheme == "palettize" else BLOCKWISE, bits, out_f, in_f, group, cblock, has_zp)


def select(layer, device: torch.device | str, batch: int) -> KernelChoice:
    """The kernel for ``layer`` run on ``device`` with ``batch`` rows (tokens) of input. Pure decision; logs once."""
    device = torch.device(device)
    fmt = layer_format(layer)
    if device.type != "cuda":
        choice = KernelChoice("reference", f"device {device.type} (fused kernels run on CUDA)")
    elif not enabled():
        choice = KernelChoice("reference", "QRECOVER_KERNELS=0")
    elif not triton_available():
        choice = KernelChoice("reference", "triton is not installed; pip install 'qrecover[kernels]'")
    elif isinstance(fmt, str):
        choice = KernelChoice("reference", fmt)
    elif batch <= GEMV_MAX_BATCH:
        choice = KernelChoice("gemv", f"batch {batch} <= {GEMV_MAX_BATCH}: split-K GEMV")
    else:
        choice = KernelChoice("tiled", f"batch {batch} > {GEMV_MAX_BATCH}: tiled tl.dot")
    key = (layer.scheme, layer.bits, tuple(layer.shape), device.type, choice.name)
    if key not in _logged:
        _logged.add(key)
        logger.info("%s %d-bit %s on %s, batch %d: %s (%s)", layer.scheme, layer.bits, tuple(layer.shape),
                    device.type, batch, choice.name, choice.reason)
    return choice


def linear(layer, x: torch.Tensor) -> torch.Tensor:
    """``x (..., I) -> (..., O)`` through the kernel :func:`select` picks; the reference path when autograd
    needs the input's gradient (the kernels have no backward)."""
    batch = x.numel() // x.shape[-1] if x.numel() else 0
    if batch == 0 or (torch.is_grad_enabled() and x.requires_grad):
        return reference.linear(layer, x)
    if not select(layer, x.device, batch).fused:
        return reference.linear(layer, x)
    from .qmatmul import quant_matmul  # triton: an optional dependency, imported at first use

    tensors = {n: getattr(layer, n) for n in layer._tensor_names}
    y = quant_matmul(x.reshape(batch, x.shape[-1]), layer_format(layer), tensors, layer.bias)
    return y.reshape(*x.shape[:-1], y.shape[-1])


def fused_linear(layer, x: torch.Tensor, config=None) -> torch.Tensor:
    """The fused kernel on ``x (..., I)`` whatever the device (tests run it on CPU under ``TRITON_INTERPRET=1``).

    Raises :class:`~qrecover.errors.QRecoverError` for a layer the kernel cannot read.
    """
    fmt = layer_format(layer)
    if isinstance(fmt, str):
        raise QRecoverError(f"layer {tuple(layer.shape)} {layer.scheme} {layer.bits}-bit: {fmt}; use the reference path")
    from .qmatmul import quant_matmul  # triton: an optional dependency, imported at first use
    tensors = {n: getattr(layer, n) for n in layer._tensor_names}
    batch = x.numel() // x.shape[-1]
    y = quant_matmul(x.reshape(batch, x.shape[-1]), fmt, tensors, layer.bias, config)
    return y.reshape(*x.shape[:-1], y.shape[-1])

__all__ = ["KernelChoice", "select", "linear", "fused_linear", "layer_format", "enabled", "reference"]

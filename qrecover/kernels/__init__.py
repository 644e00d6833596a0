"""Fused kernels for packed layers, and the one place that decides whether to use them.

:func:`select` picks, for a :class:`~qrecover.qlinear.QuantLinear`, a device, a batch size and a dtype:

- ``"gemv"``: the fused dequantize-matmul kernel's split-K path (batch <= 16, decoding),
- ``"tiled"``: its ``tl.dot`` tile path (batch > 16, prefill),
- ``"dense"``: a dense copy dequantized once, then ``F.linear`` (cuBLAS), and
- ``"int4"``: torch's ``_weight_int4pack_mm`` on a one-time repack (:mod:`.int4pack`, blockwise 4-bit): what the
  measured policy (:mod:`.dispatch`) keeps where it timed faster than the fused kernel,
- ``"reference"``: ``F.linear(x, layer.dequantize(x.dtype), bias)`` (:mod:`.reference`; it reads the layer's
  dense cache when it has one), when the device is not CUDA, ``QRECOVER_KERNELS=0``, triton is not installed
  (``pip install 'qrecover[kernels]'``), the layer's format/shape is not one the kernel reads (see
  :func:`layer_format`), autograd needs the input's gradient, the model is training, or the layer holds a
  dense cache.

``QRECOVER_KERNELS``: unset (or ``auto``) measures; ``1`` forces the fused kernel wherever it can run (not when
autograd needs the input's gradient: the kernels have no backward); ``0`` forces the reference path.

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
from . import dispatch, int4pack, reference
from .formats import BLOCKWISE, PALETTIZE, Format

logger = logging.getLogger("qrecover.kernels")

#: bit widths the fused kernel decodes (codes never straddle a 32-bit word, or straddle at fixed offsets for 3)
#: GPTQ stores and decodes exactly blockwise's tensors (``block_size = group_size``): the blockwise kernels serve it
KERNEL_BITS = {"palettize": (2, 3, 4, 8), "blockwise": (2, 3, 4, 8), "gptq": (2, 3, 4, 8)}
GEMV_MAX_BATCH = 16

_logged: set[tuple] = set()


@dataclass(frozen=True)
class KernelChoice:
    """What :func:`select` decided: ``name`` in {"gemv", "tiled", "dense", "int4", "reference"}, and why.

    ``pending``: a fused choice not yet measured against the dense path (:func:`linear` measures it).
    """

    name: str
    reason: str
    pending: bool = False

    @property
    def fused(self) -> bool:
        return self.name in ("gemv", "tiled")


def mode() -> str:
    """``QRECOVER_KERNELS``: "0" (reference path), "1" (fused wherever it can run) or "auto" (unset: measured)."""
    value = os.environ.get("QRECOVER_KERNELS", "auto").strip().lower()
    return value if value in ("0", "1") else "auto"


def enabled() -> bool:
    """False when the environment variable ``QRECOVER_KERNELS`` is ``0`` (force the reference path)."""
    return mode() != "0"


def gpu_device(device: torch.device) -> bool:
    """True for a device the fused kernels run on (CUDA). Tests patch it to reach the kernel path on CPU."""
    return device.type == "cuda"


def is_training(layer, x: torch.Tensor) -> bool:
    """The module is in training mode (``model.train()``; also under ``no_grad``, e.g. a check forward inside a training
    step), or grad is enabled and the input or a parameter of the module needs it. ``model.eval()`` for inference."""
    return layer.training or (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in layer.parameters())))


@functools.cache
def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def layer_format(layer) -> Format | str:
    """The kernel :class:`~qrecover.kernels.qmatmul.Format` of a packed layer, or a string saying why it has none.

    Pure: reads ``layer.scheme/bits/shape/params``, its quantizer's block and which buffers it has; needs no triton
    and no GPU.
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
    else:  # blockwise, or GPTQ (blockwise's tensors): the block its quantizer decodes with, zero points if stored
        group, cblock, has_zp = 1, int(layer._quantizer._block((out_f, in_f))), "zero_point" in layer._tensor_names
    if cblock % 32:
        return f"block_size={cblock} is not a multiple of 32"
    return Format(PALETTIZE if scheme == "palettize" else BLOCKWISE, bits, out_f, in_f, group, cblock, has_zp)


def select(layer, device: torch.device | str, batch: int, dtype: torch.dtype | None = None, training: bool = False,
           needs_grad: bool = False) -> KernelChoice:
    """The kernel for ``layer`` run on ``device`` with ``batch`` rows (tokens) of input in ``dtype``; logs once.

    ``training``: the model is training (:func:`is_training`); ``needs_grad``: autograd needs the input's gradient.
    A fused choice that the measured policy has not decided yet comes back ``pending``; one it decided comes
    back as it decided ("dense" or the fused path).
    """
    device = torch.device(device)
    fmt = layer_format(layer)
    forced = mode()
    fused_name = "gemv" if batch <= GEMV_MAX_BATCH else "tiled"
    fused_why = (f"batch {batch} <= {GEMV_MAX_BATCH}: split-K GEMV" if batch <= GEMV_MAX_BATCH
                 else f"batch {batch} > {GEMV_MAX_BATCH}: tiled tl.dot")
    dense = layer.cache or layer._dense is not None  # the layer keeps (or will keep) a dense cache: cuBLAS on it
    if not gpu_device(device):
        choice = KernelChoice("reference", f"device {device.type} (fused kernels run on CUDA)")
    elif forced == "0":
        choice = KernelChoice("reference", "QRECOVER_KERNELS=0")
    elif not triton_available():
        choice = KernelChoice("reference", "triton is not installed; pip install 'qrecover[kernels]'")
    elif isinstance(fmt, str):
        choice = KernelChoice("reference", fmt)
    elif needs_grad:
        choice = KernelChoice("reference", "autograd needs the input's gradient (the kernels have no backward)")
    elif forced == "1":
        choice = KernelChoice(fused_name, f"QRECOVER_KERNELS=1; {fused_why}")
    elif training:
        choice = KernelChoice("reference", "training: the dense path")
    elif dense:
        choice = KernelChoice("reference", "the layer holds a dense cache (cache=True)")
    else:
        decided = dispatch.DECISIONS.get(dispatch.key(fmt, batch, dtype or torch.float16, device))
        if decided is None:
            choice = KernelChoice(fused_name, f"{fused_why}; to be timed against the dense path", pending=True)
        elif decided in ("dense", "int4"):
            choice = KernelChoice(decided, "measured faster than the fused kernel")
        else:
            choice = KernelChoice(fused_name, f"{fused_why}; measured faster than the dense path")
    log_key = (layer.scheme, layer.bits, tuple(layer.shape), device.type, choice.name, choice.pending)
    if log_key not in _logged:
        _logged.add(log_key)
        logger.info("%s %d-bit %s on %s, batch %d: %s (%s)", layer.scheme, layer.bits, tuple(layer.shape),
                    device.type, batch, choice.name, choice.reason)
    return choice


def linear(layer, x: torch.Tensor) -> torch.Tensor:
    """``x (..., I) -> (..., O)`` through the path :func:`select` picks, timing a pending one first (:mod:`.dispatch`)."""
    batch = x.numel() // x.shape[-1] if x.numel() else 0
    if batch == 0:
        return reference.linear(layer, x)
    if layer.training or layer.cache or layer._dense is not None:
        # what select decides for a training module or a dense cache unless QRECOVER_KERNELS=1, answered before it
        # so that torch.compile traces one F.linear here (select's logging, cache and dispatch table made dynamo
        # recompile per grad mode and autocast state: --compile-layers on an H100 hit its recompile limit)
        if mode() != "1":
            return reference.linear(layer, x)
    return _opaque()(layer, x, batch)


_OPAQUE: list = []


def _opaque():
    """:func:`_dispatched` behind ``torch.compiler.disable``, made at first use: the decorator imports dynamo, which
    imports triton, and importing this package must not (``TRITON_INTERPRET`` is read when triton's kernels are
    defined, and a process may set it after importing qrecover)."""
    if not _OPAQUE:
        _OPAQUE.append(torch.compiler.disable(_dispatched))
    return _OPAQUE[0]


def _dispatched(layer, x: torch.Tensor, batch: int) -> torch.Tensor:
    """:func:`linear`'s choice and call, opaque to ``torch.compile`` (:func:`_opaque`: one graph break per packed
    layer), so that a compiled decode step fuses the elementwise work between the packed layers and calls the chosen
    path as it is: dynamo need not trace the dispatch's tables, timing and logging, nor triton launches."""
    choice = select(layer, x.device, batch, x.dtype, training=is_training(layer, x),
                    needs_grad=torch.is_grad_enabled() and x.requires_grad)
    if choice.pending:
        best = dispatch.measure(layer, x, layer_format(layer), lambda v: fused_linear(layer, v))
        choice = KernelChoice(choice.name if best == "fused" else best, "measured")
    if choice.name == "int4":
        w4 = dispatch.int4_weight(layer, layer_format(layer), x.dtype)
        if w4 is not None:
            return int4pack.linear(w4, x, layer.bias)
        choice = KernelChoice("gemv" if batch <= GEMV_MAX_BATCH else "tiled", "no memory for the int4 repack")
    if choice.name == "dense":
        w = dispatch.dense_weight(layer, x.dtype, x.device)
        if w is not None:
            return dispatch.dense_linear(layer, x, w)
        choice = KernelChoice("gemv" if batch <= GEMV_MAX_BATCH else "tiled", "no memory for a dense copy")
    if not choice.fused:
        return reference.linear(layer, x)
    return fused_linear(layer, x)


def kernel_tensors(layer, fmt: Format) -> dict[str, torch.Tensor]:
    """The layer's packed buffers, plus for palettize the decode kernel's tables, repacked once
    (:func:`~qrecover.kernels.gemv.kernel_tables`) and kept on the layer until its tables change (moved or written):
    ``lut_kernel`` in the default layout, ``lut_kernel_<mode>`` for each layout the tuner may pick; and
    ``qdata_nibbles`` (:func:`~qrecover.kernels.gemv.nibble_codes`, a second copy of the codes) only where the
    tuner chose that layout."""
    tensors = {n: getattr(layer, n) for n in layer._tensor_names}
    if fmt.scheme == PALETTIZE:
        lut = tensors["lut"]
        key = (lut.data_ptr(), str(lut.device), lut._version)
        cached = getattr(layer, "_kernel_repack", None)
        if cached is None or cached[0] != key:
            # triton: an optional dependency, imported at first use
            from .gemv import LUT_REGS, kernel_tables, table_modes
            tables = {}
            for m in table_modes(fmt):  # the register-table modes share one repack (same planes; other codes, FMAs)
                tables[m] = tables[LUT_REGS] if m > LUT_REGS and LUT_REGS in tables else kernel_tables(fmt, lut, m)
            cached = layer._kernel_repack = (key, tables)
        tables = cached[1]
        tensors["lut_kernel"] = next(iter(tables.values()))
        tensors.update({f"lut_kernel_{m}": t for m, t in tables.items()})
        if fmt.bits in (2, 3):
            from .qmatmul import code_words, nibble_codes_wanted
            if nibble_codes_wanted(fmt):  # the tuner chose nibble codes: a second copy of the codes, made once
                qdata = tensors["qdata"]
                key = (qdata.data_ptr(), str(qdata.device), qdata._version)
                cached = getattr(layer, "_nibble_repack", None)
                if cached is None or cached[0] != key:
                    from .gemv import nibble_codes
                    cached = layer._nibble_repack = (key, nibble_codes(fmt, code_words(qdata)))
                tensors["qdata_nibbles"] = cached[1]
    return tensors


def fused_linear(layer, x: torch.Tensor, config=None) -> torch.Tensor:
    """The fused kernel on ``x (..., I)`` whatever the device (tests run it on CPU under ``TRITON_INTERPRET=1``).

    Raises :class:`~qrecover.errors.QRecoverError` for a layer the kernel cannot read.
    """
    fmt = layer_format(layer)
    if isinstance(fmt, str):
        raise QRecoverError(f"layer {tuple(layer.shape)} {layer.scheme} {layer.bits}-bit: {fmt}; use the reference path")
    from .qmatmul import quant_matmul  # triton: an optional dependency, imported at first use
    tensors = kernel_tensors(layer, fmt)
    batch = x.numel() // x.shape[-1]
    # the tuner checks each candidate against the dequantize-then-matmul path once (:func:`.qmatmul._tune`)
    y = quant_matmul(x.reshape(batch, x.shape[-1]), fmt, tensors, layer.bias, config,
                     reference=lambda v: reference.linear(layer, v))
    return y.reshape(*x.shape[:-1], y.shape[-1])

__all__ = ["KernelChoice", "select", "linear", "fused_linear", "layer_format", "enabled", "mode", "gpu_device", "is_training",
           "dispatch", "reference"]

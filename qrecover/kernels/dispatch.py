"""The measured half of the dispatch: on first use, time the fused kernel against the dense path and keep the faster.

:func:`qrecover.kernels.select` rules out what cannot or must not run fused (CPU, training, a dense cache, an
unsupported format; ``QRECOVER_KERNELS=0/1`` forces either path). What is left is a speed question, answered
here once per ``(Format, batch bucket, dtype, device)`` (:func:`key`): the first call of that kind times

- ``fused``: the fused dequant-matmul kernel (:func:`qrecover.kernels.fused_linear`), tuned first, and
- ``dense``: dequantize once, then ``F.linear`` (cuBLAS), where the layer may hold a dense copy
  (:func:`dense_allowed`: its bytes fit in :data:`DENSE_FREE_FRACTION` of the free device memory),
- ``int4``: torch's ``_weight_int4pack_mm`` on a one-time repack (:mod:`.int4pack`), for blockwise 4-bit layers
  whose geometry it takes (the same numbers: ``zero = (8 - z) * s``); dropped if torch refuses the dtype,

with :data:`timer` (default: ``triton.testing.do_bench``, which flushes L2 between repetitions), and records the
faster in :data:`DECISIONS`. Later layers of the same kind take the recorded path without timing. A layer
that takes the dense path keeps its dense copy in ``layer._dispatch_dense`` (dropped by ``.to()`` and
``set_packed``); if memory does not allow one, it runs fused. Tests inject a fake :data:`timer`.
"""

from __future__ import annotations

import logging
from typing import Callable

import torch
import torch.nn.functional as F

from . import int4pack

logger = logging.getLogger("qrecover.kernels")

#: a layer may keep a dense copy when its bytes are at most this fraction of the device's free memory
DENSE_FREE_FRACTION = 0.25

#: ``{key(...): "fused" | "dense"}``: the measured choice per layer kind and batch bucket (in-process)
DECISIONS: dict[tuple, str] = {}


def bucket(m: int) -> int:
    """The batch bucket of ``m`` tokens: the next power of two, capped at 256."""
    return 1 << max(0, (m - 1).bit_length()) if m <= 256 else 256


def key(fmt, m: int, dtype: torch.dtype, device: torch.device) -> tuple:
    """What one measurement decides for: layer format and shape, batch bucket, activation dtype, device."""
    return (fmt, bucket(m), dtype, str(device))


def _bench(name: str, fn: Callable[[], object]) -> float:
    """Milliseconds per call of ``fn`` on CUDA (median; L2 flushed between repetitions). ``name`` is for fakes."""
    from triton.testing import do_bench  # triton: an optional dependency, imported at first use

    return float(do_bench(fn, warmup=5, rep=25))


#: ``timer(name, fn) -> time`` with ``name`` in {"fused", "dense", "int4"}; any unit, smaller is faster
timer: Callable[[str, Callable[[], object]], float] = _bench


def free_memory(device: torch.device) -> int:
    """Free bytes on ``device`` (CUDA: ``torch.cuda.mem_get_info``; anything else: unlimited)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return 1 << 62


def dense_bytes(layer, dtype: torch.dtype) -> int:
    out_f, in_f = layer.shape
    return out_f * in_f * torch.empty((), dtype=dtype).element_size()


def dense_allowed(layer, dtype: torch.dtype, device: torch.device) -> bool:
    """True when a dense ``(out, in)`` copy in ``dtype`` fits in :data:`DENSE_FREE_FRACTION` of the free memory."""
    return dense_bytes(layer, dtype) <= DENSE_FREE_FRACTION * free_memory(device)


def dense_weight(layer, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    """The layer's dense copy for the dispatch (made once, if memory allows), or None."""
    w = getattr(layer, "_dispatch_dense", None)
    if w is not None and w.dtype == dtype and w.device == device:
        return w
    if not dense_allowed(layer, dtype, device):
        return None
    layer._dispatch_dense = layer.dequantize(dtype).detach()
    return layer._dispatch_dense


def int4_weight(layer, fmt, dtype: torch.dtype) -> int4pack.Int4Weight | None:
    """The layer's repack for torch's int4 matmul in ``dtype`` (made once, kept until its codes change), or None
    when the geometry does not fit or memory does not allow it."""
    if not int4pack.supported(fmt):
        return None
    q = layer.qdata
    key = (q.data_ptr(), str(q.device), q._version, dtype)
    cached = getattr(layer, "_dispatch_int4", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    if layer.nbytes > DENSE_FREE_FRACTION * free_memory(q.device):
        return None
    layer._dispatch_int4 = (key, int4pack.repack(layer, fmt, dtype))
    return layer._dispatch_int4[1]


def dense_linear(layer, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x (..., I) @ w.T (+ bias)`` with ``w (O, I)`` dense in ``x.dtype``."""
    return F.linear(x, w, None if layer.bias is None else layer.bias.to(x.dtype))


def measure(layer, x: torch.Tensor, fmt, fused: Callable[[torch.Tensor], torch.Tensor]) -> str:
    """Time ``fused(x)`` against the dense path for ``layer`` and record the faster under :func:`key`.

    Returns "fused", "dense" or "int4". Without room for a dense copy the dense path is not timed.
    While a CUDA graph is being captured nothing can be timed: "fused", not recorded.
    """
    k = key(fmt, x.numel() // x.shape[-1], x.dtype, x.device)
    if k in DECISIONS:
        return DECISIONS[k]
    if x.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "fused"
    fused(x)  # compile and tune before timing
    times = {"fused": timer("fused", lambda: fused(x))}
    had_copy = getattr(layer, "_dispatch_dense", None) is not None  # kept for another bucket: keep it
    had_int4 = getattr(layer, "_dispatch_int4", None) is not None
    w = dense_weight(layer, x.dtype, x.device)
    if w is not None:
        times["dense"] = timer("dense", lambda: dense_linear(layer, x, w))
    try:
        w4 = int4_weight(layer, fmt, x.dtype)
        if w4 is not None:
            int4pack.linear(w4, x, layer.bias)  # raises where this torch build does not take the dtype
            times["int4"] = timer("int4", lambda: int4pack.linear(w4, x, layer.bias))
    except RuntimeError as e:
        logger.info("torch's int4 matmul is not a candidate for %s: %s", tuple(layer.shape), str(e)[:120])
    best = min(times, key=times.get)
    if best != "dense" and not had_copy:
        layer._dispatch_dense = None  # made only to be timed
    if best != "int4" and not had_int4:
        layer._dispatch_int4 = None
    DECISIONS[k] = best
    logger.info("%s %d-bit %s, batch bucket %d, %s: %s (%s)", layer.scheme, layer.bits, tuple(layer.shape), k[1],
                x.dtype, best, ", ".join(f"{n} {t:.4g}" for n, t in times.items()))
    return best

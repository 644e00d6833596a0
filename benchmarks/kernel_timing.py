"""L2-cold layer timing and the rows benchmarks/kernels.py compares: fp16, the fused kernel, torch's int4, gemlite.

L2-cold: every call reads another copy of the weights (enough copies to exceed 3x the L2 cache), and many calls
are captured in one CUDA graph, replayed and timed with CUDA events (launch overhead excluded, as in a decode
graph). Warm-up (compilation, tuning, repacks) runs before capture and is reported apart, as load/repack time.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from qrecover import kernels
from qrecover.kernels import int4pack, layer_format
from qrecover.kernels.timing import cold_ms, l2_bytes, n_copies  # noqa: F401  (re-exported: the benchmarks' names)
from qrecover.packing import unpack


def timed_once(fn: Callable[[], object], device: str) -> tuple[object, float]:
    """``(fn(), seconds)`` of a one-time cost such as a repack: wall time synchronised on CUDA, this process's CPU
    time on the CPU (a shared machine's load does not count)."""
    if device == "cuda":
        torch.cuda.synchronize()
    clock = time.perf_counter if device == "cuda" else time.process_time
    t0 = clock()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return out, clock() - t0


def repack_costs(layer, device: str) -> dict:
    """One-time costs at first use: the decode kernel's table repack and torch's int4 repack (where it applies)."""
    fmt = layer_format(layer)
    tensors, s = timed_once(lambda: kernels.kernel_tensors(layer, fmt), device)
    extra = {id(t): t for k, t in tensors.items() if k.startswith("lut_kernel_") and t is not tensors.get("lut")}  # every layout kept
    row = {"packed_MB": layer.nbytes / 1e6, "repack_ms": s * 1e3,
           "repack_MB": sum(t.numel() * t.element_size() for t in extra.values()) / 1e6}
    if fmt.scheme == 0 and fmt.bits in (2, 3):  # nibble codes: kept only where the tuner picks them (a second copy)
        from qrecover.kernels import gemv, qmatmul
        codes, s = timed_once(lambda: gemv.nibble_codes(fmt, qmatmul.code_words(layer.qdata)), device)
        row.update(nibble_repack_ms=s * 1e3, nibble_MB=codes.nbytes / 1e6)
    if int4pack.supported(fmt):
        try:
            w, s = timed_once(lambda: int4pack.repack(layer, fmt, torch.bfloat16), device)
            row.update(int4_repack_ms=s * 1e3, int4_MB=w.nbytes / 1e6)
        except RuntimeError as e:
            row["int4_error"] = str(e)[:120]
    return row


def int4_call(layer, x: torch.Tensor) -> Callable[[], torch.Tensor] | str:
    """A zero-argument call of torch's int4 matmul on ``layer`` (repacked here), or why there is none.
    CUDA builds may take only bf16: fp16 activations are tried first, then bf16 (the row says which)."""
    fmt = layer_format(layer)
    if not int4pack.supported(fmt):
        return "not a blockwise 4-bit layout torch's int4 kernels take"
    errors = []
    for dtype in (x.dtype, torch.bfloat16):
        try:
            w = int4pack.repack(layer, fmt, dtype)
            xd = x.to(dtype)
            int4pack.linear(w, xd)
            return lambda: int4pack.linear(w, xd)
        except RuntimeError as e:
            errors.append(f"{dtype}: {str(e)[:80]}")
    return "; ".join(errors)


def gemlite_call(layer, x: torch.Tensor) -> Callable[[], torch.Tensor] | str:
    """gemlite's ``GemLiteLinear`` on the layer's codes (blockwise 4-bit: ``w = (code - z) * s``), or why there is none."""
    try:
        from gemlite.core import DType, GemLiteLinear  # optional: only where gemlite is installed
    except ImportError:
        return "gemlite not installed (pip install gemlite)"
    fmt = layer_format(layer)
    if not int4pack.supported(fmt):
        return "not a blockwise 4-bit layout"
    n, k = fmt.out_f, fmt.in_f
    codes = unpack(layer.qdata, 4, n * k).view(n, k).to(torch.uint8)
    scale = layer.scale.to(x.dtype)
    zeros = (unpack(layer.zero_point, 4, scale.numel()).view(scale.shape).to(x.dtype) if fmt.has_zp
             else torch.full_like(scale, 8))
    try:
        gl = GemLiteLinear(4, group_size=fmt.cblock, in_features=k, out_features=n, input_dtype=DType.FP16,
                           output_dtype=DType.FP16)
        gl.pack(codes, scale, zeros, None)
        gl(x)
    except Exception as e:  # noqa: BLE001 (a third-party API of changing shape: report, don't stop the run)
        return f"gemlite failed: {type(e).__name__}: {str(e)[:80]}"
    return lambda: gl(x)

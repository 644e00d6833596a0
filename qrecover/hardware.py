"""What this machine has: what its device computes natively, how much memory is free (a leaf: no qrecover imports)."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator

import torch


def native_bf16() -> bool:
    """Whether this process's device computes bf16 matmuls natively: a CUDA GPU with bf16, or a CPU with
    AVX512-BF16 or AMX (oneDNN's check). There bf16 autocast is about 2x faster than fp32 (measured on this
    repo's 2-core AMD EPYC: a 4 x 512 forward of the default model in 2.4 s instead of 5.4 s; one decoder layer's
    forward and backward on 512 tokens in 0.08-0.10 s instead of 0.16-0.18 s); on an Intel Xeon with AMX a bf16
    matmul of the default model's shapes is 4-10x float32's (docs/compress.md, "bf16 matmuls in the statistics passes")."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(torch.backends.mkldnn.is_available() and check is not None and check())


def wants_bf16(precision: str) -> bool:
    """A ``--*-precision`` option's answer here: 'bf16', or 'auto' where :func:`native_bf16` holds."""
    return precision == "bf16" or (precision == "auto" and native_bf16())


@functools.cache
def cpu_rounds_bf16_inputs() -> bool:
    """Whether this CPU's float32 matmuls take :func:`cpu_matmul_inputs`'s 'bf16' (oneDNN rounds their inputs to bf16).
    An Intel Xeon with AMX does; the 2-core AMD EPYC with AVX512-BF16 of 2026-11-29's eighth session (torch 2.13) does
    not: the setting leaves its products exact. Probed once: a 16 x 64 x 16 product whose inputs bf16 cannot hold,
    compared with the exact one."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(16, 64, generator=g), torch.randn(64, 16, generator=g)
    with cpu_matmul_inputs("bf16"):
        got = (a @ b).double()
    return bool((got - a.double() @ b.double()).abs().max() > 1e-3)


def bf16_matmul_inputs(precision: str) -> bool:
    """A ``--finalize-precision`` answer on the CPU: :func:`wants_bf16` and the CPU takes it
    (:func:`cpu_rounds_bf16_inputs`), so that what is recorded is what ran."""
    return wants_bf16(precision) and cpu_rounds_bf16_inputs()


@contextlib.contextmanager
def cpu_matmul_inputs(kind: str) -> Iterator[None]:
    """While active, the CPU's float32 matmuls (oneDNN: ``torch.mm``, ``F.linear``, ``@``) round their inputs to
    bf16 (``kind`` 'bf16': products and sums stay float32) or keep them float32 (``kind`` 'fp32'); the setting before
    is put back on exit. It changes no GPU matmul. Where the CPU has AMX this is 2-4x faster than float32 for the
    default model's shapes (docs/compress.md, "bf16 matmuls in finalize"); some CPUs ignore 'bf16'
    (:func:`cpu_rounds_bf16_inputs`)."""
    if kind not in ("bf16", "fp32"):
        raise ValueError(f"cpu_matmul_inputs: kind {kind!r} must be 'bf16' or 'fp32'")
    knob = torch.backends.mkldnn.matmul
    before = knob.fp32_precision
    knob.fp32_precision = "bf16" if kind == "bf16" else "ieee"
    try:
        yield
    finally:
        knob.fp32_precision = before


def available_memory() -> int:
    """Bytes of memory available to this process now: Linux's ``MemAvailable`` (free plus reclaimable page cache),
    else free pages (``sysconf``); 0 where neither can be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0

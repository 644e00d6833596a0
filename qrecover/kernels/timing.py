"""L2-cold GPU timing: every call reads another copy of its weights, many calls are captured in one CUDA graph.

What a layer's kernel meets in a model is weights streamed from memory, one layer after another, with no launch
gaps (a decode step is replayed as a CUDA graph). Timing one call over and over on the same weights instead keeps
them in the 50 MB L2 of an H100, and ``triton.testing.do_bench``'s way to empty L2 (a 256 MB memset before each
call) leaves it full of dirty lines: on an H100 both ranked the decode kernel's configurations differently from
L2-cold replays (the tuner kept a palettize-3 configuration 2.4x slower than the best, `docs/kernels.md`). The
tuner (:mod:`.qmatmul`) and ``benchmarks/kernels.py`` use this module, so that they measure the same thing.
"""

from __future__ import annotations

import statistics
from typing import Callable

import torch


def l2_bytes(device: torch.device | int | None = None) -> int:
    """The GPU's L2 cache size (50 MB on an H100); 50 MB when unknown."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device() if device is None else device)
    return int(getattr(props, "L2_cache_size", 50 << 20) or (50 << 20))


def n_copies(bytes_per_copy: int, l2: int, factor: int = 3, cap: int = 64) -> int:
    """Weight copies to rotate so that one round reads more than ``factor`` x the L2 cache (at least 2)."""
    return max(2, min(cap, -(-factor * l2 // max(bytes_per_copy, 1))))


def cold_ms(calls: list[Callable[[], object]], min_calls: int = 200, replays: int = 5) -> float:
    """Milliseconds per call of ``calls`` (one per weight copy) run round-robin inside one CUDA graph, the median
    of ``replays`` replays. Each call runs once first, outside the graph (compilation, tuning, allocation)."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    rounds = max(1, -(-min_calls // len(calls)))
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(rounds):
                for c in calls:
                    c()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / (rounds * len(calls)))
    del graph
    return statistics.median(times)


def tensor_copies(tensors: dict[str, torch.Tensor], l2: int, max_fraction_free: float = 0.25) -> list[dict] | None:
    """``tensors`` (a layer's kernel buffers) and copies of them, enough that one round reads 2x L2; None when the
    copies would take more than ``max_fraction_free`` of the device's free memory (time warm instead)."""
    uniq = {id(t): t for t in tensors.values()}
    nbytes = sum(t.numel() * t.element_size() for t in uniq.values())
    n = n_copies(nbytes, l2, factor=2, cap=16)
    device = next(iter(uniq.values())).device
    free, _ = torch.cuda.mem_get_info(device)
    if nbytes * (n - 1) > max_fraction_free * free:
        return None
    out = [tensors]
    for _ in range(n - 1):
        clones = {i: t.clone() for i, t in uniq.items()}
        out.append({k: clones[id(t)] for k, t in tensors.items()})
    return out

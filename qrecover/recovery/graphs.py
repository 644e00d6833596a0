"""The distillation teacher's forward replayed as a CUDA graph: no host time for the frozen half of a step.

The teacher runs the same forward at every micro-batch: no gradient, one shape (``batch x seq_len``, packed
windows), weights that never change. An H100 profile of a recovery step (docs/training-speed.md) spent about as
much host time as GPU time, and on the CPU the teacher's forward is 14% of a step's host time at the 1B's 16 layers
(``benchmarks/train_speed.py``'s tiny build, one thread). Captured once per input shape, its replay costs one
launch. The same kernels run on the same inputs, so the hidden states are those of the eager forward.

How (torch's documented recipe; ``torch.cuda.graph``):

- The first :data:`WARMUP_CALLS` call per shape runs eagerly (Triton's compilation, cuBLAS's workspaces and the
  allocator settle there), then at the next, within the trainer's warm-up steps, one more eager call on a side stream, then the
  capture into the graph's own memory pool, with autocast's weight cache off (a cached cast would belong to the
  pool). Later calls copy their ids into the captured input and replay.
- The returned hidden states live in the graph's pool and are overwritten by the next replay: the trainer uses them
  within the micro-batch (its loss, and a backward that finishes before the next micro-batch's teacher call).
- Anything a capture cannot hold (a host synchronisation, a CPU tensor, an op that allocates outside the pool)
  raises during capture: the teacher then runs eagerly for the rest of the run, with one warning naming the error.
- Memory: the graph keeps the forward's transient tensors in its own pool for the whole run, which the student's
  steps cannot reuse: about one decoder layer's working set (at the 1B geometry and 4 x 2048 tokens, three
  8,192-wide MLP activations of 128 MB each, by arithmetic), on top of the eager peak.
- At most :data:`MAX_SHAPES` shapes are captured (a run has one, two with a shorter last batch); others run eagerly.
- Not with forward hooks on the teacher (``--hidden-weight`` reads every layer's output: hooks run at capture only),
  nor with ``--compile-layers``; the trainer leaves the teacher eager there.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import Counter
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

# eager calls per shape before the capture: 1, so that the capture (it synchronises and empties torch's allocator
# cache) falls in the trainer's 2 warm-up steps, timed apart, and not in the steady state
WARMUP_CALLS = 1
MAX_SHAPES = 2
DEVICE_TYPE = "cuda"  # inputs on this device type are captured (tests replace it and ``cuda`` with stand-ins)
cuda = torch.cuda


class GraphedForward:
    """``fn(ids) -> tensor`` replayed as a CUDA graph per ``ids`` shape on CUDA (eager elsewhere; see the module)."""

    def __init__(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.fn = fn
        self.calls: Counter = Counter()
        self.graphs: dict = {}
        self.failed: str | None = None
        self.replays = 0

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.device.type != DEVICE_TYPE or self.failed is not None:
            return self.fn(ids)
        autocast = torch.is_autocast_enabled(ids.device.type)
        key = (tuple(ids.shape), ids.dtype, ids.device, autocast, torch.get_autocast_dtype(ids.device.type) if autocast else None)
        found = self.graphs.get(key)
        if found is None:
            self.calls[key] += 1
            if self.calls[key] <= WARMUP_CALLS or len(self.graphs) >= MAX_SHAPES:
                return self.fn(ids)
            with cuda.device(ids.device):  # the teacher may have a GPU of its own (--teacher-device)
                found = self._capture(key, ids)
            if found is None:
                return self.fn(ids)
        static_ids, out, graph = found
        with cuda.device(ids.device):
            static_ids.copy_(ids)
            graph.replay()
        self.replays += 1
        return out

    def _capture(self, key: tuple, ids: torch.Tensor):
        *_, autocast, low = key  # autocast's state and dtype at this call, as __call__ keyed them
        try:
            static_ids = ids.clone()
            current = cuda.current_stream(ids.device)
            side = cuda.Stream(device=ids.device)
            side.wait_stream(current)
            with cuda.stream(side):  # torch's rule: one call on a side stream before capturing
                self.fn(static_ids)
            current.wait_stream(side)
            graph = cuda.CUDAGraph()
            cast = (torch.autocast(ids.device.type, dtype=low, cache_enabled=False) if autocast
                    else contextlib.nullcontext())
            # thread_local: another thread's CUDA calls (a loader pinning memory) do not invalidate the capture
            with cuda.graph(graph, capture_error_mode="thread_local"), cast:
                out = self.fn(static_ids)
        except Exception as e:  # noqa: BLE001 — any capture failure: eager from here on, said once
            self.failed = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            self.graphs.clear()
            warnings.warn(f"qrecover: the teacher's forward could not be captured as a CUDA graph ({self.failed}); it "
                          "runs eagerly for the rest of this run (--no-teacher-graph chooses that from the start)",
                          stacklevel=4)
            return None
        self.graphs[key] = (static_ids, out, graph)
        return self.graphs[key]


_GRAPHED: dict[int, GraphedForward] = {}


@contextlib.contextmanager
def teacher_graph(teacher: nn.Module | None, fn: Callable[[nn.Module, torch.Tensor], torch.Tensor],
                  enable: bool = True) -> Iterator[GraphedForward | None]:
    """While active, :func:`graphed` gives ``teacher``'s ``fn(teacher, ids)`` as a :class:`GraphedForward`; the
    graphs and their memory are released on exit. Yields it (None when ``enable`` is false or there is no teacher)."""
    if teacher is None or not enable:
        yield None
        return
    g = GraphedForward(lambda ids: fn(teacher, ids))
    _GRAPHED[id(teacher)] = g
    try:
        yield g
    finally:
        if _GRAPHED.get(id(teacher)) is g:
            del _GRAPHED[id(teacher)]
        g.graphs.clear()


def graphed(teacher: nn.Module) -> GraphedForward | None:
    """The active :class:`GraphedForward` of ``teacher`` (see :func:`teacher_graph`), or None."""
    return _GRAPHED.get(id(teacher))

"""Compression on several processes (``torchrun --nproc_per_node N -m qrecover.cli compress ...``), with the bytes
of one process.

What is split: the calibration windows (each process runs its contiguous share, :meth:`World.span`) and the
candidate quantization (each process quantizes a share of the (unit, encoding group) jobs, claiming the next one
whenever it is free, :meth:`World.take`; the results are gathered on every process). What is reduced: every statistic summed over windows (Hessians,
input second moments, output-gradient moments, the embedding's Fisher, the calibration loss), by
:class:`OrderedSum`: the float64 additions happen in window order, exactly as one process does them, so the sums
are the same bits on any number of processes (a tree or ring all-reduce would add in another order, and float
addition is not associative). Only rank 0 writes the checkpoint.

The process group is joined from torchrun's (or ``accelerate launch``'s) environment: gloo for CPU tensors and,
when CUDA is present, NCCL for CUDA tensors, each process on ``cuda:LOCAL_RANK``.
"""

from __future__ import annotations

import itertools
import os
import signal
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

from .errors import QRecoverError


@dataclass(frozen=True)
class World:
    """This process's place among ``size`` processes (``size`` 1: no process group, every method a no-op)."""

    rank: int = 0
    size: int = 1

    def span(self, n: int) -> slice:
        """The contiguous share of ``n`` windows this process runs: ``n // size`` each, the first ``n % size``
        processes one more. Rank 0 holds window 0."""
        base, extra = divmod(n, self.size)
        start = self.rank * base + min(self.rank, extra)
        return slice(start, start + base + (self.rank < extra))

    def share(self, costs: list[float]) -> list[int]:
        """Indices of the jobs (with these costs) this process runs: the costliest first, each to the least
        loaded process (ties to the lower rank); the same assignment on every process."""
        if self.size == 1:
            return list(range(len(costs)))
        load = [0.0] * self.size
        mine = []
        for j in sorted(range(len(costs)), key=lambda j: (-costs[j], j)):
            r = min(range(self.size), key=lambda r: (load[r], r))
            load[r] += costs[j]
            if r == self.rank:
                mine.append(j)
        return sorted(mine)

    def take(self, costs: list[float]) -> Iterator[int]:
        """The jobs (with these estimated costs) this process runs, claimed one at a time as it becomes free, the
        costliest first: each process takes the next unclaimed job from a counter in the launch's key-value store
        (one round trip per job), so a process whose jobs ran faster than their estimate takes more. Each job goes
        to exactly one process, which one depends on timing: use it where a job's result does not depend on the
        process that runs it (results gathered afterwards). Every process must call it in the same sequence. One
        process: every job, in index order. Without a store: :meth:`share`'s static assignment."""
        if self.size == 1:
            yield from range(len(costs))
            return
        store = _store()
        if store is None:
            yield from self.share(costs)
            return
        order = sorted(range(len(costs)), key=lambda j: (-costs[j], j))
        key = f"qrecover/take/{next(_TAKES)}"
        while (i := store.add(key, 1) - 1) < len(order):
            yield order[i]

    def gather(self, obj: Any) -> list[Any]:
        """Every process's ``obj`` (picklable), in rank order."""
        if self.size == 1:
            return [obj]
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, obj)
        return out

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``src``'s ``obj`` on every process."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src)
        return box[0]

    def all_true(self, flag: bool) -> bool:
        return all(self.gather(bool(flag)))

    def total(self, n: int) -> int:
        """The integer ``n`` summed over the processes."""
        return sum(self.gather(int(n)))

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier()


SINGLE = World()
_TAKES = itertools.count()  # one counter key per World.take call (every process calls it in the same sequence)


def _store():
    """The default process group's key-value store (torchrun's rendezvous store), or None."""
    try:
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def world() -> World:
    """The current process group's view, or :data:`SINGLE` when there is none."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return SINGLE


def launched() -> bool:
    """Started by torchrun or ``accelerate launch`` with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def join() -> World:
    """Join the launch's process group (once; none when not launched with several processes). Each process uses
    ``cuda:LOCAL_RANK`` when CUDA is present; a termination signal (torchrun stops the others when one fails)
    raises SystemExit, so that a half-written temporary checkpoint is removed on the way out."""
    if not launched() or (dist.is_available() and dist.is_initialized()):
        return world()
    if not dist.is_available():
        raise QRecoverError("this torch build has no torch.distributed; run compress as one process (without torchrun)")
    backend = "cpu:gloo"
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        backend = "cpu:gloo,cuda:nccl"
    dist.init_process_group(backend)
    signal.signal(signal.SIGTERM, _exit_on_term)
    return world()


def _exit_on_term(signum, _frame) -> None:
    raise SystemExit(128 + signum)


def local_device(device: torch.device) -> torch.device:
    """``device`` for this process: a bare ``cuda`` means ``cuda:LOCAL_RANK`` under a launch."""
    if device.type == "cuda" and device.index is None and launched():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


class OrderedSum:
    """Sums over calibration windows keyed by name, the same bits on any number of processes.

    ``add(key, value)``: ``acc[key] = acc[key] + value`` (the first value is taken as is); ``index_add(key, shape,
    ids, rows)``: ``acc[key].index_add_(0, ids, rows)`` into a float64 zero buffer of ``shape``. Call them window by
    window in window order. Rank 0 (or a single process) applies them at once; a later rank records them until
    :meth:`reduce`, which hands the running sums from rank to rank (rank r applies its records onto rank r-1's
    sums: one process's order of additions) and broadcasts the last rank's sums. Memory: a later rank holds each of
    its windows' contributions until then.
    """

    def __init__(self, group: World = SINGLE):
        self.world = group
        self.acc: dict[str, torch.Tensor] = {}
        self._log: list[tuple] = []

    def add(self, key: str, value: torch.Tensor) -> None:
        self._do(("add", key, value))

    def index_add(self, key: str, shape: tuple[int, ...], ids: torch.Tensor, rows: torch.Tensor) -> None:
        self._do(("index_add", key, (tuple(shape), ids, rows)))

    def _do(self, op: tuple) -> None:
        if self.world.rank == 0:
            _apply(self.acc, op)
        else:
            self._log.append(op)

    def reduce(self) -> dict[str, torch.Tensor]:
        """The sums over every process's windows (on every process)."""
        w = self.world
        if w.size == 1:
            return self.acc
        if w.rank > 0:
            self.acc = _recv(w.rank - 1)
            for op in self._log:
                _apply(self.acc, op)
            self._log = []
        if w.rank < w.size - 1:
            _send(self.acc, w.rank + 1)
        self.acc = _broadcast(self.acc if w.rank == w.size - 1 else None, w.size - 1)
        return self.acc


def _apply(acc: dict[str, torch.Tensor], op: tuple) -> None:
    kind, key, arg = op
    if kind == "add":
        acc[key] = acc[key] + arg if key in acc else arg
    else:
        shape, ids, rows = arg
        if key not in acc:
            acc[key] = torch.zeros(shape, dtype=torch.float64, device=rows.device)
        acc[key].index_add_(0, ids.to(rows.device), rows)


def _meta(acc: dict[str, torch.Tensor]) -> list[tuple[str, tuple[int, ...], torch.dtype, str]]:
    return [(k, tuple(t.shape), t.dtype, t.device.type) for k, t in acc.items()]


def _empty(meta) -> dict[str, torch.Tensor]:
    dev = {"cpu": torch.device("cpu"), "cuda": torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None}
    return {k: torch.empty(shape, dtype=dtype, device=dev[kind]) for k, shape, dtype, kind in meta}


def _send(acc: dict[str, torch.Tensor], dst: int) -> None:
    dist.send_object_list([_meta(acc)], dst=dst)
    for t in acc.values():
        dist.send(t.contiguous(), dst=dst)


def _recv(src: int) -> dict[str, torch.Tensor]:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src)
    out = _empty(box[0])
    for t in out.values():
        dist.recv(t, src=src)
    return out


def _broadcast(acc: dict[str, torch.Tensor] | None, src: int) -> dict[str, torch.Tensor]:
    box: list[Any] = [_meta(acc) if acc is not None else None]
    dist.broadcast_object_list(box, src=src)
    out = {k: t.contiguous() for k, t in acc.items()} if acc is not None else _empty(box[0])
    for t in out.values():
        dist.broadcast(t, src=src)
    return out

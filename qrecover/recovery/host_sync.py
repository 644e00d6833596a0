"""Count what a piece of training code asks of the host: reads of device values (host synchronisations) and
operator dispatches (kernel launches on a GPU), on any device, the CPU included.

A GPU runs ahead of Python only while Python never waits for it: ``loss.item()``, ``float(t)``, ``if t:``,
``t.tolist()``, ``t.cpu()``, ``torch.cuda.synchronize()`` and data-dependent shapes (``t[mask]``, ``nonzero``,
``masked_select``, ``unique``) all stop the host until the device has caught up. :class:`HostSyncCounter` counts
them two ways, so that a CPU test sees what a GPU run would wait on:

* Python: the tensor methods and torch functions that read a value back are wrapped while the counter is active
  (each call counted by name);
* dispatcher: a :class:`~torch.utils._python_dispatch.TorchDispatchMode` sees every ATen operator the code runs,
  counting the ones that read a value (``aten._local_scalar_dense``, what ``item``/``float``/``bool`` call) or
  produce a data-dependent shape (``aten.nonzero``, ``aten.masked_select``, boolean-mask indexing, ...), and
  every operator in all (``dispatches``: on a GPU, about one kernel launch each).

Usage::

    with HostSyncCounter() as c:
        run_one_step()
    assert c.syncs == 0, c.by_name
"""

from __future__ import annotations

import collections
import functools
import traceback
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: ATen operators that read a device value back to the host or whose output shape depends on the data
SYNC_OPS = ("_local_scalar_dense", "nonzero", "nonzero_static", "masked_select", "unique", "_unique", "_unique2",
            "unique_consecutive", "unique_dim", "is_nonzero", "equal", "item", "repeat_interleave")

#: Python entry points that read a device value (tensor methods, then functions of the torch module)
SYNC_METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "nonzero",
                "masked_select")
SYNC_FUNCTIONS = (("torch", "nonzero"), ("torch", "masked_select"), ("torch.cuda", "synchronize"))


class _Dispatches(TorchDispatchMode):
    def __init__(self, counter: "HostSyncCounter"):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.counter.dispatches += 1
        self.counter.ops[name] += 1
        if name in SYNC_OPS or (name == "index" and _has_bool_index(args)):
            self.counter._hit(f"aten.{name}")
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.counter.out_bytes[name] += t.numel() * t.element_size()
        return out


def _has_bool_index(args: tuple) -> bool:
    """``aten.index(x, indices)`` with a boolean mask among the indices: a data-dependent output shape."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())


class HostSyncCounter:
    """Count host synchronisations (``syncs``, by name in ``by_name``) and ATen dispatches (``dispatches``; by
    operator in ``ops``, with the bytes of their outputs in ``out_bytes``: a step's copies and casts show there) while
    active. Nested Python reads inside a counted one (``float(t)`` calling ``item``) count once per dispatcher read
    plus once per outermost Python call; any non-zero ``syncs`` means the code waits on the device."""

    def __init__(self) -> None:
        self.by_name: collections.Counter[str] = collections.Counter()
        self.sites: collections.Counter[str] = collections.Counter()  # "file:line" of the Python call that read
        self.dispatches = 0
        self.ops: collections.Counter[str] = collections.Counter()  # dispatches by ATen operator
        self.out_bytes: collections.Counter[str] = collections.Counter()  # bytes of their outputs (views count too)
        self._saved: list[tuple[Any, str, Any]] = []
        self._mode: _Dispatches | None = None
        self._depth = 0

    @property
    def syncs(self) -> int:
        return sum(self.by_name.values())

    def _hit(self, name: str) -> None:
        self.by_name[name] += 1
        frames = [f for f in traceback.extract_stack()[:-2] if "host_sync" not in f.filename and "/torch/" not in f.filename]
        if frames:
            self.sites[f"{frames[-1].filename}:{frames[-1].lineno}"] += 1

    def _wrap(self, owner: Any, attr: str, label: str) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            return
        counter = self

        @functools.wraps(original)
        def counted(*args, **kwargs):
            if counter._depth == 0:
                counter._hit(label)
            counter._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                counter._depth -= 1

        self._saved.append((owner, attr, original))
        setattr(owner, attr, counted)

    def __enter__(self) -> "HostSyncCounter":
        for m in SYNC_METHODS:
            self._wrap(torch.Tensor, m, f"Tensor.{m}")
        for mod_name, fn in SYNC_FUNCTIONS:
            mod = torch.cuda if mod_name == "torch.cuda" else torch
            self._wrap(mod, fn, f"{mod_name}.{fn}")
        self._mode = _Dispatches(self)
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._mode is not None
        self._mode.__exit__(*exc)
        for owner, attr, original in reversed(self._saved):
            setattr(owner, attr, original)
        self._saved.clear()

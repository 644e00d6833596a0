"""Calibration: the statistics quantizers and the sensitivity estimate need, from real text.

Two passes over the calibration windows:

1. :func:`qrecover.grad_pass.gradient_stats`: forward + backward of the unquantized model, one window at a time,
   accumulating small per-layer vectors only: output-gradient second moments of every linear layer,
   the logit-gradient moments and final-hidden-state second moments of the output matrix, and the
   embedding's per-(token, dim) Fisher. Memory: the model, its gradients' activations for one window.
2. :func:`layer_stats`, called layer by layer by the compress stages (:mod:`qrecover.stages`): the
   decoder layer's inputs (:func:`capture_inputs`) are replayed through it with hooks that accumulate
   the statistics the quantizers ask for (``E[x x^T]`` once per distinct input, ``E[x**2]``); the
   layer's outputs become the next layer's inputs. Only one decoder layer's statistics exist at a time.

The ``calibrate`` stage of compression (:mod:`qrecover.stages`) is here too: :func:`plan_stats` decides which
statistics to compute, only those asked for: the union of the chosen quantizers' ``needs`` (read on
instances: ``get_quantizer(...).needs``), plus what the damage estimate needs when there is something to
allocate (``hessian`` and the output-gradient moments, :mod:`qrecover.sensitivity`). The backward pass runs
only when some quantizer needs ``out_grad_sq``, the embedding's candidates need its Fisher (``element_sq``), or
damage must be estimated; the Hessian only when a quantizer or the damage estimate needs it.
:func:`layer_pass` walks the decoder layers one at a time on the compute device, handing each layer's
statistics to a callback.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from .distributed import SINGLE, OrderedSum, World
from .grad_pass import Stop as _Stop
from .grad_pass import gradient_stats, to_device
from .hardware import wants_bf16
from .models import decoder_layers, linear_layers, module_name, resident
from .moe import expert_key
from .progress import progress


def capture_inputs(model: nn.Module, windows: torch.Tensor, device: torch.device | str = "cpu", layer: int = 0
                   ) -> tuple[list[torch.Tensor], list[dict]]:
    """Decoder layer ``layer``'s inputs for every window: ``(hidden states [(1, seq, hidden)], kwargs)``,
    moved to ``device``. Runs the model (on its own device) only up to that layer."""
    layers = decoder_layers(model)
    captured: list[tuple[tuple, dict]] = []

    def catch(_m, args, kwargs):
        captured.append((args, dict(kwargs)))
        raise _Stop

    h = layers[layer].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with torch.no_grad():
            for w in windows:
                try:
                    model(input_ids=w.unsqueeze(0), use_cache=False)
                except _Stop:
                    pass
    finally:
        h.remove()
    hidden = [to_device(a[0] if a else kw.pop("hidden_states"), device) for a, kw in captured]
    return hidden, [to_device(kw, device) for _, kw in captured]


@torch.no_grad()
def forward_layer(layer: nn.Module, hidden: list[torch.Tensor], kwargs: list[dict]) -> list[torch.Tensor]:
    """``layer`` applied to every window's hidden states."""
    outs = []
    for x, kw in zip(hidden, kwargs):
        y = layer(x, **kw)
        outs.append(y[0] if isinstance(y, tuple) else y)
    return outs


#: on the CPU, x^T x is computed in tiles of about this many columns, the upper triangle only and mirrored
XTX_TILE = 256


def xtx(x: torch.Tensor, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``x (tokens, in)`` -> ``x^T x (in, in)`` computed in ``dtype``, returned in float64 (one Hessian
    contribution). On the CPU only the tiles on and above the diagonal are multiplied and the rest mirrored
    (torch has no symmetric rank-k product): 1.5-1.7x faster for 1536 columns on one thread, and each element is
    the same dot product over the same tokens, so the same bits as the full product with the CPU's BLAS
    (tests/test_calibrate_xtx.py checks it; the quick start's checkpoint keeps its sha256)."""
    x = x.to(dtype)
    n = x.shape[1]
    if x.device.type != "cpu" or n <= XTX_TILE * 3 // 2:
        return (x.T @ x).double()
    out = torch.empty(n, n, dtype=torch.float64)
    step = -(-n // -(-n // XTX_TILE))  # equal tiles of at most about XTX_TILE columns
    xt = x.T
    for i in range(0, n, step):
        for j in range(i, n, step):
            tile = (xt[i:i + step] @ x[:, j:j + step]).double()
            out[i:i + step, j:j + step] = tile
            if j != i:
                out[j:j + step, i:i + step] = tile.T
    return out


@torch.no_grad()
def input_moments(model: nn.Module, modules: dict[str, nn.Module], windows: torch.Tensor) -> dict[str, torch.Tensor]:
    """``{name: E[x x^T] (in, in)}``, float64 on the CPU, of the inputs of each of ``modules`` (modules inside
    ``model``) over every token of ``windows (n, seq_len)`` run through ``model`` as it is (one window at a time;
    for whole-model passes such as the adapters' svd init and the merge statistics)."""
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}

    def hook(name: str):
        def fn(_mod, inputs, _out):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
            sums[name] = sums.get(name, 0) + xtx(x)
            counts[name] = counts.get(name, 0) + x.shape[0]
        return fn

    device = next(model.parameters()).device
    handles = [m.register_forward_hook(hook(n)) for n, m in modules.items()]
    try:
        for w in windows:
            model(input_ids=w.unsqueeze(0).to(device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return {n: (sums[n] / counts[n]).cpu() for n in modules}


def linear_groups(layer: nn.Module, x: torch.Tensor, kw: dict, linears: dict[str, nn.Module]) -> list[list[str]]:
    """``linears`` grouped by the input tensor they are fed (q/k/v; gate/up), groups in the order the layer
    calls them, from one forward of one window ``x (1, seq, hidden)``."""
    groups: dict[int, tuple[torch.Tensor, list[str]]] = {}

    def hook(name: str):
        def fwd(_m, inp, _out):
            groups.setdefault(id(inp[0]), (inp[0], []))[1].append(name)
        return fwd

    hooks = [m.register_forward_hook(hook(n)) for n, m in linears.items()]
    try:
        with torch.no_grad():
            layer(x, **kw)
    finally:
        for h in hooks:
            h.remove()
    out: list[list[str]] = []
    by_block: dict[tuple[str, str], list[str]] = {}  # every expert's gate_up (down) reads the same stage's output
    for _, names in groups.values():
        plain = [n for n in names if expert_key(n) is None]
        if plain:
            out.append(plain)
        for n in names:
            key = expert_key(n)
            if key is not None:
                if key not in by_block:
                    by_block[key] = []
                    out.append(by_block[key])
                by_block[key].append(n)
    seen = {n for g in out for n in g}
    for n in linears:  # experts this window routed no token to: with their block's group, else alone at the end
        if n not in seen:
            key = expert_key(n)
            if key in by_block:
                by_block[key].append(n)
            else:
                out.append([n])
    return out


@torch.no_grad()
def layer_stats(layer: nn.Module, hidden: list[torch.Tensor], kwargs: list[dict], linears: dict[str, nn.Module],
                want: frozenset[str] | set[str], outputs: bool = True, hessian_dtype: torch.dtype = torch.float64,
                inputs: dict[str, list[torch.Tensor]] | None = None, group: World = SINGLE
                ) -> tuple[dict[str, dict[str, torch.Tensor]], list[torch.Tensor]]:
    """Replay ``hidden`` through ``layer``, accumulating input statistics of ``linears`` (full name -> module
    inside ``layer``); returns ``(stats, outputs)``.

    ``want`` (subset of ``{"hessian", "input_sq"}``) says what to compute; nothing else is. Linear layers fed
    the very same input tensor (q/k/v; gate/up) share ONE Hessian computation: their ``stats[n]["hessian"]``
    is the same tensor object. ``hessian (in, in)`` = mean of x x^T, ``input_sq (in,)`` = mean of x**2
    (the Hessian's diagonal when it is computed), both fp32 on the layer's device. ``outputs=False`` stops
    each window's forward once every linear of ``linears`` has been called, which then do not compute
    (:func:`_not_computed`), and returns no outputs.
    ``hessian_dtype``: the dtype of each window's ``x^T x`` (sums are float64 either way). ``inputs``: a dict
    that receives, per linear, the input tensor of each of its calls (in window order).

    ``group``: the processes of a launch, each replaying its own windows (``hidden``: this process's share); the
    statistics are reduced in window order (:class:`qrecover.distributed.OrderedSum`: one process's bits).
    """
    want = set(want) & {"hessian", "input_sq"}
    acc = OrderedSum(group)  # by owner: the first linear that saw an input tensor
    counts: dict[str, int] = {}
    owner_of: dict[str, str] = {}
    seen: dict[int, tuple[torch.Tensor, str]] = {}  # id of an input tensor (this window) -> (it, owner);
    # holding the tensor keeps its id from being reused by a later tensor of the same window
    fired: set[str] = set()

    def hook(name: str):
        def fwd(_m, inp, _out):
            x = inp[0]
            owner = seen.setdefault(id(x), (x, name))[1]
            owner_of[name] = owner
            fired.add(name)
            if inputs is not None:
                inputs.setdefault(name, []).append(x)
            if owner == name and want:
                x = x.reshape(-1, x.shape[-1])
                v = xtx(x, hessian_dtype) if "hessian" in want else x.double().square().sum(0)
                acc.add(owner, v)
                counts[owner] = counts.get(owner, 0) + x.shape[0]
            if not outputs and len(fired) == len(linears):
                raise _Stop
        return fwd

    hooks = [m.register_forward_hook(hook(n)) for n, m in linears.items()] if (want or not outputs or inputs is not None) else []
    outs = []
    try:
        with nullcontext() if outputs else _not_computed(linears.values()):
            for x, kw in zip(hidden, kwargs):
                seen.clear()
                fired.clear()
                try:
                    y = layer(x, **kw)
                except _Stop:
                    continue
                if outputs:
                    outs.append(y[0] if isinstance(y, tuple) else y)
    finally:
        for hk in hooks:
            hk.remove()
    sums = acc.reduce()
    if group.size > 1:  # a routed expert may run on some processes' windows only
        owner_of = {n: o for part in group.gather(owner_of) for n, o in part.items()}  # later windows win, as in one process
        counts = {o: sum(part.get(o, 0) for part in parts) for parts in [group.gather(counts)] for o in sums}
    per_owner: dict[str, dict[str, torch.Tensor]] = {}
    for owner, total in sums.items():
        mean = (total / counts[owner]).float()
        per_owner[owner] = {"hessian": mean, "input_sq": mean.diagonal().clone()} if "hessian" in want else {"input_sq": mean}
    stats = {n: dict(per_owner.get(owner_of.get(n, ""), {})) for n in linears}
    for n, m in linears.items():
        if n not in owner_of and want:  # never called (an expert no calibration token was routed to): neutral
            one = torch.ones(m.weight.shape[1], device=m.weight.device)  # statistics, i.e. plain rounding
            stats[n] = {"hessian": torch.diag(one), "input_sq": one} if "hessian" in want else {"input_sq": one}
    for st in stats.values():
        if "input_sq" not in want:
            st.pop("input_sq", None)
    return stats, outs


@contextmanager
def _not_computed(linears: Iterable[nn.Linear]) -> Iterator[None]:
    """While active, each of ``linears`` returns zeros of its output's shape instead of multiplying (its hooks still
    see its input): for a pass that only wants these linears' inputs and ends once every one has been called. Linears
    grouped by a shared input never read one another's outputs, so their inputs are the same bits either way; in
    finalize's quick start this skips about a third of its linear forwards (docs/compress.md)."""
    patched = []
    for m in linears:
        own = m.__dict__.get("forward")  # an instance-level forward (e.g. an offloading hook's) to restore
        m.forward = (lambda out: lambda x, *_a, **_k: x.new_zeros(*x.shape[:-1], out))(m.out_features)
        patched.append((m, own))
    try:
        yield
    finally:
        for m, own in patched:
            if own is None:
                del m.forward
            else:
                m.forward = own


# --- the calibrate stage: plan what to compute, then one decoder layer at a time -------------------------


@dataclass(frozen=True)
class StatsPlan:
    """``layer``: per-linear input statistics to collect (subset of {"hessian", "input_sq"});
    ``gradients``: whether the backward pass runs; ``damage``: whether damage is estimated."""

    layer: frozenset[str]
    gradients: bool
    damage: bool


def plan_stats(linear: Sequence[Any], embedding: Sequence[Any], damage: bool) -> StatsPlan:
    """What calibration must compute for these candidates (:class:`qrecover.stages.specs.Encoding`: what counts is
    ``.quantizer.needs``). ``damage``: estimate each candidate's damage (needed whenever there is a choice to make)."""
    needs: set[str] = set()
    for e in linear:
        needs |= set(e.quantizer.needs)
    emb_needs = set().union(*(set(e.quantizer.needs) for e in embedding)) if embedding else set()
    layer = {s for s in needs if s in ("hessian", "input_sq")} | ({"hessian"} if damage else set())
    gradients = damage or "out_grad_sq" in needs or bool(emb_needs)
    return StatsPlan(frozenset(layer), gradients, damage)


def gradients(model: nn.Module, windows: torch.Tensor, plan: StatsPlan, device, show_progress: bool,
              group: World = SINGLE, precision: str = "fp32") -> dict | None:
    """The backward pass's statistics (:func:`gradient_stats`), or None when not planned. ``precision``: 'fp32',
    'bf16' (autocast) or 'auto' (bf16 where the device computes it natively)."""
    if not plan.gradients:
        return None
    return gradient_stats(model, windows, show_progress, device, group=group, bf16=wants_bf16(precision))


def layer_pass(model: nn.Module, windows: torch.Tensor, want: frozenset[str],
               on_layer: Callable[[int, nn.Module, dict[str, dict[str, torch.Tensor]]], None],
               device, show_progress: bool, title: str = "calibrate + quantize: decoder layers", group: World = SINGLE) -> None:
    """For each decoder layer in turn: move it to ``device``, replay the calibration inputs through it
    collecting ``want``, call ``on_layer(index, layer, stats)`` (stats by the linear's full name), move it
    back to the CPU (a lazily loaded model's layer: drop its weights, :func:`qrecover.models.resident`); its
    outputs (unquantized weights) are the next layer's inputs. ``group``: each process replays its share of
    ``windows``, the statistics reduced to one process's bits (:mod:`qrecover.distributed`)."""
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    hidden, kwargs = capture_inputs(model, windows[group.span(len(windows))], device)
    with progress() as bar:
        task = bar.add_task(title, total=len(layers), visible=show_progress)
        for i, layer in enumerate(layers):
            with resident(model, layer, device):
                lins = linear_layers(layer, prefix=f"{prefix}.{i}.")
                # each window's x^T x in float32, summed in float64 (as finalize does): the candidates only rank the
                # encodings, finalize re-quantizes the chosen ones; same checkpoint bytes as float64 products on the
                # default model (quick and full menus), -19 s of the quick start's 2-core wall time (docs/compress.md)
                stats, hidden = layer_stats(layer, hidden, kwargs, lins, want, hessian_dtype=torch.float32, group=group)
                on_layer(i, layer, stats)
                del stats
            bar.advance(task)

"""Stage ``candidates``: quantize one unit (a linear layer, the embedding, an untied output matrix) at every
allowed encoding, with each result's estimated damage (:mod:`qrecover.sensitivity`).

:func:`prepare` runs the stages up to here (``transform`` -> ``calibrate`` -> ``candidates``) and returns a
:class:`Prepared`: the expensive part of compression, reusable for any budget, scope, allocation or
embedding width."""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..calibrate import gradients, layer_pass, plan_stats
from ..config import CompressConfig
from ..data.mix import calibration_windows
from ..distributed import SINGLE, World, join
from ..errors import QRecoverError
from ..models import count_parameters, decoder_layers, is_tied, linear_layers, load_model, module_name, state_tensors
from ..progress import progress
from ..schemes import QuantizedWeight
from ..sensitivity import linear_damage, lookup_damage
from ..transforms import get_transform
from .checks import check_linears, check_shapes, encodings_of, fits, resolve_device
from .specs import Encoding
from .transform import apply_transforms, transforms_of

DamageFn = Callable[[torch.Tensor], float]


def to_cpu(qw: QuantizedWeight) -> QuantizedWeight:
    return dataclasses.replace(qw, tensors={k: v.cpu() for k, v in qw.tensors.items()})


def stats_for(enc: Encoding, stats: dict[str, torch.Tensor], cache: dict) -> dict[str, torch.Tensor]:
    """``stats`` plus, for a quantizer that shares work across layers with the same inputs (GPTQ's and palettization's
    ``shared_factor``: the inverse Hessian's Cholesky factor for its damp and column order), that work as
    ``hessian_inv_chol``, computed once per (Hessian, ``factor_key``: damp and column order): q/k/v and gate/up share
    it, and so do every palettization candidate and GPTQ without act order (the same factor)."""
    key = _factor_key(enc, stats)
    if key is None:
        return stats
    if key not in cache:
        cache[key] = (stats["hessian"], enc.quantizer.shared_factor(stats["hessian"]).to(stats["hessian"].device))  # keeps H alive: ids stay unique
    return {**stats, "hessian_inv_chol": cache[key][1]}


def _factor_key(enc: Encoding, stats: dict[str, torch.Tensor]) -> tuple[int, str] | None:
    """The key of the shared factor ``enc`` uses with ``stats`` (the Hessian's identity and the quantizer's
    ``factor_key``), or None where it uses none."""
    q = enc.quantizer
    if not hasattr(q, "shared_factor") or "hessian" not in stats or "hessian" not in q.needs:
        return None
    return (id(stats["hessian"]), json.dumps(q.factor_key))


def share_factors(units: dict[str, "Job"], group: World, cache: dict) -> None:
    """Every shared factor the jobs of ``units`` use, each computed by one process and gathered into every
    process's ``cache`` (:func:`stats_for`'s): without this, each process computes the factors its own jobs need, and
    where the jobs reading one Hessian are split (q and k; the two palettization layouts of down_proj) each
    computes the same factor (a float64 Cholesky and triangular inverse, 0.2 s at 1536 columns). The same factors,
    bit for bit (the same function on the same Hessian). CPU statistics only: a GPU computes a factor in
    milliseconds, faster than it could be gathered (2 GB per Llama-8B layer, pickled, to every process)."""
    if group.size == 1:
        return
    needed: dict[tuple[int, str], tuple[torch.Tensor, Any]] = {}
    for _, encs, st, _ in units.values():  # every process walks the same units and encodings in the same order
        for e in encs:
            key = _factor_key(e, st)
            if key is not None and key not in cache:
                if st["hessian"].device.type != "cpu":
                    return
                needed.setdefault(key, (st["hessian"], e.quantizer))
    keys = list(needed)
    mine = {i: needed[keys[i]][1].shared_factor(needed[keys[i]][0]).cpu()
            for i in group.share([needed[k][0].shape[0] ** 3 for k in keys])}
    for part in group.gather(mine):
        for i, f in part.items():
            h = needed[keys[i]][0]
            cache[keys[i]] = (h, f.to(h.device))


def quantize_unit(weight: torch.Tensor, encodings: Sequence[Encoding], stats: dict[str, torch.Tensor],
                  damage_fn: DamageFn | None, cache: dict | None = None) -> list[tuple[QuantizedWeight, float | None]]:
    """``[(QuantizedWeight on the CPU, damage or None)]`` for every encoding of ``encodings``, in order.

    Encodings with the same scheme and parameters are quantized in one ``quantize_many`` call (shared work
    across widths). ``weight (out, in)`` and ``stats`` live on the compute device.
    """
    cache = {} if cache is None else cache
    by_key: dict[str, list[Encoding]] = {}
    for e in encodings:
        by_key.setdefault(e.key, []).append(e)
    done: dict[Encoding, QuantizedWeight] = {}
    for group in by_key.values():
        q = group[0].quantizer
        for e, qw in zip(group, q.quantize_many(weight, [e.bits for e in group], stats_for(group[0], stats, cache))):
            done[e] = qw
    w = weight.detach().float()
    out = []
    for e in encodings:
        qw = done[e]
        damage = None if damage_fn is None else max(damage_fn(w - qw.dequantize().to(w.device)), 0.0)
        out.append((to_cpu(qw), damage))
    return out


#: one unit's work for :func:`quantize_shared`: ``(weight (out, in), encodings, stats, damage fn or None)``
Job = tuple[torch.Tensor, Sequence[Encoding], dict[str, torch.Tensor], "DamageFn | None"]


def quantize_shared(units: dict[str, Job], group: World = SINGLE, cache: dict | None = None
                    ) -> dict[str, list[tuple[QuantizedWeight, float | None]]]:
    """:func:`quantize_unit` of every unit: ``{name: [(QuantizedWeight on the CPU, damage)] in encoding order}``.

    The jobs (a unit's encodings of one scheme and parameters, quantized together) are shared out among the
    processes of ``group`` (:meth:`qrecover.distributed.World.take`: the costliest first by weight size x widths,
    each process claiming the next job when it is free) and the results gathered on every process: the same results
    as one process, which runs every job.
    """
    cache = {} if cache is None else cache
    share_factors(units, group, cache)
    jobs = [(n, key) for n, (_, encs, _, _) in units.items() for key in dict.fromkeys(e.key for e in encs)]
    costs = [units[n][0].numel() * sum(e.key == key for e in units[n][1]) for n, key in jobs]
    done: dict[tuple[str, str], list] = {}
    for j in group.take(costs):  # claimed as each process becomes free: the same results whoever runs a job
        n, key = jobs[j]
        w, encs, st, fn = units[n]
        done[n, key] = quantize_unit(w, [e for e in encs if e.key == key], st, fn, cache)
    if group.size > 1:
        done = {k: v for part in group.gather(done) for k, v in part.items()}
    out: dict[str, list[tuple[QuantizedWeight, float | None]]] = {}
    for n, (_, encs, _, _) in units.items():
        taken = {key: iter(done[n, key]) for key in dict.fromkeys(e.key for e in encs)}
        out[n] = [next(taken[e.key]) for e in encs]
    return out


def embedding_stats(grads: dict | None, shape: tuple[int, int], tied: bool, device: torch.device | str
                    ) -> tuple[tuple[dict[str, torch.Tensor], DamageFn | None], tuple[dict[str, torch.Tensor], DamageFn | None]]:
    """``((stats, damage fn) of the embedding, (stats, damage fn) of an untied output matrix)`` from the gradient
    pass's statistics (:func:`qrecover.calibrate.gradient_stats`; None: no statistics, no damage).

    The embedding's ``element_sq`` (per-weight importance, for weighted look-up tables) and ``hessian`` (for GPTQ):
    an embedding row's lookup damage is ``dE diag(F) dE^T`` with ``F`` the per-dimension Fisher, every row alike
    (calibration sees a few thousand of the vocabulary's tokens, too few to estimate per-token frequencies: see
    :func:`qrecover.sensitivity.lookup_damage`). A tied matrix also serves the logits, row ``v`` adding
    ``g_v dE H dE^T`` (``H`` the final hidden state's second moments, ``g_v`` its logit's gradient moment): GPTQ's
    one Hessian for every row takes ``g_v`` at its mean, ``mean(g) H + diag(F)``; an untied embedding's is
    ``diag(F)`` (no input correlations: GPTQ then rounds to nearest). An untied output matrix is a linear layer.
    """
    if grads is None:
        return ({}, None), ({}, None)
    h, g = grads["head"]["hessian"].to(device), grads["head"]["out_grad_sq"].to(device)
    fisher_dim = grads["emb_fisher"].to(device).sum(0) / shape[0]  # (hidden,)
    fisher = fisher_dim.expand(shape)
    if tied:
        imp = fisher + g.unsqueeze(1) * h.diagonal().unsqueeze(0)
        emb = ({"element_sq": imp, "hessian": g.mean() * h + torch.diag(fisher_dim)},
               lambda dw: lookup_damage(dw, fisher) + linear_damage(dw, h, g))
    else:
        emb = ({"element_sq": fisher, "hessian": torch.diag(fisher_dim)}, lambda dw: lookup_damage(dw, fisher))
    return emb, ({"input_sq": h.diagonal(), "hessian": h}, lambda dw: linear_damage(dw, h, g))


# --- prepare: the stages up to candidates ---------------------------------------------------------------


@dataclass
class Unit:
    """One quantizable matrix: a linear layer, the embedding, or an untied output matrix.

    ``kind``: ``"linear"``, ``"embedding"`` or ``"head"``; ``cands``: the encodings it may take; ``results``: per
    candidate ``(QuantizedWeight, estimated damage or None)``, in ``cands`` order (empty while ``deferred``: a
    uniform model with finalize on, whose linears finalize quantizes itself; None once freed); ``tied``: the
    embedding also serves as the output matrix."""

    kind: str
    module: nn.Module
    cands: list[Encoding]
    results: list[tuple[QuantizedWeight, float | None]] | None = field(default_factory=list)
    tied: bool = False
    deferred: bool = False

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.module.weight.shape)

    def result(self, k: int) -> tuple[QuantizedWeight | None, float | None]:
        """Candidate ``k``'s ``(QuantizedWeight, damage)``; ``(None, None)`` for a deferred unit."""
        return (None, None) if self.deferred else self.results[k]

    def damages(self) -> dict[str, float | None]:
        """Each candidate's estimated damage by its label (None: not estimated, or deferred)."""
        return {c.label: self.result(k)[1] for k, c in enumerate(self.cands[: 1 if self.deferred else None])}


@dataclass
class Prepared:
    """The expensive part of compression, reusable for any budget, scope, allocation or embedding width:
    the loaded (and transformed) model, and every quantizable :class:`Unit` with its candidates."""

    cfg: CompressConfig
    model: nn.Module
    tokenizer: Any
    source: Any
    params: dict[str, int]
    units: dict[str, Unit]
    remainder: dict[str, torch.Tensor]
    head_name: str | None
    calibration: dict[str, Any]
    seconds: float
    windows: torch.Tensor | None = None
    grads: dict[str, Any] | None = None
    transforms: dict[str, Any] | None = None


def find_units(model: nn.Module, lin_encs: list[Encoding], emb_all: list[Encoding]) -> tuple[dict[str, Unit], str | None]:
    """Every quantizable matrix of ``model`` as a :class:`Unit` with the encodings that fit it, and the output
    matrix's name; refuses a model or menu that cannot be quantized (QRecoverError naming the shape)."""
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    linears = {f"{prefix}.{i}.{n}": m for i, l in enumerate(layers) for n, m in linear_layers(l).items()}
    check_linears(model, linears)
    emb, head, tied = model.get_input_embeddings(), model.get_output_embeddings(), is_tied(model)
    head_name = module_name(model, head) if head is not None else None
    check_shapes(lin_encs, {n: tuple(m.weight.shape) for n, m in linears.items()})
    emb_encs = [c for c in emb_all if fits(c, tuple(emb.weight.shape))]
    if not emb_encs:
        raise QRecoverError(f"no embedding encoding of {[e.label for e in emb_all]} fits shape {tuple(emb.weight.shape)}; "
                            "allow others with --embedding-encodings")
    for t in transforms_of(lin_encs + emb_encs):
        get_transform(t).check(model)
    units = {n: Unit("linear", m, [e for e in lin_encs if fits(e, tuple(m.weight.shape))]) for n, m in linears.items()}
    units[module_name(model, emb)] = Unit("embedding", emb, emb_encs, tied=tied)
    if head is not None and not tied:
        units[head_name] = Unit("head", head, emb_encs)
    return units, head_name


def prepare(cfg: CompressConfig, show_progress: bool = True, lazy: bool = True) -> Prepared:
    """Stages ``transform`` -> ``calibrate`` -> ``candidates`` (see :mod:`qrecover.stages`): load, transform,
    calibrate what the candidates need, and quantize every unit at every candidate encoding.

    ``lazy`` (the default): a safetensors model is loaded with one decoder layer in memory at a time (read
    from disk when a stage reaches it, :func:`qrecover.models.load_model`); the result is bit-identical to
    ``lazy=False``, which loads the whole model in fp32 first (as a GGUF source always is). A lazily loaded
    ``Prepared.model`` holds its decoder layers on the meta device: it cannot run as a whole."""
    t0 = time.time()
    lin_encs, emb_all = encodings_of(cfg)
    group = join()  # under torchrun: windows and candidates shared out, statistics reduced (qrecover.distributed)
    if cfg.calib_samples < group.size:
        raise QRecoverError(f"--calib-samples {cfg.calib_samples} is fewer than the {group.size} processes; give at least one window per process")
    n_grad = cfg.calib_samples if cfg.grad_samples is None else cfg.grad_samples
    if n_grad < group.size:
        raise QRecoverError(f"--grad-samples {n_grad} is fewer than the {group.size} processes; give at least one window per process")
    device = resolve_device(cfg.device)
    model, tok, source = load_model(cfg.model, lazy=lazy)
    lin_encs, emb_all = encodings_of(cfg, model)  # a GGUF source's architecture is known only now
    units, head_name = find_units(model, lin_encs, emb_all)
    linears = {n: u for n, u in units.items() if u.kind == "linear"}
    emb_unit = next(u for u in units.values() if u.kind == "embedding")
    windows = calibration_windows(tok, cfg.calib_data, cfg.calib_samples, cfg.seq_len, model=cfg.model, show_progress=show_progress)

    # stage transform (optional, model-level, function-preserving)
    tinfo = apply_transforms(model, windows, lin_encs + emb_unit.cands, device, show_progress)
    # stage calibrate: only what the candidates and the damage estimate need
    plan = plan_stats(lin_encs, emb_unit.cands, cfg.bpw is not None or any(len(u.cands) > 1 for u in units.values()))
    grads = gradients(model, windows[:n_grad], plan, device, show_progress, group, cfg.grad_precision)

    # stage candidates, layer by layer (one decoder layer's statistics at a time)
    def on_layer(_i: int, _layer: nn.Module, stats: dict) -> None:
        jobs = {}
        for name, st in stats.items():
            st = dict(st)
            if grads is not None:
                st["out_grad_sq"] = grads["out_grad_sq"][name].to(device)
            fn = (lambda dw, st=st: linear_damage(dw, st["hessian"], st["out_grad_sq"])) if plan.damage else None
            jobs[name] = (units[name].module.weight, units[name].cands, st, fn)
        for name, results in quantize_shared(jobs, group).items():
            units[name].results = results

    # A uniform model (one linear encoding, no budget) with finalize on: finalize re-quantizes every linear on
    # quantized inputs and nothing reads the candidates, so their pass is skipped (about half the time of a
    # uniform GPTQ compress); they stay deferred and such a Prepared serves only that config.
    if cfg.bpw is None and cfg.finalize and len(lin_encs) == 1:
        for u in linears.values():
            u.deferred = True
    else:
        layer_pass(model, windows, plan.layer, on_layer, device, show_progress, group=group)
    _quantize_embeddings(units, grads, plan.damage, device, show_progress, group)
    quantized = {f"{n}.weight" for n in units} | ({f"{head_name}.weight"} if emb_unit.tied else set())
    remainder = state_tensors(model, [k for k in model.state_dict() if k not in quantized])  # after the transform
    calibration = {"source": cfg.calib_data, "split": "calib", "windows": cfg.calib_samples, "seq_len": cfg.seq_len,
                   "tokens": int(windows.numel()), "gradient_windows": n_grad, "loss": grads["loss"] if grads is not None else None,
                   "computed": {"layer_stats": sorted(plan.layer), "gradients": plan.gradients, "damage": plan.damage},
                   "device": str(device)}
    params = {"model": count_parameters(model), "linear": sum(u.module.weight.numel() for u in linears.values())}
    return Prepared(cfg, model, tok, source, params, units, remainder, head_name, calibration, time.time() - t0,
                    windows=windows, grads=grads, transforms=tinfo)


def _quantize_embeddings(units: dict[str, Unit], grads: dict | None, damage: bool, device: torch.device, show_progress: bool,
                         group: World) -> None:
    """The embedding's (and an untied output matrix's) candidates, from the gradient pass's statistics."""
    emb = next(u for u in units.values() if u.kind == "embedding")
    head = next((u for u in units.values() if u.kind == "head"), None)
    with progress() as bar:
        task = bar.add_task("quantize: embedding", total=1, visible=show_progress)
        (emb_stats, fn), (head_stats, hfn) = embedding_stats(grads, emb.shape, emb.tied, device)
        names = {id(u): n for n, u in units.items()}
        jobs = {names[id(emb)]: (emb.module.weight.detach().to(device), emb.cands, emb_stats, fn if damage else None)}
        if head is not None:
            jobs[names[id(head)]] = (head.module.weight.detach().to(device), head.cands, head_stats, hfn if damage else None)
        for name, results in quantize_shared(jobs, group).items():
            units[name].results = results
        bar.advance(task)


_SAME = ("model", "calib_data", "calib_samples", "seq_len", "grad_samples")


def check_reusable(p: Prepared, cfg: CompressConfig, lin_encs: list[Encoding], emb_encs: list[Encoding]) -> list[Encoding]:
    """Refuse a :class:`Prepared` that cannot serve ``cfg`` (another model or calibration, candidates it lacks, a
    deferred one asked for a budget); return the embedding encodings of ``emb_encs`` that fit its embedding."""
    linears = [u for u in p.units.values() if u.kind == "linear"]
    have_lin = list(dict.fromkeys(e for u in linears for e in u.cands))
    lin_shapes = {u.shape for u in linears}
    want_lin = [e for e in lin_encs if any(fits(e, shape) for shape in lin_shapes)]  # a preset's misfits dropped
    emb_unit = next(u for u in p.units.values() if u.kind == "embedding")
    emb_want = [e for e in emb_encs if fits(e, emb_unit.shape)]
    if (any(getattr(cfg, k) != getattr(p.cfg, k) for k in _SAME) or any(e not in have_lin for e in want_lin)
            or any(e not in emb_unit.cands for e in emb_want)):
        raise QRecoverError(
            f"the prepared candidates were made with {({k: getattr(p.cfg, k) for k in _SAME})}, linear "
            f"{[e.label for e in have_lin]}, embedding {[e.label for e in emb_unit.cands]}; this config asks for "
            f"{({k: getattr(cfg, k) for k in _SAME})}, linear {[e.label for e in want_lin]}, embedding "
            f"{[e.label for e in emb_want]}: prepare again"
        )
    if any(u.deferred for u in p.units.values()) and (cfg.bpw is not None or not cfg.finalize):
        raise QRecoverError("the prepared model has no linear candidates (it was prepared for a uniform model with "
                            "finalize on, which quantizes them itself); prepare again with this config")
    if not emb_want:
        raise QRecoverError(f"no embedding encoding of {[e.label for e in emb_encs]} fits shape {emb_unit.shape}; "
                            "allow others with --embedding-encodings")
    return emb_want

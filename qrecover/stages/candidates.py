"""Stage ``candidates``: quantize one unit (a linear layer, the embedding, an untied output matrix) at every
allowed encoding, with each result's estimated damage (:mod:`qrecover.sensitivity`)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Sequence

import torch

from ..distributed import SINGLE, World
from ..schemes import QuantizedWeight
from ..sensitivity import linear_damage, lookup_damage
from .specs import Encoding

DamageFn = Callable[[torch.Tensor], float]


def to_cpu(qw: QuantizedWeight) -> QuantizedWeight:
    return dataclasses.replace(qw, tensors={k: v.cpu() for k, v in qw.tensors.items()})


def stats_for(enc: Encoding, stats: dict[str, torch.Tensor], cache: dict) -> dict[str, torch.Tensor]:
    """``stats`` plus, for a quantizer that shares work across layers with the same inputs (GPTQ's and palettization's
    ``shared_factor``: the inverse Hessian's Cholesky factor for its damp and column order), that work as
    ``hessian_inv_chol``, computed once per (Hessian, ``factor_key``: damp and column order): q/k/v and gate/up share
    it, and so do every palettization candidate and GPTQ without act order (the same factor)."""
    q = enc.quantizer
    if not hasattr(q, "shared_factor") or "hessian" not in stats or "hessian" not in q.needs:
        return stats
    key = (id(stats["hessian"]), json.dumps(q.factor_key))
    if key not in cache:
        cache[key] = (stats["hessian"], q.shared_factor(stats["hessian"]).to(stats["hessian"].device))  # keeps H alive: ids stay unique
    return {**stats, "hessian_inv_chol": cache[key][1]}


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
Unit = tuple[torch.Tensor, Sequence[Encoding], dict[str, torch.Tensor], "DamageFn | None"]


def quantize_shared(units: dict[str, Unit], group: World = SINGLE, cache: dict | None = None
                    ) -> dict[str, list[tuple[QuantizedWeight, float | None]]]:
    """:func:`quantize_unit` of every unit: ``{name: [(QuantizedWeight on the CPU, damage)] in encoding order}``.

    The jobs (a unit's encodings of one scheme and parameters, quantized together) are shared out among the
    processes of ``group`` (:meth:`qrecover.distributed.World.share`, by weight size x widths) and the results
    gathered on every process: the same results as one process, which runs every job.
    """
    cache = {} if cache is None else cache
    jobs = [(n, key) for n, (_, encs, _, _) in units.items() for key in dict.fromkeys(e.key for e in encs)]
    costs = [units[n][0].numel() * sum(e.key == key for e in units[n][1]) for n, key in jobs]
    done: dict[tuple[str, str], list] = {}
    for j in group.share(costs):
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

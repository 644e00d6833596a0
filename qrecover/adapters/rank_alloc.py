"""Rank per layer under an adapter-size budget (``--rank-allocation damage``).

A uniform rank gives every quantized projection the same number of adapter parameters per row and column,
however much that layer's quantization hurt. Here the budget is the same number of LoRA parameters as rank
``r`` everywhere, ``r * sum(in + out)``, and it goes where it removes the most damage:

- the **spectrum** of each layer's quantization error in the norm its inputs induce: the squared singular values
  ``s_1^2 >= s_2^2 >= ...`` of ``E H^(1/2)``, ``E = W - Q(W)``, ``H = E[x x^T]`` on the checkpoint's calibration
  text (the eigenvalues of ``E H E^T``; their sum is the layer's output error ``tr(E H E^T)``). A rank-``k``
  adapter initialised from the error (the default svd init) removes exactly ``sum_{i<=k} s_i^2`` of it
  (Eckart-Young), a share ``f_l(k)`` of the layer's output error;
- the **damage** of the layer at its chosen encoding (the compress manifest's ``damage``, the allocator's estimate
  of what the layer costs the model): a second-order estimate, proportional to the output error, so the adapter
  removes about ``damage_l * f_l(k)`` of it.

Ranks grow in steps (``step`` ranks at a time) on the layer with the largest damage removed per parameter, until
the budget is spent: with decreasing singular values every layer's gain per step decreases, so this greedy order
is the optimum of the budgeted problem up to the last step (a fractional knapsack). Layers that get no rank get no
adapter. The result is a PEFT ``rank_pattern``: the adapter loads with plain PEFT like any other.
"""

from __future__ import annotations

import heapq
from typing import Any

import torch
from torch import nn

from ..errors import QRecoverError
from .svd_init import EXACT_MAX_WIDTH, OVERSAMPLE, POWER_ITERS, each_layer_input, input_weighting, teacher_modules

MAX_RANK_FACTOR = 4  # a layer's rank is at most this many times the mean rank


def top_spectrum(error: torch.Tensor, k: int, inputs: torch.Tensor, damp: float = 0.01, seed: int = 0,
                 ) -> tuple[torch.Tensor, float]:
    """``(s2, total)``: the ``k`` largest eigenvalues of ``E H E^T`` (float64, descending; the squared singular
    values of the weighted error) and its trace, with ``H = X^T X / tokens + damp * mean(diag) * I`` from
    ``inputs (tokens, in)``, the same weighting as :func:`~qrecover.adapters.svd_init.best_correction`. Exact
    (an eigendecomposition of the ``out x out`` matrix) up to ``EXACT_MAX_WIDTH``; a randomized subspace
    iteration above, which never forms an ``in x in`` or ``out x out`` matrix."""
    out_f, in_f = error.shape
    k = min(k, out_f, in_f)
    if max(out_f, in_f) <= EXACT_MAX_WIDTH:
        e, x = error.double(), inputs.double()
        h = input_weighting(None, x, damp, in_f, torch.float64, e.device)
        g = e @ h(e.T)
        s2 = torch.linalg.eigvalsh((g + g.T) / 2).flip(0).clamp_min(0.0)
        return s2[:k], float(g.diagonal().sum())
    e = error.float()
    h = input_weighting(None, inputs, damp, in_f, torch.float32, e.device)
    total = float((e * h(e.T).T).double().sum())
    m = min(k + OVERSAMPLE, out_f, in_f)
    gen = torch.Generator(device=e.device).manual_seed(seed)
    y = torch.randn(out_f, m, generator=gen, device=e.device, dtype=torch.float32)
    for _ in range(POWER_ITERS + 1):
        q, _ = torch.linalg.qr(y)
        y = e @ h(e.T @ q)
    q, _ = torch.linalg.qr(y)
    z = q.T @ e
    g = (z @ h(z.T)).double()
    return torch.linalg.eigvalsh((g + g.T) / 2).flip(0).clamp_min(0.0)[:k], total


def error_spectra(model: nn.Module, teacher: nn.Module, windows: torch.Tensor, names: list[str], k: int,
                  damp: float = 0.01, device: str | torch.device = "cpu") -> dict[str, tuple[torch.Tensor, float]]:
    """``{layer: top_spectrum(W_teacher - W_quantized, k, that layer's teacher inputs)}`` for the quantized layers
    ``names`` of ``model``, from one teacher forward over ``windows`` (each layer's spectrum computed in a hook as
    its inputs appear, so one layer's inputs are held at a time)."""
    quant = dict(model.named_modules())
    modules = teacher_modules(model, teacher, names, "use --rank-allocation uniform")
    dev = torch.device(device)
    out: dict[str, tuple[torch.Tensor, float]] = {}

    def spectrum(name: str, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to(dev, torch.float32)
        error = modules[name].weight.detach().to(dev, torch.float64) - quant[name].weight.detach().to(dev, torch.float64)
        out[name] = top_spectrum(error, k, x, damp)

    each_layer_input(teacher, windows, names, spectrum, "use --rank-allocation uniform")
    return {n: out[n] for n in names}


def allocate_ranks(spectra: dict[str, tuple[torch.Tensor, float]], damage: dict[str, float],
                   shapes: dict[str, tuple[int, int]], budget: int, step: int, max_rank: int) -> dict[str, int]:
    """``{layer: rank}`` (multiples of ``step``, at most ``max_rank`` and the layer's smaller side) with
    ``sum(rank * (in + out)) <= budget`` parameters, maximising ``sum(damage_l * f_l(rank_l))`` greedily (module
    docstring). ``shapes``: ``{layer: (out, in)}``. Every layer is in the result, 0 for those left out."""
    if step <= 0 or max_rank <= 0 or budget < 0:
        raise QRecoverError(f"rank allocation needs step, max_rank > 0 and budget >= 0 (got {step}, {max_rank}, {budget})")
    ranks = {n: 0 for n in spectra}
    cap = {n: min(max_rank, *shapes[n]) // step * step for n in spectra}

    def gain(n: str) -> float:
        s2, total = spectra[n]
        r = ranks[n]
        if r + step > cap[n] or total <= 0:
            return 0.0
        return float(damage.get(n, 1.0)) * float(s2[r:r + step].sum()) / total

    heap = [(-gain(n) / (step * sum(shapes[n])), n) for n in spectra]
    heapq.heapify(heap)
    left = budget
    while heap:
        neg, n = heapq.heappop(heap)
        cost = step * sum(shapes[n])
        if neg >= 0 or cost > left:
            continue  # no gain left here, or this layer's next step does not fit (a cheaper layer's may)
        ranks[n] += step
        left -= cost
        heapq.heappush(heap, (-gain(n) / cost, n))
    return ranks


def damage_ranks(model: nn.Module, teacher: nn.Module, windows: torch.Tensor, names: list[str], rank: int,
                 device: str | torch.device = "cpu") -> dict[str, Any]:
    """The ranks of ``--rank-allocation damage`` for mean rank ``rank`` over the layers ``names`` (budget
    ``rank * sum(in + out)``, ranks in steps of ``max(1, rank // 4)`` up to ``MAX_RANK_FACTOR * rank``); returns
    ``{"ranks": {layer: rank > 0}, "budget": ..., "parameters": ..., "expected_removed": ..., "uniform_removed": ...}``
    where the last two are the damage-weighted shares of output error a rank-k svd init removes, allocated and
    uniform (the allocator's own objective; training then moves on from there)."""
    mods = dict(model.named_modules())
    shapes = {n: (mods[n].out_features, mods[n].in_features) for n in names}
    layers = model.qrecover_manifest["layers"]
    damage = {n: float(layers.get(n, {}).get("damage") or 0.0) for n in names}
    if not any(damage.values()):  # no damage estimates (e.g. a uniform compress): the error shares alone
        damage = {n: 1.0 for n in names}
    step, max_rank = max(1, rank // 4), MAX_RANK_FACTOR * rank
    spectra = error_spectra(model, teacher, windows, names, max_rank, device=device)
    budget = rank * sum(sum(s) for s in shapes.values())
    ranks = allocate_ranks(spectra, damage, shapes, budget, step, max_rank)

    def removed(rk: dict[str, int]) -> float:
        tot = sum(damage.values())
        return sum(damage[n] * float(spectra[n][0][:rk[n]].sum()) / spectra[n][1]
                   for n in names if spectra[n][1] > 0) / tot

    return {"ranks": {n: r for n, r in ranks.items() if r > 0}, "budget": budget,
            "parameters": sum(r * sum(shapes[n]) for n, r in ranks.items()),
            "expected_removed": removed(ranks), "uniform_removed": removed({n: min(rank, *shapes[n]) for n in names})}


__all__ = ["allocate_ranks", "damage_ranks", "error_spectra", "top_spectrum"]

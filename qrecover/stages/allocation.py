"""Stage ``allocate``: one encoding per unit within the byte budget, by the knapsack of
:mod:`qrecover.allocate` (the pure, torch-free allocator) or its position baseline.

:func:`allocation_table` turns a :class:`~qrecover.stages.candidates.Prepared`'s units into the allocator's
table of :class:`~qrecover.allocate.Choice` (only the encodings this config allows); :func:`choose` picks one per
unit. A budget below the smallest plan raises the allocator's one exception,
:class:`~qrecover.allocate.InfeasibleBudget` (bytes; :meth:`Budget.bpw_of` converts them)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..allocate import Choice, InfeasibleBudget, allocate, allocate_by_position
from ..config import CompressConfig
from .candidates import Prepared, Unit
from .checks import infeasible
from .specs import Encoding


@dataclass
class Budget:
    """``bpw`` over ``denom`` parameters, ``fixed`` bytes (the 16-bit remainder) already spent; ``units``:
    the names the budget covers (others take their largest allowed choice)."""

    bpw: float | None
    denom: int
    fixed: int
    units: list[str]

    @property
    def bytes(self) -> int:
        return math.floor(self.bpw * self.denom / 8) - self.fixed

    def bpw_of(self, nbytes: int) -> float:
        """``nbytes`` (the remainder included) as bits per weight of this budget's parameters."""
        return 8 * nbytes / self.denom


def allocation_table(units: dict[str, Unit], linear: list[Encoding], embedding: list[Encoding]
                     ) -> tuple[dict[str, list[Choice]], dict[str, list[int]]]:
    """``(table, picks)``: per unit, a :class:`Choice` (label, bytes, damage) for each of its candidates this config
    allows (``linear`` for linear units, ``embedding`` for the others), and the indices of those candidates in
    ``unit.cands``. A deferred unit's choice has 0 bytes and no damage (a uniform model: nothing to choose)."""
    table: dict[str, list[Choice]] = {}
    picks: dict[str, list[int]] = {}
    for n, u in units.items():
        allowed = linear if u.kind == "linear" else embedding
        keep = [k for k, c in enumerate(u.cands) if c in allowed]
        picks[n] = keep
        table[n] = [Choice(u.cands[k].label, 0, 0.0) if u.deferred else
                    Choice(u.cands[k].label, u.results[k][0].nbytes, u.results[k][1] or 0.0) for k in keep]
    return table, picks


def choose(table: dict[str, list[Choice]], budget: Budget, allocation: str = "sensitivity") -> dict[str, int]:
    """Index into ``table[name]`` for every unit. ``budget.bpw`` None: each unit's only (first) choice.

    Raises :class:`InfeasibleBudget` (bytes with the 16-bit remainder) when the budget is below the smallest plan."""
    if budget.bpw is None:
        return {n: 0 for n in table}
    lo = sum(min(c.nbytes for c in table[n]) for n in budget.units) + budget.fixed
    hi = sum(max(c.nbytes for c in table[n]) for n in budget.units) + budget.fixed
    if budget.bytes + budget.fixed < lo:
        raise InfeasibleBudget(budget.bytes + budget.fixed, lo, hi)
    fn = allocate if allocation == "sensitivity" else allocate_by_position
    chosen: dict[str, Any] = dict(fn({n: table[n] for n in budget.units}, budget.bytes).choices)
    for n in table:  # outside the budget's scope: the largest allowed choice
        chosen.setdefault(n, max(range(len(table[n])), key=lambda k: table[n][k].nbytes))
    return chosen


def choose_units(p: Prepared, cfg: CompressConfig, linear: list[Encoding], embedding: list[Encoding],
                 unquantized: dict[str, list[int]]) -> dict[str, int]:
    """Stage ``allocate`` on a prepared model: unit name -> index into ``unit.cands`` of its encoding, within
    ``cfg.bpw`` over the model (``scope`` 'model': the 16-bit remainder and the embeddings count) or over the
    linear layers alone. A budget no plan meets is a QRecoverError with the reachable range (and, when some
    matrices stay in 16 bits, ``unquantized`` names them)."""
    in_scope_emb = cfg.scope == "model"
    remainder_bytes = sum(v.numel() * 2 for v in p.remainder.values())  # stored as 16-bit
    table, picks = allocation_table(p.units, linear, embedding)
    budget = Budget(cfg.bpw, p.params["model"] if in_scope_emb else p.params["linear"],
                    remainder_bytes if in_scope_emb else 0,
                    [n for n, u in p.units.items() if u.kind == "linear" or in_scope_emb])
    try:
        chosen = choose(table, budget, cfg.allocation)
    except InfeasibleBudget as e:
        raise infeasible(cfg, budget.bpw_of(e.min_bytes), budget.bpw_of(e.max_bytes), unquantized) from None
    return {n: picks[n][chosen[n]] for n in p.units}

"""Stage ``allocate``: one encoding per unit within the byte budget, by the knapsack of
:mod:`qrecover.allocate` (unchanged) or its position baseline."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from ..allocate import Choice, allocate, allocate_by_position


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


class Infeasible(Exception):
    """The budget is below the smallest plan; ``lo``/``hi``: the smallest and largest reachable bpw."""

    def __init__(self, lo: float, hi: float):
        super().__init__(lo, hi)
        self.lo, self.hi = lo, hi


def choose(table: dict[str, list[Choice]], budget: Budget, allocation: str = "sensitivity") -> dict[str, int]:
    """Index into ``table[name]`` for every unit. ``budget.bpw`` None: each unit's only (first) choice."""
    if budget.bpw is None:
        return {n: 0 for n in table}
    lo = sum(min(c.nbytes for c in table[n]) for n in budget.units) + budget.fixed
    hi = sum(max(c.nbytes for c in table[n]) for n in budget.units) + budget.fixed
    if budget.bytes + budget.fixed < lo:
        raise Infeasible(8 * lo / budget.denom, 8 * hi / budget.denom)
    fn = allocate if allocation == "sensitivity" else allocate_by_position
    chosen: dict[str, Any] = dict(fn({n: table[n] for n in budget.units}, budget.bytes).choices)
    for n in table:  # outside the budget's scope: the largest allowed choice
        chosen.setdefault(n, max(range(len(table[n])), key=lambda k: table[n][k].nbytes))
    return chosen

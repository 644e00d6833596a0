"""Bit allocation across layers as a multiple-choice knapsack.

Every layer of a model can be stored in one of several ways (for example
``"palettize:4"`` or ``"palettize:3"``).  Each way -- a :class:`Choice` --
has an exact packed size in bytes and an estimated *damage*, the increase in
loss we expect from storing the layer that way.  Given a total byte budget,
:func:`allocate` picks exactly one choice per layer so that the summed
damage is as small as possible while the summed size stays within the
budget.  :func:`allocate_by_position` is the damage-blind baseline that the
allocator is compared against.

This module is pure and deterministic: it depends on numpy only (no torch),
does no I/O and keeps no state between calls.  Equal inputs give equal
outputs on every run and platform.

Units used throughout: sizes (``nbytes``, ``budget_bytes``, ...) are Python
``int`` bytes; damage is a non-negative, finite ``float`` in whatever unit the
caller estimated it (typically nats of loss increase); totals are plain sums
over layers.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from .allocate_solver import knapsack

__all__ = [
    "Choice",
    "InfeasibleBudget",
    "Allocation",
    "allocate",
    "allocate_by_position",
    "position_order",
]

#: Largest number of choices a layer may offer; back-pointers are ``uint8``.
MAX_CHOICES_PER_LAYER = 256


@dataclass(frozen=True)
class Choice:
    """One way of storing one layer.

    A ``Choice`` is a plain record and does not validate itself; the
    functions of this module validate every choice they are given and name
    the offending layer when one is bad.

    Attributes:
        label: Human-readable name of the choice, e.g. ``"palettize:4"``.
            Not interpreted by this module.
        nbytes: Exact packed size of the layer under this choice, in bytes.
            Must be a positive ``int`` (``numpy`` integers are accepted,
            ``bool`` is not).
        damage: Estimated damage (loss increase) caused by storing the layer
            this way.  Must be a finite real number ``>= 0``.
    """

    label: str
    nbytes: int
    damage: float


class InfeasibleBudget(ValueError):
    """No plan fits: even the smallest choice of every layer exceeds the budget.

    Attributes:
        budget_bytes: The budget that was asked for, in bytes.
        min_bytes: Size of the smallest possible plan (every layer at its
            smallest choice), in bytes; ``min_bytes > budget_bytes``.
        max_bytes: Size of the largest possible plan (every layer at its
            largest choice), in bytes.
    """

    def __init__(self, budget_bytes: int, min_bytes: int, max_bytes: int) -> None:
        self.budget_bytes = int(budget_bytes)
        self.min_bytes = int(min_bytes)
        self.max_bytes = int(max_bytes)
        super().__init__(
            f"budget_bytes={self.budget_bytes} is infeasible: the smallest "
            f"possible plan needs min_bytes={self.min_bytes} "
            f"(the largest possible plan is max_bytes={self.max_bytes})"
        )

    def __reduce__(self):  # keep the exception picklable (multiprocessing)
        return (type(self), (self.budget_bytes, self.min_bytes, self.max_bytes))


@dataclass(frozen=True)
class Allocation:
    """The outcome of an allocation: one choice per layer.

    Attributes:
        choices: Layer name -> index into that layer's choice list (the list
            given in the table), for every layer of the table, in table
            order.
        nbytes: Total size of the chosen plan in bytes (exact sum of the
            chosen ``Choice.nbytes``); always ``<= budget_bytes``.
        damage: Total damage of the chosen plan (sum of the chosen
            ``Choice.damage``, summed with :func:`math.fsum`).
        bound_gap_bytes: Optimality guarantee, in bytes.  The plan's damage
            is no larger than that of the best plan whose size is at most
            ``budget_bytes - bound_gap_bytes``.  ``0`` means the plan is an
            exact optimum for ``budget_bytes``.  Always ``0`` for
            :func:`allocate_by_position`, which gives no optimality
            guarantee at all (it ignores damage).
    """

    choices: dict[str, int]
    nbytes: int
    damage: float
    bound_gap_bytes: int


# --------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------


def _is_int(x: object) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _validate(
    table: Mapping[str, Sequence[Choice]], budget_bytes: int
) -> tuple[list[str], list[list[int]], list[list[float]]]:
    """Check ``table`` and ``budget_bytes``; return names, sizes and damages.

    Returns:
        ``(names, sizes, damages)`` where ``names`` is the list of layer names
        in table order, ``sizes[i][c]`` is the ``int`` byte size and
        ``damages[i][c]`` the ``float`` damage of choice ``c`` of layer ``i``.

    Raises:
        ValueError: naming the offending layer / value.
    """
    if not _is_int(budget_bytes):
        raise ValueError(f"budget_bytes must be an int, got {budget_bytes!r}")
    if budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
    if not isinstance(table, Mapping):
        raise ValueError(
            f"table must be a mapping of layer name -> choices, got {type(table).__name__}"
        )
    if len(table) == 0:
        raise ValueError("table is empty: at least one layer is needed")

    names: list[str] = []
    sizes: list[list[int]] = []
    damages: list[list[float]] = []
    for name, choices in table.items():
        if not isinstance(name, str):
            raise ValueError(f"layer names must be str, got {name!r}")
        if isinstance(choices, (str, bytes)) or not isinstance(choices, Sequence):
            raise ValueError(
                f"layer {name!r}: choices must be a list of Choice, got {type(choices).__name__}"
            )
        if len(choices) == 0:
            raise ValueError(f"layer {name!r} has no choices")
        if len(choices) > MAX_CHOICES_PER_LAYER:
            raise ValueError(
                f"layer {name!r} has {len(choices)} choices; "
                f"at most {MAX_CHOICES_PER_LAYER} are supported"
            )
        layer_sizes: list[int] = []
        layer_damages: list[float] = []
        for c, ch in enumerate(choices):
            if not isinstance(ch, Choice):
                raise ValueError(
                    f"layer {name!r} choice {c}: expected a Choice, got {type(ch).__name__}"
                )
            where = f"layer {name!r} choice {c} ({ch.label!r})"
            nb = ch.nbytes
            if not _is_int(nb):
                raise ValueError(f"{where}: nbytes must be an int, got {nb!r}")
            if nb <= 0:
                raise ValueError(f"{where}: nbytes must be positive, got {nb}")
            dm = ch.damage
            if not isinstance(dm, numbers.Real) or isinstance(dm, (bool, np.bool_)):
                raise ValueError(f"{where}: damage must be a real number, got {dm!r}")
            dmf = float(dm)
            if not math.isfinite(dmf):
                raise ValueError(f"{where}: damage must be finite, got {dm!r}")
            if dmf < 0:
                raise ValueError(f"{where}: damage must be >= 0, got {dm!r}")
            layer_sizes.append(int(nb))
            layer_damages.append(dmf)
        names.append(name)
        sizes.append(layer_sizes)
        damages.append(layer_damages)

    if not math.isfinite(math.fsum(max(d) for d in damages)):
        raise ValueError("total damage overflows a float; rescale the damage estimates")
    return names, sizes, damages


def _size_range(sizes: list[list[int]], budget_bytes: int) -> tuple[int, int]:
    """The smallest and largest possible plan sizes, ``(base, max_bytes)``, in bytes.

    Raises:
        InfeasibleBudget: ``budget_bytes < base``, so no plan fits.
    """
    base = sum(min(s) for s in sizes)
    max_bytes = sum(max(s) for s in sizes)
    if budget_bytes < base:
        raise InfeasibleBudget(budget_bytes, base, max_bytes)
    return base, max_bytes


def _make_plan(
    names: list[str],
    sizes: list[list[int]],
    damages: list[list[float]],
    picks: list[int],
    bound_gap_bytes: int,
) -> Allocation:
    return Allocation(
        choices={n: int(c) for n, c in zip(names, picks)},
        nbytes=sum(s[c] for s, c in zip(sizes, picks)),
        damage=math.fsum(d[c] for d, c in zip(damages, picks)),
        bound_gap_bytes=int(bound_gap_bytes),
    )


# --------------------------------------------------------------------------
# optimal allocator
# --------------------------------------------------------------------------


def allocate(
    table: Mapping[str, Sequence[Choice]],
    budget_bytes: int,
    *,
    max_states: int = 2_000_000,
) -> Allocation:
    """Pick one choice per layer, minimising total damage within a byte budget.

    Solves the multiple-choice knapsack by an exact dynamic programme over
    the *extra* bytes spent above the all-smallest plan.

    Let ``base`` be the sum over layers of the smallest ``nbytes`` and
    ``slack = budget_bytes - base``.  Each choice costs
    ``extra = nbytes - (its layer's smallest nbytes) >= 0`` bytes of slack.

    * ``slack < 0``: no plan fits, :class:`InfeasibleBudget` is raised.
    * ``slack >=`` the sum of every layer's largest extra (the budget covers
      the all-largest plan): every plan fits, so each layer independently
      takes its least-damage choice -- which need not be its biggest.  Exact,
      ``bound_gap_bytes == 0``.
    * otherwise the programme counts in units of ``u`` bytes:

      - exact path: ``u = gcd`` of all extras, used when
        ``slack // u <= max_states``.  The result is an exact optimum and
        ``bound_gap_bytes == 0``.
      - scaled path, otherwise: ``u = ceil(slack / max_states)`` and every
        extra is rounded *up* to a multiple of ``u``, so the plan always fits
        the budget.  Any plan of at most ``budget_bytes - n_layers * u``
        bytes still fits the rounded programme, so the result is guaranteed
        to be no worse than the exact optimum for that reduced budget;
        ``bound_gap_bytes == n_layers * u``.

    The state axis has ``slack // u + 1 <= max_states + 1`` entries and each
    layer costs one vectorised numpy pass per (non-dominated) choice over it,
    done in cache-sized blocks.  Per layer a ``uint8`` back-pointer array
    (the chosen index per state) is kept for backtracking, so memory is about
    ``n_layers * (max_states + 1)`` bytes at worst (~0.5 GB for 250 layers
    at the default), less where fewer states are reachable (early layers).

    Ties are broken deterministically.  Among plans of exactly equal damage
    the one using the fewest units (bytes, on the exact paths) is returned,
    so bytes that do not reduce damage are not bought; remaining ties go to
    the lower choice index.  (On the dynamic-programme paths damages are
    compared as float sums, so "exactly equal" is up to rounding.)

    Args:
        table: Ordered mapping ``layer name -> list of Choice``; each list
            holds the candidates of one layer (at most 256).  Order of layers
            only matters for ties.
        budget_bytes: Total byte budget for all layers together, a positive
            ``int``.  A plan of exactly ``budget_bytes`` bytes fits.
        max_states: Largest number of DP states (units of ``u`` bytes) before
            switching to the scaled path; a positive ``int``.  Time is
            roughly proportional to ``n_choices_total * min(states,
            max_states)``.

    Returns:
        The :class:`Allocation`; ``plan.nbytes <= budget_bytes`` always.

    Raises:
        InfeasibleBudget: ``budget_bytes < base`` (no plan fits); carries
            ``min_bytes=base`` and ``max_bytes`` = the all-largest size.
        ValueError: invalid input -- empty table, a layer without choices,
            a choice with non-int or non-positive ``nbytes``, negative or
            non-finite ``damage``, a non-positive ``budget_bytes`` or
            ``max_states``; the message names the offending layer / value.
    """
    if not _is_int(max_states) or max_states <= 0:
        raise ValueError(f"max_states must be a positive int, got {max_states!r}")
    names, sizes, damages = _validate(table, budget_bytes)
    base, max_bytes = _size_range(sizes, budget_bytes)
    if budget_bytes >= max_bytes:
        return _make_plan(names, sizes, damages, _least_damage_picks(sizes, damages), 0)

    weights, n_states, gap = _unit_weights(sizes, budget_bytes - base, max_states)
    picks = knapsack(weights, damages, n_states)
    return _make_plan(names, sizes, damages, picks, gap)


def _least_damage_picks(sizes: list[list[int]], damages: list[list[float]]) -> list[int]:
    """Each layer's own best choice, for a budget that every plan fits.

    Least damage per layer, then fewest bytes, then lowest index.
    """
    return [
        min(range(len(s)), key=lambda c, s=s, d=d: (d[c], s[c], c))
        for s, d in zip(sizes, damages)
    ]


def _unit_weights(
    sizes: list[list[int]], slack: int, max_states: int
) -> tuple[list[list[int]], int, int]:
    """Each choice's extra bytes above its layer's smallest, in DP units of ``u`` bytes.

    Exact when ``slack // gcd(extras) <= max_states`` (``u`` is that gcd);
    otherwise ``u = ceil(slack / max_states)`` and extras are rounded up, so
    the plan still fits (see :func:`allocate`).

    Returns:
        ``(weights, n_states, bound_gap_bytes)``: ``weights[i][c]`` in units,
        the DP capacity ``slack // u`` in units, and ``0`` (exact) or
        ``n_layers * u`` (scaled).
    """
    mins = [min(s) for s in sizes]
    extras = [[b - m for b in s] for s, m in zip(sizes, mins)]
    g = 0
    for ex in extras:
        for e in ex:
            g = math.gcd(g, e)
    # g > 0 here: some layer has two sizes, or budget_bytes >= max_bytes.
    u = g
    if slack // u <= max_states:
        gap = 0
        weights = [[e // u for e in ex] for ex in extras]
    else:
        u = -(-slack // max_states)
        gap = len(sizes) * u
        weights = [[-(-e // u) for e in ex] for ex in extras]
    n_states = slack // u  # DP capacity in units; states 0..n_states
    return weights, n_states, gap


# --------------------------------------------------------------------------
# positional baseline
# --------------------------------------------------------------------------


def position_order(n: int) -> list[int]:
    """Order in which :func:`allocate_by_position` visits layer positions.

    A permutation of ``range(n)`` whose every prefix is spread evenly over
    the positions.  It is built by splitting ``0..n`` into ``m`` equal
    segments for ``m = 1, 2, 4, 8, ...`` and, for each ``m`` and
    ``k = 0..m-1`` in turn, visiting the position under the centre of
    segment ``k``, ``((2*k + 1) * n) // (2*m)``, unless it was visited
    already; it stops once all ``n`` positions are listed (at the latest
    when ``m >= n``, where segments are at most one position wide).

    Example: ``position_order(10) == [5, 2, 7, 1, 3, 6, 8, 0, 4, 9]``.
    """
    if not _is_int(n) or n < 0:
        raise ValueError(f"n must be a non-negative int, got {n!r}")
    order: list[int] = []
    seen = [False] * n
    m = 1
    while len(order) < n:
        for k in range(m):
            p = ((2 * k + 1) * n) // (2 * m)
            if not seen[p]:
                seen[p] = True
                order.append(p)
        m *= 2
    return order


def allocate_by_position(table: Mapping[str, Sequence[Choice]], budget_bytes: int) -> Allocation:
    """Damage-blind baseline: shrink layers evenly spread by position.

    1. Every layer starts at its choice with the most bytes (lowest index
       among equal sizes).
    2. While the plan exceeds ``budget_bytes``, layers are stepped down one
       at a time, each step moving one layer to its *next smaller* size: the
       choice with the largest ``nbytes`` strictly below its current one
       (lowest index among equal sizes).  Layers are visited in the order
       ``position_order(n_layers)`` (positions in table order, every prefix
       evenly spaced; see :func:`position_order`), cycling through that
       order again and again; a layer already at its smallest size is
       skipped.  The plan size is checked after every step and the process
       stops as soon as it fits.  So every layer is stepped down once, in
       the spread order, before any layer is stepped down twice.

    Damage is ignored when choosing; it is only summed into ``Allocation.damage``.

    Args:
        table: Ordered mapping ``layer name -> list of Choice`` (see
            :func:`allocate`); the order defines the positions.
        budget_bytes: Total byte budget, a positive ``int``.

    Returns:
        The :class:`Allocation` (``nbytes <= budget_bytes``, ``bound_gap_bytes``
        is ``0`` and carries no meaning here).

    Raises:
        InfeasibleBudget: even the all-smallest plan exceeds the budget.
        ValueError: invalid input (as for :func:`allocate`).
    """
    names, sizes, damages = _validate(table, budget_bytes)
    _, max_bytes = _size_range(sizes, budget_bytes)

    # Per layer: distinct sizes, largest first, each with its lowest index.
    ladders: list[list[int]] = []
    for s in sizes:
        first_idx: dict[int, int] = {}
        for c, b in enumerate(s):
            first_idx.setdefault(b, c)
        ladders.append([first_idx[b] for b in sorted(first_idx, reverse=True)])
    level = [0] * len(sizes)
    total = max_bytes
    order = position_order(len(sizes))
    while total > budget_bytes:
        for p in order:
            lad = ladders[p]
            if level[p] + 1 >= len(lad):
                continue
            total -= sizes[p][lad[level[p]]] - sizes[p][lad[level[p] + 1]]
            level[p] += 1
            if total <= budget_bytes:
                break
    picks = [lad[lv] for lad, lv in zip(ladders, level)]
    return _make_plan(names, sizes, damages, picks, 0)

"""Tests for ``qrecover.allocate``, the per-layer bit allocator.

What is checked:

* ``allocate`` finds the least-damage plan within the budget: against brute
  force (``itertools.product``) on many seeded random small tables built to
  contain ties in sizes and damages, on hand-made tables, with budgets equal
  to a plan's exact size (which must be feasible) and above the all-largest
  plan (where damage is still minimised);
* ``InfeasibleBudget`` is raised, with ``min_bytes``/``max_bytes`` in its
  attributes and message, when even the all-smallest plan does not fit;
* the scaled path (small ``max_states``) always returns a plan that fits and
  is no worse than the brute-force optimum for ``budget - bound_gap_bytes``;
  the exact path reports ``bound_gap_bytes == 0``;
* results are deterministic and ties go to the lower choice index;
* invalid input raises ``ValueError`` naming the offending layer / value;
* ``allocate_by_position`` fits the budget, ignores damage and steps layers
  down in the documented evenly spread order (positions checked by hand on a
  10-layer table);
* one realistic 250-layer table completes (a smoke test, not a timed test).
"""

from __future__ import annotations

import itertools
import math
import pickle
import random

import numpy as np
import pytest

from qrecover.allocate import (
    Allocation,
    Choice,
    InfeasibleBudget,
    allocate,
    allocate_by_position,
    position_order,
)

# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def brute_force(table, budget):
    """Least total damage over all plans of size <= budget (None if none fit)."""
    names = list(table)
    best = None
    for picks in itertools.product(*(range(len(table[n])) for n in names)):
        size = sum(table[n][c].nbytes for n, c in zip(names, picks))
        if size > budget:
            continue
        dmg = math.fsum(table[n][c].damage for n, c in zip(names, picks))
        if best is None or dmg < best:
            best = dmg
    return best


def plan_size(table, plan):
    return sum(table[n][c].nbytes for n, c in plan.choices.items())


def plan_damage(table, plan):
    return math.fsum(table[n][c].damage for n, c in plan.choices.items())


def check_consistent(table, plan, budget):
    """The allocation covers every layer in order, fits, and its totals are right."""
    assert isinstance(plan, Allocation)
    assert list(plan.choices) == list(table)
    for name, c in plan.choices.items():
        assert isinstance(c, int) and 0 <= c < len(table[name])
    assert plan.nbytes == plan_size(table, plan)
    assert plan.nbytes <= budget
    assert plan.damage == pytest.approx(plan_damage(table, plan), rel=1e-12, abs=1e-12)


def random_table(rng, n_layers, max_choices, size_range, damage_pool=None):
    table = {}
    for i in range(n_layers):
        k = rng.randint(1, max_choices)
        choices = []
        for c in range(k):
            nbytes = rng.randint(*size_range)
            if damage_pool is not None:
                damage = rng.choice(damage_pool)
            else:
                damage = rng.random() * 3
            choices.append(Choice(f"c{c}", nbytes, damage))
        table[f"layer{i}"] = choices
    return table


def bounds(table):
    lo = sum(min(c.nbytes for c in v) for v in table.values())
    hi = sum(max(c.nbytes for c in v) for v in table.values())
    return lo, hi


def all_plan_sizes(table):
    names = list(table)
    return sorted(
        {
            sum(table[n][c].nbytes for n, c in zip(names, picks))
            for picks in itertools.product(*(range(len(table[n])) for n in names))
        }
    )


# ---------------------------------------------------------------------------
# allocate: optimality
# ---------------------------------------------------------------------------


def test_hand_made_table():
    table = {
        "a": [Choice("8", 80, 0.0), Choice("4", 40, 1.0), Choice("2", 20, 5.0)],
        "b": [Choice("8", 80, 0.0), Choice("4", 40, 0.1), Choice("2", 20, 0.2)],
        "c": [Choice("8", 80, 0.0), Choice("4", 40, 3.0)],
    }
    # all-largest fits: zero damage
    p = allocate(table, 240)
    assert p.choices == {"a": 0, "b": 0, "c": 0} and p.damage == 0.0 and p.nbytes == 240
    # must shed 40 bytes: cheapest is b -> 4 bits
    p = allocate(table, 200)
    assert p.choices == {"a": 0, "b": 1, "c": 0}
    assert p.nbytes == 200 and p.damage == pytest.approx(0.1) and p.bound_gap_bytes == 0
    # must shed 60 bytes: b -> 2 bits (0.2) beats anything else
    p = allocate(table, 180)
    assert p.choices == {"a": 0, "b": 2, "c": 0} and p.damage == pytest.approx(0.2)
    # must shed 100: b -> 2 (60) + a -> 4 (40) = 1.2 < c -> 4 + b -> 2 (3.2)
    p = allocate(table, 140)
    assert p.choices == {"a": 1, "b": 2, "c": 0} and p.damage == pytest.approx(1.2)
    # smallest possible plan
    p = allocate(table, 80)
    assert p.choices == {"a": 2, "b": 2, "c": 1} and p.nbytes == 80
    assert p.damage == pytest.approx(8.2)


@pytest.mark.parametrize("seed", range(40))
def test_matches_brute_force_random(seed):
    rng = random.Random(seed)
    # small integer damages from a pool produce many exact ties
    pool = [0.0, 0.5, 1.0, 1.5, 2.0, 0.25] if seed % 2 == 0 else None
    for _ in range(15):
        table = random_table(rng, rng.randint(1, 5), 4, (1, 30), pool)
        lo, hi = bounds(table)
        sizes = all_plan_sizes(table)
        budgets = {lo, hi, hi + 7, rng.randint(lo, hi), rng.choice(sizes)}
        for budget in budgets:
            plan = allocate(table, budget)
            check_consistent(table, plan, budget)
            assert plan.bound_gap_bytes == 0
            assert plan.damage == pytest.approx(brute_force(table, budget), rel=1e-9, abs=1e-12)


def test_matches_brute_force_large_sizes_random():
    """Realistic byte counts (gcd 1), still on the exact path."""
    rng = random.Random(1234)
    for _ in range(60):
        table = random_table(rng, rng.randint(2, 5), 4, (1000, 5000))
        lo, hi = bounds(table)
        budget = rng.randint(lo, hi)
        plan = allocate(table, budget)
        check_consistent(table, plan, budget)
        assert plan.bound_gap_bytes == 0
        assert plan.damage == pytest.approx(brute_force(table, budget), rel=1e-9, abs=1e-12)


def test_exact_budget_is_feasible():
    table = {
        "a": [Choice("big", 100, 0.0), Choice("small", 60, 2.0)],
        "b": [Choice("big", 100, 0.0), Choice("small", 50, 3.0)],
    }
    # plans: 200 (d 0), 160 (a small, d 2), 150 (b small, d 3), 110 (d 5)
    # 160 bytes exactly: the 160-byte plan fits and is optimal
    p = allocate(table, 160)
    assert p.nbytes == 160 and p.choices == {"a": 1, "b": 0} and p.damage == 2.0
    # one byte less: the 160-byte plan no longer fits
    p = allocate(table, 159)
    assert p.nbytes == 150 and p.choices == {"a": 0, "b": 1} and p.damage == 3.0
    # the smallest plan exactly
    p = allocate(table, 110)
    assert p.nbytes == 110 and p.choices == {"a": 1, "b": 1}
    # the largest plan exactly
    p = allocate(table, 200)
    assert p.nbytes == 200 and p.damage == 0.0


def test_budget_above_max_still_minimises_damage():
    # The least-damage choice of a layer is not always its biggest.
    table = {
        "a": [Choice("8", 100, 0.3), Choice("6", 80, 0.1), Choice("4", 60, 0.9)],
        "b": [Choice("8", 100, 0.0), Choice("4", 50, 0.5)],
        "c": [Choice("x", 30, 0.2)],
    }
    p = allocate(table, 10_000)
    assert p.choices == {"a": 1, "b": 0, "c": 0}
    assert p.damage == pytest.approx(0.3)
    assert p.nbytes == 210


def test_equal_damage_prefers_fewer_bytes():
    """With damage all zero, no bytes are bought that do not reduce damage."""
    table = {
        f"l{i}": [Choice("8", 100, 0.0), Choice("4", 50, 0.0), Choice("2", 25, 0.0)]
        for i in range(6)
    }
    p = allocate(table, 10_000)  # covers every plan
    assert p.nbytes == 6 * 25 and p.damage == 0.0
    p = allocate(table, 6 * 100 - 1)  # dynamic-programme path
    assert p.nbytes == 6 * 25 and p.damage == 0.0
    p = allocate(table, 6 * 100 - 1, max_states=3)  # scaled path
    assert p.nbytes == 6 * 25 and p.damage == 0.0 and p.bound_gap_bytes > 0


def test_damage_non_increasing_in_budget():
    rng = random.Random(7)
    table = random_table(rng, 8, 5, (100, 900))
    lo, hi = bounds(table)
    prev = math.inf
    for budget in range(lo, hi + 1, max(1, (hi - lo) // 60)):
        d = allocate(table, budget).damage
        assert d <= prev + 1e-12
        prev = d


def test_single_layer_and_single_choice_layers():
    table = {"only": [Choice("a", 10, 1.0), Choice("b", 5, 2.0)]}
    assert allocate(table, 10).choices == {"only": 0}
    assert allocate(table, 9).choices == {"only": 1}
    table = {"x": [Choice("fixed", 7, 0.5)], "y": [Choice("fixed", 3, 0.25)]}
    p = allocate(table, 10)
    assert p.choices == {"x": 0, "y": 0} and p.nbytes == 10 and p.damage == 0.75


def test_numpy_scalars_accepted():
    table = {
        "a": [
            Choice("8", np.int64(100), np.float32(0.0)),
            Choice("4", np.int32(50), np.float64(1.0)),
        ],
    }
    p = allocate(table, np.int64(80))
    assert p.choices == {"a": 1} and isinstance(p.nbytes, int) and isinstance(p.damage, float)


# ---------------------------------------------------------------------------
# infeasible budgets
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("fn", [allocate, allocate_by_position])
def test_infeasible_budget(fn):
    table = {
        "a": [Choice("8", 100, 0.0), Choice("4", 50, 1.0)],
        "b": [Choice("8", 80, 0.0), Choice("4", 40, 1.0)],
    }
    with pytest.raises(InfeasibleBudget) as info:
        fn(table, 89)
    err = info.value
    assert isinstance(err, ValueError)
    assert (err.budget_bytes, err.min_bytes, err.max_bytes) == (89, 90, 180)
    msg = str(err)
    assert "89" in msg and "90" in msg and "180" in msg
    # just feasible
    assert fn(table, 90).nbytes == 90


def test_infeasible_budget_pickles():
    err = InfeasibleBudget(1, 2, 3)
    back = pickle.loads(pickle.dumps(err))
    assert isinstance(back, InfeasibleBudget)
    assert (back.budget_bytes, back.min_bytes, back.max_bytes) == (1, 2, 3)
    assert str(back) == str(err)


# ---------------------------------------------------------------------------
# scaled (approximate) path
# ---------------------------------------------------------------------------


def test_gcd_units_keep_exact_path():
    """Sizes in multiples of 4096 need few states: exact even for tiny max_states."""
    table = {
        f"l{i}": [
            Choice("8", 4096 * 10, 0.0),
            Choice("4", 4096 * 5, 1.0 + i),
            Choice("2", 4096 * 2, 3.0 + i),
        ]
        for i in range(3)
    }
    lo, _ = bounds(table)
    budget = lo + 4096 * 10  # slack of 10 units of 4096
    p = allocate(table, budget, max_states=10)
    assert p.bound_gap_bytes == 0
    assert p.damage == pytest.approx(brute_force(table, budget))


@pytest.mark.parametrize("max_states", [1, 3, 10, 40])
def test_scaled_path_feasible_and_within_bound(max_states):
    rng = random.Random(max_states)
    n_scaled = 0
    for _ in range(40):
        n = rng.randint(1, 5)
        table = random_table(rng, n, 4, (1000, 9000))
        lo, hi = bounds(table)
        budget = rng.randint(lo, hi + 500)
        plan = allocate(table, budget, max_states=max_states)
        check_consistent(table, plan, budget)  # always fits
        exact = brute_force(table, budget)
        assert plan.damage >= exact - 1e-9  # cannot beat the true optimum
        gap = plan.bound_gap_bytes
        if gap == 0:
            assert plan.damage == pytest.approx(exact, rel=1e-9, abs=1e-12)
            continue
        n_scaled += 1
        assert budget < hi  # budgets covering every plan are solved exactly
        u = -(-(budget - lo) // max_states)
        assert gap == n * u
        reduced = budget - gap
        if reduced >= lo:
            assert plan.damage <= brute_force(table, reduced) + 1e-9
    assert n_scaled > 10  # the scaled path was really exercised


def test_scaled_path_on_bigger_table():
    rng = random.Random(99)
    table = random_table(rng, 40, 5, (1_000, 50_000))
    lo, hi = bounds(table)
    budget = (lo + hi) // 2
    exact = allocate(table, budget)
    coarse = allocate(table, budget, max_states=500)
    assert exact.bound_gap_bytes == 0 and coarse.bound_gap_bytes > 0
    check_consistent(table, coarse, budget)
    assert coarse.damage >= exact.damage - 1e-9
    # the exact optimum at the reduced budget is no better than the coarse plan
    reduced = allocate(table, budget - coarse.bound_gap_bytes)
    assert coarse.damage <= reduced.damage + 1e-9


# ---------------------------------------------------------------------------
# determinism and ties
# ---------------------------------------------------------------------------


def test_deterministic():
    rng = random.Random(5)
    table = random_table(rng, 30, 5, (100, 2000), damage_pool=[0.0, 1.0, 2.0])
    lo, hi = bounds(table)
    budget = (lo + hi) // 2
    p1 = allocate(table, budget)
    p2 = allocate(dict(table), budget)
    p3 = allocate({k: list(v) for k, v in table.items()}, budget)
    assert p1 == p2 == p3
    s1 = allocate(table, budget, max_states=50)
    s2 = allocate(table, budget, max_states=50)
    assert s1 == s2
    assert allocate_by_position(table, budget) == allocate_by_position(table, budget)


def test_ties_prefer_lower_index():
    table = {
        "a": [Choice("x", 10, 1.0), Choice("y", 10, 1.0), Choice("z", 10, 1.0)],
        "b": [Choice("x", 20, 0.5), Choice("y", 20, 0.5)],
    }
    assert allocate(table, 30).choices == {"a": 0, "b": 0}
    # same sizes, lower damage later: the lower damage wins
    table = {"a": [Choice("x", 10, 1.0), Choice("y", 10, 0.5)]}
    assert allocate(table, 10).choices == {"a": 1}


# ---------------------------------------------------------------------------
# validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "table, budget, match",
    [
        ({}, 10, "empty"),
        ({"lyr": []}, 10, "lyr"),
        ({"lyr": [Choice("a", 10, -0.1)]}, 10, "lyr"),
        ({"lyr": [Choice("a", 10, float("nan"))]}, 10, "lyr"),
        ({"lyr": [Choice("a", 10, float("inf"))]}, 10, "lyr"),
        ({"lyr": [Choice("a", 0, 0.0)]}, 10, "lyr"),
        ({"lyr": [Choice("a", -5, 0.0)]}, 10, "lyr"),
        ({"lyr": [Choice("a", 10.0, 0.0)]}, 10, "lyr"),
        ({"lyr": [Choice("a", True, 0.0)]}, 10, "lyr"),
        ({"lyr": [Choice("a", "10", 0.0)]}, 10, "lyr"),
        ({"lyr": [Choice("a", 10, "0.1")]}, 10, "lyr"),
        ({"lyr": ["not a choice"]}, 10, "lyr"),
        ({"lyr": [Choice("a", 10, 0.0)]}, 0, "budget_bytes"),
        ({"lyr": [Choice("a", 10, 0.0)]}, -3, "budget_bytes"),
        ({"lyr": [Choice("a", 10, 0.0)]}, 10.0, "budget_bytes"),
        ({1: [Choice("a", 10, 0.0)]}, 10, "1"),
    ],
)
@pytest.mark.parametrize("fn", [allocate, allocate_by_position])
def test_validation_errors(fn, table, budget, match):
    with pytest.raises(ValueError, match=match) as info:
        fn(table, budget)
    assert not isinstance(info.value, InfeasibleBudget)


def test_validation_names_the_bad_layer_among_good_ones():
    table = {
        "good": [Choice("a", 10, 0.0)],
        "blocks.7.mlp": [Choice("a", 10, 0.0), Choice("b", 5, -1.0)],
    }
    with pytest.raises(ValueError, match=r"blocks\.7\.mlp.*damage"):
        allocate(table, 100)


@pytest.mark.parametrize("max_states", [0, -1, 2.5])
def test_bad_max_states(max_states):
    with pytest.raises(ValueError, match="max_states"):
        allocate({"a": [Choice("a", 10, 0.0)]}, 10, max_states=max_states)


# ---------------------------------------------------------------------------
# allocate_by_position
# ---------------------------------------------------------------------------


def test_position_order_documented_example():
    assert position_order(10) == [5, 2, 7, 1, 3, 6, 8, 0, 4, 9]
    assert position_order(1) == [0]
    assert position_order(0) == []


@pytest.mark.parametrize("n", list(range(1, 70)) + [100, 250, 251])
def test_position_order_is_spread_permutation(n):
    order = position_order(n)
    assert sorted(order) == list(range(n))
    # every prefix of length m leaves no gap much larger than n / m
    for m in range(1, n + 1):
        pts = sorted(order[:m])
        gaps = [pts[0] + 1] + [b - a for a, b in zip(pts, pts[1:])] + [n - pts[-1]]
        assert max(gaps) <= 3 * n / m + 1


def _ten_layer_table(damages=None):
    # every layer: 8-bit 200 B, 4-bit 100 B, 2-bit 50 B; one step from the
    # top saves 100 B, the second step 50 B.
    table = {}
    for i in range(10):
        d = damages[i] if damages else 0.0
        table[f"blk{i}"] = [Choice("8", 200, 0.0), Choice("4", 100, d), Choice("2", 50, 2 * d)]
    return table


def test_by_position_hand_made_positions():
    table = _ten_layer_table()
    names = list(table)
    # all-largest = 2000 B fits 2000: nothing stepped
    p = allocate_by_position(table, 2000)
    assert set(p.choices.values()) == {0} and p.nbytes == 2000
    # 1700 B: three steps of 100 B, at positions 5, 2, 7 (evenly spread)
    p = allocate_by_position(table, 1700)
    stepped = [i for i, n in enumerate(names) if p.choices[n] == 1]
    assert stepped == [2, 5, 7] and p.nbytes == 1700
    assert all(p.choices[n] == 0 for i, n in enumerate(names) if i not in stepped)
    # 1650 B: needs a 4th step; the next position in the order is 1
    p = allocate_by_position(table, 1650)
    assert [i for i, n in enumerate(names) if p.choices[n] == 1] == [1, 2, 5, 7]
    assert p.nbytes == 1600
    # 1000 B: every layer once (10 x 100 B saved)
    p = allocate_by_position(table, 1000)
    assert set(p.choices.values()) == {1} and p.nbytes == 1000
    # 900 B: second pass starts again at position 5, then 2 (each saves 50 B)
    p = allocate_by_position(table, 900)
    assert [i for i, n in enumerate(names) if p.choices[n] == 2] == [2, 5] and p.nbytes == 900
    # 500 B: all smallest
    p = allocate_by_position(table, 500)
    assert set(p.choices.values()) == {2} and p.nbytes == 500


def test_by_position_ignores_damage_but_reports_it():
    damages = [9.0, 0.0, 5.0, 1.0, 0.0, 7.0, 0.0, 3.0, 0.0, 0.0]
    table = _ten_layer_table(damages)
    p = allocate_by_position(table, 1700)
    assert p.choices == allocate_by_position(_ten_layer_table(), 1700).choices
    assert p.damage == pytest.approx(damages[2] + damages[5] + damages[7])
    assert p.bound_gap_bytes == 0
    # the optimal allocator would rather step the zero-damage layers
    assert allocate(table, 1700).damage == 0.0


def test_by_position_skips_smallest_and_handles_duplicate_sizes():
    table = {
        "a": [Choice("only", 50, 0.0)],  # already smallest: skipped
        "b": [Choice("8", 100, 0.0), Choice("8dup", 100, 0.0), Choice("4", 60, 1.0)],
        "c": [Choice("4", 60, 1.0), Choice("8", 100, 0.0)],  # unsorted list
    }
    # order for n=3: [1, 0, 2]; start b=0 (first of the two 100 B), c=1
    assert position_order(3) == [1, 0, 2]
    p = allocate_by_position(table, 250)
    assert p.choices == {"a": 0, "b": 0, "c": 1}
    p = allocate_by_position(table, 249)  # b steps to the next *smaller* size (index 2)
    assert p.choices == {"a": 0, "b": 2, "c": 1} and p.nbytes == 210
    p = allocate_by_position(table, 209)  # a is skipped, c steps down
    assert p.choices == {"a": 0, "b": 2, "c": 0} and p.nbytes == 170


def test_by_position_fits_random_and_optimal_is_no_worse():
    rng = random.Random(42)
    for _ in range(100):
        table = random_table(rng, rng.randint(1, 6), 4, (1, 40))
        lo, hi = bounds(table)
        budget = rng.randint(lo, hi + 5)
        base = allocate_by_position(table, budget)
        check_consistent(table, base, budget)
        best = allocate(table, budget)
        assert best.damage <= base.damage + 1e-9


# ---------------------------------------------------------------------------
# smoke test at realistic scale (not timed)
# ---------------------------------------------------------------------------


def test_250_layer_table_completes():
    rng = random.Random(2024)
    table = {}
    for i in range(250):
        n_params = rng.randint(1_000_000, 60_000_000)
        bits = sorted(rng.sample(range(2, 9), rng.randint(3, 6)), reverse=True)
        table[f"model.layers.{i // 7}.w{i % 7}"] = [
            Choice(
                f"palettize:{b}",
                n_params * b // 8 + rng.randint(0, 4096),
                rng.random() * 2.0**-b,
            )
            for b in bits
        ]
    lo, hi = bounds(table)
    budget = lo + 60_000_000
    plan = allocate(table, budget)
    check_consistent(table, plan, budget)
    assert plan.nbytes > lo  # the slack was used
    base = allocate_by_position(table, budget)
    check_consistent(table, base, budget)
    assert plan.damage <= base.damage
    # damage is monotone in bits here, so the optimum beats all-smallest
    assert plan.damage < allocate(table, lo).damage


def _with_dominated(table: dict[str, list[Choice]], rng: random.Random) -> tuple[dict[str, list[Choice]], dict[str, list[int]]]:
    """``table`` with dominated choices inserted at random positions (each costs at least the bytes of a choice of its
    layer and does strictly more damage, or the same damage for strictly more bytes); returns the new table and, per
    layer, the new index of every original choice."""
    out, where = {}, {}
    for name, choices in table.items():
        new = list(choices)
        for _ in range(rng.randint(1, 3)):
            o = rng.choice(choices)
            if rng.random() < 0.5:
                extra = Choice(f"dom-{o.label}", o.nbytes + rng.randint(0, 40), o.damage + rng.uniform(1e-3, 1.0))
            else:
                extra = Choice(f"dom-{o.label}", o.nbytes + rng.randint(1, 40), o.damage)
            new.insert(rng.randint(0, len(new)), extra)
        out[name] = new
        where[name] = [next(i for i, c in enumerate(new) if c is x) for x in choices]
    return out, where


@pytest.mark.parametrize("seed", range(12))
def test_dominated_choices_never_change_the_plan(seed):
    """A choice with no fewer bytes and more damage than another of its layer (or equal damage and more bytes) can
    never be in the optimum: swapping it for the other keeps the plan within the budget and lowers its damage (or its
    bytes, the tie-break). So a menu that offers such candidates allocates exactly as one without them: hand-made
    tables, with and without dominated choices inserted anywhere, give the same choices, bytes and damage."""
    rng = random.Random(seed)
    table = {f"l{i}": [Choice(f"c{j}", rng.randint(10, 200), rng.uniform(0.0, 5.0)) for j in range(rng.randint(1, 4))]
             for i in range(rng.randint(2, 7))}
    lo, hi = sum(min(c.nbytes for c in v) for v in table.values()), sum(max(c.nbytes for c in v) for v in table.values())
    padded, where = _with_dominated(table, rng)
    for budget in sorted({lo, (lo + hi) // 2, lo + (hi - lo) // 3, hi, hi + 50}):
        plain, more = allocate(table, budget), allocate(padded, budget)
        assert {n: where[n][k] for n, k in plain.choices.items()} == more.choices, (seed, budget)
        assert (plain.nbytes, plain.damage) == (more.nbytes, more.damage)

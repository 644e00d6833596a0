"""The exact multiple-choice knapsack behind :func:`qrecover.allocate.allocate`.

:func:`knapsack` is a dynamic programme over integer units of slack: every layer offers a few choices, each with
an integer weight (units) and a damage, and exactly one choice per layer is picked so that the summed damage is
least while the summed weight stays within the capacity. :mod:`qrecover.allocate` turns byte sizes into these
units (exactly, or rounded up on its scaled path) and checks its inputs; this module trusts them.

Pure and deterministic like its caller: numpy only, no I/O, no state between calls.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["knapsack"]

#: States per block of the DP inner loop (sized to stay in L2 cache).
_BLOCK = 1 << 15


class _Scratch(NamedTuple):
    """Block-sized work buffers, allocated once per :func:`knapsack` call and reused by every layer."""

    cand: np.ndarray  # (B,) float64: dp[s - w] + d for one choice
    mask: np.ndarray  # (B,) bool: where that candidate beats the best so far
    mask8: np.ndarray  # (B,) uint8 view of mask
    tmp8: np.ndarray  # (B,) uint8: mask * choice index

    @classmethod
    def of_size(cls, B: int) -> _Scratch:
        mask = np.empty(B, dtype=bool)
        return cls(np.empty(B, dtype=np.float64), mask, mask.view(np.uint8), np.empty(B, dtype=np.uint8))


def knapsack(weights: list[list[int]], damages: list[list[float]], S: int) -> list[int]:
    """Multiple-choice knapsack DP with integer weights and capacity ``S``.

    ``dp[s]`` is the least damage of the layers seen so far using *at most*
    ``s`` units, for ``s = 0..S``.  Every layer has a weight-0 choice, so
    every state is reachable and ``dp`` is finite and non-increasing.
    After layer ``i`` only states ``0..hi_i`` (``hi_i = min(S, sum of the
    largest weights of layers 0..i)``) are distinct: ``dp`` is constant
    beyond ``hi_i``, and so is the back-pointer.  Only that prefix is
    computed and stored.

    Returns the chosen index per layer.
    """
    dp = np.zeros(S + 1, dtype=np.float64)
    new = np.empty(S + 1, dtype=np.float64)
    scratch = _Scratch.of_size(_BLOCK)

    # back[i] is None for layers whose choice does not depend on the state
    # (all weights zero); otherwise a uint8 array of length hi_i + 1.
    back: list[np.ndarray | None] = []
    fixed: list[int] = []  # the choice of state-independent layers
    his: list[int] = []
    hi_prev = 0
    for w_row, d_row in zip(weights, damages):
        wmax = max(w_row)
        if wmax == 0:
            # every choice costs 0 units: least damage, lowest index.
            c_best = min(range(len(d_row)), key=lambda c: (d_row[c], c))
            if d_row[c_best] != 0.0:
                dp += d_row[c_best]
            back.append(None)
            fixed.append(c_best)
            his.append(hi_prev)
            continue

        hi = min(S, hi_prev + wmax)
        bp = _relax_layer(dp, new, _live_choices(w_row, d_row, hi), hi, scratch)
        # states 0..hi are final; beyond hi the value is constant.
        if hi + 1 <= S:
            new[hi + 1 :] = new[hi]
        dp, new = new, dp
        back.append(bp)
        fixed.append(-1)
        his.append(hi)
        hi_prev = hi

    return _backtrack(dp, back, fixed, his, weights, S)


def _live_choices(w_row: list[int], d_row: list[float], hi: int) -> list[tuple[int, int, float]]:
    """The layer's choices that can win some state in ``0..hi``, as ``(index, weight, damage)`` by index.

    A choice that can never be the (lowest-index) argmin is skipped: one that
    does not fit at all, or one dominated by another choice that costs no
    more units and has less damage (or equal damage and a lower index),
    since dp is non-increasing in s.
    """
    k = len(w_row)
    return [
        (c, w_row[c], d_row[c])
        for c in range(k)
        if w_row[c] <= hi
        and not any(
            w_row[o] <= w_row[c] and (d_row[o] < d_row[c] or (d_row[o] == d_row[c] and o < c))
            for o in range(k)
            if o != c
        )
    ]


def _relax_layer(
    dp: np.ndarray, new: np.ndarray, live: list[tuple[int, int, float]], hi: int, scratch: _Scratch
) -> np.ndarray:
    """Fill ``new[0..hi]`` with one more layer's best values from ``dp``; return its back-pointers.

    ``dp`` beyond ``hi_prev`` equals ``dp[hi_prev]`` (kept filled), so reading
    ``dp[s - w]`` for any ``s <= hi`` is valid.  The state axis is processed in
    cache-sized blocks; within a block, choices in increasing index.

    Returns ``bp``, ``(hi + 1,)`` uint8: the winning choice index per state.
    """
    L = hi + 1
    B = _BLOCK
    bp = np.zeros(L, dtype=np.uint8)
    for a in range(0, L, B):
        b = min(L, a + B)
        nv = new[a:b]
        nv.fill(np.inf)
        bpb = bp[a:b]
        for c, w, d in live:
            lo = max(a, w)  # states below w cannot take this choice
            if lo >= b:
                continue
            m = b - lo
            seg = new[lo:b]
            cb = scratch.cand[:m]
            np.add(dp[lo - w : b - w], d, out=cb)
            mk = scratch.mask[:m]
            np.less(cb, seg, out=mk)  # strict: lower index wins exact ties
            np.minimum(seg, cb, out=seg)
            if c:
                # Choices come in increasing index, so every index stored
                # so far is < c and "bp = c where mk" is max(bp, mk * c),
                # far faster than a masked copy.
                t8 = scratch.tmp8[:m]
                np.multiply(scratch.mask8[:m], np.uint8(c), out=t8)
                bseg = bpb[lo - a :]
                np.maximum(bseg, t8, out=bseg)
    return bp


def _backtrack(
    dp: np.ndarray,
    back: list[np.ndarray | None],
    fixed: list[int],
    his: list[int],
    weights: list[list[int]],
    S: int,
) -> list[int]:
    """Walk the back-pointers from the last layer to the first; return the chosen index per layer.

    Among states with exactly the optimal value, start from the smallest, so
    units that do not reduce damage are not bought.
    """
    best = dp[S]
    s = int(np.argmax(dp <= best))

    picks = [0] * len(weights)
    for i in range(len(weights) - 1, -1, -1):
        bp = back[i]
        if bp is None:
            picks[i] = fixed[i]
            continue
        si = min(s, his[i])
        c = int(bp[si])
        picks[i] = c
        s = si - weights[i][c]
        assert s >= 0
    return picks

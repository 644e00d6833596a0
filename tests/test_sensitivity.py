"""Tests for ``qrecover.sensitivity``: the second-order estimate of the loss increase caused by a weight error.

Checks: ``linear_damage(dW, H, g)`` equals the float64 brute force
``1/2 * mean_t sum_i g_i (dW x_t)_i^2`` when ``H = mean_t x_t x_t^T`` is built from the same x;
``lookup_damage(dE, F)`` equals ``1/2 * mean_t sum_j delta_tj^2 dE[token_t, j]^2`` when
``F[v, j] = mean_t delta_tj^2 [token_t == v]``; both are zero for a zero error, quadratic in the error
and non-negative. On tiny fitted models (a Gaussian-noise regression and a softmax classifier trained to
its optimum with the real cross-entropy), the estimate built from the same statistics calibration
collects (``g = E[(dL/dy)^2]``, ``H = E[x x^T]``) tracks the true loss increase of small random weight
perturbations within 0.5x..2x, and a larger perturbation gives a larger damage.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from qrecover.sensitivity import linear_damage, lookup_damage


def gen(seed):
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("seed", range(4))
def test_linear_damage_equals_brute_force(seed):
    g_ = gen(seed)
    T, I, O = 50, 7, 5
    x = torch.randn(T, I, generator=g_, dtype=torch.float64)
    dw = torch.randn(O, I, generator=g_, dtype=torch.float64) * 0.1
    g = torch.rand(O, generator=g_, dtype=torch.float64) * 3
    H = x.T @ x / T
    brute = 0.5 * float(sum((g * (dw @ x[t]) ** 2).sum() for t in range(T)) / T)
    got = linear_damage(dw.float(), H.float(), g.float())
    assert isinstance(got, float)
    assert got == pytest.approx(brute, rel=1e-5)


def test_linear_damage_out_grad_weights_rows():
    H = torch.eye(3)
    dw = torch.tensor([[1.0, 0.0, 0.0], [0.0, 2.0, 0.0]])
    assert linear_damage(dw, H, torch.tensor([1.0, 0.0])) == pytest.approx(0.5)
    assert linear_damage(dw, H, torch.tensor([0.0, 1.0])) == pytest.approx(2.0)
    assert linear_damage(torch.zeros(2, 3), H, torch.ones(2)) == 0.0


def test_linear_damage_quadratic_and_nonnegative():
    g_ = gen(7)
    x = torch.randn(40, 6, generator=g_)
    H = x.T @ x / 40
    g = torch.rand(4, generator=g_)
    for _ in range(5):
        dw = torch.randn(4, 6, generator=g_)
        d = linear_damage(dw, H, g)
        assert d >= 0
        assert linear_damage(3 * dw, H, g) == pytest.approx(9 * d, rel=1e-5)
        assert linear_damage(-dw, H, g) == pytest.approx(d, rel=1e-6)


@pytest.mark.parametrize("seed", range(3))
def test_lookup_damage_equals_brute_force(seed):
    g_ = gen(seed)
    V, D, T = 11, 4, 60
    tokens = torch.randint(0, V, (T,), generator=g_)
    delta = torch.randn(T, D, generator=g_, dtype=torch.float64)
    dE = torch.randn(V, D, generator=g_, dtype=torch.float64) * 0.1
    F = torch.zeros(V, D, dtype=torch.float64)
    F.index_add_(0, tokens, delta**2)
    F /= T
    brute = 0.5 * float(sum((delta[t] ** 2 * dE[tokens[t]] ** 2).sum() for t in range(T)) / T)
    assert lookup_damage(dE.float(), F.float()) == pytest.approx(brute, rel=1e-5)
    # rows of tokens never seen cost nothing
    unseen = sorted(set(range(V)) - set(tokens.tolist()))
    if unseen:
        only_unseen = torch.zeros(V, D)
        only_unseen[unseen] = 5.0
        assert lookup_damage(only_unseen, F.float()) == 0.0


def _fit_softmax(T=4000, I=8, C=10, seed=0):
    """A softmax classifier fitted to its optimum (zero gradient) on labels drawn from a softmax model."""
    g_ = gen(seed)
    x = torch.randn(T, I, generator=g_, dtype=torch.float64)
    w0 = torch.randn(C, I, generator=g_, dtype=torch.float64) * 0.5
    y = torch.multinomial(torch.softmax(x @ w0.T, -1), 1, generator=g_).squeeze(1)
    w = w0.clone().requires_grad_(True)
    opt = torch.optim.LBFGS([w], max_iter=300, tolerance_grad=1e-12, tolerance_change=1e-15, line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = nn.functional.cross_entropy(x @ w.T, y)
        loss.backward()
        return loss

    opt.step(closure)
    closure()
    assert float(w.grad.norm()) < 1e-6  # at the optimum: the first-order term vanishes
    return x, y, w.detach()


def test_damage_tracks_cross_entropy_increase():
    x, y, w = _fit_softmax()
    T = x.shape[0]
    lin = nn.Linear(8, 10, bias=False).double()
    with torch.no_grad():
        lin.weight.copy_(w)
    # the statistics calibration collects: per-token output gradients of the summed loss, input moments
    out = lin(x)
    out.retain_grad()
    nn.functional.cross_entropy(out, y, reduction="sum").backward()
    g = (out.grad**2).mean(0)
    H = x.T @ x / T
    with torch.no_grad():
        base = float(nn.functional.cross_entropy(lin(x), y))
    prev_est, prev_true = 0.0, 0.0
    for scale in (0.01, 0.03, 0.1):
        for seed in range(3):
            dw = torch.randn(10, 8, generator=gen(10 + seed), dtype=torch.float64) * scale
            with torch.no_grad():
                true = float(nn.functional.cross_entropy(x @ (w + dw).T, y)) - base
            est = linear_damage(dw, H, g)
            assert true > 0
            assert 0.5 * true <= est <= 2.0 * true, (scale, seed, est, true)
        assert est > prev_est and true > prev_true  # same direction (seed 2), larger scale: larger damage
        prev_est, prev_true = est, true


def test_damage_tracks_gaussian_regression_increase():
    """Gaussian NLL 1/2 |y - t|^2 / s^2 at the least-squares fit: the estimate is the exact increase, up to
    the residual variance's sampling error."""
    g_ = gen(3)
    T, I, O, s = 5000, 6, 4, 0.5
    x = torch.randn(T, I, generator=g_, dtype=torch.float64)
    w_true = torch.randn(O, I, generator=g_, dtype=torch.float64)
    t = x @ w_true.T + s * torch.randn(T, O, generator=g_, dtype=torch.float64)
    w = torch.linalg.lstsq(x, t).solution.T  # zero gradient

    def loss(wm):
        return float((0.5 * ((x @ wm.T - t) ** 2).sum(1) / s**2).mean())

    delta = (x @ w.T - t) / s**2
    g = (delta**2).mean(0)
    H = x.T @ x / T
    ests = []
    for scale in (0.001, 0.01, 0.05):
        dw = torch.randn(O, I, generator=gen(99), dtype=torch.float64) * scale
        true = loss(w + dw) - loss(w)
        est = linear_damage(dw, H, g)
        assert 0.5 * true <= est <= 2.0 * true, (scale, est, true)
        assert est == pytest.approx(true, rel=0.1)
        ests.append(est)
    assert ests[0] < ests[1] < ests[2]

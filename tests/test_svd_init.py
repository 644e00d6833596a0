"""The adapters' SVD initialisation at scale (qrecover/adapters/svd_init.py): the randomized path against the exact one.

The exact path (a float64 eigendecomposition of ``H`` and a full SVD, cubic in the width) is the Eckart-Young optimum
in the input norm; the randomized one (subspace iteration on ``E H E^T``, float32, products only) must come within
1% of that optimum's weighted error on random layers with decaying error spectra and activation-like inputs, from
the Gram matrix or from the inputs themselves, be deterministic for a seed, reproduce a low-rank error, split the
singular values between B and A as the exact path does, and :func:`init_error_svd` (one layer's inputs at a time,
in a hook) must give what the former all-layers-at-once computation gave.
"""

from __future__ import annotations

import pytest
import torch

from qrecover.adapters import svd_init
from qrecover.adapters.lora import attach_lora, lora_modules
from qrecover.adapters.svd_init import best_correction, init_error_svd, lowrank_correction, randomized_correction
from qrecover.calibrate import input_moments
from qrecover.loading import load


def _layer(out_f, in_f, decay, seed=0, tokens=1024):
    """An error ``E (out, in)`` with singular values ``i^-decay`` (plus a little noise) and inputs ``X (tokens, in)``
    with decaying channel scales and a few outlier channels, as real activations have."""
    g = torch.Generator().manual_seed(seed)
    n = min(out_f, in_f)
    u, _ = torch.linalg.qr(torch.randn(out_f, n, generator=g, dtype=torch.float64))
    v, _ = torch.linalg.qr(torch.randn(in_f, n, generator=g, dtype=torch.float64))
    s = torch.arange(1, n + 1, dtype=torch.float64) ** -decay
    e = (u * s) @ v.T + 1e-3 * torch.randn(out_f, in_f, generator=g, dtype=torch.float64)
    scale = torch.linspace(1.0, 0.1, in_f, dtype=torch.float64)
    scale[torch.randperm(in_f, generator=g)[:4]] = 20.0
    x = torch.randn(tokens, in_f, generator=g, dtype=torch.float64) * scale
    return e, x


def _damped(x, damp=0.01):
    h = x.T @ x / x.shape[0]
    return h + damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=torch.float64)


def _werr(e, b, a, scaling, h):
    r = e - scaling * b @ a
    return float(torch.einsum("oi,ij,oj->", r, h, r))


@pytest.mark.parametrize("out_f, in_f, decay", [(384, 256, 1.0), (256, 512, 0.5), (512, 384, 0.3)])
@pytest.mark.parametrize("source", ["gram", "inputs"])
def test_randomized_is_within_one_percent_of_the_optimal_weighted_error(out_f, in_f, decay, source):
    e, x = _layer(out_f, in_f, decay)
    h = _damped(x)
    rank, scaling = 16, 2.0
    b0, a0 = lowrank_correction(e, x.T @ x / x.shape[0], rank, scaling)
    optimum = _werr(e, b0, a0, scaling, h)
    kw = {"gram": x.T @ x / x.shape[0]} if source == "gram" else {"inputs": x.float()}
    b, a = randomized_correction(e.float(), rank, scaling, **kw)
    assert b.dtype == a.dtype == torch.float64 and b.shape == (out_f, rank) and a.shape == (rank, in_f)
    fast = _werr(e, b, a, scaling, h)
    assert optimum <= fast * (1 + 1e-6)  # the exact path really is the optimum
    assert fast <= 1.01 * optimum, (fast / optimum)
    # and the correction is worth something: far below the uncorrected error
    assert optimum < 0.9 * _werr(e, 0 * b, a, scaling, h)


def test_randomized_is_deterministic_under_a_seed():
    e, x = _layer(256, 320, 0.7, seed=3)
    one = randomized_correction(e.float(), 8, 2.0, inputs=x.float(), seed=5)
    two = randomized_correction(e.float(), 8, 2.0, inputs=x.float(), seed=5)
    other = randomized_correction(e.float(), 8, 2.0, inputs=x.float(), seed=6)
    assert all(torch.equal(p, q) for p, q in zip(one, two))
    assert not torch.equal(one[0], other[0])  # the seed is used
    h = _damped(x)
    assert _werr(e, *other, 2.0, h) == pytest.approx(_werr(e, *one, 2.0, h), rel=1e-3)


def test_randomized_reproduces_a_low_rank_error_and_splits_singular_values_like_the_exact_path():
    g = torch.Generator().manual_seed(1)
    low = torch.randn(200, 5, generator=g, dtype=torch.float64) @ torch.randn(5, 300, generator=g, dtype=torch.float64)
    _, x = _layer(200, 300, 1.0, seed=1)
    b, a = randomized_correction(low.float(), 8, 2.0, inputs=x.float())
    assert torch.allclose(2.0 * b @ a, low, atol=1e-4 * float(low.abs().max()))
    assert torch.equal(b[:, 5:], torch.zeros_like(b[:, 5:])) or float(b[:, 5:].abs().max()) < 1e-3 * float(b.abs().max())

    e, x = _layer(300, 200, 1.0, seed=2)
    h = _damped(x)
    b0, a0 = lowrank_correction(e, x.T @ x / x.shape[0], 6, 2.0)
    b, a = randomized_correction(e.float(), 6, 2.0, inputs=x.float())
    # B^T B = A H A^T = diag(sigma / scaling), the same sigma as the exact path's
    for bb, aa in ((b0, a0), (b, a)):
        assert torch.allclose(bb.T @ bb, aa @ h @ aa.T, rtol=1e-3, atol=1e-6 * float((bb.T @ bb).abs().max()))
    assert torch.allclose(torch.diagonal(b.T @ b), torch.diagonal(b0.T @ b0), rtol=1e-3)


def test_zero_error_gives_a_zero_adapter():
    _, x = _layer(64, 96, 1.0)
    b, a = randomized_correction(torch.zeros(64, 96), 4, 2.0, inputs=x.float())
    assert torch.equal(b, torch.zeros_like(b)) and torch.equal(a, torch.zeros_like(a))


def test_best_correction_is_exact_for_narrow_layers_and_randomized_for_wide(monkeypatch):
    e, x = _layer(96, 64, 1.0)
    gram = x.T @ x / x.shape[0]
    exact = lowrank_correction(e, gram, 4, 2.0)
    auto = best_correction(e, 4, 2.0, inputs=x)
    assert all(torch.allclose(p, q, atol=1e-10) for p, q in zip(exact, auto))
    monkeypatch.setattr(svd_init, "EXACT_MAX_WIDTH", 64)
    wide = best_correction(e.float(), 4, 2.0, inputs=x.float())
    assert all(torch.equal(p, q) for p, q in zip(wide, randomized_correction(e.float(), 4, 2.0, inputs=x.float())))
    with pytest.raises(Exception, match="svd init method 'qr'"):
        best_correction(e, 4, 2.0, method="qr")


def _previous_init(peft_model, teacher, windows, damp=0.01):
    """The former init_error_svd: every layer's Gram matrix first (input_moments), then the exact correction."""
    layers = lora_modules(peft_model)
    modules = dict(teacher.named_modules())
    grams = input_moments(teacher, {n: modules[n] for n in layers}, windows)
    out = {}
    for n, mod in layers.items():
        error = modules[n].weight.detach().double() - mod.base_layer.weight.detach().double()
        out[n] = lowrank_correction(error, grams[n], mod.lora_A["default"].weight.shape[0], mod.scaling["default"], damp)
    return out


def test_init_layer_by_layer_equals_the_former_all_at_once_init(tiny_ckpt, tiny_model_dir):
    from qrecover.data.corpus import token_windows
    from qrecover.models import load_model

    teacher, tok, _ = load_model(str(tiny_model_dir))
    windows = token_windows(tok, "python-docs", "calib", 2, 64)
    model = attach_lora(load(tiny_ckpt), rank=8)
    want = _previous_init(model, teacher, windows)
    captured = init_error_svd(model, teacher, windows, method="exact")
    for n, mod in lora_modules(model).items():
        b, a = want[n]
        assert torch.allclose(mod.lora_B["default"].weight.double(), b, rtol=1e-4, atol=1e-6), n
        assert torch.allclose(mod.lora_A["default"].weight.double(), a, rtol=1e-4, atol=1e-6), n
    fast = attach_lora(load(tiny_ckpt), rank=8)
    captured_fast = init_error_svd(fast, teacher, windows, method="randomized")
    # the randomized path removes (within 1% of the error left) as much of the output error as the exact one
    assert (1 - captured_fast["_total"]) <= 1.01 * (1 - captured["_total"])
    assert 0.0 < captured["_total"] < 1.0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_randomized_on_cuda_matches_cpu_quality():
    e, x = _layer(512, 384, 0.5)
    h = _damped(x)
    b0, a0 = lowrank_correction(e, x.T @ x / x.shape[0], 16, 2.0)
    b, a = randomized_correction(e.float().cuda(), 16, 2.0, inputs=x.float().cuda())
    assert b.device.type == "cuda"
    assert _werr(e, b.cpu(), a.cpu(), 2.0, h) <= 1.01 * _werr(e, b0, a0, 2.0, h)
    again = randomized_correction(e.float().cuda(), 16, 2.0, inputs=x.float().cuda())
    assert torch.equal(b, again[0])


# --- issue 23: float32 randomized on the training device, batched over the layers that share inputs -------------

@pytest.mark.parametrize("out_f, in_f", [(576, 576), (192, 576), (1536, 576), (576, 1536)])  # the default model's shapes
def test_randomized_rank_r_part_is_close_to_the_float64_full_svd(out_f, in_f):
    e, x = _layer(out_f, in_f, 1.0, tokens=2048)
    b, a = lowrank_correction(e, x.T @ x / x.shape[0], 16, 2.0)  # float64 eigendecomposition + full SVD
    br, ar = randomized_correction(e.float(), 16, 2.0, inputs=x.float())
    exact = b @ a
    assert float((br @ ar - exact).norm() / exact.norm()) < 0.05  # measured 0.2% .. 3.4% (slow spectral decay)
    # with a spectral gap after rank r the float32 subspace is the exact one to float32 precision
    g = torch.Generator().manual_seed(3)
    low = torch.randn(out_f, 16, generator=g, dtype=torch.float64) @ torch.randn(16, in_f, generator=g, dtype=torch.float64)
    low = low + 1e-4 * torch.randn(out_f, in_f, generator=g, dtype=torch.float64)
    b, a = lowrank_correction(low, x.T @ x / x.shape[0], 16, 2.0)
    br, ar = randomized_correction(low.float(), 16, 2.0, inputs=x.float())
    assert float((br @ ar - b @ a).norm() / (b @ a).norm()) < 1e-4


def test_batched_layers_equal_one_at_a_time():
    (e1, x), (e2, _), (e3, _) = _layer(96, 64, 1.0), _layer(32, 64, 0.8, seed=1), _layer(32, 64, 1.2, seed=2)
    errors = [e.float() for e in (e1, e2, e3)]
    many = svd_init.randomized_corrections(errors, [4, 6, 4], [2.0, 1.0, 2.0], inputs=x.float())
    for e, r, s, (b, a) in zip(errors, [4, 6, 4], [2.0, 1.0, 2.0], many):
        b1, a1 = randomized_correction(e, r, s, inputs=x.float())
        assert b.shape == (e.shape[0], r) and a.shape == (r, 64)
        assert torch.allclose(b @ a, b1 @ a1, rtol=0, atol=1e-6 * float((b1 @ a1).abs().max()))


def test_auto_is_randomized_off_the_cpu_and_exact_on_it_for_narrow_layers():
    assert svd_init.exact_here(torch.empty(64, 96), "auto")
    assert not svd_init.exact_here(torch.empty(64, 96, device="meta"), "auto")  # a GPU's case: no float64 SVD there
    assert not svd_init.exact_here(torch.empty(64, svd_init.EXACT_MAX_WIDTH + 1), "auto")
    assert svd_init.exact_here(torch.empty(64, 96, device="meta"), "exact")
    with pytest.raises(Exception, match="svd init method 'qr'"):
        svd_init.exact_here(torch.empty(2, 2), "qr")

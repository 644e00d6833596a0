"""Tests for the quantizer plug-ins (``qrecover.schemes``): palettize, blockwise and the registry.

Palettize, against float64 references on small seeded tensors: every code is the nearest entry of the
stored fp16 table (brute-force argmin), ``dequantize() == lut[code]`` exactly, each group uses at most
``2**bits`` distinct values and its table is sorted; the relative MSE on Gaussian weights is close to the
Lloyd-Max optimum and falls with the width; importance weighting lowers the importance-weighted error on
data with a few heavy channels; results are deterministic; ``weighted_kmeans_1d`` equals a float64 numpy
Lloyd iteration from the same weighted-quantile start; ``quantize_many`` equals ``quantize`` per width.

Blockwise: ``|w - deq| <= scale/2`` (plus the slack from storing the scale in fp16) per element,
symmetric and asymmetric; weights already on the grid round-trip exactly; per-channel int8.

Both: ``nbytes(shape, bits)`` equals the actual stored bytes for several shapes / widths / parameters;
unsupported widths and non-dividing group/block sizes raise QRecoverError naming the values.

Registry: unknown scheme / unknown parameter errors, duplicate names refused, and a custom toy quantizer
registered with ``register_quantizer`` works end to end (get_quantizer, QuantizedWeight.dequantize,
QuantLinear).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from qrecover.errors import QRecoverError
from qrecover.packing import pack, packed_nbytes, unpack
from qrecover.schemes import QuantizedWeight, Quantizer, get_quantizer, quantizer_names, register_quantizer
from qrecover.schemes import base as schemes_base
from qrecover.schemes.base import doc_field
from qrecover.schemes.palettize import nearest_block, weighted_kmeans_1d


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def groups_of(t: torch.Tensor, g: int, c: int) -> torch.Tensor:
    """``(O, I) -> (O/g * I/c, g*c)`` in row-major (O/g, I/c) group order (the documented lut order)."""
    o, i = t.shape
    return t.reshape(o // g, g, i // c, c).permute(0, 2, 1, 3).reshape(-1, g * c)


def codes_of(qw: QuantizedWeight) -> torch.Tensor:
    return unpack(qw.tensors["qdata"], qw.bits, qw.numel).view(qw.shape).long()


# --- palettize ---------------------------------------------------------------------------------------------

PAL_GEOMETRIES = [(16, None), (8, 16), (4, 32), (1, None)]


@pytest.mark.parametrize("bits", [2, 3, 4, 6])
@pytest.mark.parametrize("group_size,block_size", PAL_GEOMETRIES)
def test_palettize_codes_are_nearest_lut_entry(bits, group_size, block_size):
    w = randn(32, 64, seed=bits)
    stats = {"input_sq": torch.rand(64, generator=torch.Generator().manual_seed(9)) + 0.5}
    q = get_quantizer("palettize", group_size=group_size, block_size=block_size)
    qw = q.quantize(w, bits, stats)
    c = block_size or 64
    n_groups = (32 // group_size) * (64 // c)
    lut = qw.tensors["lut"]
    assert lut.dtype == torch.float16 and lut.shape == (n_groups, 2**bits)
    assert qw.tensors["qdata"].dtype == torch.uint8
    assert torch.all(lut[:, 1:] >= lut[:, :-1]), "each table is sorted ascending"
    lut64 = lut.double()
    wg = groups_of(w.double(), group_size, c)  # (n_groups, g*c)
    cg = groups_of(codes_of(qw), group_size, c)
    dist = (wg.unsqueeze(-1) - lut64.unsqueeze(1)).abs()  # (n_groups, g*c, k)
    best = dist.min(dim=-1).values
    chosen = dist.gather(-1, cg.unsqueeze(-1)).squeeze(-1)
    # nearest up to ties at a midpoint (computed in fp32 by the implementation)
    assert torch.all(chosen <= best + 1e-6 * (1 + wg.abs())), float((chosen - best).max())
    # dequantize is exactly lut[code] of the code's own group
    deq = q.dequantize(qw)
    expect = lut64.gather(1, cg)  # (n_groups, g*c)
    assert torch.equal(groups_of(deq.double(), group_size, c), expect)
    assert torch.equal(qw.dequantize(), deq)
    # at most 2**bits values per group
    for row in groups_of(deq, group_size, c):
        assert row.unique().numel() <= 2**bits


@pytest.mark.parametrize("bits,bound", [(2, 0.13), (3, 0.04), (4, 0.012)])
def test_palettize_gaussian_mse_near_lloyd_max(bits, bound):
    # Lloyd-Max for a unit Gaussian: 0.1175 (2-bit), 0.03454 (3-bit), 0.009497 (4-bit)
    w = randn(64, 256, seed=42)
    qw = get_quantizer("palettize").quantize(w, bits, {})
    rel = float(((w.double() - qw.dequantize().double()) ** 2).sum() / (w.double() ** 2).sum())
    assert rel < bound, rel
    assert rel > 0.5 * {2: 0.1175, 3: 0.03454, 4: 0.009497}[bits]  # 2048 values per table cannot beat it by 2x


def test_palettize_error_falls_with_width():
    w = randn(32, 128, seed=3)
    q = get_quantizer("palettize")
    errs = [float(((w - qw.dequantize()) ** 2).mean()) for qw in q.quantize_many(w, [2, 3, 4, 6, 8], {})]
    assert all(a > b for a, b in zip(errs, errs[1:])), errs


def _weighted_err(w, deq, imp):
    return float((imp.double() * (w.double() - deq.double()) ** 2).sum())


@pytest.mark.parametrize("bits", [2, 3])
def test_palettize_importance_weighting_helps_heavy_channels(bits):
    out_f, in_f = 32, 64
    w = randn(out_f, in_f, seed=11)
    imp = torch.full((in_f,), 0.01)
    heavy = torch.tensor([3, 17, 40, 51])
    imp[heavy] = 100.0
    w[:, heavy] *= 0.3  # heavy channels off the bulk's cluster centres: the unweighted tables ignore them
    stats = {"input_sq": imp}
    weighted = get_quantizer("palettize", weighted=True).quantize(w, bits, stats)
    plain = get_quantizer("palettize", weighted=False).quantize(w, bits, stats)
    e_w = _weighted_err(w, weighted.dequantize(), imp.expand(out_f, in_f))
    e_p = _weighted_err(w, plain.dequantize(), imp.expand(out_f, in_f))
    assert e_w < 0.5 * e_p, (e_w, e_p)
    # and the unweighted one wins on the plain MSE it optimises
    assert float(((w - plain.dequantize()) ** 2).sum()) < float(((w - weighted.dequantize()) ** 2).sum())


@pytest.mark.parametrize("bits", [2, 3])
def test_palettize_element_importance(bits):
    """Per-element importance (``element_sq``, the embedding's Fisher) steers the tables to the hot weights."""
    out_f, in_f = 32, 64
    w = randn(out_f, in_f, seed=12)
    imp = torch.full((out_f, in_f), 0.01)
    hot = torch.rand(out_f, in_f, generator=torch.Generator().manual_seed(1)) < 0.1
    imp[hot] = 100.0
    w[hot] *= 0.3
    weighted = get_quantizer("palettize").quantize(w, bits, {"element_sq": imp})
    plain = get_quantizer("palettize", weighted=False).quantize(w, bits, {"element_sq": imp})
    assert _weighted_err(w, weighted.dequantize(), imp) < 0.5 * _weighted_err(w, plain.dequantize(), imp)


def test_palettize_weighted_without_stats_equals_unweighted():
    w = randn(16, 48, seed=4)
    a = get_quantizer("palettize", weighted=True).quantize(w, 3, {})
    b = get_quantizer("palettize", weighted=False).quantize(w, 3, {"input_sq": torch.ones(48)})
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in ("qdata", "lut"))


def test_palettize_deterministic():
    w = randn(32, 64, seed=5)
    stats = {"input_sq": torch.rand(64, generator=torch.Generator().manual_seed(2))}
    q = get_quantizer("palettize", group_size=8, block_size=32)
    a, b = q.quantize(w, 3, stats), q.quantize(w.clone(), 3, {k: v.clone() for k, v in stats.items()})
    assert a.tensors.keys() == b.tensors.keys()
    for k in a.tensors:
        assert torch.equal(a.tensors[k], b.tensors[k])
    assert a.params == b.params and a.shape == b.shape == (32, 64)


@pytest.mark.parametrize("with_hessian", [False, True])
def test_palettize_quantize_many_equals_quantize(with_hessian):
    w = randn(32, 64, seed=6)
    stats = {"input_sq": torch.rand(64, generator=torch.Generator().manual_seed(3)) + 0.1}
    if with_hessian:
        x = randn(200, 64, seed=7)
        stats["hessian"] = x.T @ x / 200
    q = get_quantizer("palettize", group_size=16, block_size=32)
    widths = [2, 3, 4, 6, 8]
    many = q.quantize_many(w, widths, stats)
    assert [m.bits for m in many] == widths
    for bits, m in zip(widths, many):
        one = q.quantize(w, bits, stats)
        assert m.tensors.keys() == one.tensors.keys()
        for k in m.tensors:
            assert torch.equal(m.tensors[k], one.tensors[k]), (bits, k)


def reference_kmeans(x: np.ndarray, w: np.ndarray, k: int, iters: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 weighted Lloyd, per row: weighted-quantile start (first sorted value whose inclusive weight
    prefix sum reaches (j + 1/2)/k of the total), nearest-centroid assignment (a value exactly on a
    midpoint goes up), empty clusters keep their centroid, stop when no assignment changes."""
    w = np.broadcast_to(w, x.shape).astype(np.float64)
    x = x.astype(np.float64)
    cents, codes = [], []
    for xr, wr in zip(x, w):
        order = np.argsort(xr, kind="stable")
        xs, cw = xr[order], np.cumsum(wr[order])
        idx = np.minimum(np.searchsorted(cw, (np.arange(k) + 0.5) / k * cw[-1], side="left"), len(xs) - 1)
        c = xs[idx].copy()

        def assign(c):
            return np.searchsorted((c[1:] + c[:-1]) / 2, xr, side="right")

        a = assign(c)
        for _ in range(iters):
            new = c.copy()
            for j in range(k):
                m = a == j
                if wr[m].sum() > 0:
                    new[j] = (wr[m] * xr[m]).sum() / wr[m].sum()
            c = np.sort(new)
            na = assign(c)
            if np.array_equal(na, a):
                break
            a = na
        cents.append(c)
        codes.append(a)
    return np.array(cents), np.array(codes)


@pytest.mark.parametrize("k,iters", [(2, 30), (4, 30), (8, 30), (4, 1), (8, 2), (16, 30)])
def test_weighted_kmeans_1d_matches_float64_lloyd(k, iters):
    for seed in range(4):
        g = torch.Generator().manual_seed(100 * k + seed)
        x = torch.randn(3, 24, generator=g)
        w = torch.rand(3, 24, generator=g) + 0.05
        c, codes = weighted_kmeans_1d(x, w, k, iters)
        rc, rcodes = reference_kmeans(x.numpy(), w.numpy(), k, iters)
        assert c.shape == (3, k) and codes.shape == (3, 24)
        np.testing.assert_allclose(c.double().numpy(), rc, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(codes.numpy(), rcodes)


def test_weighted_kmeans_1d_broadcast_weights_and_few_values():
    x = torch.tensor([[0.0, 0.0, 1.0, 1.0, 5.0, 5.0], [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]])
    w = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])  # broadcasts over rows
    c, codes = weighted_kmeans_1d(x, w, 4, 30)
    rc, rcodes = reference_kmeans(x.numpy(), w.numpy(), 4, 30)
    np.testing.assert_allclose(c.double().numpy(), rc, atol=1e-6)
    np.testing.assert_array_equal(codes.numpy(), rcodes)
    # three distinct values in row 0: each reproduced exactly
    assert torch.equal(c[0].gather(0, codes[0]), x[0])
    assert torch.all(c[1] == 3.0)


def test_weighted_kmeans_1d_weights_pull_centroid():
    x = torch.tensor([[0.0, 1.0, 10.0, 11.0]])
    c, _ = weighted_kmeans_1d(x, torch.tensor([[1.0, 3.0, 1.0, 1.0]]), 2)
    torch.testing.assert_close(c, torch.tensor([[0.75, 10.5]]))


# --- palettize with GPTQ error feedback (stats carry the input Hessian) ---------------------------------------


def _correlated_hessian(in_f: int, seed: int, T: int = 512) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(in_f, in_f, generator=g) / in_f**0.5 + 0.3 * torch.eye(in_f)
    x = torch.randn(T, in_f, generator=g) @ mix
    return x.T @ x / T


def _output_err(w, deq, H):
    d = (w - deq).double()
    return float(torch.trace(d @ H.double() @ d.T))


@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("group_size,block_size", [(16, None), (8, 16)])
def test_palettize_feedback_codes_index_the_stored_tables(bits, group_size, block_size):
    """Error feedback changes which entry a weight takes, not the tables: dequantize is still exactly
    lut[code] of the weight's own group, and the tables equal those fitted without feedback."""
    w = randn(32, 64, seed=20 + bits)
    H = _correlated_hessian(64, seed=bits)
    stats = {"input_sq": H.diagonal().clone(), "hessian": H}
    fb = get_quantizer("palettize", group_size=group_size, block_size=block_size).quantize(w, bits, stats)
    plain = get_quantizer("palettize", group_size=group_size, block_size=block_size, error_feedback=False).quantize(w, bits, stats)
    assert torch.equal(fb.tensors["lut"], plain.tensors["lut"])
    c = block_size or 64
    codes = groups_of(codes_of(fb), group_size, c)
    assert int(codes.max()) < 2**bits
    assert torch.equal(groups_of(fb.dequantize().double(), group_size, c), fb.tensors["lut"].double().gather(1, codes))
    assert not torch.equal(fb.tensors["qdata"], plain.tensors["qdata"])  # feedback did move some codes


@pytest.mark.parametrize("seed", range(3))
def test_palettize_feedback_lowers_output_error(seed):
    """GPTQ's objective is the layer's output error tr(dW H dW^T) on correlated inputs: feedback lowers it
    (by ~35-50% here) at every width, although the plain weight error rises."""
    w = randn(32, 64, seed=seed)
    H = _correlated_hessian(64, seed=100 + seed)
    stats = {"input_sq": H.diagonal().clone(), "hessian": H}
    for bits in (2, 3, 4):
        fb = get_quantizer("palettize").quantize(w, bits, stats).dequantize()
        plain = get_quantizer("palettize", error_feedback=False).quantize(w, bits, stats).dequantize()
        assert _output_err(w, fb, H) < 0.8 * _output_err(w, plain, H), (seed, bits)


def test_palettize_feedback_with_diagonal_hessian_is_nearest():
    """With uncorrelated inputs (diagonal H) no error is pushed to other columns: codes are the nearest entries."""
    w = randn(32, 64, seed=31)
    d = torch.rand(64, generator=torch.Generator().manual_seed(3)) + 0.5
    stats = {"input_sq": d, "hessian": torch.diag(d)}
    fb = get_quantizer("palettize").quantize(w, 3, stats)
    plain = get_quantizer("palettize", error_feedback=False).quantize(w, 3, stats)
    assert torch.equal(fb.tensors["qdata"], plain.tensors["qdata"])


def _reference_tables(w: torch.Tensor, codes: torch.Tensor, k: int, H: torch.Tensor, g: int) -> torch.Tensor:
    """float64 least squares over whole-row tables: for each group of g rows, the K values t minimising
    sum_r (w_r - M_r t) H (w_r - M_r t)^T, from the normal equations built element by element."""
    w, H = w.double(), H.double()
    out = []
    for r0 in range(0, w.shape[0], g):
        a = torch.zeros(k, k, dtype=torch.float64)
        b = torch.zeros(k, dtype=torch.float64)
        for r in range(r0, r0 + g):
            m = torch.nn.functional.one_hot(codes[r], k).double()  # (I, K)
            a += m.T @ H @ m
            b += m.T @ H @ w[r]
        out.append(torch.linalg.solve(a, b))
    return torch.stack(out)


@pytest.mark.parametrize("bits", [2, 3])
def test_refit_tables_match_float64_least_squares(bits):
    """Whole-row tables: one refit is the exact least-squares optimum for the fixed codes (to fp16 rounding),
    returned sorted with the codes renumbered so that lut[code] is unchanged."""
    from qrecover.schemes.palettize import refit_tables

    w, H = randn(32, 48, seed=40 + bits), _correlated_hessian(48, seed=41)
    qw = get_quantizer("palettize", group_size=8).quantize(w, bits, {"input_sq": H.diagonal().clone(), "hessian": H})
    codes = codes_of(qw)
    lut, new_codes = refit_tables(w, codes, qw.tensors["lut"], H, 8, 48)
    ref = _reference_tables(w, codes, 2**bits, H, 8)
    got = lut.double().repeat_interleave(8, 0).gather(1, new_codes)
    want = ref.repeat_interleave(8, 0).gather(1, codes)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    assert lut.dtype == torch.float16 and torch.all(lut[:, 1:] >= lut[:, :-1])
    assert _output_err(w, got, H) < _output_err(w, qw.dequantize(), H)  # the k-means tables are one feasible point


def test_refit_tables_diagonal_hessian_is_weighted_mean():
    """Uncorrelated inputs decouple every entry (block tables included): each value becomes the H_jj-weighted
    mean of the weights coded to it; an entry no weight uses keeps its value."""
    from qrecover.schemes.palettize import refit_tables

    w = randn(8, 32, seed=7)
    d = torch.rand(32, generator=torch.Generator().manual_seed(8)) + 0.5
    codes = (w > 0).long() * 2  # codes 0 and 2 only: entries 1 and 3 unused
    lut = torch.tensor([[-1.0, 5.0, 1.0, 7.0]]).half().repeat(2 * 2, 1)  # 2 row groups x 2 column blocks
    new, new_codes = refit_tables(w, codes, lut, torch.diag(d), 4, 16)
    for gi, bi in itertools.product(range(2), range(2)):
        rows, cols = slice(4 * gi, 4 * gi + 4), slice(16 * bi, 16 * bi + 16)
        wb, cb, db = w[rows, cols].double(), codes[rows, cols], d[cols].double().expand(4, 16)
        table = new[2 * gi + bi].double()
        for code, old in ((0, -1.0), (2, 1.0)):
            m = cb == code
            want = float((wb[m] * db[m]).sum() / db[m].sum())
            assert table[new_codes[rows, cols][m][0]].item() == pytest.approx(want, abs=2e-3)
        assert {5.0, 7.0} <= set(table.tolist())  # unused entries kept


@pytest.mark.parametrize("block_size", [None, 16])
def test_palettize_refit_lowers_output_error(block_size):
    """refit=2 (refit, reassign with feedback, refit; the best of those kept per width) never raises the
    layer's output error on the calibration Hessian and lowers it in total (by 3.5-6.5% on these random
    weights; 10-45% on the default model's layers, benchmarks/layer_damage.py); the stored format is unchanged
    (dequantize == lut[code], tables sorted)."""
    w, H = randn(32, 64, seed=50), _correlated_hessian(64, seed=51)
    stats = {"input_sq": H.diagonal().clone(), "hessian": H}
    base = get_quantizer("palettize", block_size=block_size).quantize_many(w, [2, 3, 4], stats)
    refit = get_quantizer("palettize", block_size=block_size, refit=2).quantize_many(w, [2, 3, 4], stats)
    c = block_size or 64
    errs = [(_output_err(w, q0.dequantize(), H), _output_err(w, q1.dequantize(), H)) for q0, q1 in zip(base, refit)]
    assert all(e1 <= e0 for e0, e1 in errs), errs
    assert sum(e1 for _, e1 in errs) < 0.975 * sum(e0 for e0, _ in errs), errs
    for q1 in refit:
        lut = q1.tensors["lut"]
        assert torch.all(lut[:, 1:] >= lut[:, :-1])
        assert torch.equal(groups_of(q1.dequantize().double(), 16, c), lut.double().gather(1, groups_of(codes_of(q1), 16, c)))


def test_palettize_refit_must_be_non_negative():
    with pytest.raises(QRecoverError, match="refit=-1"):
        get_quantizer("palettize", refit=-1)


def test_inverse_hessian_factor():
    from qrecover.schemes.feedback import inverse_hessian_factor

    H = _correlated_hessian(12, seed=5).double()
    H[3, :] = 0.0
    H[:, 3] = 0.0  # a dead input channel (never active)
    u = inverse_hessian_factor(H.float(), damp=0.01).double()
    assert u.shape == (12, 12) and torch.all(torch.isfinite(u))
    assert torch.equal(u, torch.triu(u))
    h = H.clone()
    h[3, 3] = 1.0
    h += 0.01 * h.diagonal().mean() * torch.eye(12)
    torch.testing.assert_close(u.T @ u, torch.linalg.inv(h), rtol=1e-4, atol=1e-5)


def _reference_gptq(w: torch.Tensor, H: torch.Tensor, round_fn, damp: float = 0.01) -> torch.Tensor:
    """float64 OBS form of GPTQ: the full inverse Hessian, column j's scaled error pushed onto the later
    columns, then column j eliminated from the inverse."""
    W = w.double().clone()
    h = H.double().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    h += damp * h.diagonal().mean() * torch.eye(h.shape[0], dtype=h.dtype)
    hinv = torch.linalg.inv(h)
    codes = torch.empty(W.shape, dtype=torch.long)
    for j in range(W.shape[1]):
        q, c = round_fn(j, W[:, j])
        codes[:, j] = c
        e = (W[:, j] - q) / hinv[j, j]
        W[:, j + 1:] -= e.unsqueeze(1) * hinv[j, j + 1:].unsqueeze(0)
        hinv = hinv - hinv[:, j:j + 1] @ hinv[j:j + 1, :] / hinv[j, j]
    return codes


def _grid_round(step: float, levels: int):
    def round_fn(_j, col):
        c = torch.clamp(torch.round(col / step) + levels // 2, 0, levels - 1).long()
        return ((c - levels // 2).to(col.dtype) * step), c
    return round_fn


@pytest.mark.parametrize("block", [1, 4, 128])
def test_error_feedback_matches_float64_obs_reference(block):
    from qrecover.schemes.feedback import error_feedback

    for seed in range(3):
        w = randn(6, 10, seed=seed)
        H = _correlated_hessian(10, seed=50 + seed)
        got = error_feedback(w, H, _grid_round(0.37, 9), block=block)
        want = _reference_gptq(w, H, _grid_round(0.37, 9))
        assert torch.equal(got, want), (block, seed)


# --- blockwise ---------------------------------------------------------------------------------------------


def _fp16_slack(bits: int) -> float:
    # the scale is stored in fp16 (relative error <= 2**-11), so the extreme codes may miss by qmax * 2**-11
    return (2**bits - 1) * 2.0**-11 * 1.01


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("block_size", [16, 32, None])
def test_blockwise_error_within_half_step(bits, symmetric, block_size):
    out_f, in_f = 8, 64
    w = randn(out_f, in_f, seed=bits) * 0.05
    w[0] += 0.03  # one all-positive-ish row: asymmetric zero points away from the middle
    q = get_quantizer("blockwise", block_size=block_size, symmetric=symmetric)
    qw = q.quantize(w, bits, {})
    b = block_size or in_f
    scale = qw.tensors["scale"]
    assert scale.dtype == torch.float16 and scale.shape == (out_f, in_f // b)
    assert ("zero_point" in qw.tensors) == (not symmetric)
    deq = qw.dequantize()
    assert deq.shape == (out_f, in_f) and deq.dtype == torch.float32
    s = scale.double().repeat_interleave(b, dim=1)
    err = (w.double() - deq.double()).abs()
    assert torch.all(err <= s * (0.5 + _fp16_slack(bits)) + 1e-7), float((err / s).max())
    codes = codes_of(qw)
    assert int(codes.max()) <= 2**bits - 1
    if symmetric:  # code = round(w / s) + 2**(bits-1), s = absmax / (2**(bits-1) - 1)
        half = 2 ** (bits - 1)
        absmax = w.abs().reshape(out_f, in_f // b, b).amax(-1).double()
        torch.testing.assert_close(scale.double(), absmax / max(half - 1, 1), rtol=2**-10, atol=0)
        expect = torch.round(deq.double() / s) + half
        assert torch.equal(codes.double(), expect)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_blockwise_symmetric_on_grid_round_trips(bits):
    half = 2 ** (bits - 1)
    g = torch.Generator().manual_seed(bits)
    out_f, in_f, b = 4, 32, 16
    s = torch.tensor([0.125, 0.5, 2.0 ** -7, 1.0]).repeat_interleave(in_f).view(out_f, in_f)
    ints = torch.randint(-(half - 1), half, (out_f, in_f), generator=g).float()
    ints[:, 0], ints[:, b] = half - 1, -(half - 1)  # every block reaches the extreme, so absmax = (half-1)*s
    w = ints * s
    qw = get_quantizer("blockwise", block_size=b).quantize(w, bits, {})
    assert torch.equal(qw.dequantize(), w)


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_blockwise_asymmetric_on_grid_round_trips(bits):
    qmax = 2**bits - 1
    g = torch.Generator().manual_seed(bits)
    out_f, in_f, b = 4, 32, 16
    s = torch.tensor([0.25, 2.0 ** -5, 1.0, 0.5]).view(out_f, 1, 1)
    zp = torch.randint(0, qmax + 1, (out_f, in_f // b, 1), generator=g).float()
    q = torch.randint(0, qmax + 1, (out_f, in_f // b, b), generator=g).float()
    q[..., 0], q[..., 1] = 0, qmax  # each block spans the full code range
    w = ((q - zp) * s).reshape(out_f, in_f)
    qw = get_quantizer("blockwise", block_size=b, symmetric=False).quantize(w, bits, {})
    assert torch.equal(qw.dequantize(), w)
    assert torch.equal(unpack(qw.tensors["zero_point"], bits, out_f * in_f // b).float(), zp.reshape(-1))


def test_blockwise_zero_block_and_per_channel_int8():
    w = randn(6, 40, seed=8)
    w[2] = 0.0
    q = get_quantizer("blockwise", block_size=None, symmetric=True)
    qw = q.quantize(w, 8, {})
    assert qw.tensors["scale"].shape == (6, 1)
    assert qw.tensors["qdata"].numel() == 6 * 40  # one byte per weight
    deq = qw.dequantize()
    assert torch.all(deq[2] == 0)
    torch.testing.assert_close(qw.tensors["scale"].float().squeeze(1), (w.abs().amax(1) / 127).half().float())
    rel = float(((w - deq) ** 2).sum() / (w**2).sum())
    assert rel < 1e-4, rel


def _clip_reference(w, bits, symmetric, b, H):
    """float64 brute force of ``clip=true``: per block, every ratio of CLIP_RATIOS quantized the documented way and
    scored by ``dw^T H_bb dw``; the first ratio of least error wins. Returns the dequantized weight and the ratios."""
    from qrecover.schemes.blockwise import CLIP_RATIOS

    qmax, half = 2**bits - 1, 2 ** (bits - 1)
    out = torch.empty(w.shape, dtype=torch.float64)
    ratios = torch.empty(w.shape[0], w.shape[1] // b)
    for o in range(w.shape[0]):
        for k in range(w.shape[1] // b):
            blk = w[o, k * b:(k + 1) * b].double()
            hb = H[k * b:(k + 1) * b, k * b:(k + 1) * b].double()
            best = None
            for r in CLIP_RATIOS:
                if symmetric:
                    s = float(torch.tensor(float(blk.abs().max()) * r / max(half - 1, 1)).half()) or 1.0
                    deq = ((torch.round(blk / s) + half).clamp(0, qmax) - half) * s
                else:
                    lo, hi = min(float(blk.min()), 0.0) * r, max(float(blk.max()), 0.0) * r
                    s = float(torch.tensor((hi - lo) / qmax).half()) or 1.0
                    zp = min(max(round(-lo / s), 0), qmax)
                    deq = ((torch.round(blk / s) + zp).clamp(0, qmax) - zp) * s
                err = float((blk - deq) @ hb @ (blk - deq))
                if best is None or err < best[0] * (1 - 1e-6):
                    best = (err, deq, r)
            out[o, k * b:(k + 1) * b], ratios[o, k] = best[1], best[2]
    return out, ratios


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [3, 4])
def test_blockwise_clip_matches_float64_search(bits, symmetric):
    out_f, in_f, b = 6, 64, 16
    w = randn(out_f, in_f, seed=bits) * 0.05
    w[:, 3] *= 8  # outliers: shrinking the range pays for some blocks
    H = _correlated_hessian(in_f, seed=bits)
    qw = get_quantizer("blockwise", block_size=b, symmetric=symmetric, clip=True).quantize(w, bits, {"hessian": H.double()})
    want, ratios = _clip_reference(w, bits, symmetric, b, H)
    torch.testing.assert_close(qw.dequantize().double(), want, rtol=0, atol=1e-6)
    assert (ratios < 1).any()  # the search clipped (the plain range is ratio 1)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("bits", [2, 3, 4])
@pytest.mark.parametrize("block_size", [16, None])
def test_blockwise_clip_lowers_output_error(bits, symmetric, block_size):
    w = randn(32, 64, seed=bits + 10) * 0.05
    w[::5, 7] += 0.4  # a few large weights
    H = _correlated_hessian(64, seed=bits)
    plain = get_quantizer("blockwise", block_size=block_size, symmetric=symmetric).quantize(w, bits, {})
    clip_q = get_quantizer("blockwise", block_size=block_size, symmetric=symmetric, clip=True)
    assert clip_q.needs == {"hessian"} and get_quantizer("blockwise").needs == frozenset()
    clipped = clip_q.quantize(w, bits, {"hessian": H})
    assert {k: (v.shape, v.dtype) for k, v in clipped.tensors.items()} == {k: (v.shape, v.dtype) for k, v in plain.tensors.items()}
    e_plain, e_clip = _output_err(w, plain.dequantize(), H), _output_err(w, clipped.dequantize(), H)
    assert e_clip < 0.97 * e_plain, (e_clip, e_plain)


def test_blockwise_clip_without_hessian_uses_element_weights():
    w = randn(8, 32, seed=3)
    e = torch.rand(8, 32, generator=torch.Generator().manual_seed(1))
    q = get_quantizer("blockwise", block_size=16, symmetric=False, clip=True)
    plain = get_quantizer("blockwise", block_size=16, symmetric=False).quantize(w, 3, {}).dequantize()
    for stats, weight in (({"element_sq": e}, e), ({"input_sq": e[0]}, e[0].expand(8, 32)), ({}, torch.ones(8, 32))):
        got = q.quantize(w, 3, stats).dequantize()
        e_got, e_plain = float(((w - got) ** 2 * weight).sum()), float(((w - plain) ** 2 * weight).sum())
        assert e_got < 0.99 * e_plain, (stats.keys(), e_got, e_plain)


# --- both: sizes and errors --------------------------------------------------------------------------------

SIZE_CASES = [
    ("palettize", {}, [(16, 64), (32, 48), (48, 128)]),
    ("palettize", {"group_size": 8, "block_size": 16}, [(16, 64), (24, 48)]),
    ("palettize", {"group_size": 1}, [(3, 5), (7, 9)]),
    ("blockwise", {}, [(4, 64), (3, 128)]),
    ("blockwise", {"block_size": 32, "symmetric": False}, [(4, 64), (5, 96)]),
    ("blockwise", {"block_size": None}, [(3, 7), (5, 33)]),
    ("blockwise", {"block_size": 8, "symmetric": False}, [(3, 8), (1, 24)]),
]


@pytest.mark.parametrize("scheme,params,shapes", SIZE_CASES)
def test_nbytes_equals_stored_bytes(scheme, params, shapes):
    q = get_quantizer(scheme, **params)
    for shape, bits in itertools.product(shapes, q.supported_bits):
        qw = q.quantize(randn(*shape, seed=shape[0] * 10 + bits), bits, {})
        tensor_bytes = sum(t.numel() * t.element_size() for t in qw.tensors.values())
        assert q.nbytes(shape, bits) == qw.nbytes == tensor_bytes, (scheme, params, shape, bits)
        assert qw.tensors["qdata"].numel() == packed_nbytes(shape[0] * shape[1], bits)
        assert qw.scheme == scheme and qw.bits == bits and qw.shape == shape and qw.params == q.params


def test_nbytes_hand_values():
    # palettize 32x64, groups of 16 rows, whole-row tables, 4 bits: 1024 bytes of codes + 2 tables x 16 x 2 bytes
    assert get_quantizer("palettize").nbytes((32, 64), 4) == 1024 + 2 * 16 * 2
    # blockwise 4x64 asym 3-bit, block 32: ceil(256*3/8)=96 + 8 scales * 2 + ceil(8*3/8)=3
    assert get_quantizer("blockwise", block_size=32, symmetric=False).nbytes((4, 64), 3) == 96 + 16 + 3


@pytest.mark.parametrize("scheme,bad", [("palettize", [1, 5, 7, 9]), ("blockwise", [1, 5, 6, 7])])
def test_unsupported_bits_raise(scheme, bad):
    q = get_quantizer(scheme)
    w = randn(16, 64)
    for bits in bad:
        with pytest.raises(QRecoverError, match=rf"{scheme}.*bits={bits}") as e:
            q.quantize(w, bits, {})
        assert str(list(q.supported_bits)) in str(e.value)
        with pytest.raises(QRecoverError, match=rf"bits={bits}"):
            q.check((16, 64), bits)
    with pytest.raises(QRecoverError, match="bits=5"):
        q.quantize_many(w, [4, 5], {})


def test_non_dividing_sizes_raise():
    with pytest.raises(QRecoverError, match=r"group_size=16.*\(24, 64\)|\(24, 64\).*group_size=16"):
        get_quantizer("palettize").quantize(randn(24, 64), 4, {})
    with pytest.raises(QRecoverError, match=r"block_size=48"):
        get_quantizer("palettize", block_size=48).quantize(randn(16, 64), 4, {})
    with pytest.raises(QRecoverError, match=r"group_size=16"):
        get_quantizer("palettize").nbytes((24, 64), 4)
    with pytest.raises(QRecoverError, match=r"block_size=64.*96|96.*block_size=64"):
        get_quantizer("blockwise").quantize(randn(4, 96), 4, {})
    with pytest.raises(QRecoverError, match=r"block_size=64"):
        get_quantizer("blockwise").nbytes((4, 96), 4)
    with pytest.raises(QRecoverError, match=r"block_size=32"):
        get_quantizer("blockwise", block_size=32).check((4, 40), 8)


def test_palettize_nearest_block_is_the_exact_block_it_resolves_to():
    """``block_fit='nearest'``: per layer the multiple of 32 dividing the width nearest to block_size (by ratio,
    within a factor 2, short of the whole row; ties: the larger), stored as that exact block: the same tensors,
    bytes and parameters as asking for that block directly."""
    assert [nearest_block(i, 192) for i in (576, 1536, 2048, 4096, 14336, 11008, 5632, 3072, 8192)] == \
        [192, 192, 256, 256, 224, 256, 256, 192, 256]
    assert nearest_block(96, 64) == 32 and nearest_block(128, 64) == 64  # 32 and 96/64: log-nearest, tie -> larger
    assert nearest_block(64, 192) is None and nearest_block(1000, 192) is None  # nothing in [96, 384] divides
    w = randn(32, 2048, seed=5)
    stats = {"input_sq": randn(2048, seed=6).abs() + 0.1}
    near = get_quantizer("palettize", block_size=192, block_fit="nearest", error_feedback=False)
    exact = get_quantizer("palettize", block_size=256, error_feedback=False)
    a, b = near.quantize(w, 3, stats), exact.quantize(w, 3, stats)
    assert a.params == b.params and a.params["block_size"] == 256 and a.params["block_fit"] == "exact"
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in b.tensors)
    assert near.nbytes((32, 2048), 3) == exact.nbytes((32, 2048), 3) == a.nbytes
    assert a.tensors["lut"].shape == (2 * 8, 8)  # 2 row groups x 8 blocks of 256 columns
    assert torch.equal(a.dequantize(), exact.dequantize(b))
    with pytest.raises(QRecoverError, match=r"block_size=192 block_fit='nearest'.*\(16, 64\)'s 64 columns"):
        near.check((16, 64), 3)
    with pytest.raises(QRecoverError, match="needs a target block_size"):
        get_quantizer("palettize", block_fit="nearest")
    with pytest.raises(QRecoverError, match=r"block_fit='close' is unknown"):
        get_quantizer("palettize", block_size=192, block_fit="close")


# --- registry ----------------------------------------------------------------------------------------------


def test_builtin_schemes_registered():
    assert {"palettize", "blockwise"} <= set(quantizer_names())


def test_unknown_scheme():
    with pytest.raises(QRecoverError, match=r"unknown scheme 'nope'.*blockwise.*palettize"):
        get_quantizer("nope")


def test_unknown_parameter():
    with pytest.raises(QRecoverError, match=r"'palettize'.*\['groupsize'\]") as e:
        get_quantizer("palettize", groupsize=8)
    assert "group_size" in str(e.value)  # lists what it does take
    with pytest.raises(QRecoverError, match=r"blockwise.*\['bits'\]"):
        get_quantizer("blockwise", bits=4)


def test_params_round_trip():
    import dataclasses

    from qrecover.schemes.palettize import PalettizeConfig

    q = get_quantizer("palettize", group_size=8, block_size=32, weighted=False, iters=5)
    assert set(q.params) == {f.name for f in dataclasses.fields(PalettizeConfig)}
    assert {k: q.params[k] for k in ("group_size", "block_size", "weighted", "iters")} == {
        "group_size": 8, "block_size": 32, "weighted": False, "iters": 5}
    assert get_quantizer("palettize", **q.params).params == q.params
    assert get_quantizer("blockwise", block_size=None, symmetric=False).params == {"block_size": None, "symmetric": False, "clip": False}


@dataclass
class _ToyConfig:
    gain: float = doc_field(1.0, "multiplies the stored scale")


def _make_toy():
    class ToySign(Quantizer):
        """1-bit sign quantizer with one fp16 scale per row (mean |w|)."""

        name = "toy-sign-test"
        supported_bits = (1,)
        Config = _ToyConfig

        def nbytes(self, shape, bits):
            return packed_nbytes(shape[0] * shape[1], 1) + 2 * shape[0]

        def quantize(self, weight, bits, stats):
            self.check(tuple(weight.shape), bits)
            scale = (weight.abs().mean(1) * self.config.gain).half()
            return self._pack(bits, tuple(weight.shape), {"qdata": pack((weight >= 0).to(torch.uint8), 1), "scale": scale})

        def dequantize(self, qw, dtype=torch.float32):
            signs = unpack(qw.tensors["qdata"], 1, qw.numel).view(qw.shape).to(dtype) * 2 - 1
            return signs * qw.tensors["scale"].to(dtype).unsqueeze(1)

    return ToySign


def test_register_custom_quantizer_end_to_end(monkeypatch):
    from qrecover.qlinear import QuantLinear

    monkeypatch.setattr(schemes_base, "_REGISTRY", schemes_base._REGISTRY.copy())  # leave the real registry alone
    toy = register_quantizer(_make_toy())
    assert "toy-sign-test" in quantizer_names()
    assert register_quantizer(toy) is toy  # registering the same class again is harmless
    q = get_quantizer("toy-sign-test", gain=2.0)
    assert isinstance(q, toy) and q.params == {"gain": 2.0}
    w = randn(4, 16, seed=1)
    qw = q.quantize(w, 1, {})
    assert qw.scheme == "toy-sign-test" and qw.params == {"gain": 2.0}
    assert qw.nbytes == q.nbytes((4, 16), 1) == 8 + 8
    expect = torch.sign(w) * (w.abs().mean(1) * 2).half().float().unsqueeze(1)
    assert torch.equal(qw.dequantize(), expect)  # QuantizedWeight.dequantize goes through the registry by name
    lin = QuantLinear(qw)
    x = randn(3, 16, seed=2)
    torch.testing.assert_close(lin(x), x @ expect.T)
    with pytest.raises(QRecoverError, match="bits=2"):
        q.quantize(w, 2, {})
    with pytest.raises(QRecoverError, match=r"\['scale'\]"):
        get_quantizer("toy-sign-test", scale=1.0)

    other = _make_toy()  # a different class under the same name
    with pytest.raises(ValueError, match="already registered"):
        register_quantizer(other)


# --- palettize: Fisher weighting (SqueezeLLM) --------------------------------------------------------------


def _fisher_stats(out_f: int, in_f: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(in_f, generator=g) ** 3 * 4 + 0.05  # uneven input channel energies
    return {"input_sq": d, "hessian": torch.diag(d), "out_grad_sq": torch.rand(out_f, generator=g) + 0.5}


@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("power", [0.5, 1.0])
def test_palettize_fisher_with_equal_gradients_is_input_weighting(feedback, power):
    # weighting="fisher" uses (g_i * E[x_j^2])**p normalised to mean 1; with every g_i = 1 that is exactly
    # weighting="input" with the same p (E[x_j^2]**p); with every g_i = c it is the same up to rounding
    w = randn(32, 64, seed=11)
    stats = _fisher_stats(32, 64)
    inp = get_quantizer("palettize", weighting="input", importance_power=power, error_feedback=feedback)
    fis = get_quantizer("palettize", weighting="fisher", importance_power=power, error_feedback=feedback)
    for bits in (2, 3, 4):
        want = inp.quantize(w, bits, stats)
        got = fis.quantize(w, bits, {**stats, "out_grad_sq": torch.ones(32)})
        assert torch.equal(got.tensors["qdata"], want.tensors["qdata"]) and torch.equal(got.tensors["lut"], want.tensors["lut"])
        scaled = fis.quantize(w, bits, {**stats, "out_grad_sq": torch.full((32,), 0.37)})
        torch.testing.assert_close(scaled.dequantize(), want.dequantize(), rtol=0, atol=2e-3)
    torch.testing.assert_close(fis.importance((32, 64), {**stats, "out_grad_sq": torch.full((32,), 0.37)}),
                               inp.importance((32, 64), stats), rtol=1e-5, atol=0)
    assert fis.params["weighting"] == "fisher" and get_quantizer("palettize", **fis.params).params == fis.params


@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("bits", [2, 3])
def test_palettize_fisher_favours_rows_with_large_gradients(feedback, bits):
    # rows 0 and 17 (one in each 16-row table group) have wider values than their neighbours and move the
    # loss 50x more: the shared tables move towards them, their own input-weighted error falls, and the
    # Fisher-weighted total error falls too
    w = randn(32, 64, seed=12)
    w[[0, 17]] *= 3.0
    stats = _fisher_stats(32, 64, seed=3)
    stats["out_grad_sq"] = torch.ones(32)
    stats["out_grad_sq"][[0, 17]] = 50.0
    d = stats["input_sq"]

    def row_errors(qw):
        return (((w - qw.dequantize()) ** 2) * d).sum(1)

    e_in = row_errors(get_quantizer("palettize", error_feedback=feedback).quantize(w, bits, stats))
    e_fi = row_errors(get_quantizer("palettize", weighting="fisher", error_feedback=feedback).quantize(w, bits, stats))
    assert float(e_fi[[0, 17]].sum()) < 0.9 * float(e_in[[0, 17]].sum()), (e_fi[[0, 17]], e_in[[0, 17]])
    g = stats["out_grad_sq"]
    assert float((g * e_fi).sum()) < float((g * e_in).sum())


def test_palettize_needs_and_weighting_errors():
    assert get_quantizer("palettize").needs == {"input_sq", "hessian"}
    assert get_quantizer("palettize", weighting="fisher").needs == {"input_sq", "hessian", "out_grad_sq"}
    assert get_quantizer("palettize", weighting="fisher", error_feedback=False).needs == {"input_sq", "out_grad_sq"}
    assert get_quantizer("palettize", weighted=False, error_feedback=False).needs == set()
    with pytest.raises(QRecoverError, match=r"weighting='hessian'.*\['input', 'fisher'\]"):
        get_quantizer("palettize", weighting="hessian")
    stats = _fisher_stats(16, 64)
    del stats["out_grad_sq"]
    with pytest.raises(QRecoverError, match="out_grad_sq"):
        get_quantizer("palettize", weighting="fisher").quantize(randn(16, 64), 3, stats)
    # the embedding's per-element statistic takes precedence over either weighting
    el = {"element_sq": torch.rand(16, 64, generator=torch.Generator().manual_seed(2))}
    a = get_quantizer("palettize", weighting="fisher").quantize(randn(16, 64), 3, el)
    b = get_quantizer("palettize").quantize(randn(16, 64), 3, el)
    assert torch.equal(a.tensors["qdata"], b.tensors["qdata"])


def test_sort_rows_is_a_stable_sort_with_signed_zeros_tied():
    """palettize's row sort (numpy int64 keys on the CPU) against torch's stable sort: the same values to the bit
    (-0.0 kept where it was) and the same order, ties (bf16-valued weights have many) in index order."""
    from qrecover.schemes import feedback
    from qrecover.schemes.palettize import sort_rows

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(7, 1000, generator=g) * 0.02).bfloat16().float()
    x[0, :6] = torch.tensor([0.0, -0.0, 1e-30, -1e-30, -0.0, 0.0])
    x[1] = 0.5  # a row of ties
    x[2, ::3] = float("inf")
    x[3, ::5] = float("-inf")
    want_v, want_i = x.sort(dim=1, stable=True)
    for numpy_path in (True, False):
        feedback.NUMPY_ON_CPU = numpy_path
        try:
            v, i = sort_rows(x)
        finally:
            feedback.NUMPY_ON_CPU = True
        assert torch.equal(i, want_i) and torch.equal(v.view(torch.int32), want_v.view(torch.int32))

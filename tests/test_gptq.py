"""Tests for the ``gptq`` quantizer (``qrecover.schemes.gptq``).

- Codes equal a plain, unblocked float64 implementation of GPTQ's Algorithm 1 written below (the full
  inverse Hessian, one column at a time, each group's grid computed from the current weights when its
  first column is reached; act order with static groups), exactly when run in float64, for every block
  size; the float32 default agrees on all but rare near-ties.
- Its layer output error ``tr(dW H dW^T)`` is well below RTN's (blockwise, same bits and groups) on
  correlated inputs; act order stores plain row-major static groups that dequantize consistently.
- Storage is blockwise's: ``nbytes`` equals the stored bytes, dequantization is blockwise's formula.
- A shared inverse-Hessian factor gives the same result; dead input channels store zeros; a group size
  that does not divide the columns raises QRecoverError naming it and the divisors.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from qrecover.errors import QRecoverError
from qrecover.packing import unpack
from qrecover.schemes import get_quantizer
from qrecover.schemes.gptq import gptq_quantize, hessian_factor


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def correlated_hessian(n: int, seed: int = 0, tokens: int = 512) -> torch.Tensor:
    """``E[x x^T]`` of inputs with strongly correlated channels of unequal scale."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, n, generator=g) * 0.3 + torch.eye(n)
    x = torch.randn(tokens, n, generator=g) @ mix * (torch.rand(n, generator=g) * 2 + 0.2)
    return (x.T @ x / tokens).float()


def output_error(w: torch.Tensor, deq: torch.Tensor, h: torch.Tensor) -> float:
    d = (w - deq).double()
    return float(torch.einsum("oi,ij,oj->", d, h.double(), d))


def codes_of(qw) -> torch.Tensor:
    return unpack(qw.tensors["qdata"], qw.bits, qw.numel).view(qw.shape).long()


# --- the reference: GPTQ Algorithm 1, unblocked, float64 ---------------------------------------------------


def reference_gptq(w, H, bits, group_size, symmetric, act_order, damp=0.01):
    """Codes, scales (fp16-rounded, float64) and zero points, by the textbook algorithm:

    H += damp * mean(diag H) * I (dead channels: H[j, j] = 1, W[:, j] = 0); Hinv = H^-1 kept whole; for
    each column j in order: round it on its group's grid, e = (w_j - q_j) / Hinv[j, j], subtract
    e * Hinv[j, k] from every later column k, and eliminate j from Hinv (the OBS update).
    Grid: symmetric scale = 2 absmax / (2^b - 1), zero 2^(b-1); asymmetric from min(w,0)/max(w,0).
    """
    W = w.double().clone()
    h = H.double().clone()
    n_out, n = W.shape
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    W[:, dead] = 0.0
    g = group_size or n
    maxq = 2**bits - 1

    def grid(cols):  # cols (O, g)
        if symmetric:
            s = (2 * cols.abs().amax(1) / maxq).half().double()
            return s, torch.full_like(s, 2 ** (bits - 1))
        lo, hi = cols.amin(1).clamp(max=0), cols.amax(1).clamp(min=0)
        s = ((hi - lo) / maxq).half().double()
        safe = torch.where(s > 0, s, torch.ones_like(s))
        return s, torch.round(-lo / safe).clamp(0, maxq)

    scale = torch.zeros(n_out, n // g, dtype=torch.float64)
    zero = torch.zeros(n_out, n // g, dtype=torch.float64)
    order = list(range(n))
    if act_order:
        order = torch.argsort(h.diagonal(), descending=True, stable=True).tolist()
        for gi in range(n // g):  # static groups: from the original weights, original column order
            scale[:, gi], zero[:, gi] = grid(W[:, gi * g:(gi + 1) * g])
    W = W[:, order]
    h = h[order][:, order]
    h += damp * h.diagonal().mean() * torch.eye(n, dtype=h.dtype)
    hinv = torch.linalg.inv(h)
    codes = torch.zeros(n_out, n, dtype=torch.long)
    for j in range(n):
        col = order[j]
        gi = col // g
        if not act_order and col % g == 0:
            scale[:, gi], zero[:, gi] = grid(W[:, j:j + g])
        s = torch.where(scale[:, gi] > 0, scale[:, gi], torch.ones_like(scale[:, gi]))
        c = (torch.round(W[:, j] / s) + zero[:, gi]).clamp(0, maxq)
        q = (c - zero[:, gi]) * scale[:, gi]
        codes[:, col] = c.long()
        e = (W[:, j] - q) / hinv[j, j]
        W[:, j + 1:] -= e.unsqueeze(1) * hinv[j, j + 1:].unsqueeze(0)
        hinv = hinv - hinv[:, j:j + 1] @ hinv[j:j + 1, :] / hinv[j, j]
    return codes, scale, zero


CASES = list(itertools.product([2, 3, 4, 8], [16, None], [True, False], [False, True]))


@pytest.mark.parametrize("bits,group_size,symmetric,act_order", CASES)
def test_float64_equals_reference_for_every_block(bits, group_size, symmetric, act_order):
    w, H = randn(12, 64, seed=bits) * 0.1, correlated_hessian(64, seed=bits)
    want_codes, want_scale, want_zero = reference_gptq(w, H, bits, group_size, symmetric, act_order)
    for block in (1, 5, 16, 64):  # 64 = the whole matrix in one block; 5 cuts groups across blocks
        codes, scale, zero = gptq_quantize(w, H, bits, group_size, symmetric, act_order, block=block, dtype=torch.float64)
        assert torch.equal(codes, want_codes), (block, int((codes != want_codes).sum()))
        assert torch.equal(scale.double(), want_scale), block
        assert zero is None if symmetric else torch.equal(zero.double(), want_zero)


@pytest.mark.parametrize("bits,group_size,symmetric,act_order", CASES)
def test_float32_nearly_equals_reference(bits, group_size, symmetric, act_order):
    # float32 arithmetic moves values by ~1e-7 relative; a value that lands within that of a rounding
    # boundary may take the other code, and its (tiny) different error then feeds the later columns.
    # So: codes agree almost everywhere and the output error is the same to a fraction of a percent.
    w, H = randn(12, 64, seed=bits) * 0.1, correlated_hessian(64, seed=bits)
    want_codes, want_scale, want_zero = reference_gptq(w, H, bits, group_size, symmetric, act_order)
    codes, scale, zero = gptq_quantize(w, H, bits, group_size, symmetric, act_order, block=16)
    assert float((codes == want_codes).double().mean()) >= 0.99
    z = 2 ** (bits - 1) if symmetric else zero.double()
    g = group_size or 64
    got = (codes.double() - (z if symmetric else z.repeat_interleave(g, 1))) * scale.double().repeat_interleave(g, 1)
    want = (want_codes.double() - want_zero.repeat_interleave(g, 1)) * want_scale.repeat_interleave(g, 1)
    assert output_error(w, got, H) == pytest.approx(output_error(w, want, H), rel=5e-3)


@pytest.mark.parametrize("bits,group_size,act_order", [(3, 32, False), (4, 32, False), (3, None, False), (4, 16, False),
                                                       (2, 32, True), (3, 32, True), (4, 32, True)])
@pytest.mark.parametrize("symmetric", [True, False])
def test_output_error_well_below_rtn(bits, group_size, act_order, symmetric):
    # (2 bits without act order is left out: asymmetric, its group grids, fitted to columns that earlier
    # errors have already moved, come out no better than RTN here, 0.7-1.0x, as with the reference GPTQ)
    for seed in range(3):
        w, H = randn(24, 128, seed=seed) * 0.05, correlated_hessian(128, seed=10 + seed)
        q = get_quantizer("gptq", group_size=group_size, symmetric=symmetric, act_order=act_order).quantize(w, bits, {"hessian": H})
        rtn = get_quantizer("blockwise", block_size=group_size, symmetric=symmetric).quantize(w, bits, {})
        e_gptq, e_rtn = output_error(w, q.dequantize(), H), output_error(w, rtn.dequantize(), H)
        assert e_gptq < 0.8 * e_rtn, (seed, e_gptq, e_rtn)


@pytest.mark.parametrize("symmetric", [True, False])
def test_act_order_static_groups_storage(symmetric):
    bits, g = 4, 16
    w, H = randn(12, 64, seed=3) * 0.1, correlated_hessian(64, seed=4)
    assert not torch.equal(torch.argsort(H.diagonal(), descending=True), torch.arange(64))  # a real reorder
    qw = get_quantizer("gptq", group_size=g, symmetric=symmetric, act_order=True).quantize(w, bits, {"hessian": H})
    # plain row-major groups: every group's scale is the grid of that group's ORIGINAL weights
    cols = w.reshape(12, 64 // g, g)
    if symmetric:
        want_scale = (2 * cols.abs().amax(-1) / 15).half()
    else:
        want_scale = ((cols.amax(-1).clamp(min=0) - cols.amin(-1).clamp(max=0)) / 15).half()
    assert torch.equal(qw.tensors["scale"], want_scale)
    codes = codes_of(qw).double()
    zp = 8.0 if symmetric else unpack(qw.tensors["zero_point"], bits, 12 * 64 // g).view(12, -1).double().repeat_interleave(g, 1)
    manual = (codes - zp) * qw.tensors["scale"].double().repeat_interleave(g, 1)
    assert torch.equal(qw.dequantize(torch.float64), manual)
    assert torch.equal(qw.dequantize(), get_quantizer("blockwise", block_size=g, symmetric=symmetric).dequantize(qw))
    plain = get_quantizer("gptq", group_size=g, symmetric=symmetric, act_order=False).quantize(w, bits, {"hessian": H})
    assert not torch.equal(codes_of(plain), codes_of(qw))  # the order did change the pass
    rtn = get_quantizer("blockwise", block_size=g, symmetric=symmetric).quantize(w, bits, {})
    assert output_error(w, qw.dequantize(), H) < 0.8 * output_error(w, rtn.dequantize(), H)


@pytest.mark.parametrize("params", [{}, {"group_size": 32, "symmetric": False}, {"group_size": None},
                                    {"group_size": 64, "act_order": False, "symmetric": False}])
def test_nbytes_equals_stored_bytes_and_params(params):
    q = get_quantizer("gptq", **params)
    for shape, bits in itertools.product([(4, 128), (3, 256)], q.supported_bits):
        w = randn(*shape, seed=bits)
        qw = q.quantize(w, bits, {"hessian": correlated_hessian(shape[1], seed=1)})
        stored = sum(t.numel() * t.element_size() for t in qw.tensors.values())
        assert q.nbytes(shape, bits) == qw.nbytes == stored, (params, shape, bits)
        assert qw.scheme == "gptq" and qw.params == q.params and qw.params["act_order"] == params.get("act_order", True)
        assert set(qw.tensors) == {"qdata", "scale"} | ({"zero_point"} if not q.config.symmetric else set())
    # the same bytes as blockwise at the same group size
    b = get_quantizer("blockwise", block_size=q.config.group_size, symmetric=q.config.symmetric)
    assert q.nbytes((4, 128), 3) == b.nbytes((4, 128), 3)


def test_quantize_many_equals_quantize_and_shared_factor():
    w, H = randn(16, 64, seed=5) * 0.1, correlated_hessian(64, seed=6)
    for params in ({"group_size": 32}, {"group_size": 16, "act_order": True, "symmetric": False}):
        q = get_quantizer("gptq", **params)
        many = q.quantize_many(w, [2, 3, 4, 8], {"hessian": H})
        factor = hessian_factor(H, q.config.damp, q.config.act_order)
        for bits, qm in zip([2, 3, 4, 8], many):
            one = q.quantize(w, bits, {"hessian": H})
            shared = q.quantize(w, bits, {"hessian": H, "hessian_inv_chol": factor})
            for t in one.tensors:
                assert torch.equal(qm.tensors[t], one.tensors[t]), (params, bits, t)
                assert torch.equal(shared.tensors[t], one.tensors[t]), (params, bits, t)


def test_dead_input_channels_store_zero():
    w, H = randn(8, 32, seed=7), correlated_hessian(32, seed=8)
    H[5, :] = H[:, 5] = 0.0
    for symmetric in (True, False):
        deq = get_quantizer("gptq", group_size=16, symmetric=symmetric).quantize(w, 4, {"hessian": H}).dequantize()
        assert torch.all(deq[:, 5] == 0) and torch.all(torch.isfinite(deq))


def test_bad_group_size_names_value_and_divisors():
    w = randn(4, 96)
    with pytest.raises(QRecoverError, match=r"group_size=64.*96.*\[32\]"):
        get_quantizer("gptq", group_size=64).quantize(w, 4, {"hessian": torch.eye(96)})
    with pytest.raises(QRecoverError, match=r"group_size=128"):
        get_quantizer("gptq").check((1536, 576), 4)
    with pytest.raises(QRecoverError, match=r"gptq.*bits=5"):
        get_quantizer("gptq", group_size=32).check((4, 96), 5)
    with pytest.raises(QRecoverError, match="hessian"):
        get_quantizer("gptq", group_size=32).quantize(w, 4, {})
    assert get_quantizer("gptq").needs == {"hessian"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_equals_cpu():
    w, H = randn(12, 64, seed=2) * 0.1, correlated_hessian(64, seed=3)
    for act_order in (False, True):
        want = gptq_quantize(w, H, 3, 16, False, act_order, block=16, dtype=torch.float64)
        got = gptq_quantize(w.cuda(), H.cuda(), 3, 16, False, act_order, block=16, dtype=torch.float64)
        assert got[0].device.type == "cuda"
        for a, b in zip(got, want):
            assert torch.equal(a.cpu(), b)
    qw = get_quantizer("gptq", group_size=16).quantize(w.cuda(), 4, {"hessian": H.cuda()})
    assert qw.tensors["qdata"].device.type == "cuda"
    cpu = get_quantizer("gptq", group_size=16).quantize(w, 4, {"hessian": H})
    assert float((qw.dequantize().cpu() == cpu.dequantize()).float().mean()) > 0.98


@pytest.mark.parametrize("act_order", [False, True])
def test_pipeline_shared_factor_equals_own_factor(act_order):
    """The compress stage computes GPTQ's inverse-Hessian factor once per shared input (q/k/v) and passes it in
    ``hessian_inv_chol``: the result must be exactly what the quantizer computes on its own, act order included
    (a factor for the unpermuted columns would silently mis-quantize under act order)."""
    from qrecover.stages.candidates import stats_for
    from qrecover.stages.specs import parse_encoding

    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, 64, generator=g) @ torch.randn(64, 64, generator=g)
    h = x.T @ x / x.shape[0]
    w = torch.randn(24, 64, generator=g)
    enc = parse_encoding(f"gptq:3/g32/act_order={str(act_order).lower()}")
    shared = stats_for(enc, {"hessian": h}, {})
    assert "hessian_inv_chol" in shared
    a = enc.quantizer.quantize(w, 3, shared)
    b = enc.quantizer.quantize(w, 3, {"hessian": h})
    assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in b.tensors)


@pytest.mark.parametrize("symmetric", [True, False])
def test_mse_grid_never_rounds_worse_than_min_max_and_is_off_by_default(symmetric):
    """``mse``: per row, the shrunk range's ``sum |w - q|^2.4`` is at most min/max's (1 is among the factors); the
    grid stays fp16-representable with codes in range; without it the grid is min/max's, bit for bit."""
    from qrecover.schemes.gptq import _grid, _grid_error

    cols = randn(64, 40, seed=3) ** 3  # heavy tails: outliers that a shrunk range clips
    maxq = torch.full((40,), 7.0)
    plain = _grid(cols, maxq, symmetric)
    assert all(torch.equal(a, b) for a, b in zip(plain, _grid(cols, maxq, symmetric, mse=False)))
    shrunk = _grid(cols, maxq, symmetric, mse=True)
    e_plain, e_mse = _grid_error(cols, *plain, maxq), _grid_error(cols, *shrunk, maxq)
    assert (e_mse <= e_plain).all() and (e_mse < e_plain).float().mean() > 0.6  # most rows gain
    assert torch.equal(shrunk[0], shrunk[0].half().float()) and ((shrunk[1] >= 0) & (shrunk[1] <= 7)).all()
    w, H = randn(24, 128, seed=1) ** 3 * 0.05, correlated_hessian(128, seed=11)
    q = get_quantizer("gptq", group_size=32, symmetric=symmetric, mse=True).quantize(w, 3, {"hessian": H})
    assert output_error(w, q.dequantize(), H) < output_error(
        w, get_quantizer("gptq", group_size=32, symmetric=symmetric).quantize(w, 3, {"hessian": H}).dequantize(), H)


@pytest.mark.parametrize("symmetric,act_order", [(False, True), (True, False), (False, False)])
def test_batched_range_search_gives_the_loops_grids_in_a_few_dispatches(monkeypatch, symmetric, act_order):
    """The range search as a batch over the shrink factors (what a GPU runs, ``gptq.BATCHED_SEARCH``; forced on the
    CPU here, in chunks that split the 81 factors unevenly) stores exactly the tensors of the factor-by-factor loop,
    ties to the earlier factor included (rounded weights tie often), with ~80x fewer operator dispatches per group."""
    from qrecover.recovery.host_sync import HostSyncCounter
    from qrecover.schemes import gptq

    w, H = randn(24, 128, seed=4) ** 3 * 0.05, correlated_hessian(128, seed=12)
    w[:4] = (w[:4] * 40).round() / 40  # equal errors at several factors
    q = get_quantizer("gptq", group_size=32, symmetric=symmetric, act_order=act_order, mse=True)
    with HostSyncCounter() as loop:
        a = q.quantize_many(w, [2, 3, 4], {"hessian": H})
    monkeypatch.setattr(gptq, "BATCHED_SEARCH", {"cpu"})
    monkeypatch.setattr(gptq, "BATCHED_ELEMENTS", 32 * 72 * 17)  # 17 factors per chunk: 5 chunks, the last short
    with HostSyncCounter() as batched:
        b = q.quantize_many(w, [2, 3, 4], {"hessian": H})
    for x, y in zip(a, b):
        assert all(torch.equal(x.tensors[k], y.tensors[k]) for k in x.tensors)
    groups = 128 // 32
    assert (loop.dispatches - batched.dispatches) / groups > 1500, (loop.dispatches, batched.dispatches)

"""The candidates stage's shared work gives exactly the results of the unshared path.

Checked on small seeded inputs: the inverse-Hessian factor that the stage computes once per input and damp/order
(``stats_for``) is, bit for bit, the one the error feedback computes on its own; palettization with refits given
that factor writes the same tensors as without it; palettization and GPTQ without act order share one factor, GPTQ
with act order gets its own (a permuted factor for unpermuted columns would silently mis-quantize).
"""

from __future__ import annotations

import inspect

import pytest
import torch

from qrecover.schemes.feedback import error_feedback, inverse_hessian_factor
from qrecover.stages.candidates import quantize_unit, stats_for
from qrecover.stages.specs import parse_encoding, parse_encodings


def _inputs(out_f: int = 32, in_f: int = 64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(512, in_f, generator=g) @ torch.randn(in_f, in_f, generator=g) * torch.rand(in_f, generator=g)
    h = x.T @ x / x.shape[0]
    w = torch.randn(out_f, in_f, generator=g) * 0.05
    return w, {"hessian": h, "input_sq": h.diagonal().clone(), "out_grad_sq": torch.rand(out_f, generator=g)}


def test_palettize_factor_is_the_feedbacks_own():
    w, st = _inputs()
    pal = parse_encoding("palettize:3/refit=2")
    shared = stats_for(pal, st, {})["hessian_inv_chol"]
    assert pal.quantizer.damp == inspect.signature(error_feedback).parameters["damp"].default
    assert torch.equal(shared, inverse_hessian_factor(st["hessian"], pal.quantizer.damp, torch.float32))

    def round_fn(_j, col):
        q = torch.round(col * 8) / 8
        return q, (q * 8).long()

    assert torch.equal(error_feedback(w, st["hessian"], round_fn), error_feedback(w, None, round_fn, factor=shared))


@pytest.mark.parametrize("spec", ["palettize:2/g8/refit=2", "palettize:3/g8/b32/refit=2", "palettize:4/g4/refit=0"])
def test_palettize_with_shared_factor_equals_own(spec):
    w, st = _inputs(seed=1)
    enc = parse_encoding(spec)
    q = enc.quantizer
    own = q.quantize_many(w, [2, 3, 4], st)
    shared = q.quantize_many(w, [2, 3, 4], stats_for(enc, st, {}))
    for a, b in zip(own, shared):
        assert set(a.tensors) == set(b.tensors)
        assert all(torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors), spec


def test_one_factor_per_input_damp_and_order():
    w, st = _inputs(seed=2)
    cache: dict = {}
    encs = parse_encodings("palettize:2/refit=2,palettize:3/g8/b32/refit=2,gptq:3/g32/act_order=false,gptq:4/g32,gptq:3/g32/damp=0.1")
    factors = [stats_for(e, st, cache)["hessian_inv_chol"] for e in encs]
    assert factors[0] is factors[1] is factors[2]  # palettization and GPTQ without act order: one factor
    assert factors[3] is not factors[0] and not torch.equal(factors[3], factors[0])  # act order: permuted
    assert factors[4] is not factors[0] and not torch.equal(factors[4], factors[0])  # another damp
    assert len(cache) == 3
    # and the stage's results with the shared cache are the quantizers' own, encoding by encoding
    got = quantize_unit(w, encs, st, None, {})
    for e, (qw, _) in zip(encs, got):
        want = e.quantizer.quantize(w, e.bits, st)
        assert all(torch.equal(qw.tensors[k], want.tensors[k]) for k in want.tensors), e.label

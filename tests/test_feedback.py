"""Error feedback on the CPU runs its per-column steps on numpy views (``qrecover.schemes.feedback.NUMPY_ON_CPU``), with
palettization's numpy compare-and-count rounding and GPTQ's numpy rounding; it must give exactly what torch ops
throughout give (``NUMPY_ON_CPU = False``, a GPU's path without the fused kernel): the checkpoint bytes of every compression depend on it.

Checked: palettization (three widths stacked, whole-row and per-block tables, refits), GPTQ (group grids set as columns
are reached, a group across a block edge, symmetric and not, per channel), every column's running state to the bit
against an independent copy of the algorithm (equal codes alone would miss one-ulp differences, which rarely flip a
code), and 8-bit codes through the int16 buffer.
"""

from __future__ import annotations

import pytest
import torch

from qrecover.schemes import feedback, get_quantizer
from qrecover.schemes.feedback import error_feedback, inverse_hessian_factor


def reference_feedback(weight, round_fn, factor, block=32):
    """The algorithm as it stood before the numpy steps (torch ops, int64 codes), without group callbacks."""
    wt = weight.detach().float().T.contiguous()
    in_f, out_f = wt.shape
    u = factor.float()
    codes = torch.empty(in_f, out_f, dtype=torch.long)
    for b0 in range(0, in_f, block):
        b1 = min(b0 + block, in_f)
        wb, ub = wt[b0:b1].clone(), u[b0:b1, b0:b1]
        errs = torch.empty_like(wb)
        for k in range(b1 - b0):
            q, c = round_fn(b0 + k, wb[k])
            codes[b0 + k] = c
            e = (wb[k] - q) / ub[k, k]
            wb[k + 1:] -= ub[k, k + 1:].unsqueeze(1) * e.unsqueeze(0)
            errs[k] = e
        wt[b1:] -= u[b0:b1, b1:].T @ errs
    return codes.T.contiguous()


def _layer(out_f, in_f, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * in_f, in_f, generator=g) * torch.rand(in_f, generator=g).add(0.1)  # uneven channel scales
    return torch.randn(out_f, in_f, generator=g), {"hessian": (x.T @ x).double(), "input_sq": (x**2).mean(0)}


def _both(monkeypatch, fn):
    """``fn()`` with the numpy steps, then with torch ops throughout."""
    fast = fn()
    monkeypatch.setattr(feedback, "NUMPY_ON_CPU", False)
    return fast, fn()


def _assert_same_weights(a, b):
    for x, y in zip(a, b):
        assert x.tensors.keys() == y.tensors.keys()
        for k in y.tensors:
            assert torch.equal(x.tensors[k], y.tensors[k]), f"{x.bits}-bit {k}: {(x.tensors[k] != y.tensors[k]).sum()} differ"


@pytest.mark.parametrize("shape,params", [((64, 96), {}), ((48, 128), dict(block_size=32)), ((32, 256), dict(block_size=64, refit=2))])
def test_palettization_equals_torch_throughout(monkeypatch, shape, params):
    w, stats = _layer(*shape)
    pal = get_quantizer("palettize", **params)
    fast, slow = _both(monkeypatch, lambda: pal.quantize_many(w, [2, 3, 4], stats))
    _assert_same_weights(fast, slow)
    assert [int(q.tensors["lut"].shape[-1]) for q in fast] == [4, 8, 16]


@pytest.mark.parametrize("group_size,symmetric", [(32, False), (48, True), (None, False)])
def test_gptq_equals_torch_throughout(monkeypatch, group_size, symmetric):
    """GPTQ's blocks are 128 columns: groups of 48 straddle block edges (the pending errors applied to the rest)."""
    w, stats = _layer(40, 288, seed=2)
    gptq = get_quantizer("gptq", group_size=group_size, symmetric=symmetric, act_order=False)
    fast, slow = _both(monkeypatch, lambda: gptq.quantize_many(w, [2, 3, 4], stats))
    _assert_same_weights(fast, slow)


@pytest.mark.parametrize("block", [32, 128])
def test_every_column_is_rounded_from_the_same_bits(block):
    """Each column handed to the rounding rule, the running state of the feedback, equals the reference's to the bit."""
    w, stats = _layer(24, 160, seed=4)
    factor = inverse_hessian_factor(stats["hessian"])
    seen = {"new": [], "ref": []}

    def recorder(key):
        def round_fn(j, col):
            seen[key].append(col.clone())
            c = (col * 3).round()
            return c / 3, c.long()
        return round_fn
    got = error_feedback(w, None, recorder("new"), block=block, factor=factor)
    want = reference_feedback(w, recorder("ref"), factor, block=block)
    assert len(seen["new"]) == 160 and torch.equal(got, want)
    for j, (a, b) in enumerate(zip(seen["new"], seen["ref"])):
        assert torch.equal(a, b), f"column {j}: {(a != b).sum()} values differ"


def test_codes_keep_widths_up_to_8_bits():
    """Codes are collected in int16 and returned as int64: an 8-bit grid's 255 survives."""
    w, stats = _layer(16, 64, seed=3)
    factor = inverse_hessian_factor(stats["hessian"])

    def round_fn(j, col):
        c = (col * 200 + 128).round().clamp(0, 255)
        return (c - 128) / 200, c.long()
    codes = error_feedback(w, None, round_fn, factor=factor)
    assert codes.dtype == torch.long and int(codes.max()) == 255 and int(codes.min()) == 0
    assert torch.equal(codes, reference_feedback(w, round_fn, factor))


def test_codes_come_back_contiguous_int64(monkeypatch):
    """As before the int16 buffer: ``(out, in)`` int64, contiguous (callers view and pack it), on both paths."""
    w, stats = _layer(16, 64, seed=5)
    factor = inverse_hessian_factor(stats["hessian"])
    fast, slow = _both(monkeypatch, lambda: error_feedback(w, None, lambda j, col: (col.round(), col.round().long()), factor=factor))
    for codes in (fast, slow):
        assert codes.shape == (16, 64) and codes.dtype == torch.long and codes.is_contiguous()

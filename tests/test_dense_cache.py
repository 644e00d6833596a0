"""The dense cache of a packed layer (:meth:`qrecover.qlinear._Packed.dequantize`), and packed embedding lookups
that decode only their rows (:meth:`qrecover.schemes.base.Quantizer.rows`).

A tied packed table is read in two dtypes while training with a bf16 base on a GPU: its lookups in the compute
dtype (fp32) and the output head in bf16. Before, each evicted the other from the one-dtype cache, so the whole table
was dequantized twice at every step; now the lookups decode their rows and the head's bf16 table is made once.

A lookup reads a few rows of a large table: it decodes those rows (the same values as the whole dequantization's,
every scheme and width), and keeps no dense copy of the table unless one is kept already in its dtype.
"""

from __future__ import annotations

import pytest
import torch

from qrecover.qlinear import QuantEmbedding
from qrecover.schemes import get_quantizer


def _table(cache: bool = True) -> QuantEmbedding:
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(0))
    return QuantEmbedding(get_quantizer("blockwise", block_size=16).quantize(w, 4, {}), cache=cache)


def _counted(layer, monkeypatch) -> list:
    calls = []
    real = layer._quantizer.dequantize

    def counting(qw, dtype=None):
        calls.append(dtype)
        return real(qw, dtype)

    monkeypatch.setattr(layer._quantizer, "dequantize", counting)
    return calls


def test_a_tied_table_training_in_bf16_is_dequantized_once(monkeypatch):
    """GPU training with the bf16 base: the lookups (compute dtype fp32) decode their rows, so the only dense copy is
    the head's bf16 one, made once; before, the lookups' fp32 table and the head's bf16 one evicted each other."""
    from qrecover.qlinear import QuantLMHead

    layer = _table()
    head = QuantLMHead(layer)
    layer.train()
    ids, h = torch.tensor([[1, 5, 5, 63]]), torch.randn(4, 32).bfloat16()
    calls = _counted(layer, monkeypatch)
    for _ in range(3):  # step after step: lookups, then the head
        assert layer(ids).dtype == torch.float32
        assert head(h).dtype == torch.bfloat16
    assert calls == [torch.bfloat16] and layer._dense.dtype == torch.bfloat16


def test_dropping_the_cache_drops_the_autocast_cast_too():
    layer = _linear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(torch.randn(2, 64))
    assert "_dense_autocast" in layer.__dict__
    layer._dense = None
    assert "_dense_autocast" not in layer.__dict__


def test_no_cache_keeps_nothing(monkeypatch):
    layer = _table(cache=False)
    calls = _counted(layer, monkeypatch)
    layer.dequantize(), layer.dequantize(torch.bfloat16), layer.dequantize()
    assert len(calls) == 3 and layer._dense is None


# --- lookups decode only their rows ----------------------------------------------------------------------------

ROW_CASES = [("blockwise", dict(block_size=32, symmetric=True), 4, (64, 96)),
             ("blockwise", dict(block_size=32, symmetric=False), 3, (64, 96)),  # zero points end inside a byte: repacked
             ("blockwise", dict(block_size=16, symmetric=False), 8, (48, 64)),
             ("gptq", dict(group_size=32, symmetric=False), 4, (64, 96)),
             ("gptq", dict(group_size=32, symmetric=False), 2, (64, 96)),
             ("palettize", dict(group_size=16), 3, (64, 96)),
             ("palettize", dict(group_size=16, block_size=32), 2, (64, 96)),
             ("palettize", dict(group_size=8), 6, (32, 64))]


def _quantized(scheme, params, bits, shape):
    w = torch.randn(shape, generator=torch.Generator().manual_seed(bits))
    stats = {"hessian": torch.eye(shape[1]) + 0.1, "input_sq": torch.ones(shape[1])}
    q = get_quantizer(scheme, **params)
    return q, q.quantize(w, bits, stats)




@pytest.mark.parametrize("scheme,params,bits,shape", ROW_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_rows_are_the_whole_dequantization_rows(scheme, params, bits, shape, dtype):
    q, qw = _quantized(scheme, params, bits, shape)
    ids = torch.tensor([5, 0, shape[0] - 1, 5, 17, 16, 15])  # repeats, both ends, a group's edge
    rows = q.rows(qw, ids, dtype)
    assert rows.dtype == dtype and torch.equal(rows, q.dequantize(qw, dtype)[ids])


def test_rows_whose_codes_end_inside_a_byte_are_not_taken():
    q, qw = _quantized("blockwise", dict(block_size=None, symmetric=True), 3, (16, 36))  # 108 bits a row
    assert q.rows(qw, torch.tensor([1])) is None


def test_embedding_lookup_decodes_rows_and_keeps_no_dense_table(monkeypatch):
    """A lookup gives exactly ``F.embedding`` of the whole dequantized table, of any ids shape, and leaves no
    table-sized copy behind; where a dense cache in the compute dtype exists (a tied head on the CPU), it is read."""
    for scheme, params, bits, shape in ROW_CASES:
        _, qw = _quantized(scheme, params, bits, shape)
        emb = QuantEmbedding(qw, cache=True)
        ids = torch.tensor([[3, 3, 0], [shape[0] - 1, 7, 16]])
        want = torch.nn.functional.embedding(ids, emb._quantizer.dequantize(emb.packed))
        assert torch.equal(emb(ids), want) and emb._dense is None, scheme
    emb.dequantize()  # the cache, in the compute dtype: lookups read it from now on
    monkeypatch.setattr(emb._quantizer, "rows", lambda *a: pytest.fail("rows decoded beside a dense cache"))
    assert torch.equal(emb(ids), want)


def test_embedding_without_row_access_falls_back_to_the_whole_table():
    _, qw = _quantized("blockwise", dict(block_size=None, symmetric=True), 3, (16, 36))
    emb = QuantEmbedding(qw, cache=True)
    ids = torch.tensor([0, 15, 4])
    assert torch.equal(emb(ids), emb._quantizer.dequantize(emb.packed)[ids]) and emb._dense is not None


# --- the weight a linear reads under autocast ------------------------------------------------------------------

def _linear(cache: bool = True):
    from qrecover.qlinear import QuantLinear

    w = torch.randn(48, 64, generator=torch.Generator().manual_seed(1))
    return QuantLinear(get_quantizer("blockwise", block_size=32).quantize(w, 4, {}), bias=torch.randn(48), cache=cache)


def _weight_casts(fn) -> int:
    """How many ``_to_copy`` of a weight-sized (48 x 64) tensor ``fn`` dispatches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket.__name__ == "_to_copy" and tuple(out.shape) == (48, 64):
                Casts.n += 1
            return out

    with Casts():
        fn()
    return Casts.n


@pytest.mark.parametrize("low", [torch.bfloat16, torch.float16])
def test_autocast_weight_is_cast_once_and_kept_in_place_of_fp32(low):
    """bf16 autocast over fp32 activations (the CPU's recovery): the same outputs as autocast casting the fp32 weight
    at every call, bit for bit, with one cast in all; the cast is kept instead of the fp32 weight."""
    layer = _linear()
    x = torch.randn(5, 64, requires_grad=True)
    w32 = layer._quantizer.dequantize(layer.packed, torch.float32)
    with torch.autocast("cpu", dtype=low):
        want = torch.nn.functional.linear(x, w32, layer.bias)
        assert _weight_casts(lambda: layer(x)) == 1
        for _ in range(2):
            assert _weight_casts(lambda: torch.equal(layer(x), want)) == 0
            out = layer(x)
            assert out.dtype == low and torch.equal(out, want)
    gx, = torch.autograd.grad(out.float().sum(), x)
    with torch.autocast("cpu", dtype=low):
        gx_want, = torch.autograd.grad(torch.nn.functional.linear(x, w32, layer.bias).float().sum(), x)
    assert torch.equal(gx, gx_want)
    assert layer._dense is None and layer.__dict__["_dense_autocast"].dtype == low
    assert torch.equal(layer(x), torch.nn.functional.linear(x, w32, layer.bias))  # outside autocast: fp32 again
    layer.to(torch.float32)  # a move or cast drops it
    assert "_dense_autocast" not in layer.__dict__


def test_autocast_weight_needs_the_cache_and_fp32_inputs():
    layer = _linear(cache=False)
    x = torch.randn(3, 64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert _weight_casts(lambda: (layer(x), layer(x))) == 2  # no cache: autocast casts at each call, as before
        layer = _linear()
        layer(x.bfloat16())  # bf16 inputs: the bf16 dequantization itself, as before
        assert "_dense_autocast" not in layer.__dict__ and layer._dense.dtype == torch.bfloat16

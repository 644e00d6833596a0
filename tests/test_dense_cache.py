"""The dense cache of a packed layer (:meth:`qrecover.qlinear._Packed.dequantize`).

A tied packed table is read in two dtypes while training with a bf16 base on a GPU: its lookups in the compute
dtype (fp32) and the output head in bf16. Each dtype must be dequantized once and then served from the cache; before,
each evicted the other, so the whole table was dequantized twice at every step. Dropping the cache (a move, a cast,
new packed tensors) drops both dtypes.
"""

from __future__ import annotations

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


def test_two_dtypes_are_each_dequantized_once(monkeypatch):
    layer = _table()
    want = {dt: layer._quantizer.dequantize(layer.packed, dt) for dt in (torch.float32, torch.bfloat16)}
    calls = _counted(layer, monkeypatch)
    for _ in range(3):  # lookups in fp32, the head in bf16, step after step
        assert torch.equal(layer.dequantize(), want[torch.float32])
        assert torch.equal(layer.dequantize(torch.bfloat16), want[torch.bfloat16])
    assert calls == [torch.float32, torch.bfloat16]
    # a third dtype takes the second's place; the first stays
    assert layer.dequantize(torch.float16) is layer.dequantize(torch.float16)
    assert layer.dequantize() is layer.dequantize() and len(calls) == 3
    layer.dequantize(torch.bfloat16)
    assert calls == [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]


def test_dropping_the_cache_drops_both_dtypes(monkeypatch):
    layer = _table()
    layer.dequantize(), layer.dequantize(torch.bfloat16)
    layer.to(torch.float64)  # a cast: the compute dtype changes, every cached copy goes
    calls = _counted(layer, monkeypatch)
    assert layer.dequantize().dtype == torch.float64 and layer.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert calls == [torch.float64, torch.bfloat16]
    layer._dense = None
    layer.dequantize(torch.bfloat16)
    assert calls == [torch.float64, torch.bfloat16, torch.bfloat16]


def test_no_cache_keeps_nothing(monkeypatch):
    layer = _table(cache=False)
    calls = _counted(layer, monkeypatch)
    layer.dequantize(), layer.dequantize(torch.bfloat16), layer.dequantize()
    assert len(calls) == 3 and layer._dense is None

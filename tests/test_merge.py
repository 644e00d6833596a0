"""Merging a LoRA adapter into qrecover's packed weights (qrecover.adapters.peft_quant).

Before: ``merge_and_unload()`` added the delta to ``QuantLinear.weight``, a dequantized copy, and returned the
base model unchanged. Checks that every PEFT path (``attach_lora``, ``get_peft_model`` with a registered config,
``qrecover.load(adapter=)``, ``PeftModel.from_pretrained`` through ``load_adapter``) builds
:class:`QuantLoraLinear`; that merging re-quantizes with the layer's own encoding, so the merged model follows
the adapter up to the re-quantization error (bounded per layer by 1.5x the checkpoint's own quantization error
of that layer, and exactly for blockwise int8 by half a quantization step); that unmerging restores the packed
tensors bit-exactly; that the merged model's state reloads; and that a scheme which needs calibration statistics
(palettize) refuses a bare merge with a QRecoverError, merging once :func:`collect_merge_stats` gave them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from conftest import build_tiny_model
from peft import LoraConfig, PeftModel, get_peft_model

from qrecover.adapters.lora import attach_lora, base_identity, load_adapter, lora_modules, quantized_targets, save_adapter
from qrecover.adapters.peft_quant import MERGE_WARNING, QuantLoraLinear, collect_merge_stats, merge_and_unload, register_quant_lora, requantize
from qrecover.errors import QRecoverError
from qrecover.loading import load
from qrecover.qlinear import QuantLinear
from qrecover.schemes import QuantizedWeight, get_quantizer, register_quantizer
from qrecover.schemes.blockwise import Blockwise, BlockwiseConfig

B_SCALE = 0.1  # init_lora_weights=False draws B like A; scaled by this, the delta is ~40% of the weight's norm


def _ids(n: int = 2, t: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 49152, (n, t), generator=torch.Generator().manual_seed(seed))


CALIB = _ids(4, 64, seed=7)  # the calibration windows the merge collects its statistics on


def _packed(model: nn.Module) -> dict[str, dict[str, torch.Tensor]]:
    """``{layer name in the base model: its packed tensors}`` of a base or PEFT-wrapped model."""
    return {n.removeprefix("base_model.model.").removesuffix(".base_layer"): {k: v.clone() for k, v in m.packed.tensors.items()}
            for n, m in model.named_modules() if isinstance(m, QuantLinear)}


def _random_lora(model: nn.Module, rank: int = 4):
    torch.manual_seed(0)
    config = LoraConfig(r=rank, lora_alpha=2 * rank, init_lora_weights=False, target_modules=quantized_targets(model))
    peft_model = get_peft_model(model, register_quant_lora(config))
    with torch.no_grad():
        for mod in lora_modules(peft_model).values():
            mod.lora_B["default"].weight.mul_(B_SCALE)
    return peft_model


@pytest.fixture(scope="module")
def random_adapter(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("merge") / "random-r4"
    save_adapter(_random_lora(load(tiny_ckpt)), out, base_identity(tiny_ckpt), parameters=1)
    return out


def _peft(path: str, tiny_ckpt, random_adapter):
    if path == "get_peft_model":
        return _random_lora(load(tiny_ckpt))
    if path == "attach_lora":
        torch.manual_seed(0)
        model = attach_lora(load(tiny_ckpt), 4)
        with torch.no_grad():
            for mod in lora_modules(model).values():
                nn.init.normal_(mod.lora_B["default"].weight, std=0.05)
        return model
    if path == "load(adapter=)":
        return load(tiny_ckpt, adapter=random_adapter)
    return load_adapter(load(tiny_ckpt), random_adapter, tiny_ckpt)


@pytest.mark.parametrize("path", ["get_peft_model", "attach_lora", "load(adapter=)", "PeftModel.from_pretrained"])
def test_merge_and_unload_puts_the_adapter_into_the_packed_weights(path, tiny_ckpt, tiny_model_dir, random_adapter):
    ids = _ids()
    with torch.no_grad():
        base = load(tiny_ckpt)(input_ids=ids).logits
        peft_model = _peft(path, tiny_ckpt, random_adapter)
        layers = lora_modules(peft_model)
        assert layers and all(type(m) is QuantLoraLinear for m in layers.values())
        before = _packed(peft_model)
        unmerged = peft_model(input_ids=ids).logits
        assert not torch.allclose(unmerged, base, atol=1e-3)  # the adapter does something
        with pytest.warns(UserWarning, match="re-quantizes"):
            merged_model = merge_and_unload(peft_model, CALIB)
        merged = merged_model(input_ids=ids).logits
    assert not any("lora_" in n for n, _ in merged_model.named_parameters())
    after = _packed(merged_model)
    assert set(after) == set(before)
    assert sum(not m.merge_error["kept_original"] for m in layers.values()) >= len(layers) // 2
    for name in before:  # the layers hold new packed weights (or kept theirs: see below), in the same format and size
        changed = any(not torch.equal(before[name][k], after[name][k]) for k in before[name])
        assert changed != layers[name].merge_error["kept_original"], name
        assert {k: (v.dtype, v.shape) for k, v in before[name].items()} == {k: (v.dtype, v.shape) for k, v in after[name].items()}
    # the bug: the merged model was the base model, exactly
    assert not torch.allclose(merged, base, atol=1e-3)
    # the merged model follows the adapter: much nearer to it than the base is, and re-quantizing cost no more than
    # the checkpoint's own quantization did (measured on these logits: ~0.3x and ~0.8x)
    original = build_tiny_model()(input_ids=ids).logits.detach()
    assert (merged - unmerged).norm() < 0.5 * (base - unmerged).norm()
    assert (merged - unmerged).norm() < 1.0 * (base - original).norm()
    # the stated per-layer bound: re-quantizing W + delta costs at most 1.5x the checkpoint's own quantization error
    teacher = dict(build_tiny_model().named_modules())
    for name, mod in layers.items():
        w0 = teacher[name].weight.detach()
        own = float((_dense(before[name], mod) - w0).norm() / w0.norm())
        assert mod.merge_error["requant_rel"] <= 1.5 * own, (name, mod.merge_error, own)


def _dense(tensors: dict[str, torch.Tensor], mod: QuantLoraLinear) -> torch.Tensor:
    base = mod.get_base_layer()
    qw = QuantizedWeight(base.scheme, base.bits, base.shape, base.params, tensors)
    return get_quantizer(base.scheme, **base.params).dequantize(qw)


def test_unmerge_restores_the_packed_weights_bit_exactly(tiny_ckpt):
    ids = _ids()
    peft_model = _random_lora(load(tiny_ckpt))
    before = _packed(peft_model)
    with torch.no_grad():
        unmerged = peft_model(input_ids=ids).logits
        with pytest.raises(QRecoverError, match=r"'palettize' re-quantizes .*\['hessian', 'input_sq'\].*merge_and_unload"):
            peft_model.merge_adapter()  # palettize without calibration statistics: refused, nothing changed
        assert _packed(peft_model).keys() == before.keys() and all(
            torch.equal(before[n][k], v) for n, t in _packed(peft_model).items() for k, v in t.items())
        assert collect_merge_stats(peft_model, CALIB) == len(before)
        with pytest.warns(UserWarning):
            peft_model.merge_adapter()
        merged_packed = _packed(peft_model)
        assert merged_packed.keys() == before.keys() and any(
            not torch.equal(before[n]["qdata"], merged_packed[n]["qdata"]) for n in before)
        merged = peft_model(input_ids=ids).logits
        assert not torch.equal(merged, unmerged)
        peft_model.unmerge_adapter()
        restored = _packed(peft_model)
        for name in before:
            for k in before[name]:
                assert torch.equal(before[name][k], restored[name][k]) and before[name][k].dtype == restored[name][k].dtype
        assert torch.equal(peft_model(input_ids=ids).logits, unmerged)
        # merging again is deterministic, and the adapter-disabled forward of a merged model unmerges to the base
        with pytest.warns(UserWarning):
            peft_model.merge_adapter()
        assert all(torch.equal(merged_packed[n][k], v) for n, t in _packed(peft_model).items() for k, v in t.items())
        with peft_model.disable_adapter():
            assert torch.equal(peft_model(input_ids=ids).logits, load(tiny_ckpt)(input_ids=ids).logits)


def test_merged_model_state_reloads_into_a_fresh_checkpoint_model(tiny_ckpt):
    ids = _ids()
    with torch.no_grad(), pytest.warns(UserWarning):
        merged_model = merge_and_unload(_random_lora(load(tiny_ckpt)), CALIB)
        merged = merged_model(input_ids=ids).logits
        fresh = load(tiny_ckpt)
        fresh.load_state_dict(merged_model.state_dict(), strict=True)
        assert torch.equal(fresh(input_ids=ids).logits, merged)
        assert all(t.is_contiguous() for t in merged_model.state_dict().values())
        # and the merged model takes a new adapter like any checkpoint model
        again = attach_lora(merged_model, 2)
        assert torch.equal(again(input_ids=ids).logits, merged)


def test_merge_logs_the_per_layer_cost(tiny_ckpt, caplog):
    peft_model = _random_lora(load(tiny_ckpt))
    collect_merge_stats(peft_model, CALIB)
    with caplog.at_level(logging.INFO, logger="qrecover.adapters.peft_quant"), pytest.warns(UserWarning) as record:
        peft_model.merge_adapter()
    assert any(str(w.message) == MERGE_WARNING for w in record)
    lines = [r.getMessage() for r in caplog.records if "re-quantization error" in r.getMessage()]
    assert len(lines) == len(lora_modules(peft_model))


# --- one layer, no model ------------------------------------------------------------------------------------


class _One(nn.Module):
    def __init__(self, layer: nn.Module):
        super().__init__()
        self.proj = layer

    def forward(self, x):
        return self.proj(x)


def _quant_layer(scheme: str = "blockwise", bits: int = 8, **params) -> tuple[QuantLinear, torch.Tensor]:
    w = torch.randn(6, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    qw = get_quantizer(scheme, **params).quantize(w.float(), bits, {})
    return QuantLinear(qw, bias=torch.randn(6, generator=torch.Generator().manual_seed(2))), w


def test_lora_layer_forward_is_base_plus_lora_and_trains_only_a_b():
    layer, _ = _quant_layer(block_size=8)
    model = get_peft_model(_One(layer), register_quant_lora(LoraConfig(r=2, lora_alpha=4, init_lora_weights=False,
                                                                        target_modules=["proj"])))
    lora = model.base_model.model.proj
    assert isinstance(lora, QuantLoraLinear) and "QuantLoraLinear" in repr(lora)
    x = torch.randn(3, 8, dtype=torch.float64)
    a, b = lora.lora_A["default"].weight.double(), lora.lora_B["default"].weight.double()
    ref = x @ layer.dequantize().double().T + layer.bias.double() + 2.0 * (x @ a.T) @ b.T
    out = model(x.float())
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    grads = {n for n, p in model.named_parameters() if p.grad is not None}
    assert grads == {n for n, _ in model.named_parameters() if "lora_" in n} and grads


def test_blockwise_int8_merge_is_within_half_a_step_of_the_exact_sum():
    layer, _ = _quant_layer(block_size=8)
    model = get_peft_model(_One(layer), register_quant_lora(LoraConfig(r=2, lora_alpha=4, init_lora_weights=False,
                                                                        target_modules=["proj"])))
    lora = model.base_model.model.proj
    exact = layer.dequantize().double() + lora.get_delta_weight("default").double()  # float64 reference
    with pytest.warns(UserWarning):
        lora.merge()
    merged = layer.dequantize().double()
    step = exact.abs().amax(-1, keepdim=True) / 127  # symmetric int8, one block per row here
    assert ((merged - exact).abs() <= step / 2 + step * 1e-3 + 1e-6).all()  # half a step (+ the fp16 scale)
    assert layer.scheme == "blockwise" and layer.bits == 8 and layer.params == {"block_size": 8, "symmetric": True, "clip": False}
    x = torch.randn(4, 8)
    torch.testing.assert_close(model(x).double(), x.double() @ exact.T + layer.bias.double(), rtol=0, atol=0.05)


def test_set_packed_swaps_buffers_and_drops_the_cache():
    layer, w = _quant_layer(block_size=8)
    layer.cache = True
    old = layer.dequantize().clone()
    qw = get_quantizer("blockwise", block_size=4).quantize((w * 2).float(), 4, {})
    layer.set_packed(qw)
    assert layer._dense is None and layer.bits == 4 and layer.params["block_size"] == 4
    assert torch.equal(layer.dequantize(), qw.dequantize()) and not torch.equal(layer.dequantize(), old)
    assert set(dict(layer.named_buffers())) == set(qw.tensors)
    with pytest.raises(QRecoverError, match=r"shape \(8, 6\)"):
        layer.set_packed(get_quantizer("blockwise", block_size=6).quantize(torch.randn(8, 6), 4, {}))


@dataclass
class _NeedsHessianConfig(BlockwiseConfig):
    pass


@register_quantizer
class _NeedsHessian(Blockwise):
    """A test scheme that reads the Hessian unconditionally (as a GPTQ-only scheme would)."""

    name = "test-needs-hessian"
    Config = _NeedsHessianConfig

    def quantize(self, weight, bits, stats):
        stats["hessian"]  # noqa: B018 - the point: a missing statistic
        return super().quantize(weight, bits, stats)


def test_scheme_that_cannot_requantize_without_statistics_raises_clearly():
    w = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    qw = get_quantizer("test-needs-hessian", block_size=8).quantize(w, 8, {"hessian": torch.eye(8)})
    layer = QuantLinear(qw, bias=torch.zeros(6))  # (PEFT needs one parameter in the model)
    model = get_peft_model(_One(layer), register_quant_lora(LoraConfig(r=2, init_lora_weights=False,
                                                                        target_modules=["proj"])))
    lora = model.base_model.model.proj
    packed = {k: v.clone() for k, v in layer.packed.tensors.items()}
    with pytest.raises(QRecoverError, match="'test-needs-hessian' cannot re-quantize .*'hessian'.*keep the adapter unmerged"):
        lora.merge()
    assert not lora.merged and all(torch.equal(packed[k], v) for k, v in layer.packed.tensors.items())
    lora.merge_stats = {"hessian": torch.eye(8)}  # with the statistic it merges
    with pytest.warns(UserWarning):
        lora.merge()
    assert lora.merged
    with pytest.raises(QRecoverError, match="cannot re-quantize a weight of shape"):
        requantize(qw, torch.zeros(8, 6))


def test_palettize_merges_only_with_its_statistics_and_then_like_compression():
    w = torch.randn(6, 8, generator=torch.Generator().manual_seed(0))
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(3)) * torch.tensor([8.0] + [1.0] * 7)  # an outlier
    stats = {"hessian": x.T @ x / 64, "input_sq": (x**2).mean(0)}
    params = dict(group_size=2)
    layer = QuantLinear(get_quantizer("palettize", **params).quantize(w, 2, stats), bias=torch.zeros(6))
    model = get_peft_model(_One(layer), register_quant_lora(LoraConfig(r=2, init_lora_weights=False,
                                                                        target_modules=["proj"])))
    lora = model.base_model.model.proj
    with pytest.raises(QRecoverError, match=r"\['hessian', 'input_sq'\]"):
        lora.merge()
    assert not lora.merged
    exact = layer.dequantize() + lora.get_delta_weight("default")
    collect_merge_stats(_Ids(model), x.unsqueeze(0))
    torch.testing.assert_close(lora.merge_stats["hessian"], stats["hessian"], rtol=1e-5, atol=1e-5)
    with pytest.warns(UserWarning):
        lora.merge()
    # the merged layer is exactly what compressing W + delta with the same statistics gives
    again = get_quantizer("palettize", **params).quantize(exact, 2, lora.merge_stats)
    assert all(torch.equal(again.tensors[k], v) for k, v in layer.packed.tensors.items())


class _Ids(nn.Module):
    """Feeds ``input_ids`` (here: float inputs) to the wrapped model, as a causal LM is called."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, use_cache=False):
        return self.model(input_ids)


def test_lora_bias_is_refused():
    layer, _ = _quant_layer(block_size=8)
    with pytest.raises(QRecoverError, match="lora_bias"):
        get_peft_model(_One(layer), register_quant_lora(LoraConfig(r=2, lora_bias=True, target_modules=["proj"])))


def test_plain_peft_from_pretrained_with_a_registered_config(tiny_ckpt, random_adapter):
    config = register_quant_lora(LoraConfig.from_pretrained(str(random_adapter)))
    model = PeftModel.from_pretrained(load(tiny_ckpt), str(random_adapter), config=config)
    assert all(type(m) is QuantLoraLinear for m in lora_modules(model).values())
    with pytest.raises(QRecoverError, match="not a LoRA config"):
        register_quant_lora(object())


def test_a_merge_that_cannot_help_keeps_the_packed_weights_and_says_so(tiny_ckpt):
    peft_model = _random_lora(load(tiny_ckpt))
    with torch.no_grad():
        for mod in lora_modules(peft_model).values():
            mod.lora_B["default"].weight.mul_(1e-4)  # a delta far below the quantization step
    before = _packed(peft_model)
    with pytest.warns(UserWarning, match=r"(\d+) of 14 layers kept their packed weights"):
        merged_model = merge_and_unload(peft_model, CALIB)
    after = _packed(merged_model)
    kept = [n for n in before if all(torch.equal(before[n][k], after[n][k]) for k in before[n])]
    assert len(kept) * 2 > len(before)

"""Tests for the ``awq`` transform (``qrecover.transforms.awq``).

- The grid search finds a planted best scale: on a toy linear with one input channel of huge activations,
  ``search_scales`` picks exactly the ratio that a brute force over the same grid (written here in float64
  from the formula) finds best, and that ratio beats no scaling clearly.
- Folding is function-preserving: on tiny random Llama, Mistral, Qwen2, Qwen3, SmolLM3, Gemma, Gemma-2, Gemma-3 and Phi-3
  models (2 layers, hidden 64; with and without grouped-query attention) ``apply_layer`` on every layer,
  with a crude quantize_fn so that real scales are chosen, leaves the logits equal to float32 precision; so does
  the transform stage as ``qrecover compress`` runs it on the whole model (Qwen2 untied, Gemma-3 tied), within a
  few times the untouched model's own float32 rounding (its distance to float64).
- AWQ before RTN 4-bit lowers the decoder layer's output error versus RTN alone on a layer with outlier
  input channels; an architecture without a mapping raises QRecoverError naming it and the supported ones.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from transformers import AutoConfig, AutoModelForCausalLM

from qrecover.calibrate import capture_inputs
from qrecover.errors import QRecoverError
from qrecover.models import decoder_layers, is_tied
from qrecover.schemes import get_quantizer
from qrecover.stages.specs import parse_encodings
from qrecover.stages.transform import apply_transforms
from qrecover.transforms import get_transform
from qrecover.transforms.awq import AWQ, duo_scales, search_scales, weight_mean


def rtn(bits: int, group: int):
    q = get_quantizer("blockwise", block_size=group, symmetric=False)
    return lambda _name, w: q.quantize(w, bits, {}).dequantize(w.dtype)


# --- the search ---------------------------------------------------------------------------------------------


def test_search_finds_planted_best_ratio():
    g = torch.Generator().manual_seed(0)
    n_tok, in_f, out_f = 256, 32, 16
    x = torch.randn(n_tok, in_f, generator=g)
    x[:, 5] *= 40.0  # the planted salient channel
    w = torch.randn(out_f, in_f, generator=g) * 0.1
    quant = rtn(3, 16)
    ref = x @ w.T

    def loss(s):
        wq = quant("fc", w) if s is None else quant("fc", w * s) / s
        return float(((x @ wq.T - ref).double() ** 2).mean())

    x_mean, w_mean = x.abs().mean(0), weight_mean([w], 16)
    s, ratio, before, after = search_scales(x_mean, w_mean, loss, n_grid=20)

    # brute force, float64, from the formula: s = x_mean^r / (w_mean^(1-r) + 1e-4), clamp, / sqrt(max min)
    xm = x.double().abs().mean(0)
    wa = w.double().abs().view(out_f, -1, 16)
    wm = (wa / (wa.amax(-1, keepdim=True) + 1e-6)).view(out_f, in_f).mean(0)
    losses = []
    for i in range(20):
        r = i / 20
        sc = (xm**r / (wm ** (1 - r) + 1e-4)).clamp(min=1e-4)
        sc = sc / (sc.max() * sc.min()).sqrt()
        torch.testing.assert_close(duo_scales(x_mean, w_mean, r).double(), sc, rtol=1e-5, atol=0)
        losses.append(loss(sc.float()))
    best = min(range(20), key=lambda i: losses[i])
    assert sorted(losses)[1] > 1.01 * losses[best]  # a clear winner, not a float32 tie
    assert ratio == best / 20
    assert after == pytest.approx(losses[best], rel=1e-5) and after < 0.7 * before
    assert ratio > 0 and s[5] == s.max()  # the salient channel is scaled up most


def test_search_keeps_identity_when_nothing_helps():
    # a loss that every scaling makes worse: no fold (ratio None, s = 1)
    s, ratio, before, after = search_scales(torch.rand(8) + 0.5, torch.rand(8) + 0.5,
                                            lambda s: 1.0 if s is None else 2.0, n_grid=5)
    assert ratio is None and before == after == 1.0 and torch.equal(s, torch.ones(8))


# --- tiny models --------------------------------------------------------------------------------------------

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              vocab_size=256, max_position_embeddings=128)
ARCHS = {
    "llama": dict(num_key_value_heads=4),  # no GQA: v -> o folds
    "mistral": dict(num_key_value_heads=2, sliding_window=None),
    "qwen2": dict(num_key_value_heads=2),  # GQA: v -> o skipped; q/k/v have biases
    "qwen3": dict(num_key_value_heads=2, head_dim=16),
    "gemma": dict(num_key_value_heads=1, head_dim=16),
    "smollm3": dict(num_key_value_heads=2, pad_token_id=0),
    "gemma2": dict(num_key_value_heads=4, head_dim=16, query_pre_attn_scalar=16),
    "gemma3_text": dict(num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=16, sliding_window=8),
    "phi3": dict(num_key_value_heads=4, pad_token_id=0),  # fused qkv_proj / gate_up_proj
}


def tiny_model(arch: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = AutoConfig.for_model(arch, **COMMON, **ARCHS[arch])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norms (Gemma's start at 0, the others at 1) and biases
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    return model


def layer_inputs(model: nn.Module, windows: torch.Tensor, i: int):
    """The hidden states and keyword arguments decoder layer ``i`` is called with, one per window."""
    return capture_inputs(model, windows, layer=i)


def windows(n: int = 4, seq: int = 24, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, seq), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", list(ARCHS))
def test_folding_preserves_logits(arch):
    model = tiny_model(arch)
    ids = windows()
    probe = windows(2, 32, seed=9)
    with torch.no_grad():
        want = model(input_ids=probe, use_cache=False).logits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    awq = get_transform("awq", group_size=16)
    awq.check(model)
    summaries = []
    for i, layer in enumerate(decoder_layers(model)):
        x, kw = layer_inputs(model, ids, i)
        summaries.append(awq.apply_layer(layer, x, kw, rtn(2, 16)))
    with torch.no_grad():
        got = model(input_ids=probe, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    folded = [m for s in summaries for m in s["mappings"] if m.get("ratio") is not None]
    assert folded, summaries  # real scales were folded, so the check above means something
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("norm" in k for k in changed) and any("proj" in k for k in changed)
    for s in summaries:
        for m in s["mappings"]:
            if "skipped" not in m:
                assert m["error_after"] <= m["error_before"]
    pairs = {(m["prev"], "skipped" in m) for s in summaries for m in s["mappings"]}
    gqa = ARCHS[arch]["num_key_value_heads"] < COMMON["num_attention_heads"]
    v_prev = "self_attn.qkv_proj" if arch == "phi3" else "self_attn.v_proj"
    assert (v_prev, gqa) in pairs  # v -> o is skipped exactly under grouped-query attention


@pytest.mark.parametrize("arch", ["qwen2", "gemma3_text"])
def test_transform_stage_preserves_logits(arch):
    # the whole-model path `qrecover compress` takes (stages.transform.apply_transforms: inputs captured once, each
    # layer transformed then run on to feed the next), on benchmarks/schemes.py's second architectures: Qwen2
    # (q/k/v biases, untied head) and Gemma-3 text (scaled embedding, (1 + w) sandwich norms, tied head)
    model = tiny_model(arch)
    assert is_tied(model) == (arch == "gemma3_text")
    probe = windows(2, 32, seed=9)
    with torch.no_grad():
        want = model(input_ids=probe, use_cache=False).logits
        want64 = copy.deepcopy(model).double()(input_ids=probe, use_cache=False).logits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    info = apply_transforms(model, windows(), parse_encodings("awq+blockwise:2/b16/asym"), torch.device("cpu"),
                            show_progress=False)
    with torch.no_grad():
        got = model(input_ids=probe, use_cache=False).logits
    assert info["names"] == ["awq"] and len(info["layers"]["awq"]) == COMMON["num_hidden_layers"]
    folded = [m for layer in info["layers"]["awq"] for m in layer["mappings"] if m.get("ratio") is not None]
    assert len(folded) >= 4, info["layers"]  # real scales in most mappings, so the comparison means something
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert any("layernorm" in k for k in changed) and any("up_proj" in k for k in changed)
    assert not any("embed" in k or "lm_head" in k for k in changed)
    # within a few times float32's own rounding of the untouched model (its distance to float64)
    floor = float((want.double() - want64).abs().max())
    assert float((got - want).abs().max()) <= max(8 * floor, 1e-6 * float(want.abs().max())), (floor, got - want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_awq_reduces_rtn_output_error_with_outlier_channels():
    model = tiny_model("llama", seed=3)
    layer = decoder_layers(model)[0]
    with torch.no_grad():  # a few input channels with huge activations, as real LLMs have
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight[[3, 17, 40]] *= 25.0
    x, kw = layer_inputs(model, windows(8, 32), 0)
    quant = rtn(4, 16)

    def quantized_layer_error() -> float:
        with torch.no_grad():
            ref = [layer(h, **k)[0] if isinstance(layer(h, **k), tuple) else layer(h, **k) for h, k in zip(x, kw)]
            saved = {n: m.weight.data.clone() for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
            for n, m in layer.named_modules():
                if isinstance(m, nn.Linear):
                    m.weight.data = quant(n, m.weight.data)
            out = [layer(h, **k) for h, k in zip(x, kw)]
            out = [o[0] if isinstance(o, tuple) else o for o in out]
            for n, m in layer.named_modules():
                if isinstance(m, nn.Linear):
                    m.weight.data = saved[n]
        return float(sum(((o - r) ** 2).sum() for o, r in zip(out, ref)))

    plain = quantized_layer_error()
    summary = AWQ(group_size=16).apply_layer(layer, x, kw, quant)
    smoothed = quantized_layer_error()
    assert smoothed < 0.8 * plain, (smoothed, plain, summary)
    attn = summary["mappings"][0]
    assert attn["ratio"] is not None and attn["error_after"] < 0.8 * attn["error_before"]


def test_unknown_architecture_raises():
    class FooDecoderLayer(nn.Module):
        pass

    with pytest.raises(QRecoverError,
                       match=r"awq has no mapping for FooDecoderLayer; supported: \[.*LlamaDecoderLayer.*\]; use an encoding without awq"):
        AWQ().apply_layer(FooDecoderLayer(), [], [], rtn(4, 16))
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_embd=32, n_layer=2, n_head=2, vocab_size=64))
    with pytest.raises(QRecoverError, match=r"no mapping for GPT2Block"):
        get_transform("awq").check(gpt2)
    get_transform("awq").check(tiny_model("qwen2"))  # a supported one passes


def test_search_tokens_takes_whole_first_windows():
    xs = [torch.zeros(1, 24, 64)] * 4
    assert AWQ(search_tokens=50)._search_calls(xs) == 2
    assert AWQ(search_tokens=48)._search_calls(xs) == 2
    assert AWQ(search_tokens=10)._search_calls(xs) == 1  # at least one window
    assert AWQ(search_tokens=None)._search_calls(xs) == 4
    with pytest.raises(QRecoverError, match="n_grid=0"):
        AWQ(n_grid=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_folding_preserves_logits_on_cuda():
    model = tiny_model("llama").cuda()
    ids = windows().cuda()
    probe = windows(2, 32, seed=9).cuda()
    with torch.no_grad():
        want = model(input_ids=probe, use_cache=False).logits
    awq = AWQ(group_size=16)
    for i, layer in enumerate(decoder_layers(model)):
        x, kw = layer_inputs(model, ids, i)
        awq.apply_layer(layer, x, kw, rtn(2, 16))
    with torch.no_grad():
        got = model(input_ids=probe, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))

"""Tests for the compress stages (:mod:`qrecover.stages`) on pure inputs and on the tiny Llama (conftest).

Checks: encoding specs parse to the scheme parameters they name, round-trip through their canonical text,
and every bad spec is a one-line QRecoverError naming the spec and the fix; calibration computes only what
the chosen quantizers' ``needs`` ask for (a quantizer that needs nothing: no Hessian, no backward pass;
q/k/v and gate/up share one Hessian computation); ``finalize`` with an identity quantizer is the identity
and otherwise sees the inputs produced by the already quantized layers; one knapsack picks different
schemes per layer when the damage table says so; the old default path (``--embedding-bits legacy
--no-finalize``) gives exactly the choices the code before the redesign made.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import pytest
import torch

import qrecover
import qrecover.calibrate as calib
from qrecover.allocate import Choice, InfeasibleBudget
from qrecover.api import compress, prepare
from qrecover.calibrate import layer_pass, plan_stats
from qrecover.checkpoint import read_packed
from qrecover.config import CompressConfig
from qrecover.errors import QRecoverError
from qrecover.models import decoder_layers, linear_layers
from qrecover.schemes import Quantizer, get_quantizer, register_quantizer
from qrecover.schemes.base import doc_field
from qrecover.stages.allocation import Budget, choose
from qrecover.stages.finalize import finalize
from qrecover.stages.specs import (
    EXTRA_EMBEDDING,
    LEGACY_EMBEDDING,
    PRESETS,
    embedding_encodings,
    format_encoding,
    linear_encodings,
    make_encoding,
    parse_encoding,
    parse_encodings,
    parse_params,
)

# --- test-only quantizers ------------------------------------------------------------------------------------


@dataclass
class _NoConfig:
    note: int = doc_field(0, "unused")


@register_quantizer
class _Identity(Quantizer):
    """Stores the weight exactly (fp32): quantizing changes nothing. Needs no statistics."""

    name = "t_identity"
    supported_bits = (8,)
    Config = _NoConfig

    def nbytes(self, shape, bits):
        return shape[0] * shape[1] * 4

    def quantize(self, weight, bits, stats):
        return self._pack(bits, tuple(weight.shape), {"qdata": weight.detach().float().clone()})

    def dequantize(self, qw, dtype=torch.float32):
        return qw.tensors["qdata"].to(dtype)


SEEN: dict[str, list[dict]] = {}


@dataclass
class _SpyConfig:
    step: float = doc_field(0.05, "rounding step")


@register_quantizer
class _SpyRound(Quantizer):
    """Rounds to a fixed grid (input-independent) and records the statistics it was given."""

    name = "t_spy"
    supported_bits = (4,)
    needs = frozenset({"hessian"})
    Config = _SpyConfig

    def nbytes(self, shape, bits):
        return shape[0] * shape[1] * 4

    def quantize(self, weight, bits, stats):
        SEEN.setdefault("calls", []).append({k: v.clone() for k, v in stats.items() if isinstance(v, torch.Tensor)})
        s = self.config.step
        return self._pack(bits, tuple(weight.shape), {"qdata": (torch.round(weight.detach().float() / s) * s)})

    def dequantize(self, qw, dtype=torch.float32):
        return qw.tensors["qdata"].to(dtype)


# --- specs ---------------------------------------------------------------------------------------------------


def test_spec_options_reach_the_scheme():
    e = parse_encoding("blockwise:4/b32/asym")
    assert (e.scheme, e.bits) == ("blockwise", 4)
    assert e.params == {"block_size": 32, "symmetric": False, "clip": False} and e.label == "blockwise:4/b32/asym"
    assert parse_encoding("blockwise:8/pc").params == {"block_size": None, "symmetric": True, "clip": False}
    p = parse_encoding("palettize:3/g1/iters=50/weighted=false/importance_power=1.5").params
    assert p["group_size"] == 1 and p["iters"] == 50 and p["weighted"] is False and p["importance_power"] == 1.5
    assert p["block_size"] is None and p["error_feedback"] is True  # defaults resolved
    # the default of --scheme-param applies where the scheme has the field; the spec wins
    a, b = parse_encodings("palettize:2/g8,blockwise:4", {"group_size": 32})
    assert a.params["group_size"] == 8 and b.params == {"block_size": 64, "symmetric": True, "clip": False}
    # equal storage is an equal encoding (labels aside), duplicates dropped
    assert parse_encoding("palettize:4") == parse_encoding("palettize:4/g16")
    assert len(parse_encodings("palettize:4,palettize:4/g16,palettize:3")) == 2
    assert parse_encoding("blockwise:4/b64") != parse_encoding("blockwise:4/b64/asym")


@pytest.mark.parametrize("text", ["palettize:2", "palettize:3/g1/pc", "blockwise:4/b32/asym", "blockwise:8/pc",
                                  "awq+blockwise:4/b32/asym/clip=true",
                                  "palettize:4/b128/error_feedback=false/iters=7", "t_spy:4/step=0.25"])
def test_spec_round_trip(text):
    e = parse_encoding(text)
    canon = format_encoding(e)
    assert parse_encoding(canon) == e
    assert format_encoding(parse_encoding(canon)) == canon
    assert get_quantizer(e.scheme, **e.params).params == e.params


@pytest.mark.parametrize("text, needles", [
    ("pallettize:4", ["'pallettize:4'", "unknown scheme", "palettize"]),
    ("palettize", ["'palettize'", "not an encoding spec", "SCHEME:BITS"]),
    ("palettize:x", ["'palettize:x'", "integer width"]),
    ("palettize:5", ["'palettize:5'", "does not support bits=5", "[2, 3, 4, 6, 8]"]),
    ("blockwise:4/q7", ["'blockwise:4/q7'", "option 'q7'", "gN, bN"]),
    ("blockwise:4/group_size=8", ["'blockwise:4/group_size=8'", "'group_size'", "block_size"]),
    ("nope+palettize:4", ["'nope+palettize:4'", "unknown transform 'nope'"]),
    ("palettize:4//g8", ["'palettize:4//g8'", "option ''"]),
])
def test_spec_errors_are_one_line(text, needles):
    with pytest.raises(QRecoverError) as e:
        parse_encodings(text)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--encodings")
    for n in needles:
        assert n in msg, (n, msg)


def test_spec_list_and_param_errors():
    with pytest.raises(QRecoverError, match="names no encoding"):
        parse_encodings(" , ")
    with pytest.raises(QRecoverError, match=r"--scheme-param iters: none of --encodings 'blockwise:4'"):
        parse_encodings("blockwise:4", {"iters": 3})
    assert parse_params(["group_size=8", "symmetric=false", "damp=0.02", "x=none"]) == {
        "group_size": 8, "symmetric": False, "damp": 0.02, "x": None}
    with pytest.raises(QRecoverError, match="must be KEY=VALUE"):
        parse_params(["group_size"])


def test_shorthands():
    assert [e.label for e in linear_encodings("palettize", [4, 2], {}, None)] == ["palettize:2", "palettize:4"]
    assert linear_encodings("palettize", [2], {"group_size": 8}, None)[0].params["group_size"] == 8
    with pytest.raises(QRecoverError, match=r"does not support \[5\]"):
        linear_encodings("palettize", [5], {}, None)
    assert embedding_encodings("auto", None, budgeted=False) == [LEGACY_EMBEDDING[3]]  # int8 without a budget
    auto = embedding_encodings("auto", None, budgeted=True)
    assert auto[:4] == LEGACY_EMBEDDING and {e.bits for e in auto} == {2, 3, 4, 8}
    assert any(e.scheme == "palettize" and e.params["group_size"] == 1 for e in auto)  # per-row tables
    assert [e.bits for e in embedding_encodings("4", None, True)] == [4, 4, 4]
    assert embedding_encodings("auto", "blockwise:3/b32/asym", True)[0].params == {"block_size": 32, "symmetric": False, "clip": False}


# --- allocation ----------------------------------------------------------------------------------------------


def test_choose_budget_and_scope():
    table = {"a": [Choice("x", 10, 1.0), Choice("y", 20, 0.1)], "b": [Choice("x", 10, 5.0), Choice("y", 20, 0.2)],
             "e": [Choice("z", 7, 0.0), Choice("w", 9, 0.0)]}
    assert choose(table, Budget(None, 1, 0, ["a", "b"])) == {"a": 0, "b": 0, "e": 0}
    # 8 * (30 + 5 fixed) / 8 params -> 35 bytes, 30 for a, b: b (the larger damage saved) gets y; e is outside
    got = choose(table, Budget(8 * 35 / 8 / 1, 8, 5, ["a", "b"]))
    assert got == {"a": 0, "b": 1, "e": 1}
    with pytest.raises(InfeasibleBudget) as e:  # the allocator's one exception, in bytes with the fixed 5
        choose(table, Budget(1.0, 8, 5, ["a", "b"]))
    assert (e.value.budget_bytes, e.value.min_bytes, e.value.max_bytes) == (1, 25, 45)
    assert Budget(1.0, 8, 5, ["a", "b"]).bpw_of(e.value.min_bytes) == pytest.approx(8 * 25 / 8)


# --- calibration: only what is needed --------------------------------------------------------------------------


def test_plan_stats():
    spy, ident, pal = parse_encoding("t_spy:4"), parse_encoding("t_identity:8"), parse_encoding("palettize:4")
    emb8 = LEGACY_EMBEDDING[3]  # blockwise needs nothing
    p = plan_stats([ident], [emb8], damage=False)
    assert p.layer == frozenset() and not p.gradients
    p = plan_stats([spy], [emb8], damage=False)
    assert p.layer == {"hessian"} and not p.gradients
    assert plan_stats([pal], [emb8], damage=False).layer == {"hessian", "input_sq"}
    p = plan_stats([ident], [emb8], damage=True)  # the damage estimate needs the Hessian and the gradients
    assert p.layer == {"hessian"} and p.gradients
    assert plan_stats([parse_encoding("blockwise:4/b32/asym/clip=true")], [emb8], damage=False).layer == {"hessian"}


@pytest.fixture
def counted(monkeypatch):
    calls = {"xtx": 0, "gradients": 0}
    real_xtx, real_grad = calib.xtx, calib.gradient_stats

    def xtx(*a, **k):
        calls["xtx"] += 1
        return real_xtx(*a, **k)

    def grad(*a, **k):
        calls["gradients"] += 1
        return real_grad(*a, **k)

    monkeypatch.setattr(calib, "xtx", xtx)
    monkeypatch.setattr(calib, "gradient_stats", grad)
    return calls


def _cfg(model_dir, **kw):
    return CompressConfig(**{"model": str(model_dir), "calib_samples": 2, "seq_len": 32, **kw})


def test_needs_nothing_computes_nothing(tiny_model_dir, counted):
    """A uniform model whose quantizer needs no statistics: no Hessian, no backward pass."""
    p = prepare(_cfg(tiny_model_dir, bpw=None, encodings="t_identity:8", finalize=False), show_progress=False)
    assert counted == {"xtx": 0, "gradients": 0}
    assert p.calibration["computed"] == {"layer_stats": [], "gradients": False, "damage": False}
    assert p.calibration["loss"] is None
    m = compress(_cfg(tiny_model_dir, bpw=None, encodings="t_identity:8", finalize=False), prepared=p,
                 show_progress=False, out=None)
    assert m["sensitivity"]["predicted_loss_increase"] is None
    lin = [v for v in m["layers"].values() if v["kind"] == "linear"]
    assert lin and all(v["label"] == "t_identity:8" and v["damage"] is None for v in lin)


def test_uniform_model_with_finalize_skips_the_candidate_pass(tiny_model_dir, counted, tmp_path):
    """One linear encoding, no budget, finalize on: finalize quantizes every linear on quantized inputs, so the
    candidate pass (a Hessian per input group, a GPTQ per layer) is not run, and the checkpoint is the same."""
    cfg = _cfg(tiny_model_dir, bpw=None, encodings="gptq:4/g32/asym")
    p = prepare(cfg, show_progress=False)
    assert counted == {"xtx": 0, "gradients": 0}  # finalize's own statistics come later, in compress
    assert all(u.deferred and u.results == [] for u in p.units.values() if u.kind == "linear")
    m = compress(cfg, prepared=p, show_progress=False, out=tmp_path / "a")
    assert counted["xtx"] == 2 * 4 * 2  # finalize: 2 layers x 4 input groups x 2 windows
    # the same as with the candidates computed (the pass is forced by a second, non-uniform encoding list)
    full = prepare(_cfg(tiny_model_dir, bpw=None, encodings="gptq:4/g32/asym", finalize=False), show_progress=False)
    assert not any(u.deferred for u in full.units.values()) and all(u.results for u in full.units.values())
    ref = compress(cfg, prepared=full, show_progress=False, out=tmp_path / "b")
    assert m["weights_file"]["sha256"] == ref["weights_file"]["sha256"]
    assert {n: v["nbytes"] for n, v in m["layers"].items()} == {n: v["nbytes"] for n, v in ref["layers"].items()}
    with pytest.raises(QRecoverError, match="prepared model has no linear candidates.*prepare again"):
        compress(_cfg(tiny_model_dir, bpw=None, encodings="gptq:4/g32/asym", finalize=False), prepared=p,
                 show_progress=False, out=None)


def test_clip_search_end_to_end(tiny_model_dir, tmp_path):
    """``blockwise/.../clip=true`` (with AWQ before it) compresses, calibration computes the Hessian it needs (and
    nothing else), the bytes are plain blockwise's, and the model differs from plain rounding's (some ranges clipped).
    That the clip lowers a layer's output error is tested against a float64 search in test_schemes.py."""
    runs = {}
    for clip in ("false", "true"):
        m = compress(_cfg(tiny_model_dir, bpw=None, encodings=f"awq+blockwise:4/b32/asym/clip={clip}", finalize=False),
                     out=tmp_path / clip, show_progress=False)
        runs[clip] = m
        lin = {v["label"] for v in m["layers"].values() if v["kind"] == "linear"}
        assert lin == {f"awq+blockwise:4/b32/asym/clip={clip}"}
    assert runs["true"]["calibration"]["computed"]["layer_stats"] == ["hessian"]
    assert runs["true"]["measured_bpw"] == runs["false"]["measured_bpw"]
    a, b = qrecover.load(tmp_path / "false"), qrecover.load(tmp_path / "true")
    ids = torch.arange(2, 34).unsqueeze(0)
    with torch.no_grad():
        assert not torch.equal(a(ids).logits, b(ids).logits)  # the clip changed some scales


def test_finalize_groups_layer_takes_one_statistics_pass_per_layer(tiny_model_dir, tmp_path, monkeypatch):
    """--finalize-groups layer: one statistics pass per decoder layer (true-sequential: one per input group);
    the first group (q/k/v, fed the same quantized layer input either way) comes out identical, the later
    groups differ (their statistics were taken before q/k/v were quantized)."""
    import qrecover.stages.finalize as fin
    from qrecover.checkpoint import read_packed

    calls = []
    real = fin.layer_stats
    monkeypatch.setattr(fin, "layer_stats", lambda *a, **k: calls.append(len(a[3])) or real(*a, **k))
    out = {}
    for mode in ("input", "layer"):
        calls.clear()
        m = compress(_cfg(tiny_model_dir, bpw=None, encodings="gptq:4/g32/asym", finalize_groups=mode),
                     out=tmp_path / mode, show_progress=False)
        assert m["finalize"]["mode"].startswith("true-sequential" if mode == "input" else "layer")
        out[mode] = (list(calls), read_packed(tmp_path / mode)[1])
    assert out["input"][0] == [3, 1, 2, 1] * 2 and out["layer"][0] == [7, 7]  # linears per statistics pass
    a, b = out["input"][1], out["layer"][1]
    first = "model.layers.0.self_attn.q_proj"
    assert all(torch.equal(a[first].tensors[t], b[first].tensors[t]) for t in a[first].tensors)
    later = "model.layers.0.mlp.down_proj"
    assert not all(torch.equal(a[later].tensors[t], b[later].tensors[t]) for t in a[later].tensors)
    with pytest.raises(QRecoverError, match="--finalize-groups 'all' must be 'input'"):
        _cfg(tiny_model_dir, finalize_groups="all")


def test_hessian_once_per_distinct_input(tiny_model_dir, counted):
    """palettize needs the Hessian: computed once per window for q/k/v, o, gate/up and down (4), not per linear (7)."""
    prepare(_cfg(tiny_model_dir, bpw=None, encodings="palettize:4", finalize=False), show_progress=False)
    n_layers, windows = 2, 2
    assert counted["xtx"] == n_layers * 4 * windows
    assert counted["gradients"] == 0  # uniform: nothing to allocate, palettize needs no gradients


def test_shared_hessian_is_one_tensor(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    windows = torch.randint(0, 1000, (2, 16))
    got = {}
    layer_pass(model, windows, frozenset({"hessian", "input_sq"}), lambda i, _l, st: got.update(st), "cpu", False)
    for i in range(2):
        q, k, v = (got[f"model.layers.{i}.self_attn.{n}_proj"]["hessian"] for n in "qkv")
        assert q is k is v
        assert got[f"model.layers.{i}.mlp.gate_proj"]["hessian"] is got[f"model.layers.{i}.mlp.up_proj"]["hessian"]
        assert got[f"model.layers.{i}.mlp.down_proj"]["hessian"] is not q
        torch.testing.assert_close(got[f"model.layers.{i}.self_attn.o_proj"]["input_sq"],
                                   got[f"model.layers.{i}.self_attn.o_proj"]["hessian"].diagonal())


# --- finalize ------------------------------------------------------------------------------------------------------


def _model_and_windows(model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(1)
    return model, torch.randint(0, 2000, (2, 24))


def test_finalize_identity(tiny_model_dir):
    """Nothing quantized (an exact quantizer): the finalized weights are the original weights, the model is
    unchanged, and each layer sees exactly the unquantized model's inputs."""
    model, windows = _model_and_windows(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    names = [f"model.layers.{i}.{n}" for i, l in enumerate(decoder_layers(model)) for n in linear_layers(l)]
    ident = parse_encoding("t_identity:8")
    out, info = finalize(model, windows, {n: ident for n in names}, {}, None, "cpu", False)
    assert set(out) == set(names)
    for n in names:
        assert torch.equal(out[n].dequantize(), before[f"{n}.weight"]), n
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert info["damage"] == {}


def test_finalize_sees_quantized_inputs(tiny_model_dir):
    """Layer 1's statistics in finalize are those of inputs produced by the quantized embedding and the
    quantized layer 0 (recomputed here by hand), not the unquantized model's; within a layer, o_proj sees
    q/k/v already quantized."""
    model, windows = _model_and_windows(tiny_model_dir)
    names = [f"model.layers.{i}.{n}" for i, l in enumerate(decoder_layers(model)) for n in linear_layers(l)]
    spy = parse_encoding("t_spy:4/step=0.02")
    emb_q = get_quantizer("blockwise", block_size=32, symmetric=False).quantize(model.model.embed_tokens.weight, 3, {})
    SEEN.clear()
    out, _ = finalize(model, windows, {n: spy for n in names}, {"model.embed_tokens": emb_q}, None, "cpu", False)
    calls = dict(zip(names, SEEN["calls"]))  # quantized in call order: q, k, v, o, gate, up, down per layer

    ref = _model_and_windows(tiny_model_dir)[0]
    with torch.no_grad():
        ref.model.embed_tokens.weight.copy_(emb_q.dequantize())
        for n in names:
            if n.startswith("model.layers.0.") or n.endswith(("q_proj", "k_proj", "v_proj")):
                ref.get_submodule(n).weight.copy_(out[n].dequantize())
    def input_hessian(name):
        xs = []
        h = ref.get_submodule(name).register_forward_hook(lambda _m, i, _o: xs.append(i[0].reshape(-1, i[0].shape[-1])))
        with torch.no_grad():
            for w in windows:
                ref(input_ids=w[None])
        h.remove()
        x = torch.cat(xs).double()
        return (x.T @ x / x.shape[0]).float()
    for n in ("model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.o_proj"):
        torch.testing.assert_close(calls[n]["hessian"], input_hessian(n), rtol=1e-4, atol=1e-6)
    # and it differs from the unquantized model's (the test can tell the two apart)
    plain = _model_and_windows(tiny_model_dir)[0]
    xs = []
    h = plain.model.layers[1].self_attn.q_proj.register_forward_hook(lambda _m, i, _o: xs.append(i[0][0]))
    with torch.no_grad():
        for w in windows:
            plain(input_ids=w[None])
    h.remove()
    x = torch.cat(xs).double()
    assert not torch.allclose(calls["model.layers.1.self_attn.q_proj"]["hessian"], (x.T @ x / x.shape[0]).float(), rtol=1e-3)


def test_finalize_multiplies_each_linear_once_per_window(tiny_model_dir, monkeypatch):
    """Finalize's passes multiply each linear once per window with its final weights, plus once for each of
    the single-window forwards per layer (grouping the linears, checking the attention block's replay, checking the
    output correction, which runs with the attention block replayed), and the correction adds one product of
    down_proj's shape per window: a pass that only wants a group's inputs does not multiply the group (the code
    before 2026-11-29's fifth session did: q/k/v and gate/up twice, o_proj three times per window). The packed
    weights are the same bits either way (tests/test_architectures.py's 17 models, the quick start's sha256)."""
    model, _ = _model_and_windows(tiny_model_dir)
    windows = torch.randint(0, 2000, (6, 24), generator=torch.Generator().manual_seed(2))
    short = {m.weight: n.rpartition(".")[2] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    calls: dict[str, int] = {}
    real = torch.nn.functional.linear

    def counted(x, w, b=None):
        key = short.get(w, "delta" if w.shape == model.model.layers[0].mlp.down_proj.weight.shape else "?")
        calls[key] = calls.get(key, 0) + 1
        return real(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", counted)
    names = [f"model.layers.{i}.{n}" for i, l in enumerate(decoder_layers(model)) for n in linear_layers(l)]
    enc = parse_encoding("gptq:4/g32/asym")
    _, info = finalize(model, windows, {n: enc for n in names}, {}, None, "cpu", False)
    layers = len(decoder_layers(model))
    assert info["outputs_corrected"] == f"{layers}/{layers} layers" and info["blocks_replayed"] == layers
    heads = {k: v for k, v in calls.items() if k not in ("delta", "?")}
    # the correction's check runs with the attention block replayed (its output kept from the pass before)
    assert heads == {**{n: layers * (len(windows) + 2) for n in ("q_proj", "k_proj", "v_proj", "o_proj")},
                     **{n: layers * (len(windows) + 3) for n in ("gate_proj", "up_proj", "down_proj")}}
    assert calls.get("delta") == layers * len(windows) and "?" not in calls


def test_not_computed_linears_give_zeros_of_their_shape_and_are_restored():
    """While a statistics pass only wants their inputs, linears return zeros of their output's shape (their hooks
    still see the input); afterwards each computes again, an instance-level forward (an offloading hook's) put back."""
    from qrecover.calibrate import _not_computed

    a, b = torch.nn.Linear(8, 5), torch.nn.Linear(8, 3)
    wrapped = b.forward
    b.forward = lambda x: wrapped(x) + 1  # as an offloading hook installs its own forward on the instance
    x = torch.randn(2, 4, 8)
    seen = []
    hook = a.register_forward_hook(lambda _m, inp, _out: seen.append(inp[0]))
    with _not_computed([a, b]):
        ya, yb = a(x), b(x)
        assert ya.shape == (2, 4, 5) and yb.shape == (2, 4, 3) and not ya.any() and not yb.any()
    hook.remove()
    assert seen[0] is x
    assert "forward" not in a.__dict__
    torch.testing.assert_close(a(x), x @ a.weight.T + a.bias)
    torch.testing.assert_close(b(x), x @ b.weight.T + b.bias + 1)


def test_presets_expand_to_their_menus_and_mix_with_specs():
    assert parse_encodings("afm") == linear_encodings("palettize", [2, 3, 4], {}, None)
    assert parse_encodings("mixed-awq") == parse_encodings(PRESETS["mixed-awq"])
    blocks = parse_encodings("afm-blocks")
    assert [(e.bits, e.params["block_size"], e.params["block_fit"], e.params["refit"]) for e in blocks] == [
        (2, None, "exact", 2), (3, None, "exact", 2), (4, None, "exact", 2), (2, 192, "nearest", 2), (3, 192, "nearest", 2),
        (4, 192, "nearest", 2)]
    assert parse_encodings("mixed-blocks") == blocks + parse_encodings("gptq:3/g64/mse=true,gptq:4/g64/mse=true")
    assert [(e.params["act_order"], e.params["mse"]) for e in parse_encodings("mixed-blocks")[-2:]] == [(True, True)] * 2
    # the default menu: mixed-blocks on the rotated model (rot+ on every spec)
    assert CompressConfig().encodings == "rot-mixed-blocks"
    rot = parse_encodings("rot-mixed-blocks")
    assert [dataclasses.replace(e, transforms=()) for e in rot] == parse_encodings("mixed-blocks")
    assert {e.transforms for e in rot} == {("rot",)} and len(rot) == 8
    # quick: the default menu, encoding by encoding, without the table refits and GPTQ's range search
    quick = parse_encodings("quick")
    assert [dataclasses.replace(e, params_json=json.dumps({**e.params, "refit": 2} if e.scheme == "palettize" else {**e.params, "mse": True},
                                                          sort_keys=True)) for e in quick] == rot
    assert [e.params["refit"] for e in quick if e.scheme == "palettize"] == [0] * 6
    assert [e.params["mse"] for e in quick if e.scheme == "gptq"] == [False] * 2
    assert parse_encodings("mixed-awq")[0].transforms == ("awq",)
    assert parse_encodings("mixed,blockwise:8/pc") == parse_encodings(PRESETS["mixed"]) + [parse_encoding("blockwise:8/pc")]
    with pytest.raises(QRecoverError, match="preset name"):
        parse_encodings("mixd")


def test_every_builtin_embedding_label_parses_back_to_its_encoding():
    """A manifest's label, passed to --embedding-encodings, must give the encoding that was used."""
    for e in LEGACY_EMBEDDING + EXTRA_EMBEDDING:
        assert parse_encoding(e.label) == e, e.label


def test_embedding_statistics_give_gptq_the_tied_heads_hessian():
    """A tied embedding is also the output head: GPTQ with :func:`embedding_stats`' Hessian (the final hidden state's
    second moments, plus the lookup term) cuts the predicted damage well below rounding to nearest on the same grid
    when those hidden states are correlated (as a trained model's are); an untied embedding's Hessian is diagonal
    (lookup only), and an untied head's is the hidden state's, as for any linear layer."""
    from qrecover.stages.candidates import embedding_stats, quantize_unit

    torch.manual_seed(0)
    vocab, dim = 512, 64
    mix = torch.randn(dim, dim) / dim**0.5
    mix[:, :4] *= 8  # a few dominant directions, as the final hidden states of trained models have
    hidden = torch.randn(4096, dim) @ mix.T
    grads = {"head": {"hessian": hidden.T @ hidden / len(hidden), "out_grad_sq": torch.rand(vocab) * 1e-4},
             "emb_fisher": torch.rand(vocab, dim) * 1e-6}
    w = torch.randn(vocab, dim) * 0.05
    (stats, damage), (head_stats, _) = embedding_stats(grads, (vocab, dim), tied=True, device="cpu")
    gptq = make_encoding("gptq", 4, {"group_size": 32, "symmetric": False})
    rtn = make_encoding("blockwise", 4, {"block_size": 32, "symmetric": False})
    (_, d_gptq), (_, d_rtn) = quantize_unit(w, [gptq, rtn], stats, damage)
    assert d_gptq < 0.7 * d_rtn, (d_gptq, d_rtn)
    (untied, _), _ = embedding_stats(grads, (vocab, dim), tied=False, device="cpu")
    assert torch.count_nonzero(untied["hessian"] - torch.diag(untied["hessian"].diagonal())) == 0
    assert torch.equal(head_stats["hessian"], grads["head"]["hessian"])
    assert embedding_stats(None, (vocab, dim), tied=True, device="cpu") == (({}, None), ({}, None))


# --- the pipeline on the tiny model ----------------------------------------------------------------------------

#: choices of the code before the redesign (commit edf19ed, `api.compress` with tiny_prepared's settings)
OLD_CHOICES_4_6 = {
    **{f"model.layers.{i}.{n}": lab for i in range(2) for n, lab in {
        "self_attn.q_proj": "palettize:2", "self_attn.k_proj": "palettize:2", "self_attn.v_proj": "palettize:4",
        "self_attn.o_proj": "palettize:4", "mlp.down_proj": "palettize:4"}.items()},
    "model.layers.0.mlp.gate_proj": "palettize:4", "model.layers.0.mlp.up_proj": "palettize:3",
    "model.layers.1.mlp.gate_proj": "palettize:3", "model.layers.1.mlp.up_proj": "palettize:3",
    "model.embed_tokens": "blockwise:4/b32/asym",  # labelled "blockwise:4/b32" then (the same encoding)
}
OLD_DAMAGE_4_6 = 0.00020060519669903653


def test_old_default_path_same_choices(tiny_model_dir, tiny_prepared):
    m = compress(CompressConfig(model=str(tiny_model_dir), bpw=4.6, calib_samples=2, seq_len=64, embedding_bits="legacy",
                                finalize=False, bits=[2, 3, 4]), prepared=tiny_prepared, show_progress=False, out=None)
    assert {n: v["label"] for n, v in m["layers"].items()} == OLD_CHOICES_4_6
    assert m["sensitivity"]["predicted_loss_increase"] == pytest.approx(OLD_DAMAGE_4_6, rel=1e-6)
    assert m["finalize"] == {"enabled": False}


def test_finalize_keeps_choices_and_bytes(tiny_model_dir, tiny_prepared, tmp_path):
    a = compress(CompressConfig(model=str(tiny_model_dir), bpw=4.6, calib_samples=2, seq_len=64, finalize=False, bits=[2, 3, 4]),
                 prepared=tiny_prepared, show_progress=False, out=tmp_path / "a")
    b = compress(CompressConfig(model=str(tiny_model_dir), bpw=4.6, calib_samples=2, seq_len=64, bits=[2, 3, 4]),
                 prepared=tiny_prepared, show_progress=False, out=tmp_path / "b")
    assert b["finalize"]["enabled"] and set(b["finalize"]["damage"]) == {n for n, v in b["layers"].items() if v["kind"] == "linear"}
    assert {n: v["label"] for n, v in a["layers"].items()} == {n: v["label"] for n, v in b["layers"].items()}
    assert a["bytes"]["total"] == b["bytes"]["total"]
    lin = [n for n, v in a["layers"].items() if v["kind"] == "linear"]
    ma, mb = qrecover.load(tmp_path / "a"), qrecover.load(tmp_path / "b")
    assert any(not torch.equal(ma.get_submodule(n).dequantize(), mb.get_submodule(n).dequantize()) for n in lin)
    # the prepared model was restored: a second no-finalize run gives the same bytes
    c = compress(CompressConfig(model=str(tiny_model_dir), bpw=4.6, calib_samples=2, seq_len=64, finalize=False, bits=[2, 3, 4]),
                 prepared=tiny_prepared, show_progress=False, out=tmp_path / "c")
    assert c["weights_file"]["sha256"] == a["weights_file"]["sha256"]


@pytest.fixture(scope="module")
def mixed_prepared(tiny_model_dir):
    return prepare(_cfg(tiny_model_dir, bpw=5.0, encodings="palettize:2,palettize:4,blockwise:3/b32/asym,blockwise:8/pc",
                        embedding_encodings="blockwise:4/b32/asym,blockwise:8/pc"), show_progress=False)


def test_mixed_knapsack_follows_damage_table(tiny_model_dir, mixed_prepared, tmp_path):
    """Layer 0 says blockwise is harmless and palettize harmful, layer 1 the reverse: the knapsack follows."""
    p = dataclasses.replace(mixed_prepared, units={n: dataclasses.replace(u) for n, u in mixed_prepared.units.items()})
    for n, u in p.units.items():
        if u.kind == "linear":
            layer0 = ".layers.0." in n
            u.results = [(qw, (0.0 if (c.scheme == "blockwise") == layer0 else 1.0) + 0.01 * (8 - c.bits))
                         for c, (qw, _) in zip(u.cands, u.results)]
    m = compress(_cfg(tiny_model_dir, bpw=6.0, encodings="palettize:2,palettize:4,blockwise:3/b32/asym,blockwise:8/pc",
                      embedding_encodings="blockwise:4/b32/asym,blockwise:8/pc", finalize=False),
                 prepared=p, show_progress=False, out=tmp_path / "mixed")
    for n, v in m["layers"].items():
        if v["kind"] == "linear":
            assert v["scheme"] == ("blockwise" if ".layers.0." in n else "palettize"), (n, v["label"])
    model = qrecover.load(tmp_path / "mixed")  # a checkpoint of mixed schemes loads
    assert {model.get_submodule(n).scheme for n, v in m["layers"].items() if v["kind"] == "linear"} == {"blockwise", "palettize"}


def test_mixed_encodings_real_budget(tiny_model_dir, mixed_prepared, tmp_path):
    m = compress(_cfg(tiny_model_dir, bpw=4.6, encodings="palettize:2,palettize:4,blockwise:3/b32/asym,blockwise:8/pc",
                      embedding_encodings="blockwise:4/b32/asym,blockwise:8/pc"),
                 prepared=mixed_prepared, show_progress=False, out=tmp_path / "real")
    assert m["measured_bpw"]["model"] <= 4.6
    assert m["budget"]["encodings"] == ["palettize:2", "palettize:4", "blockwise:3/b32/asym", "blockwise:8/pc"]
    table = m["sensitivity"]["table"]["model.layers.0.mlp.down_proj"]
    assert set(table) == set(m["budget"]["encodings"])
    # a subset of the prepared encodings reuses the calibration; one outside it is refused
    sub = compress(_cfg(tiny_model_dir, bpw=4.7, encodings="blockwise:3/b32/asym,blockwise:8/pc",
                        embedding_encodings="blockwise:4/b32/asym", finalize=False),
                   prepared=mixed_prepared, show_progress=False, out=None)
    assert {v["scheme"] for v in sub["layers"].values()} == {"blockwise"}
    with pytest.raises(QRecoverError, match="prepared candidates"):
        compress(_cfg(tiny_model_dir, bpw=4.6, encodings="blockwise:4/b32/asym"), prepared=mixed_prepared,
                 show_progress=False, out=None)


def test_menu_encodings_may_fit_some_layers_only(tiny_model_dir, counted, tmp_path):
    """Tables per 128 columns fit only down_proj (128 input columns; the others have 64): it is a candidate there
    and nowhere else, and the allocation runs. A spec that fits no layer, or a menu with nothing for some layer,
    is refused before any work."""
    cfg = dict(bpw=2.6, scope="linear", embedding_encodings="blockwise:4/b32/asym", finalize=False)
    r = compress(_cfg(tiny_model_dir, encodings="palettize:2,palettize:3,palettize:2/b128", **cfg), show_progress=False, out=None)
    table = r["sensitivity"]["table"]
    for n, v in r["layers"].items():
        if v["kind"] != "linear":
            continue
        want = {"palettize:2", "palettize:3"} | ({"palettize:2/b128"} if n.endswith("down_proj") else set())
        assert set(table[n]) == want, n
    assert all(v["label"] != "palettize:2/b128" or n.endswith("down_proj") for n, v in r["layers"].items())
    counted.update(xtx=0, gradients=0)
    with pytest.raises(QRecoverError, match=r"encoding 'palettize:2/b96' cannot store .*block_size=96"):
        compress(_cfg(tiny_model_dir, encodings="palettize:2,palettize:2/b96", **cfg), out=tmp_path / "x", show_progress=False)
    with pytest.raises(QRecoverError, match=r"no encoding of \['palettize:2/b128'\] can store model.layers.0.self_attn.q_proj"):
        compress(_cfg(tiny_model_dir, encodings="palettize:2/b128", **cfg), out=tmp_path / "x", show_progress=False)
    assert counted == {"xtx": 0, "gradients": 0} and not (tmp_path / "x").exists()
    # a preset serves every width: its encodings that fit no layer here (tables per 192 columns) are dropped
    r = compress(_cfg(tiny_model_dir, encodings="afm-blocks", **cfg), show_progress=False, out=None)
    assert {lab for t in r["sensitivity"]["table"].values() for lab in t} >= {"palettize:2/refit=2", "palettize:4/refit=2"}
    assert not any("b192" in lab for t in r["sensitivity"]["table"].values() for lab in t)


def test_nearest_blocks_store_each_layers_own_block(tiny_model_dir, tmp_path):
    """``palettize:2/b64/block_fit=nearest`` on the tiny model: 32 columns per table on its 64-wide layers, 64 on
    down_proj (128 wide); the checkpoint stores each layer's exact block and loads back to the same weights."""
    spec = "palettize:2/b64/block_fit=nearest"
    r = compress(_cfg(tiny_model_dir, bpw=None, encodings=spec, embedding_encodings="blockwise:8/pc", finalize=False),
                 out=tmp_path / "c", show_progress=False)
    lin = {n: v for n, v in r["layers"].items() if v["kind"] == "linear"}
    assert lin and all(v["label"] == spec for v in lin.values())
    assert {n: v["params"]["block_size"] for n, v in lin.items()} == {n: v["shape"][1] // 2 for n, v in lin.items()}
    assert all(v["params"]["block_fit"] == "exact" for v in lin.values())
    layers = read_packed(tmp_path / "c")[1]
    w = layers["model.layers.0.mlp.down_proj"]
    assert w.tensors["lut"].shape == (w.shape[0] // 16 * 2, 4)
    assert torch.equal(w.dequantize(), get_quantizer("palettize", block_size=64).dequantize(w))


def test_bad_specs_fail_before_work(tiny_model_dir, counted, tmp_path):
    with pytest.raises(QRecoverError, match=r"encoding 'blockwise:4/b48' cannot store .*block_size=48"):
        compress(_cfg(tiny_model_dir, bpw=5.0, encodings="blockwise:4/b48"), out=tmp_path / "x", show_progress=False)
    with pytest.raises(QRecoverError, match="unknown scheme"):
        compress(_cfg(tiny_model_dir, bpw=5.0, encodings="gpqt:4"), out=tmp_path / "x", show_progress=False)
    if not torch.cuda.is_available():
        with pytest.raises(QRecoverError, match="CUDA is not available here; use --device cpu or auto"):
            compress(_cfg(tiny_model_dir, bpw=5.0, device="cuda"), out=tmp_path / "x", show_progress=False)
    assert counted == {"xtx": 0, "gradients": 0} and not (tmp_path / "x").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(tiny_model_dir):
    a = prepare(_cfg(tiny_model_dir, bpw=None, encodings="blockwise:4/b32/asym", device="cpu", finalize=False), show_progress=False)
    b = prepare(_cfg(tiny_model_dir, bpw=None, encodings="blockwise:4/b32/asym", device="cuda", finalize=False), show_progress=False)
    for n in a.units:
        wa, wb = a.units[n].results[0][0].dequantize(), b.units[n].results[0][0].dequantize()
        assert wb.device.type == "cpu"
        torch.testing.assert_close(wa, wb, atol=1e-3, rtol=0)


def test_layerwise_gradients_match_whole_model(tiny_model_dir):
    """The one-layer-at-a-time backward pass (the CUDA default) gives the whole-model pass's statistics."""
    model, windows = _model_and_windows(tiny_model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    a = calib.gradient_stats(model, windows, False, "cpu", layerwise=False)
    b = calib.gradient_stats(model, windows, False, "cpu", layerwise=True)
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6) and a["tokens"] == b["tokens"]
    assert set(a["out_grad_sq"]) == set(b["out_grad_sq"]) and len(a["out_grad_sq"]) == 14
    for k in a["out_grad_sq"]:
        torch.testing.assert_close(b["out_grad_sq"][k], a["out_grad_sq"][k], rtol=1e-4, atol=0)
    for k in ("out_grad_sq", "hessian"):
        torch.testing.assert_close(b["head"][k], a["head"][k], rtol=1e-4, atol=1e-12)
    torch.testing.assert_close(b["emb_fisher"], a["emb_fisher"], rtol=1e-4, atol=1e-14)
    assert float(a["emb_fisher"].sum()) > 0 and float(a["out_grad_sq"]["model.layers.0.mlp.down_proj"].sum()) > 0
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]) and v.device.type == "cpu", k
    assert all(not p.requires_grad or p.grad is None for p in model.parameters())


@pytest.mark.parametrize("layerwise", [False, True])
def test_bf16_gradient_pass_keeps_the_statistics_close(tiny_model_dir, layerwise):
    """--grad-precision bf16 (autocast; about 2x faster on CPUs with native bf16): the damage estimates' weights
    stay within a few percent of the fp32 pass's, summed per linear; the model is left as it was."""
    model, windows = _model_and_windows(tiny_model_dir)
    a = calib.gradient_stats(model, windows, False, "cpu", layerwise=layerwise)
    b = calib.gradient_stats(model, windows, False, "cpu", layerwise=layerwise, bf16=True)
    assert b["loss"] == pytest.approx(a["loss"], rel=2e-2)
    for k in a["out_grad_sq"]:
        assert float(b["out_grad_sq"][k].sum()) == pytest.approx(float(a["out_grad_sq"][k].sum()), rel=0.1), k
    assert float(b["emb_fisher"].sum()) == pytest.approx(float(a["emb_fisher"].sum()), rel=0.1)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with pytest.raises(QRecoverError, match="--grad-precision 'half' must be fp32, bf16 or auto"):
        CompressConfig(grad_precision="half")


def test_cpu_matmul_inputs_rounds_to_bf16_and_restores_the_setting():
    """``cpu_matmul_inputs('bf16')``: a float32 matmul equals the float32 product of its bf16-rounded inputs where
    the CPU takes the setting (``cpu_rounds_bf16_inputs``: an Intel CPU with AMX) and so differs from the exact one,
    and is the exact product where it does not (an AMD EPYC with AVX512-BF16); the setting before is back on exit,
    an exception included; an unknown kind is refused."""
    from qrecover.hardware import cpu_matmul_inputs, cpu_rounds_bf16_inputs

    knob = torch.backends.mkldnn.matmul
    before = knob.fp32_precision
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(64, 256, generator=g), torch.randn(256, 96, generator=g)
    exact = (a.double() @ b.double()).float()
    rounded = (a.bfloat16().double() @ b.bfloat16().double()).float()
    with cpu_matmul_inputs("fp32"):
        assert torch.allclose(a @ b, exact, rtol=1e-4, atol=1e-4)
    with cpu_matmul_inputs("bf16"):
        got = a @ b
    if cpu_rounds_bf16_inputs():
        assert torch.allclose(got, rounded, rtol=1e-5, atol=1e-4)
        assert (got - exact).abs().max() > 1e-2  # really rounded: bf16 keeps 8 significant bits
    else:
        assert torch.allclose(got, exact, rtol=1e-4, atol=1e-4)
    with pytest.raises(RuntimeError, match="boom"), cpu_matmul_inputs("bf16"):
        raise RuntimeError("boom")
    assert knob.fp32_precision == before
    with pytest.raises(ValueError, match="'half' must be 'bf16' or 'fp32'"), cpu_matmul_inputs("half"):
        pass


def test_finalize_precision_bf16_rounds_the_statistics_passes_only(tiny_model_dir, tmp_path, monkeypatch):
    """--finalize-precision bf16: finalize's statistics passes run with bf16 matmul inputs, its quantization (GPTQ's
    error feedback) with float32 ones; the manifest records it, the setting is restored, and the weights are as good
    as the fp32 run's (reconstruction error within 10%). 'auto' is bf16 only on a CPU that computes it natively,
    never on a GPU; on a CPU that ignores bf16 inputs it is fp32, recorded as such (an asked-for bf16 warns); a bad
    value is refused before any work."""
    import qrecover.hardware as hardware
    import qrecover.stages.finalize as fin
    from qrecover.checkpoint import read_packed

    monkeypatch.setattr(hardware, "cpu_rounds_bf16_inputs", lambda: True)  # the setting's path on any CPU
    knob = torch.backends.mkldnn.matmul
    before = knob.fp32_precision
    real_stats, real_quantize = fin.layer_stats, fin.quantize_shared
    monkeypatch.setattr(fin, "layer_stats", lambda *a, **k: seen["stats"].add(knob.fp32_precision) or real_stats(*a, **k))
    monkeypatch.setattr(fin, "quantize_shared",
                        lambda *a, **k: seen["quantize"].add(knob.fp32_precision) or real_quantize(*a, **k))
    model, _ = _model_and_windows(tiny_model_dir)
    weights = {f"{n}.weight": m.weight.detach() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    err = {}
    for kind in ("fp32", "bf16"):
        seen = {"stats": set(), "quantize": set()}
        m = compress(_cfg(tiny_model_dir, bpw=None, encodings="gptq:4/g32", finalize_precision=kind),
                     out=tmp_path / kind, show_progress=False)
        assert m["finalize"]["matmul_inputs"] == kind
        assert seen == {"stats": {"bf16" if kind == "bf16" else "ieee"}, "quantize": {"ieee"}}, kind
        assert knob.fp32_precision == before
        packed = read_packed(tmp_path / kind)[1]
        err[kind] = sum(float((packed[n].dequantize() - weights[f"{n}.weight"]).norm() ** 2) for n in packed
                        if f"{n}.weight" in weights)
    assert 0 < err["bf16"] <= 1.1 * err["fp32"]
    monkeypatch.setattr(hardware, "native_bf16", lambda: False)
    assert [fin.matmul_inputs(p, "cpu") for p in ("fp32", "bf16", "auto")] == ["fp32", "bf16", "fp32"]
    monkeypatch.setattr(hardware, "native_bf16", lambda: True)
    assert fin.matmul_inputs("auto", "cpu") == "bf16"
    assert fin.matmul_inputs("auto", "cuda") == fin.matmul_inputs("bf16", torch.device("cuda", 0)) == "fp32"
    monkeypatch.setattr(hardware, "cpu_rounds_bf16_inputs", lambda: False)
    assert fin.matmul_inputs("auto", "cpu") == "fp32"
    with pytest.warns(UserWarning, match="ignores bf16 inputs for float32 matmuls"):
        assert fin.matmul_inputs("bf16", "cpu") == "fp32"
    with pytest.raises(QRecoverError, match="--finalize-precision 'half' must be fp32, bf16 or auto"):
        _cfg(tiny_model_dir, finalize_precision="half")


def test_grad_samples_runs_the_gradient_pass_on_the_first_windows(tiny_model_dir, tmp_path, monkeypatch):
    """``grad_samples=N``: the gradient pass sees the first N calibration windows, the layer pass all of them, and
    the manifest records it; more than the calibration windows is refused before any work."""
    import qrecover.stages.candidates as cand

    seen = {}
    real = cand.gradients

    def spy(model, windows, *a, **k):
        seen["windows"] = windows.clone()
        return real(model, windows, *a, **k)

    monkeypatch.setattr(cand, "gradients", spy)
    run = dict(model=str(tiny_model_dir), bpw=5.0, calib_samples=3, seq_len=32, bits=[2, 4])
    p = prepare(CompressConfig(**run, grad_samples=2), show_progress=False)
    assert torch.equal(seen["windows"], p.windows[:2]) and len(p.windows) == 3
    assert p.calibration["gradient_windows"] == 2 and p.grads["tokens"] == 2 * 32
    with pytest.raises(QRecoverError, match=r"--grad-samples 4 must be between 1 and --calib-samples \(3\)"):
        CompressConfig(**run, grad_samples=4)

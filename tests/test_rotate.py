"""Rotations (qrecover.transforms.rotate / .hadamard): every Hadamard order built is exactly Hadamard and every
rotation orthogonal in float64; R1 + R2 fused into the weights preserve the logits (float64) on tiny random
models of every supported architecture (tied heads via the online final norm, Gemma's (1 + w) norms, q/k/v
biases, q/k norms, fused qkv / gate_up, MoE experts fused and unfused); architectures it cannot fold and
unknown rotation names are one-line errors, exit 2, before any work; a rotated checkpoint reloads with the
in-memory compressed model's logits."""

from __future__ import annotations

import copy
import importlib.util
import json
import math

import pytest
import torch
import transformers as T
from cli_helpers import run as cli
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from qrecover.api import compress, load, prepare
from qrecover.config import CompressConfig
from qrecover.errors import QRecoverError
from qrecover.export import export
from qrecover.models import default_model_dir
from qrecover.moe import unfuse_experts
from qrecover.qlinear import _Packed
from qrecover.transforms import get_transform
from qrecover.transforms.hadamard import KINDS, factors, hadamard, rotation
from qrecover.transforms.rotate import OnlineRotation, check_model, final_norm

BASE = dict(vocab_size=256, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1)
# hidden 48 = 12 x 4 (a Paley factor, as the default model's 576 = 72 x 8); head_dim 12 (Paley I, q = 11)
ARCHS = {
    "llama": (T.LlamaConfig, dict(tie_word_embeddings=True)),
    "qwen2": (T.Qwen2Config, dict(tie_word_embeddings=False)),  # q/k/v biases
    "qwen3": (T.Qwen3Config, dict(tie_word_embeddings=True, head_dim=12)),  # q/k norms
    "gemma": (T.GemmaConfig, dict(tie_word_embeddings=True, head_dim=12)),  # (1 + w) norms, sqrt(hidden) scale
    "phi3": (T.Phi3Config, dict(tie_word_embeddings=False, pad_token_id=0)),  # fused qkv_proj, gate_up_proj
    "mistral": (T.MistralConfig, dict(tie_word_embeddings=False)),
    "granite": (T.GraniteConfig, dict(tie_word_embeddings=True, embedding_multiplier=2.0, residual_multiplier=0.5)),
    "smollm3": (T.SmolLM3Config, dict(tie_word_embeddings=True, pad_token_id=0)),
    "mixtral": (T.MixtralConfig, dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (T.Qwen2MoeConfig, dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=24, shared_expert_intermediate_size=48)),
}
REFUSED = {"gemma2": (T.Gemma2Config, dict(head_dim=12), "Gemma2DecoderLayer"),
           "olmo2": (T.Olmo2Config, {}, "Olmo2DecoderLayer"), "phi": (T.PhiConfig, {}, "PhiDecoderLayer"),
           "cohere": (T.CohereConfig, {}, "CohereDecoderLayer")}


def _model(cls, extra, dtype=torch.float64):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**{**BASE, **extra}), dtype=dtype, experts_implementation="eager").eval()
    with torch.no_grad():  # norms and biases away from their 0/1 init: folding them must matter
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("n", [2, 4, 12, 20, 28, 36, 48, 64, 72, 192, 576, 1536])
def test_hadamard_orders_exact(n):
    h = hadamard(n)
    assert h.dtype == torch.float64 and bool((h.abs() == 1).all())
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.float64))
    assert math.prod(factors(n)) == n


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n", [12, 48, 64, 576, 1536])
def test_rotations_orthogonal(kind, n):
    r = rotation(n, kind, seed=3)
    assert (r @ r.T - torch.eye(n, dtype=torch.float64)).abs().max() < 1e-12
    assert torch.equal(r, rotation(n, kind, seed=3)) and not torch.equal(r, rotation(n, kind, seed=4))
    if kind == "block":  # 576 = 9 blocks of 64: nothing mixes across blocks
        b = n & -n
        assert r[:b, b:].abs().max() == 0 if n != b else True


def test_no_hadamard_for_an_odd_order():
    with pytest.raises(QRecoverError, match="no Hadamard matrix of order 9"):
        hadamard(9)


@pytest.mark.parametrize("tf", ["rot", "rot-block", "rot-random", "rot1", "rot2"])
@pytest.mark.parametrize("name", sorted(ARCHS))
def test_fused_rotation_preserves_logits(name, tf):
    model = _model(*ARCHS[name])
    if name in ("mixtral", "qwen2_moe") and tf == "rot":
        unfuse_experts(model)  # as compress sees them: nn.Linear pairs (the other kinds fold the fused tensors)
    ref = copy.deepcopy(model)
    ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    info = get_transform(tf).apply_model(model, "cpu")
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    # float64 models; some RMSNorms (Gemma's, Granite's) compute in float32 even then: 1e-6 (measured <= 2e-7;
    # a wrong fold is O(1))
    assert float((got - want).abs().max() / want.abs().max()) < 1e-6, name
    emb = model.get_input_embeddings().weight
    assert torch.allclose(emb, ref.get_input_embeddings().weight) == (tf == "rot2")  # R1 rotates the embedding's rows
    layer, ref_layer = model.model.layers[0], ref.model.layers[0]
    offset = 1.0 if name == "gemma" else 0.0
    assert torch.all(layer.input_layernorm.weight == 1 - offset) == (tf != "rot2")  # R1: the scale is in the weights now
    v = "v_proj" if hasattr(layer.self_attn, "v_proj") else "qkv_proj"
    changed = not torch.allclose(getattr(layer.self_attn, v).weight, getattr(ref_layer.self_attn, v).weight)
    assert changed and (info["r2"] is None) == (tf == "rot1")
    if tf == "rot2":
        return
    assert info["tied_head"] == ARCHS[name][1]["tie_word_embeddings"] and bool(info["online"]) == info["tied_head"]
    if not info["tied_head"]:
        assert torch.all(final_norm(model).weight == 1 - offset)


def test_online_rotation_is_the_norm_unrotated():
    norm = T.models.llama.modeling_llama.LlamaRMSNorm(12).double()
    norm.weight.data = torch.randn(12, dtype=torch.float64)
    x, r = torch.randn(5, 12, dtype=torch.float64), rotation(12, "hadamard", 0)
    want = norm(x) @ r
    hooks = OnlineRotation(norm, r)
    assert torch.allclose(norm(x @ r), want, atol=1e-6)  # the hooks run in the input's dtype; r is kept fp32
    first = hooks._on(x)
    assert torch.allclose(norm(x @ r), want, atol=1e-6) and hooks._on(x) is first  # converted once per device/dtype
    assert torch.allclose(norm.float()(x.float() @ r.float()), want.float(), atol=1e-5) and len(hooks._copies) == 2


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_unfoldable_architecture_refused(name):
    cls, extra, layer = REFUSED[name]
    with pytest.raises(QRecoverError, match=f"rot cannot fold {layer}") as e:
        check_model(_model(cls, extra))
    assert "\n" not in str(e.value) and "drop rot+" in str(e.value)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny")
    model = _model(T.LlamaConfig, dict(tie_word_embeddings=True, vocab_size=49152, hidden_size=64, head_dim=16), dtype=torch.float32)
    model.save_pretrained(d)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(d)
    return d


def test_cli_refuses_unknown_rotation_and_unfoldable_model(tmp_path, tiny_dir, capsys):
    out = tmp_path / "out"
    code, _, err = cli(["compress", "--model", str(tiny_dir), "--encodings", "rotx+gptq:3/g64", "--out", str(out)], capsys)
    assert code == 2 and "unknown transform 'rotx'" in err and not out.exists()
    g2 = tmp_path / "g2"
    _model(T.Gemma2Config, dict(head_dim=12, vocab_size=49152), dtype=torch.float32).save_pretrained(g2)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(g2)
    code, _, err = cli(["compress", "--model", str(g2), "--encodings", "rot+gptq:4/g16", "--out", str(out)], capsys)
    assert code == 2 and "rot cannot fold Gemma2DecoderLayer" in err and not out.exists()


def test_the_default_menu_runs_unrotated_where_rotation_cannot_fold(tmp_path, capsys):
    """The default and quick menus are rotated presets: on Gemma-2 (norms after the attention and MLP outputs) their
    rot+ is dropped with a warning and the model compresses unrotated; a hand-written rot+ is refused (test above)."""
    g2 = tmp_path / "g2"
    _model(T.Gemma2Config, dict(head_dim=16, hidden_size=64, intermediate_size=128, vocab_size=49152),
           dtype=torch.float32).save_pretrained(g2)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(g2)
    cfg = CompressConfig(model=str(g2), bpw=4.5, encodings="quick", calib_samples=2, seq_len=32)
    with pytest.warns(UserWarning, match="rot cannot fold Gemma2DecoderLayer.*run without rot\\+ on this model"):
        manifest = compress(cfg, out=tmp_path / "q", show_progress=False)
    assert not manifest.get("transforms") and manifest["budget"]["encodings"]
    labels = {info["label"] for info in manifest["layers"].values()}
    assert labels and not any("rot" in label for label in labels), labels
    code, _, err = cli(["compress", "--model", str(g2), "--bpw", "4.5", "--calib-samples", "2", "--seq-len", "32",
                        "--out", str(tmp_path / "cli")], capsys)
    assert code == 0 and not json.loads((tmp_path / "cli" / "qrecover.json").read_text()).get("transforms")


def test_a_size_with_no_hadamard_construction_is_refused_before_any_work(tmp_path):
    """hidden 92 = 4 x 23 (head dim 46): no Sylvester x Paley construction; rot+ is refused by its check (before calibration), the
    block-diagonal and random kinds take it."""
    src = tmp_path / "h92"
    _model(T.LlamaConfig, dict(hidden_size=92, num_attention_heads=2, num_key_value_heads=2, vocab_size=49152),
           dtype=torch.float32).save_pretrained(src)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(src)
    model = AutoModelForCausalLM.from_pretrained(src)
    with pytest.raises(QRecoverError, match="rot needs a Hadamard matrix of order 92.*use rot-block\\+ or rot-random\\+") as e:
        get_transform("rot").check(model)
    assert "\n" not in str(e.value)
    get_transform("rot-block").check(model), get_transform("rot-random").check(model)


def test_rotated_checkpoint_reloads_with_the_in_memory_logits(tmp_path, tiny_dir, capsys):
    cfg = CompressConfig(model=str(tiny_dir), bpw=None, encodings="rot+gptq:4/g16", embedding_bits="8",
                         calib_samples=2, seq_len=32)
    prepared = prepare(cfg, show_progress=False, lazy=False)
    rotated = copy.deepcopy(prepared.model)  # the in-memory rotated model (online final norm included)
    manifest = compress(cfg, out=tmp_path / "q", prepared=prepared, show_progress=False)
    assert manifest["transforms"]["online"]["model.norm"]["size"] == 64  # tied head: the final norm runs un-rotated
    ids = torch.randint(0, 49152, (1, 20), generator=torch.Generator().manual_seed(2))
    orig = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    q = load(tmp_path / "q")
    with torch.no_grad():
        assert _rel(rotated(ids).logits, orig(ids).logits) < 1e-5  # the fused rotation preserves the function
        for p in rotated.parameters():  # the remainder (norms) is stored in 16 bits
            p.data = p.data.half().float()
        for n, m in q.named_modules():  # the in-memory model with the stored (dequantized) weights
            if isinstance(m, _Packed):
                rotated.get_submodule(n).weight.data = m.dequantize()
        got, exact = q(ids).logits, rotated(ids).logits
        bare = load(tmp_path / "q")
        bare.model.norm._forward_pre_hooks.clear(), bare.model.norm._forward_hooks.clear()
        without = bare(ids).logits
    assert torch.all(q.model.norm.weight != 1)  # tied: the final norm keeps its scale
    assert _rel(got, exact) < 1e-5 and _rel(without, exact) > 0.1  # the re-attached hooks are what makes it exact
    code, out, err = cli(["info", str(tmp_path / "q")], capsys)
    text = " ".join((err + out).replace("│", " ").split())
    assert code == 0 and "1 rotation(s) at run time (tied head" in text and "every export folds it into an untied head" in text


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None, reason="needs compressed-tensors ([export-ct])")
def test_rotated_tied_checkpoint_exports_to_compressed_tensors_with_an_untied_head(tmp_path, tiny_dir):
    """compressed-tensors holds no online final-norm rotation, so the export unties the head (E R1^T diag(g) R1, the
    final norm the identity): transformers alone, nothing online, gives qrecover.load's logits."""
    cfg = CompressConfig(model=str(tiny_dir), bpw=None, encodings="rot+gptq:4/g16/symmetric=true", embedding_bits="8",
                         calib_samples=2, seq_len=32)
    compress(cfg, out=tmp_path / "q", show_progress=False)
    rep = export(tmp_path / "q", "compressed-tensors", tmp_path / "ct")
    assert rep["untied_head"] == {"from": "model.norm", "values": 49152 * 64, "dtype": "float16"} and "transforms" not in rep
    served = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32).eval()
    assert served.lm_head.weight is not served.model.embed_tokens.weight and torch.all(served.model.norm.weight == 1)
    ids = torch.randint(0, 49152, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, ref = served(ids).logits, load(tmp_path / "q")(ids).logits
    assert _rel(got, ref) < 1e-3, _rel(got, ref)  # the untied head is stored in fp16


def test_rotated_tied_checkpoint_exports_to_gguf_with_an_untied_head(tmp_path, tiny_dir):
    """GGUF holds no online final-norm rotation: the export unties the head (E R1^T diag(g) R1 at token_embd's type,
    the final norm the identity), and llama.cpp's layout read by transformers gives qrecover.load's logits."""
    pytest.importorskip("gguf")
    cfg = CompressConfig(model=str(tiny_dir), bpw=None, encodings="rot+blockwise:4/b32/sym", embedding_bits="8",
                         calib_samples=2, seq_len=32)
    compress(cfg, out=tmp_path / "q", show_progress=False)
    rep = export(tmp_path / "q", "gguf", tmp_path / "g")
    head = rep["untied_head"]
    assert head["from"] == "model.norm" and head["values"] == 49152 * 64 and head["type"] == "Q8_0"
    assert head["bytes"] == 49152 * 64 // 32 * 34 and 0 < head["rel_error"] < 1e-2
    assert rep["exact_layers"] == rep["total_layers"]  # Q4_0 and Q8_0 hold the layers and the embedding exactly
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "g", gguf_file="model.gguf", dtype=torch.float32).eval()
    assert hf.lm_head.weight is not hf.model.embed_tokens.weight and torch.all(hf.model.norm.weight == 1)
    ids = torch.randint(0, 49152, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        got, ref = hf(ids, use_cache=False).logits, load(tmp_path / "q")(ids, use_cache=False).logits
    assert _rel(got, ref) < 1e-2, _rel(got, ref)  # the head's Q8_0 rounding only


def test_adapter_on_a_rotated_checkpoint_exports_beside_its_untied_gguf_and_a_head_adapter_is_refused(tmp_path, tiny_dir):
    from qrecover.adapters.lora import attach_lora, base_identity, save_adapter

    pytest.importorskip("gguf")
    compress(CompressConfig(model=str(tiny_dir), bpw=None, encodings="rot+blockwise:4/b32/sym", embedding_bits="8",
                            calib_samples=2, seq_len=32), out=tmp_path / "q", show_progress=False)
    for head_rank in (0, 2):
        torch.manual_seed(1)
        model = attach_lora(load(tmp_path / "q"), rank=2, head_rank=head_rank)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_" in n:
                    p.normal_(0, 0.05)
        save_adapter(model, tmp_path / f"a{head_rank}", base_identity(tmp_path / "q"), model.qrecover_manifest["parameters"]["model"])
    rep = export(tmp_path / "q", "gguf", tmp_path / "g", adapter=tmp_path / "a0")
    assert rep["untied_head"]["type"] == "Q8_0" and rep["adapter"]["tensors"] == 2 * 2 * 7  # 2 layers x 7 linears, A and B
    with pytest.raises(QRecoverError, match="adapts the head of a rot\\+ checkpoint .*--head-rank 0") as e:
        export(tmp_path / "q", "gguf", tmp_path / "g2", adapter=tmp_path / "a2")
    assert "\n" not in str(e.value) and not (tmp_path / "g2").exists()


@pytest.mark.skipif(importlib.util.find_spec("coremltools") is None, reason="needs coremltools ([export-coreml])")
def test_rotated_tied_checkpoint_exports_to_coreml_with_an_untied_head(tmp_path, tiny_dir):
    """Core ML holds no online final-norm rotation either: the package's program reads an fp16 untied head."""
    cfg = CompressConfig(model=str(tiny_dir), bpw=None, encodings="rot+palettize:4", embedding_bits="8",
                         calib_samples=2, seq_len=32)
    compress(cfg, out=tmp_path / "q", show_progress=False)
    rep = export(tmp_path / "q", "coreml", tmp_path / "c")
    assert rep["untied_head"] == {"from": "model.norm", "values": 49152 * 64, "dtype": "float16"}
    assert (tmp_path / "c" / "model.mlpackage").is_dir() and rep["exact_layers"] >= 14  # the palettized layers' own tables


def test_recover_and_tune_train_a_rotated_checkpoint(tmp_path, tiny_dir, text_mix):
    """The default menu rotates: recover distils an adapter onto a rot+ checkpoint and tune trains its scales, both
    through qrecover.load (the final norm's online rotation attached), and what they write keeps the rotation. The
    adapter's 'svd' initialisation compares the teacher's layers with the checkpoint's, so the teacher is rotated the
    same way first (recovery.api.in_checkpoint_basis): with the unrotated teacher the adapted logits were 1.04 off."""
    from qrecover.recovery.api import recover
    from qrecover.recovery.config import RecoverConfig
    from qrecover.recovery.tune import TuneConfig, tune

    compress(CompressConfig(model=str(tiny_dir), bpw=None, encodings="rot+blockwise:8/b32", embedding_bits="8",
                            calib_samples=2, seq_len=32), out=tmp_path / "q", show_progress=False)
    run = dict(mix=str(text_mix), seq_len=32, batch_size=2, objective="kd", decontaminate=False, checkpoint_every=0)
    recover(tmp_path / "q", tmp_path / "lora", RecoverConfig(rank=2, tokens=32 * 2 * 3, **run), show_progress=False)
    tune(tmp_path / "q", tmp_path / "t", TuneConfig(tokens=32 * 2 * 3, lr=1e-3, rounding_windows=1, **run), show_progress=False)
    ids = torch.randint(0, 49152, (1, 20), generator=torch.Generator().manual_seed(2))
    orig = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref, base = orig(ids).logits, load(tmp_path / "q")(ids).logits
        adapted, tuned = load(tmp_path / "q", adapter=tmp_path / "lora")(ids).logits, load(tmp_path / "t")(ids).logits
    online = json.loads((tmp_path / "t" / "qrecover.json").read_text())["transforms"]["online"]
    assert list(online) == ["model.norm"] and (tmp_path / "t" / "model.safetensors").stat().st_size == (
        tmp_path / "q" / "model.safetensors").stat().st_size
    for got in (base, adapted, tuned):  # 8 bits: each near the original's function (without the online final
        assert _rel(got, ref) < 0.05, [_rel(g, ref) for g in (base, adapted, tuned)]  # norm, > 0.1 off: test above)
    assert 0 < _rel(adapted, base) and 0 < _rel(tuned, base)  # both trained


def test_svd_init_and_damage_ranks_refuse_a_teacher_outside_the_checkpoints_basis(tmp_path, tiny_dir):
    """An unrotated teacher of a rot+ checkpoint has weights and inputs in another basis than the checkpoint's layers:
    the 'svd' initialisation from it wrecked the default checkpoint (perplexity 1e13) without a word. It is refused,
    naming the fix; the teacher rotated as the checkpoint (in_checkpoint_basis) is what both accept."""
    from qrecover.adapters.lora import attach_lora
    from qrecover.adapters.rank_alloc import error_spectra
    from qrecover.adapters.svd_init import init_error_svd
    from qrecover.recovery.api import in_checkpoint_basis

    compress(CompressConfig(model=str(tiny_dir), bpw=None, encodings="rot+blockwise:4/b32", embedding_bits="8",
                            calib_samples=2, seq_len=32), out=tmp_path / "q", show_progress=False)
    peft_model = attach_lora(load(tmp_path / "q"), rank=2)
    teacher = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    windows = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    with pytest.raises(QRecoverError, match=r"transforms are none but the checkpoint's layers were quantized after "
                       r"rot.*in_checkpoint_basis.*or use --init zero"):
        init_error_svd(peft_model, teacher, windows)
    with pytest.raises(QRecoverError, match=r"in_checkpoint_basis.*or use --rank-allocation uniform"):
        error_spectra(load(tmp_path / "q"), teacher, windows, ["model.layers.0.self_attn.q_proj"], 2)
    rotated = in_checkpoint_basis(teacher, peft_model.qrecover_manifest)
    assert rotated is not teacher and rotated.qrecover_transforms == ["rot"]
    captured = init_error_svd(peft_model, rotated, windows)
    assert 0.2 < captured["_total"] <= 1.0  # a rank-2 correction of 4-bit errors in the right basis removes a real share
    compress(CompressConfig(model=str(tiny_dir), bpw=None, encodings="blockwise:4/b32", embedding_bits="8",
                            calib_samples=2, seq_len=32), out=tmp_path / "plain", show_progress=False)
    with pytest.raises(QRecoverError, match=r"transforms are rot but .*quantized after none"):  # and the other way round
        init_error_svd(attach_lora(load(tmp_path / "plain"), rank=2), rotated, windows)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def test_lazy_and_whole_model_rotate_alike(tmp_path, tiny_dir):
    """compress loads a safetensors model lazily (one decoder layer in memory at a time): same checkpoint bytes."""
    outs = []
    for lazy in (True, False):
        cfg = CompressConfig(model=str(tiny_dir), bpw=None, encodings="rot+blockwise:4/b16", embedding_bits="8",
                             calib_samples=2, seq_len=32)
        outs.append(tmp_path / f"lazy-{lazy}")
        compress(cfg, out=outs[-1], show_progress=False, lazy=lazy)
    a, b = (load_file(o / "model.safetensors") for o in outs)
    assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == []
    assert torch.all(a["model.layers.0.input_layernorm.weight"] == 1)  # folded norms are stored as ones


def test_untied_rotation_is_fully_fused_and_exports_to_gguf(tmp_path):
    """An untied head takes the final norm's scale: nothing runs online, and GGUF holds the rotated model exactly."""
    pytest.importorskip("gguf")
    src = tmp_path / "qwen2"
    _model(T.Qwen2Config, dict(tie_word_embeddings=False, vocab_size=49152, hidden_size=64), dtype=torch.float32).save_pretrained(src)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(src)
    cfg = CompressConfig(model=str(src), bpw=None, encodings="rot+blockwise:4/b32/sym", embedding_bits="8",
                         calib_samples=2, seq_len=32)
    manifest = compress(cfg, out=tmp_path / "q", show_progress=False)
    assert "online" not in manifest["transforms"] and manifest["transforms"]["layers"]["rot"]["tied_head"] is False
    export(tmp_path / "q", "gguf", tmp_path / "g")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "g", gguf_file="model.gguf", dtype=torch.float32)
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30, 2, 17, 42, 999, 12000]])
    q = load(tmp_path / "q")
    assert torch.all(q.model.norm.weight == 1) and not q.model.norm._forward_hooks
    with torch.no_grad():
        got, want = hf(ids, use_cache=False).logits, q(ids, use_cache=False).logits
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), float((got - want).abs().max())


@pytest.mark.parametrize("spec", ["rot+awq+blockwise:4/b16", "rot-block+palettize:4"])
def test_rotation_composes_with_awq_and_palettize(tmp_path, tiny_dir, spec):
    """Rotations run first (data-free), AWQ's search then sees the rotated model; the float model stays the same function."""
    cfg = CompressConfig(model=str(tiny_dir), bpw=None, encodings=spec, embedding_bits="8", calib_samples=2, seq_len=32)
    prepared = prepare(cfg, show_progress=False, lazy=False)
    ids = torch.randint(0, 49152, (1, 20), generator=torch.Generator().manual_seed(3))
    orig = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert _rel(prepared.model(ids).logits, orig(ids).logits) < 1e-5
    manifest = compress(cfg, out=tmp_path / "q", prepared=prepared, show_progress=False)
    names = spec.split("+")[:-1]
    assert manifest["transforms"]["names"] == names and set(manifest["transforms"]["layers"]) == set(names)
    with torch.no_grad():
        assert torch.isfinite(load(tmp_path / "q")(ids).logits).all()

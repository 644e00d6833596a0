"""Architectures other than Llama survive compress -> load: tiny random models of eight configurations.

For Llama, Qwen2 (qkv bias, untied head), Qwen3 (q/k norms), Gemma-2 (scaled embedding, (1+w) norms,
final logit soft-capping), Gemma-3 text (scaled embedding, Gemma3ForCausalLM), Gemma-3 with its vision
tower (Gemma3ForConditionalGeneration: ``text_config``, a vision encoder with as many layers as the text
decoder, which must not be taken for it; the vision tower stays in the 16-bit remainder), Phi-3 (fused qkv_proj and
gate_up_proj, untied) and Mistral (untied), each a 2-layer hidden-64 model with the real 49152-token
SmolLM2 vocabulary, compressed at 8 bits everywhere (8-bit palettized linears, 8-bit per-channel embedding):

* the reloaded model computes exactly what the original architecture computes with the dequantized weights
  and the 16-bit remainder (relative logit error < 1e-5; measured 0, bit-identical): nothing of the module
  classes is lost. With Gemma's ``sqrt(hidden)`` embedding scale dropped (the old plain lookup) it is 0.74-0.82;
* against the original float model: the embedding output (``hidden_states[0]``) within 2% (measured 0.6%;
  87-88% with the scale dropped), the logits within 20% (measured 3.4-7.3%, from 8-bit palettization with
  error feedback on two calibration windows of a random model; 74-82% with the scale dropped), top-1
  agreement >= 50% (measured 73-98%; 0-7% with the scale dropped).

Calibration windows start with BOS exactly when the tokenizer adds BOS itself (Gemma-style), and are
unchanged (the plain token stream, no BOS) for the default model's tokenizer, which adds none.
"""

from __future__ import annotations

import copy
import pickle
import shutil

import pytest
import torch
import transformers as T
from cli_helpers import run as cli
from tokenizers.processors import TemplateProcessing
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

from qrecover.api import compress
from qrecover.config import CompressConfig
from qrecover.data.corpus import adds_bos, documents, token_stream, token_windows
from qrecover.errors import QRecoverError
from qrecover.loading import _check_plain_linear, load
from qrecover.models import default_model_dir
from qrecover.moe import unfuse_experts
from qrecover.qlinear import QuantEmbedding, QuantLinear, QuantLMHead, _Packed
from qrecover.schemes import get_quantizer

BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.125)
# initializer_range 0.125: embedding rows of RMS ~1 after Gemma's x8 scale, as in trained Gemma models (at
# the default 0.02 the residual stream is all layer output and the embedding's scale barely shows in logits)
ARCHS = {
    "llama": (T.LlamaConfig, dict(tie_word_embeddings=True)),
    "qwen2": (T.Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen3": (T.Qwen3Config, dict(tie_word_embeddings=True, head_dim=16)),
    "gemma2": (T.Gemma2Config, dict(tie_word_embeddings=True, head_dim=16, sliding_window=32, final_logit_softcapping=30.0)),
    "gemma3": (T.Gemma3TextConfig, dict(tie_word_embeddings=True, head_dim=16, sliding_window=32, final_logit_softcapping=30.0)),
    "gemma3-vision": (lambda tie_word_embeddings, **text: T.Gemma3Config(
        text_config=text, tie_word_embeddings=tie_word_embeddings, mm_tokens_per_image=4, image_token_index=49151,
        boi_token_index=49150, eoi_token_index=49149, vision_config=dict(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, image_size=28, patch_size=14)),
        dict(tie_word_embeddings=True, head_dim=16, sliding_window=32)),
    "phi3": (T.Phi3Config, dict(tie_word_embeddings=False, pad_token_id=0)),
    "mistral": (T.MistralConfig, dict(tie_word_embeddings=False, sliding_window=32)),
    # further families: q/k norms (olmo2), multipliers (granite), partial rotary + LayerNorm with biases
    # (stablelm, gpt_neox, phi), fused qkv (gpt_neox), biased MLPs (starcoder2), parallel blocks (cohere)
    "olmo2": (T.Olmo2Config, dict(tie_word_embeddings=False)),
    "granite": (T.GraniteConfig, dict(tie_word_embeddings=True)),
    "stablelm": (T.StableLmConfig, dict(tie_word_embeddings=False)),
    "gpt_neox": (T.GPTNeoXConfig, dict(tie_word_embeddings=False)),
    "phi": (T.PhiConfig, dict(tie_word_embeddings=False)),
    "starcoder2": (T.Starcoder2Config, dict(tie_word_embeddings=True)),
    "cohere": (T.CohereConfig, dict(tie_word_embeddings=True)),
    "smollm3": (T.SmolLM3Config, dict(tie_word_embeddings=True, pad_token_id=0)),
    # mixture of experts: fused experts converted to nn.Linear pairs (qrecover.moe) and quantized; routers 16-bit
    "mixtral": (T.MixtralConfig, dict(tie_word_embeddings=False, num_local_experts=4, num_experts_per_tok=2)),
    "qwen2_moe": (T.Qwen2MoeConfig, dict(tie_word_embeddings=False, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=32, shared_expert_intermediate_size=64)),
}
MOE = ("mixtral", "qwen2_moe")
TEXT = ("def mean(values):\n    \"\"\"Return the arithmetic mean of a non-empty sequence of numbers.\"\"\"\n"
        "    return sum(values) / len(values)\n\nThe function raises ZeroDivisionError for an empty list.")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(d)
    return d


def _bos_tokenizer(tok_dir):
    """The SmolLM2 tokenizer made to add its BOS (``<|im_start|>``, id 1) in front of every text, as Gemma's does."""
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{tok.bos_token} $A", pair=f"{tok.bos_token} $A $B", special_tokens=[(tok.bos_token, tok.bos_token_id)])
    return tok


def _build(name, d, tok_dir):
    cls, extra = ARCHS[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**{**BASE, **extra}), dtype=torch.float32).eval()
    with torch.no_grad():  # norms and biases away from their 0/1 init: (1+w) norms and qkv biases must round-trip
        for n, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(d)
    for f in tok_dir.iterdir():
        shutil.copy(f, d / f.name)
    return model


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_eight_bit_round_trip(name, tok_dir, tmp_path):
    src, out = tmp_path / name, tmp_path / f"{name}-8bit"
    orig = _build(name, src, tok_dir)
    compress(CompressConfig(model=str(src), bpw=None, bits=[8], embedding_bits="8", calib_samples=2, seq_len=64),
             out=out, show_progress=False)
    q = load(out)
    tied = ARCHS[name][1]["tie_word_embeddings"]
    emb, orig_emb = q.get_input_embeddings(), orig.get_input_embeddings()
    assert isinstance(emb, QuantEmbedding)
    assert type(orig_emb) is torch.nn.Embedding or isinstance(emb, type(orig_emb))  # keeps the architecture's class
    assert isinstance(q.get_output_embeddings(), QuantLMHead if tied else QuantLinear)
    assert type(q).__name__ == type(orig).__name__
    assert q.qrecover_manifest["layers"] and not any("vision" in n for n in q.qrecover_manifest["layers"])

    # the same architecture with the dequantized weights and the 16-bit remainder: the exact reference
    ref = AutoModelForCausalLM.from_config(orig.config, dtype=torch.float32).eval()
    fused = copy.deepcopy(orig)
    assert unfuse_experts(ref) == unfuse_experts(fused) == q.qrecover_manifest.get("moe", {}).get("unfused", [])
    assert bool(q.qrecover_manifest.get("moe")) == (name in MOE)
    state = {k: v.half().float() for k, v in fused.state_dict().items()}
    for n, m in q.named_modules():
        if isinstance(m, _Packed):
            state[f"{n}.weight"] = m.dequantize()
    if tied:
        state[f"{_name_of(orig, orig.get_output_embeddings())}.weight"] = emb.dequantize()
    ref.load_state_dict(state)

    ids = AutoTokenizer.from_pretrained(out)(TEXT, return_tensors="pt")["input_ids"]
    assert ids.shape[1] >= 40
    with torch.no_grad():
        got = q(ids, output_hidden_states=True)
        exact = ref(ids).logits
        want = orig(ids, output_hidden_states=True)
    assert _rel(got.logits, exact) < 1e-5, name
    assert _rel(got.hidden_states[0], want.hidden_states[0]) < 0.02, name
    assert _rel(got.logits, want.logits) < 0.2, name
    assert float((got.logits.argmax(-1) == want.logits.argmax(-1)).float().mean()) >= 0.5, name


@pytest.mark.parametrize("name", ["llama", "qwen2"])
def test_gptq_embedding_round_trip(name, tok_dir, tmp_path):
    """GPTQ as the embedding's encoding: against the tied head's Hessian (llama), or, untied (qwen2), the embedding
    against its lookup statistics and the output matrix as a linear layer; both load to the exact dequantized model.
    (Its error against round-to-nearest: tests/test_compress_stages.py and benchmarks/embedding.py.)"""
    src, out = tmp_path / name, tmp_path / f"{name}-gptq"
    orig = _build(name, src, tok_dir)
    tied = ARCHS[name][1]["tie_word_embeddings"]
    compress(CompressConfig(model=str(src), bpw=None, bits=[8], embedding_encodings="gptq:4/g32", calib_samples=2,
                            seq_len=64), out=out, show_progress=False)
    q = load(out)
    layers = q.qrecover_manifest["layers"]
    assert [layers[n]["label"] for n in layers if layers[n]["kind"] != "linear"] == ["gptq:4/g32"] * (1 if tied else 2)
    ref = AutoModelForCausalLM.from_config(orig.config, dtype=torch.float32).eval()
    state = {k: v.half().float() for k, v in orig.state_dict().items()}
    for n, m in q.named_modules():
        if isinstance(m, _Packed):
            state[f"{n}.weight"] = m.dequantize()
    if tied:
        state[f"{_name_of(orig, orig.get_output_embeddings())}.weight"] = q.get_input_embeddings().dequantize()
    ref.load_state_dict(state)
    ids = AutoTokenizer.from_pretrained(out)(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        got, exact, want = q(ids).logits, ref(ids).logits, orig(ids).logits
    assert _rel(got, exact) < 1e-5
    assert _rel(got, want) < 0.25


def _name_of(model, module):
    return next(n for n, m in model.named_modules() if m is module)


def test_scaled_embedding_keeps_scale_and_attributes():
    """A Gemma scaled embedding replaced by a packed one keeps its forward (lookup x sqrt(hidden)), its
    ``embed_scale`` buffer and attributes; a plain nn.Embedding gives a plain QuantEmbedding."""
    torch.manual_seed(0)
    old = Gemma3TextScaledWordEmbedding(100, 16, padding_idx=0, embed_scale=4.0)
    qw = get_quantizer("blockwise", block_size=None, symmetric=True).quantize(old.weight.detach(), 8, {})
    new = QuantEmbedding.replacing(old, qw)
    assert isinstance(new, Gemma3TextScaledWordEmbedding) and type(new).__name__ == "QuantGemma3TextScaledWordEmbedding"
    assert "weight" not in dict(new.named_parameters()) and float(new.embed_scale) == 4.0
    assert new.scalar_embed_scale == 4.0 and new.padding_idx == 0
    ids = torch.tensor([[1, 5, 99, 0]])
    with torch.no_grad():
        want = torch.nn.functional.embedding(ids, qw.dequantize()) * 4.0
        assert torch.equal(new(ids), want)
        assert _rel(new(ids), old(ids)) < 0.01
    plain = QuantEmbedding.replacing(torch.nn.Embedding(100, 16), qw)
    assert type(plain) is QuantEmbedding


# --- calibration windows and BOS ---------------------------------------------------------------------------


def test_windows_start_with_bos_when_the_tokenizer_adds_it(tok_dir, tmp_path):
    plain = AutoTokenizer.from_pretrained(tok_dir)
    bos_tok = _bos_tokenizer(tok_dir)
    bos_tok.save_pretrained(tmp_path / "bos")  # as a model directory would hold it
    bos_tok = AutoTokenizer.from_pretrained(tmp_path / "bos")
    assert adds_bos(bos_tok) and not adds_bos(plain)
    w = token_windows(bos_tok, "python-docs", "calib", 3, 64)
    assert w.shape == (3, 64) and w.dtype == torch.long
    assert (w[:, 0] == bos_tok.bos_token_id).all()
    body = token_stream(plain, documents("python-docs", "calib"), 3 * 63).view(3, 63)
    assert torch.equal(w[:, 1:], body)  # then the text, continuing across windows as before


def test_default_model_windows_unchanged(tok_dir):
    """SmolLM2's tokenizer adds no BOS: its windows are the token stream cut in pieces, byte for byte (the
    README's numbers were measured on them)."""
    tok = AutoTokenizer.from_pretrained(default_model_dir())
    for split, n, L in (("calib", 4, 512), ("eval", 2, 128)):
        w = token_windows(tok, "python-docs", split, n, L)
        assert torch.equal(w, token_stream(tok, documents("python-docs", split), n * L).view(n, L))
        assert w[0, 0] != tok.bos_token_id


def test_linear_with_its_own_forward_is_refused():
    """A head or linear layer whose class computes more than ``x W^T + b`` cannot be loaded packed: refused
    with its name, not loaded as a plain linear layer that silently differs."""

    class ScaledHead(torch.nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2.0

    _check_plain_linear("lm_head", torch.nn.Linear(4, 3))  # a plain one passes
    with pytest.raises(QRecoverError, match="lm_head is a ScaledHead, whose forward is not a plain linear"):
        _check_plain_linear("lm_head", ScaledHead(4, 3))


def test_packed_scaled_embedding_pickles_and_copies():
    """``Quant<Class>`` is made at run time; a model holding one still deep-copies and pickles (torch.save)."""
    torch.manual_seed(0)
    old = Gemma3TextScaledWordEmbedding(50, 8, padding_idx=0, embed_scale=3.0)
    qw = get_quantizer("blockwise", block_size=None, symmetric=True).quantize(old.weight.detach(), 8, {})
    new = QuantEmbedding.replacing(old, qw)
    ids = torch.tensor([[3, 7, 0]])
    for other in (copy.deepcopy(new), pickle.loads(pickle.dumps(new))):
        assert type(other) is type(new) and float(other.embed_scale) == 3.0
        assert torch.equal(other(ids), new(ids))


@pytest.mark.parametrize("name", MOE)
def test_moe_experts_are_quantized_per_expert_and_routers_stay_16_bit(name, tok_dir, tmp_path, capsys):
    """Fused experts (3-D ``gate_up_proj``/``down_proj``) become one linear pair per expert, quantized with the
    others under a budget, each calibrated on its own routed tokens; routers (``mlp.gate``,
    ``shared_expert_gate``) stay in 16 bits; the checkpoint reloads to the same logits as the dequantized
    reference; nothing is left unquantized and no warning is raised."""
    import warnings

    src = tmp_path / name
    orig = _build(name, src, tok_dir)
    experts = {n: p.shape for n, p in orig.named_parameters() if ".experts." in n and p.dim() == 3}
    n_exp = next(iter(experts.values()))[0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # the unrotated menu: the reference below is the original model with the dequantized weights copied in
        manifest = compress(CompressConfig(model=str(src), bpw=3.2, scope="linear", encodings="mixed-blocks", calib_samples=2,
                                           seq_len=64), out=tmp_path / "q", show_progress=False)
    layers = manifest["layers"]
    blocks = sorted({n.rpartition(".")[0] for n in experts})
    assert manifest["moe"]["unfused"] == blocks and manifest["unquantized_matrices"] == {}
    for block in blocks:
        for e in range(n_exp):
            for leaf in ("gate_up_proj", "down_proj"):
                want = list(experts[f"{block}.{leaf}"][1:])
                assert layers[f"{block}.{e}.{leaf}"]["shape"] == want
    routers = [n for n, m in orig.named_modules() if n.endswith((".mlp.gate", "shared_expert_gate"))]
    assert routers and set(manifest["routers"]) == {f"{r}.weight" for r in routers}
    assert not any(r in layers for r in routers) and all(f"{r}.weight" in manifest["remainder"] for r in routers)
    assert len({info["bits"] for n, info in layers.items() if ".experts." in n}) >= 2  # widths allocated per expert
    q = load(tmp_path / "q")
    assert isinstance(q.get_submodule(f"{blocks[0]}.0.down_proj"), QuantLinear)
    # exactly the unfused original with the dequantized weights and the 16-bit remainder
    ref = copy.deepcopy(orig)
    unfuse_experts(ref)
    state = {k: v.half().float() for k, v in ref.state_dict().items()}
    state.update({f"{n}.weight": m.dequantize() for n, m in q.named_modules() if isinstance(m, _Packed)})
    ref.load_state_dict(state)
    ids = AutoTokenizer.from_pretrained(tmp_path / "q")(TEXT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert _rel(q(ids).logits, ref(ids).logits) < 1e-5
    code, out, err = cli(["info", tmp_path / "q"], capsys)
    text = " ".join((err + out).split())
    assert code == 0 and f"MoE │ {len(blocks)} experts blocks quantized per expert; {len(routers)} routers" in text
    pytest.importorskip("compressed_tensors")
    from qrecover.export import export

    with pytest.raises(QRecoverError, match="is a mixture-of-experts checkpoint .* to compressed-tensors is not supported yet"):
        export(tmp_path / "q", "compressed-tensors", tmp_path / "exported")
    assert not (tmp_path / "exported").exists()


def test_unfused_experts_compute_the_fused_function():
    """UnfusedExperts gives the fused module's output (same loop order: bit-identical here); a layout it does
    not reproduce (interleaved gate/up) is left fused by the verification."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from qrecover.moe import UnfusedExperts, _same_function

    torch.manual_seed(0)
    cfg = T.MixtralConfig(hidden_size=32, intermediate_size=48, num_local_experts=5)
    fused = MixtralExperts(cfg)
    with torch.no_grad():
        fused.gate_up_proj.normal_()
        fused.down_proj.normal_()
    un = UnfusedExperts(fused)
    x, idx, w = torch.randn(17, 32), torch.randint(0, 5, (17, 2)), torch.rand(17, 2)
    assert torch.equal(un(x, idx, w), fused(x, idx, w))
    assert _same_function(fused, un)

    class Interleaved(MixtralExperts):  # gate and up interleaved along the rows (as GPT-OSS stores them)
        def forward(self, hidden_states, top_k_index, top_k_weights):
            swapped = self.gate_up_proj.view(self.num_experts, -1, 2, self.hidden_dim).transpose(1, 2).reshape_as(self.gate_up_proj)
            out = torch.zeros_like(hidden_states)
            for e in range(self.num_experts):
                pos, tok = torch.where(top_k_index.T == e)
                gate, up = nn.functional.linear(hidden_states[tok], swapped[e]).chunk(2, dim=-1)
                h = nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]) * top_k_weights[tok, pos, None]
                out.index_add_(0, tok, h)
            return out

    other = Interleaved(cfg)
    other.load_state_dict(fused.state_dict())
    holder = nn.Module()
    holder.experts = other
    assert unfuse_experts(holder) == [] and holder.experts is other  # not this layout: left fused


def test_a_model_without_linear_layers_is_refused_by_name(tok_dir, tmp_path):
    src = tmp_path / "gpt2"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(T.GPT2Config(vocab_size=49152, n_embd=64, n_layer=2, n_head=4, n_positions=256)
                                     ).save_pretrained(src)
    for f in tok_dir.iterdir():
        shutil.copy(f, src / f.name)
    with pytest.raises(QRecoverError, match=r"GPT2LMHeadModel's decoder layers have no nn.Linear .*\['Conv1D'\]"):
        compress(CompressConfig(model=str(src), bpw=3.7, calib_samples=2, seq_len=64), out=tmp_path / "q",
                 show_progress=False)
    assert not (tmp_path / "q").exists()


def test_calibration_of_experts_no_token_was_routed_to():
    """An expert calibration never reaches gets neutral input statistics (plain rounding), joins its block's
    group in finalize's order, and gets its peers' mean output-gradient moments (not zero damage)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from qrecover.calibrate import layer_stats, linear_groups
    from qrecover.grad_pass import _fill_experts
    from qrecover.models import linear_layers
    from qrecover.moe import UnfusedExperts

    cfg = T.MixtralConfig(hidden_size=16, intermediate_size=8, num_local_experts=4)
    fused = MixtralExperts(cfg)
    with torch.no_grad():
        fused.gate_up_proj.normal_()
        fused.down_proj.normal_()

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(16, 16)
            self.experts = UnfusedExperts(fused)

        def forward(self, x):  # every token to experts 0 and 1 only
            h = self.q(x).reshape(-1, 16)
            idx = torch.tensor([[0, 1]]).expand(h.shape[0], 2)
            return self.experts(h, idx, torch.full((h.shape[0], 2), 0.5)).reshape(x.shape)

    layer = Layer()
    lins = linear_layers(layer)
    x = torch.randn(1, 6, 16)
    stats, _ = layer_stats(layer, [x], [{}], lins, {"hessian", "input_sq"})
    assert torch.equal(stats["experts.2.gate_up_proj"]["hessian"], torch.eye(16))
    assert torch.equal(stats["experts.3.down_proj"]["input_sq"], torch.ones(8))
    assert not torch.equal(stats["experts.0.gate_up_proj"]["hessian"], torch.eye(16))
    groups = linear_groups(layer, x, {}, lins)
    assert groups == [["q"], [f"experts.{e}.gate_up_proj" for e in range(4)], [f"experts.{e}.down_proj" for e in range(4)]]
    grads = {"q": torch.ones(16), "experts.0.down_proj": torch.full((16,), 1.0), "experts.1.down_proj": torch.full((16,), 3.0),
             "experts.0.gate_up_proj": torch.ones(16), "experts.1.gate_up_proj": torch.ones(16)}
    filled = _fill_experts(dict(grads), lins)
    assert list(filled) == list(lins) and torch.equal(filled["experts.3.down_proj"], torch.full((16,), 2.0))
    with pytest.raises(QRecoverError, match="experts.0.gate_up_proj received no gradient"):
        _fill_experts({}, {"experts.0.gate_up_proj": lins["experts.0.gate_up_proj"]})


def test_moe_recovery_adapters_reach_every_expert(tok_dir, tmp_path, text_mix):
    """LoRA recovery on a MoE checkpoint: the svd init and distillation run with the teacher's experts converted
    the same way, adapters land on every expert's linears, and the trained adapter reloads with the checkpoint."""
    from qrecover.adapters.lora import lora_modules
    from qrecover.recovery.api import recover
    from qrecover.recovery.config import RecoverConfig

    src = tmp_path / "mixtral"
    _build("mixtral", src, tok_dir)
    compress(CompressConfig(model=str(src), bpw=None, bits=[4], calib_samples=2, seq_len=64, embedding_bits="8"),
             out=tmp_path / "q", show_progress=False)
    meta = recover(tmp_path / "q", tmp_path / "ad", RecoverConfig(rank=2, tokens=128, seq_len=64, mix=str(text_mix),
                                                                  checkpoint_every=0), show_progress=False)
    assert {f"model.layers.{i}.mlp.experts.{e}.{leaf}" for i in range(2) for e in range(4)
            for leaf in ("gate_up_proj", "down_proj")} <= set(meta["target_modules"])
    assert meta["init"]["output_error_removed"] > 0.05
    model = load(tmp_path / "q", adapter=tmp_path / "ad")
    assert "base_model.model.model.layers.1.mlp.experts.3.down_proj" in {f"base_model.model.{n}" for n in lora_modules(model)}


def test_experts_left_fused_stay_16_bit_with_a_warning_and_a_budget_hint(tok_dir, tmp_path, monkeypatch):
    """Experts of a layout qrecover.moe does not reproduce (forced here) are not quantized: a warning, the
    manifest's unquantized_matrices, and a --bpw they make impossible names them."""
    import qrecover.api
    import qrecover.moe

    monkeypatch.setattr(qrecover.moe, "_same_function", lambda fused, unfused: False)
    src = tmp_path / "mixtral"
    _build("mixtral", src, tok_dir)
    cfg = dict(model=str(src), calib_samples=2, seq_len=64, embedding_bits="8")
    with pytest.warns(UserWarning, match=r"4 matrices of the decoder layers .* are not nn.Linear weights qrecover can quantize"):
        manifest = compress(CompressConfig(bpw=None, bits=[4], **cfg), out=tmp_path / "q", show_progress=False)
    assert "moe" not in manifest and sorted(manifest["unquantized_matrices"]) == [
        f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("down_proj", "gate_up_proj")]
    assert load(tmp_path / "q").get_submodule("model.layers.0.mlp.experts").gate_up_proj.dim() == 3
    # (the early check, from the config alone, cannot run the verification; the allocator's refusal names them)
    monkeypatch.setattr(qrecover.api, "check_budget_early", lambda *a: None)
    with pytest.raises(QRecoverError, match=r"--bpw 3.0 is below .*experts.*--scope linear budgets the quantized layers alone"):
        compress(CompressConfig(bpw=3.0, **cfg), out=tmp_path / "q3", show_progress=False)


def test_each_layer_input_gives_unreached_experts_the_identity():
    """The svd init and the rank allocation see an expert no token reached as inputs X = I (unweighted); any
    other layer without input is an error naming the fix."""
    from qrecover.adapters.svd_init import each_layer_input

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = nn.ModuleDict({str(e): nn.ModuleDict({"gate_up_proj": nn.Linear(8, 4)}) for e in range(3)})
            self.unused = nn.Linear(8, 4)

        def forward(self, input_ids, use_cache=False):  # only expert 0 receives tokens
            return self.experts["0"]["gate_up_proj"](torch.ones(2, 8))

    model, ids, seen = Model(), torch.zeros(1, 2, dtype=torch.long), {}
    experts = [f"experts.{e}.gate_up_proj" for e in range(3)]
    with pytest.raises(QRecoverError, match=r"layers \['unused'\] of the unquantized model saw no input .*; use --init zero"):
        each_layer_input(model, ids, experts + ["unused"], lambda n, x: None, "use --init zero")
    each_layer_input(model, ids, experts, lambda n, x: seen.setdefault(n, x), "fix")
    assert list(seen) == experts and torch.equal(seen[experts[0]], torch.ones(2, 8))
    assert torch.equal(seen[experts[1]], torch.eye(8)) and torch.equal(seen[experts[2]], torch.eye(8))


@pytest.mark.parametrize("name,corrected", [("llama", 2), ("qwen2", 2), ("phi3", 2), ("cohere", 2), ("gpt_neox", 2),
                                            ("gemma3", 0), ("mixtral", 0)])
def test_finalize_output_correction_equals_the_forward(name, corrected, tok_dir, tmp_path, monkeypatch):
    """finalize takes a layer's outputs from its last group's statistics pass plus the quantized projection's output
    change, where that is exact (the down projection added to the residual stream), and runs the layer again where
    it is not (Gemma's norm after the MLP, routed experts): every layer sees the same inputs as with the second pass
    always run (to float32 rounding), and the manifest says how many layers were corrected."""
    import qrecover.stages.finalize as fin

    src = tmp_path / name
    _build(name, src, tok_dir)
    seen: list[list[torch.Tensor]] = []
    real = fin.layer_stats
    monkeypatch.setattr(fin, "layer_stats", lambda *a, **k: seen[-1].append(a[1][1].clone()) or real(*a, **k))
    manifests = []
    cfg = CompressConfig(model=str(src), bpw=None, encodings="gptq:4/g16", embedding_bits="8", calib_samples=2, seq_len=32)
    for keep in (fin.KEEP_BYTES, 0):
        monkeypatch.setattr(fin, "KEEP_BYTES", keep)
        seen.append([])
        manifests.append(compress(cfg, out=tmp_path / f"keep{keep}", show_progress=False))
    assert manifests[0]["finalize"]["outputs_corrected"] == f"{corrected}/2 layers"
    assert manifests[1]["finalize"]["outputs_corrected"] == "0/2 layers"
    assert len(seen[0]) == len(seen[1]) > 4
    for a, b in zip(*seen):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # the attention block replayed from its output projection's kept inputs (one per layer) is bit-exact: the same
    # checkpoint as running the block in every later pass
    assert manifests[0]["finalize"]["blocks_replayed"] == 2 and manifests[1]["finalize"]["blocks_replayed"] == 0
    monkeypatch.setattr(fin, "KEEP_BYTES", 2**40)
    monkeypatch.setattr(fin, "_replayable", lambda *a: None)
    plain = compress(cfg, out=tmp_path / "plain", show_progress=False)
    assert plain["finalize"]["blocks_replayed"] == 0
    assert plain["weights_file"]["sha256"] == manifests[0]["weights_file"]["sha256"]

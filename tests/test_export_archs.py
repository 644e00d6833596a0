"""GGUF export beyond Llama: tiny random Mistral, Qwen2 (q/k/v biases, untied head), Gemma-2 and Gemma-3 text
((1 + w) norms, soft-capping, q/k norms), each with the real SmolLM2 tokenizer, compressed to layers GGUF holds
exactly (4-bit symmetric blocks of 32 = Q4_0, 8-bit per-channel embedding = Q8_0).

Read back with ``gguf.GGUFReader``: the architecture and its metadata, every packed layer bit for bit (q/k rows
un-permuted for the Llama-architecture families), the norms as llama.cpp's converter writes them. Loaded with
transformers' GGUF loader: the logits of ``qrecover.load`` on the checkpoint.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers as T
from cli_helpers import run
from transformers import AutoModelForCausalLM, AutoTokenizer

from qrecover.api import compress
from qrecover.config import CompressConfig
from qrecover.export import export
from qrecover.export.common import read_checkpoint
from qrecover.export.gguf_format import ARCHS, row_permutation
from qrecover.loading import load
from qrecover.models import default_model_dir

gguf = pytest.importorskip("gguf")

BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
# (config class, extra settings, llama.cpp architecture); Gemma's soft-capping and query scale at the defaults
# transformers' GGUF loader assumes (it does not read them back)
CASES = {
    "mistral": (T.MistralConfig, dict(tie_word_embeddings=False), "llama"),
    "qwen2": (T.Qwen2Config, dict(tie_word_embeddings=False), "qwen2"),
    "gemma2": (T.Gemma2Config, dict(tie_word_embeddings=True, head_dim=16, sliding_window=32), "gemma2"),
    "gemma3": (T.Gemma3TextConfig, dict(tie_word_embeddings=True, head_dim=16, sliding_window=32), "gemma3"),
}
IDS = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30, 2, 17, 42, 999, 12000]])


@pytest.fixture(scope="module", params=list(CASES))
def arch_ckpt(request, tmp_path_factory):
    cls, extra, gguf_arch = CASES[request.param]
    d = tmp_path_factory.mktemp(f"tiny-{request.param}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**BASE, **extra))
    with torch.no_grad():  # norms away from their init (1, or Gemma's 0), so that the (1 + w) convention shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
            if n.endswith(".bias"):
                p.normal_(0, 0.1)
    model.save_pretrained(d)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(d)
    out = tmp_path_factory.mktemp("ckpt") / request.param
    compress(CompressConfig(model=str(d), bpw=None, bits=[4], scheme="blockwise",
                            scheme_params={"block_size": 32, "symmetric": True}, embedding_bits="8", calib_samples=2,
                            seq_len=64), out=out, show_progress=False)
    return request.param, out, gguf_arch


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits[0].double()


def test_gguf_export_of_each_architecture_reads_back_exactly_and_loads_with_the_checkpoints_logits(arch_ckpt, tmp_path):
    name, path, gguf_arch = arch_ckpt
    rep = export(path, "gguf", tmp_path / "g")
    assert rep["exact_layers"] == rep["total_layers"]
    ckpt = read_checkpoint(path)
    cfg = T.AutoConfig.from_pretrained(path)
    arch = ARCHS[ckpt.manifest["architecture"]]
    reader = gguf.GGUFReader(str(tmp_path / "g" / "model.gguf"))
    assert reader.fields["general.architecture"].contents() == gguf_arch
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.model_arch), cfg.num_hidden_layers)
    tensors = {t.name: t for t in reader.tensors}

    def read(t):
        return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())

    for n, qw in ckpt.layers.items():
        w = read(tensors[f"{names.get_name(n)}.weight"]).reshape(qw.shape)
        perm = row_permutation(n, qw.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads)
        if perm is not None and arch.permute_qk:
            w = w[torch.from_numpy(np.argsort(perm))]
        assert torch.equal(w, qw.dequantize()), n
    for k, v in ckpt.remainder.items():
        base, _, suffix = k.rpartition(".")
        got = read(tensors[f"{names.get_name(base)}.{suffix}"]).reshape(v.shape)
        want = v.float() + 1.0 if (arch.norm_plus_one and k.endswith("norm.weight")) else v.float()
        assert torch.equal(got, want), k
    assert ("output.weight" in tensors) == (not cfg.tie_word_embeddings)
    if name == "qwen2":
        assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= set(tensors)
    if name == "gemma2":
        assert reader.fields["gemma2.attn_logit_softcapping"].contents() == pytest.approx(cfg.attn_logit_softcapping)
        assert reader.fields["gemma2.final_logit_softcapping"].contents() == pytest.approx(cfg.final_logit_softcapping)
    if arch.norm_plus_one:
        assert reader.fields[f"{gguf_arch}.attention.key_length"].contents() == cfg.head_dim
        assert reader.fields[f"{gguf_arch}.attention.sliding_window"].contents() == cfg.sliding_window

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "g", gguf_file="model.gguf", dtype=torch.float32)
    got, ref = _logits(hf), _logits(load(path))
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), (name, float((got - ref).abs().max()))


def test_an_unsupported_architecture_is_refused_naming_the_supported_ones(arch_ckpt, tmp_path, capsys):
    name, path, _ = arch_ckpt
    if name != "qwen2":
        pytest.skip("one architecture is enough")
    other = tmp_path / "phi"
    shutil.copytree(path, other)
    manifest = json.loads((other / "qrecover.json").read_text())
    manifest["architecture"] = "Phi3ForCausalLM"
    (other / "qrecover.json").write_text(json.dumps(manifest))
    out = tmp_path / "out"
    code, _, err = run(["export", other, "--format", "gguf", "--out", out], capsys)
    flat = " ".join(err.split())
    assert code == 2 and "'Phi3ForCausalLM'" in flat and all(a in flat for a in ARCHS) and flat.count("error:") == 1
    assert not out.exists()

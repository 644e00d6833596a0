"""Tests for ``qrecover.api`` on the tiny Llama (see conftest): compress, the checkpoint, load, errors.

Checks:

* the checkpoint holds model.safetensors, qrecover.json, config.json and the tokenizer;
* the manifest has its documented keys (format_version, source hash, per-layer scheme/bits/params,
  sensitivity table, measured_bpw, budget, calibration, versions, weights_file.sha256) with values that
  agree with the files and with the source model;
* byte accounting: the bytes of every tensor in model.safetensors (read with safe_open) equal
  ``bytes.total`` and ``sum(layer nbytes) + remainder`` (norms at 2 bytes/param), and
  ``measured_bpw == 8 * bytes / parameters`` exactly; measured bpw <= budget;
* ``qrecover.load`` builds QuantLinear/QuantEmbedding/QuantLMHead modules whose logits equal (1e-5) those
  of the original model with every quantized weight replaced by its dequantized weight and the norms
  rounded to fp16; generate works and matches the reference model's greedy tokens;
* a uniform model puts every linear layer at the one width; ``scope='linear'`` and position allocation
  respect their budgets; the sensitivity allocation predicts no more damage than the position one;
* errors are QRecoverError with a useful message: tampered weights (sha256), newer format_version,
  missing / corrupt manifest, existing output directory, infeasible budget (smallest and largest bpw),
  bpw <= 0, unsupported bits, missing model path, a directory without config.json, models that are not
  causal LMs;
* writes are atomic: an interrupt while saving leaves neither the output directory nor a ``.tmp-`` sibling.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch
from conftest import TINY_CONFIG, build_tiny_model
from safetensors import safe_open

import qrecover
from qrecover.api import compress
from qrecover.checkpoint import FORMAT_VERSION, read_manifest
from qrecover.config import CompressConfig
from qrecover.errors import QRecoverError
from qrecover.io_utils import atomic_dir, atomic_file, sha256_file, sha256_files
from qrecover.qlinear import QuantEmbedding, QuantLinear, QuantLMHead
from qrecover.stages import write as stage_write
from qrecover.stages.checks import fits
from qrecover.stages.specs import LEGACY_EMBEDDING, embedding_encodings

LEGACY_LABELS = {e.label for e in LEGACY_EMBEDDING}
N_LINEAR = TINY_CONFIG["num_hidden_layers"] * 7
DTYPE_BYTES = {"U8": 1, "I8": 1, "F16": 2, "BF16": 2, "F32": 4, "I32": 4, "I64": 8}
PROMPT = "The Python tutorial explains how to define a function with def."


def cfg(model_dir, **kw) -> CompressConfig:
    base = dict(model=str(model_dir), calib_samples=2, seq_len=64)
    base.update(kw)
    if "encodings" not in kw and "scheme" not in kw:
        base.setdefault("bits", [2, 3, 4])  # the menu these tests were written for (the default until 2026-11)
    return CompressConfig(**base)


def file_tensor_bytes(path: Path) -> dict[str, int]:
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            out[k] = math.prod(sl.get_shape()) * DTYPE_BYTES[sl.get_dtype()]
    return out


@pytest.fixture(scope="module")
def manifest(tiny_ckpt):
    return read_manifest(tiny_ckpt)


@pytest.fixture(scope="module")
def loaded(tiny_ckpt):
    return qrecover.load(tiny_ckpt)


@pytest.fixture(scope="module")
def tokenizer(tiny_ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_ckpt)


def reference_model(model_dir, qmodel, manifest):
    """The original model with each quantized weight replaced by the checkpoint's dequantized weight and every
    other tensor rounded to fp16, as stored."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name in manifest["layers"]:
            ref.get_submodule(name).weight.copy_(qmodel.get_submodule(name).dequantize())
        params = dict(ref.named_parameters())
        for k in manifest["remainder"]:
            params[k].copy_(params[k].half().float())
    return ref


# --- the checkpoint ----------------------------------------------------------------------------------------


def test_checkpoint_files(tiny_ckpt):
    for f in ("model.safetensors", "qrecover.json", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tiny_ckpt / f).is_file(), f
    assert not list(tiny_ckpt.parent.glob(".*tmp-*")), "no temporary directory left behind"


def test_manifest_keys_and_values(tiny_ckpt, tiny_model_dir, manifest):
    m = manifest
    assert m["format"] == "qrecover" and m["format_version"] == FORMAT_VERSION == 1
    assert m["architecture"] == "LlamaForCausalLM"
    assert m["source"]["kind"] == "hf" and Path(m["source"]["path"]) == Path(tiny_model_dir).resolve()
    assert m["source"]["weights_sha256"] == sha256_files([Path(tiny_model_dir) / "model.safetensors"])
    assert m["weights_file"] == {"name": "model.safetensors", "sha256": sha256_file(tiny_ckpt / "model.safetensors")}
    assert m["budget"]["bpw"] == 5.0 and m["budget"]["scope"] == "model" and m["budget"]["bits"] == [2, 3, 4]
    assert m["config"]["calib_samples"] == 2 and m["config"]["seq_len"] == 64
    cal = m["calibration"]
    assert cal["source"] == "python-docs" and cal["split"] == "calib"
    assert cal["windows"] == 2 and cal["seq_len"] == 64 and cal["tokens"] == 128
    assert 5.0 < cal["loss"] < 20.0  # an untrained model over 49152 tokens: near ln(49152) = 10.8
    assert set(m["versions"]) >= {"qrecover", "torch", "transformers", "safetensors", "python"}
    assert m["versions"]["qrecover"] == qrecover.__version__
    assert set(m["measured_bpw"]) == {"model", "linear"}

    model = build_tiny_model()
    assert m["parameters"]["model"] == sum(p.numel() for p in model.parameters())
    linear_names = {n for n, mod in model.named_modules() if isinstance(mod, torch.nn.Linear) and ".layers." in n}
    assert len(linear_names) == N_LINEAR
    assert m["parameters"]["linear"] == sum(model.get_submodule(n).weight.numel() for n in linear_names)

    layers = m["layers"]
    assert set(layers) == linear_names | {"model.embed_tokens"}
    for n, info in layers.items():
        assert {"kind", "scheme", "bits", "params", "shape", "tensors", "nbytes", "bpw", "damage", "label"} <= set(info)
        assert info["label"].split("/")[0] == f"{info['scheme']}:{info['bits']}"  # e.g. blockwise:4/b32
        assert list(model.get_submodule(n).weight.shape) == info["shape"]
        assert info["nbytes"] == qrecover.schemes.get_quantizer(info["scheme"], **info["params"]).nbytes(tuple(info["shape"]), info["bits"])
        assert info["bpw"] == pytest.approx(8 * info["nbytes"] / math.prod(info["shape"]))
    emb = layers["model.embed_tokens"]
    assert emb["kind"] == "embedding" and emb["tied_to"] == "lm_head"
    for n in linear_names:
        assert layers[n]["kind"] == "linear" and layers[n]["scheme"] == "palettize"
        assert layers[n]["params"] == qrecover.schemes.get_quantizer("palettize").params  # the defaults
        assert layers[n]["bits"] in (2, 3, 4)

    table = m["sensitivity"]["table"]
    assert set(table) == set(layers)
    for n in linear_names:
        assert set(table[n]) == {"palettize:2", "palettize:3", "palettize:4"}
        d = table[n]
        assert all(math.isfinite(v) and v >= 0 for v in d.values())
        assert d["palettize:2"] > d["palettize:4"], (n, d)  # fewer bits: more predicted damage
        assert layers[n]["damage"] == d[layers[n]["label"]]
    emb_table = table["model.embed_tokens"]
    fitting = {c.label for c in embedding_encodings("auto", None, True) if fits(c, (49152, 64))}  # blocks of 128 do not fit 64 columns
    assert set(emb_table) == fitting >= {"blockwise:4/b64/asym", "blockwise:4/b32/asym", "blockwise:8/pc", "blockwise:2/b32/asym",
                                      "palettize:3/g1/error_feedback=false", "gptq:4/g32/act_order=false"}
    assert "blockwise:4/b128/asym" not in emb_table
    assert all(emb_table[k] > emb_table["blockwise:8/pc"] for k in emb_table if k != "blockwise:8/pc")  # 2-4 < 8 bits
    assert emb_table["blockwise:2/b32/asym"] > emb_table["blockwise:3/b32/asym"] > emb_table["blockwise:4/b32/asym"]
    # the same integer grid as blockwise:4/b32/asym, codes chosen by GPTQ against the tied head's Hessian
    assert emb_table["gptq:4/g32/act_order=false"] < 0.8 * emb_table["blockwise:4/b32/asym"]
    assert emb_table["gptq:3/g32/act_order=false"] < emb_table["blockwise:3/b32/asym"]
    assert m["sensitivity"]["predicted_loss_increase"] == pytest.approx(sum(v["damage"] for v in layers.values()))
    assert set(m["remainder"]) == {k for k, _ in model.named_parameters() if "norm" in k}


def test_measured_bpw_within_budget(manifest):
    assert manifest["measured_bpw"]["model"] <= manifest["budget"]["bpw"]
    # 5.0 bpw covers every linear layer's best width but not the 8-bit embedding (~8.1 bpw alone)
    emb = manifest["layers"]["model.embed_tokens"]
    assert emb["bits"] < 8 and emb["label"] != "blockwise:8/pc"


def test_byte_accounting(tiny_ckpt, manifest):
    per = file_tensor_bytes(tiny_ckpt / "model.safetensors")
    total = sum(per.values())
    b = manifest["bytes"]
    assert b["total"] == total
    assert b["file"] == (tiny_ckpt / "model.safetensors").stat().st_size > total  # file adds a header only
    layer_sum = sum(v["nbytes"] for v in manifest["layers"].values())
    norm_params = sum(math.prod(v["shape"]) for v in manifest["remainder"].values())
    assert norm_params == (2 * TINY_CONFIG["num_hidden_layers"] + 1) * TINY_CONFIG["hidden_size"]
    assert b["remainder"] == 2 * norm_params
    assert total == layer_sum + 2 * norm_params
    # every stored tensor is accounted to one layer or to the remainder
    named = {f"{n}.{t}" for n, v in manifest["layers"].items() for t in v["tensors"]} | set(manifest["remainder"])
    assert named == set(per)
    for n, v in manifest["layers"].items():
        assert sum(per[f"{n}.{t}"] for t in v["tensors"]) == v["nbytes"]
    lin = sum(v["nbytes"] for v in manifest["layers"].values() if v["kind"] == "linear")
    assert b["linear"] == lin and b["embedding"] == manifest["layers"]["model.embed_tokens"]["nbytes"]
    p = manifest["parameters"]
    assert manifest["measured_bpw"]["model"] == 8 * total / p["model"]
    assert manifest["measured_bpw"]["linear"] == 8 * lin / p["linear"]


# --- load --------------------------------------------------------------------------------------------------


def test_load_module_types(loaded, manifest):
    assert loaded.qrecover_manifest == manifest
    for n, info in manifest["layers"].items():
        mod = loaded.get_submodule(n)
        assert isinstance(mod, QuantEmbedding if info["kind"] == "embedding" else QuantLinear), n
        assert mod.bits == info["bits"] and mod.scheme == info["scheme"] and mod.nbytes == info["nbytes"]
    assert isinstance(loaded.lm_head, QuantLMHead)
    assert loaded.lm_head.embedding is loaded.model.embed_tokens
    # every linear layer is packed: QuantLinear is an nn.Linear subclass (so PEFT wraps it), but no plain
    # nn.Linear with a dense weight remains
    assert not any(type(m) is torch.nn.Linear for m in loaded.modules())
    # no dense copy of the packed weights is kept as a parameter
    assert sum(p.numel() for p in loaded.parameters()) == sum(math.prod(v["shape"]) for v in manifest["remainder"].values())


def test_load_weights_close_to_original(loaded, manifest):
    orig = build_tiny_model()
    for n, info in manifest["layers"].items():
        w = orig.get_submodule(n).weight.detach()
        deq = loaded.get_submodule(n).dequantize()
        rel = float(((w - deq) ** 2).sum() / (w**2).sum())
        # (error feedback trades some weight error for less output error, hence not the Lloyd-Max values)
        assert rel < {2: 0.2, 3: 0.07, 4: 0.03, 8: 1e-4}[info["bits"]], (n, info["label"], rel)


def test_load_logits_equal_reference(loaded, manifest, tiny_model_dir, tokenizer):
    ref = reference_model(tiny_model_dir, loaded, manifest)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        got = loaded(input_ids=ids).logits
        want = ref(input_ids=ids).logits
        orig = build_tiny_model()(input_ids=ids).logits
    assert got.shape == (1, ids.shape[1], TINY_CONFIG["vocab_size"])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert float((got - orig).abs().max()) > 1e-3  # the comparison can tell quantized from original weights


def test_load_with_cache_same_logits(tiny_ckpt, loaded, tokenizer):
    cached = qrecover.load(tiny_ckpt, cache=True)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        a = cached(input_ids=ids).logits
        b = cached(input_ids=ids).logits  # second call uses the cached dense weights
        c = loaded(input_ids=ids).logits
    assert torch.equal(a, b)
    torch.testing.assert_close(a, c, atol=1e-6, rtol=0)


def test_dtype_cast_keeps_packed_bytes_and_follows_model_dtype(tiny_ckpt, tokenizer):
    """``model.to(bf16)`` keeps every stored tensor's dtype and bytes (fp16 tables through bf16 would lose
    bits) and makes the embedding look up, the tied head and the linears compute, in bf16 (the embedding
    used to stay fp32 whatever the model's dtype)."""
    model = qrecover.load(tiny_ckpt, cache=True)
    before = {n: b.clone() for n, b in model.named_buffers()
              if any(n.endswith(f".{t}") for t in ("qdata", "lut", "scale", "zero_point"))}
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(input_ids=ids).logits
        model.to(torch.bfloat16)
        emb_out = model.get_input_embeddings()(ids)
        got = model(input_ids=ids).logits
    after = dict(model.named_buffers())
    assert before and all(after[n].dtype == t.dtype and torch.equal(after[n], t) for n, t in before.items())
    assert emb_out.dtype == torch.bfloat16 and got.dtype == torch.bfloat16
    assert model.get_input_embeddings().weight.dtype == torch.bfloat16
    rel = float((got.float() - ref).norm() / ref.norm())
    assert 0 < rel < 0.05, rel  # bf16 rounding, not a broken model
    model.to(torch.float32)  # and back: the packed tensors are untouched, so fp32 logits are exact again
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref, atol=1e-5, rtol=0)


def test_generate(loaded, manifest, tiny_model_dir, tokenizer):
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = loaded.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id)
        ref_out = reference_model(tiny_model_dir, loaded, manifest).generate(
            ids, max_new_tokens=6, do_sample=False, pad_token_id=tokenizer.eos_token_id
        )
    assert out.shape[0] == 1 and ids.shape[1] < out.shape[1] <= ids.shape[1] + 6
    assert torch.equal(out[:, : ids.shape[1]], ids)
    assert torch.equal(out, ref_out)


def test_perplexity_api(loaded, tokenizer):
    r = qrecover.perplexity(loaded, tokenizer, windows=2, seq_len=32, show_progress=False)
    assert r["tokens"] == 2 * 31 and r["split"] == "eval"
    assert math.isfinite(r["ppl"]) and r["ppl"] > 1.0
    assert r["ppl"] == pytest.approx(math.exp(r["nll"]))


# --- budgets and allocations (reusing one calibration) -------------------------------------------------


def unit_sizes(prepared) -> dict[str, dict[str, int]]:
    return {n: {c.label: qw.nbytes for c, (qw, _) in zip(u.cands, u.results)} for n, u in prepared.units.items()}


def test_uniform_model_single_width(tiny_model_dir, tmp_path):
    m = compress(cfg(tiny_model_dir, bpw=None, bits=[4]), out=tmp_path / "u4", show_progress=False)
    lin = [v for v in m["layers"].values() if v["kind"] == "linear"]
    assert len(lin) == N_LINEAR and all(v["bits"] == 4 and v["label"] == "palettize:4" for v in lin)
    assert m["layers"]["model.embed_tokens"]["label"] == "blockwise:8/pc"  # no budget: AFM's int8 embedding
    assert m["budget"]["bpw"] is None
    assert m["measured_bpw"]["linear"] == 8 * sum(v["nbytes"] for v in lin) / m["parameters"]["linear"]
    assert 4.0 < m["measured_bpw"]["linear"] < 4.3


def test_scope_linear_budget(tiny_model_dir, tiny_prepared, tmp_path):
    m = compress(cfg(tiny_model_dir, bpw=3.0, scope="linear"), out=tmp_path / "lin3", show_progress=False,
                 prepared=tiny_prepared)
    assert m["measured_bpw"]["linear"] <= 3.0
    bits = [v["bits"] for v in m["layers"].values() if v["kind"] == "linear"]
    assert min(bits) < 4 and max(bits) > 2  # a real mix
    assert m["measured_bpw"]["linear"] > 2.5  # the budget is used, not thrown away
    assert m["layers"]["model.embed_tokens"]["label"] == "blockwise:8/pc"  # outside the scope: the 8-bit default
    assert m["budget"]["scope"] == "linear"
    # position baseline on the same budget: fits too, and the knapsack predicts no more damage
    p = compress(cfg(tiny_model_dir, bpw=3.0, scope="linear", allocation="position"), out=None,
                 show_progress=False, prepared=tiny_prepared)
    lin_bytes = sum(v["nbytes"] for v in p["layers"].values() if v["kind"] == "linear")
    assert 8 * lin_bytes / p["parameters"]["linear"] <= 3.0
    assert m["sensitivity"]["predicted_loss_increase"] <= p["sensitivity"]["predicted_loss_increase"] + 1e-12


@pytest.mark.parametrize("allocation", ["sensitivity", "position"])
def test_model_scope_budget_between_extremes(tiny_model_dir, tiny_prepared, tmp_path, allocation):
    """(The legacy embedding encodings: with 2- and 3-bit embeddings the savings buy 4-bit linears everywhere.)"""
    sizes = unit_sizes(tiny_prepared)
    sizes["model.embed_tokens"] = {k: v for k, v in sizes["model.embed_tokens"].items() if k in LEGACY_LABELS}
    n_params = tiny_prepared.params["model"]
    rem = sum(v.numel() * 2 for v in tiny_prepared.remainder.values())
    lo = sum(min(s.values()) for s in sizes.values()) + rem
    all4 = sizes["model.embed_tokens"]["blockwise:4/b64/asym"] + rem + sum(
        s["palettize:4"] for n, s in sizes.items() if n != "model.embed_tokens")
    bpw = round(8 * (lo + 0.3 * (all4 - lo)) / n_params, 4)  # 30% of the way from all-2-bit to all-4-bit linears
    m = compress(cfg(tiny_model_dir, bpw=bpw, allocation=allocation, embedding_bits="legacy"), out=tmp_path / allocation,
                 show_progress=False, prepared=tiny_prepared)
    assert m["measured_bpw"]["model"] <= bpw
    assert m["bytes"]["total"] <= math.floor(bpw * n_params / 8)
    bits = {v["bits"] for v in m["layers"].values() if v["kind"] == "linear"}
    if allocation == "sensitivity":  # (position may legitimately step every linear layer to 2 bits first)
        assert len(bits) > 1, bits
    assert m["budget"]["allocation"] == allocation
    per = file_tensor_bytes(tmp_path / allocation / "model.safetensors")
    assert m["measured_bpw"]["model"] == 8 * sum(per.values()) / n_params


def test_prepared_must_match_candidates(tiny_model_dir, tiny_prepared):
    with pytest.raises(QRecoverError, match="prepared candidates"):
        compress(cfg(tiny_model_dir, bpw=5.0, bits=[2, 6]), out=None, show_progress=False, prepared=tiny_prepared)
    with pytest.raises(QRecoverError, match="prepared candidates"):
        compress(cfg(tiny_model_dir, bpw=5.0, scheme="blockwise"), out=None, show_progress=False, prepared=tiny_prepared)


def test_prepared_subset_of_bits(tiny_model_dir, tiny_prepared):
    """A narrower set of widths reuses the same calibration: only those widths are chosen."""
    m = compress(cfg(tiny_model_dir, bpw=4.5, bits=[2, 4]), out=None, show_progress=False, prepared=tiny_prepared)
    assert {v["bits"] for v in m["layers"].values() if v["kind"] == "linear"} <= {2, 4}


def test_prepared_must_match_scheme_params(tiny_model_dir, tiny_prepared):
    """Scheme parameters are part of each candidate too: reusing a calibration quantized with group_size=16 for
    a config asking group_size=8 must be refused, not written with a manifest whose config disagrees with
    its layers."""
    with pytest.raises(QRecoverError, match="prepared"):
        compress(cfg(tiny_model_dir, bpw=5.0, scheme_params={"group_size": 8}), out=None, show_progress=False,
                 prepared=tiny_prepared)


# --- errors ------------------------------------------------------------------------------------------------


def _bpw_numbers(msg: str) -> tuple[float, float]:
    lo = float(re.search(r"smallest is ([0-9.]+)", msg).group(1))
    hi = float(re.search(r"largest ([0-9.]+)", msg).group(1))
    return lo, hi


@pytest.mark.parametrize("emb, bpw, lo_range", [("legacy", 4.0, (4.0, 4.4)), ("auto", 2.5, (2.5, 2.9))])
def test_infeasible_budget_message(tiny_model_dir, tiny_prepared, tmp_path, emb, bpw, lo_range):
    out = tmp_path / "never"
    with pytest.raises(QRecoverError, match="smallest") as early:  # refused from shapes, before calibration
        compress(cfg(tiny_model_dir, bpw=bpw, embedding_bits=emb), out=out, show_progress=False)
    msg = str(early.value)
    assert "largest" in msg and str(bpw) in msg and "--bits 2,3,4" in msg and f"--embedding-bits {emb}" in msg
    assert not out.exists()
    with pytest.raises(QRecoverError, match="smallest") as late:  # the same check after calibration
        compress(cfg(tiny_model_dir, bpw=bpw, embedding_bits=emb), out=out, show_progress=False, prepared=tiny_prepared)
    assert not out.exists()
    lo, hi = _bpw_numbers(msg)
    assert (lo, hi) == _bpw_numbers(str(late.value))  # shape-only and measured bounds agree
    sizes = unit_sizes(tiny_prepared)
    if emb == "legacy":
        sizes["model.embed_tokens"] = {k: v for k, v in sizes["model.embed_tokens"].items() if k in LEGACY_LABELS}
    rem = sum(v.numel() * 2 for v in tiny_prepared.remainder.values())
    n = tiny_prepared.params["model"]
    assert lo == pytest.approx(8 * (sum(min(s.values()) for s in sizes.values()) + rem) / n, abs=1e-3)
    assert hi == pytest.approx(8 * (sum(max(s.values()) for s in sizes.values()) + rem) / n, abs=1e-3)
    assert lo_range[0] < lo < lo_range[1] < hi


def test_infeasible_scope_linear(tiny_model_dir, tmp_path):
    with pytest.raises(QRecoverError, match=r"smallest .*largest") as e:
        compress(cfg(tiny_model_dir, bpw=1.0, scope="linear"), out=tmp_path / "x", show_progress=False)
    lo, hi = _bpw_numbers(str(e.value))
    assert 2.0 < lo < 2.2 and 4.1 < hi < 4.3


@pytest.mark.parametrize("bpw", [0, -1, -0.5, float("nan")])
def test_bpw_must_be_positive(bpw):
    with pytest.raises(QRecoverError, match="must be positive"):
        CompressConfig(bpw=bpw)


def test_unsupported_bits(tiny_model_dir, tmp_path):
    with pytest.raises(QRecoverError, match=r"does not support (bits=)?\[?5.*\[2, 3, 4, 6, 8\]"):
        compress(cfg(tiny_model_dir, bpw=5.0, bits=[5]), out=tmp_path / "x", show_progress=False)
    assert not (tmp_path / "x").exists()


def test_unsupported_bits_reported_before_budget(tiny_model_dir, tmp_path):
    """An unsupported width is the error to report, not a budget computed from sizes of a width that does not
    exist (which would advise "allow lower --bits")."""
    with pytest.raises(QRecoverError, match=r"does not support (bits=)?\[?5"):
        compress(cfg(tiny_model_dir, bpw=3.0, scope="linear", bits=[5]), out=tmp_path / "x", show_progress=False)


def test_missing_model_path(tmp_path):
    with pytest.raises(QRecoverError, match=r"does not exist"):
        compress(cfg(tmp_path / "nope"), out=tmp_path / "x", show_progress=False)
    with pytest.raises(QRecoverError, match=r"does not exist"):
        compress(cfg(tmp_path / "nope", bpw=None, bits=[4]), out=tmp_path / "x", show_progress=False)


def test_dir_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(QRecoverError, match="config.json"):
        compress(cfg(tmp_path / "empty"), out=tmp_path / "x", show_progress=False)
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(QRecoverError, match=r"not a \.gguf"):
        compress(cfg(tmp_path / "weights.bin"), out=tmp_path / "x", show_progress=False)


def _save_with_tokenizer(model, path, tiny_model_dir):
    from transformers import AutoTokenizer

    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)


def test_not_a_causal_lm_distilbert(tiny_model_dir, tmp_path):
    """DistilBERT has no causal-LM class at all: refused with a QRecoverError, with and without a budget."""
    from transformers import DistilBertConfig, DistilBertModel

    torch.manual_seed(0)
    d = tmp_path / "distilbert"
    _save_with_tokenizer(DistilBertModel(DistilBertConfig(vocab_size=1024, dim=32, n_layers=1, n_heads=2, hidden_dim=64)),
                         d, tiny_model_dir)
    with pytest.raises(QRecoverError, match="causal"):
        compress(cfg(d, bpw=None, bits=[4]), out=tmp_path / "x1", show_progress=False)
    with pytest.raises(QRecoverError, match="causal"):
        compress(cfg(d, bpw=5.0), out=tmp_path / "x2", show_progress=False)


def test_not_a_causal_lm_bert_encoder(tiny_model_dir, tmp_path):
    """A saved BertModel (a bidirectional encoder without an LM head) is not a causal LM; transformers would
    build a BertLMHeadModel around it with a randomly initialised head, which must be refused as such."""
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    d = tmp_path / "bert"
    bert = BertModel(BertConfig(vocab_size=TINY_CONFIG["vocab_size"], hidden_size=64, num_hidden_layers=1,
                                num_attention_heads=2, intermediate_size=128))
    _save_with_tokenizer(bert, d, tiny_model_dir)
    with pytest.raises(QRecoverError, match="causal"):
        compress(cfg(d, bpw=None, bits=[4], calib_samples=1, seq_len=16), out=tmp_path / "x", show_progress=False)
    assert not (tmp_path / "x").exists()


def test_hidden_size_not_a_multiple_of_64(tiny_model_dir, tmp_path):
    """A Llama with hidden size 96 (every linear shape divisible by the default group of 16 rows) compresses:
    embedding candidates whose block size does not divide the hidden size are simply not offered."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    d = tmp_path / "llama96"
    model = LlamaForCausalLM(LlamaConfig(**dict(TINY_CONFIG, hidden_size=96, intermediate_size=192, num_hidden_layers=1)))
    _save_with_tokenizer(model, d, tiny_model_dir)
    m = compress(cfg(d, bpw=None, bits=[4], calib_samples=1, seq_len=16), out=tmp_path / "u4", show_progress=False)
    assert m["layers"]["model.embed_tokens"]["label"] == "blockwise:8/pc"
    assert all(v["bits"] == 4 for v in m["layers"].values() if v["kind"] == "linear")


def test_existing_out_dir(tiny_model_dir, tiny_prepared, tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(QRecoverError, match="already exists.*--overwrite"):
        compress(cfg(tiny_model_dir, bpw=5.0), out=out, show_progress=False)
    with pytest.raises(QRecoverError, match="already exists"):
        compress(cfg(tiny_model_dir, bpw=5.0), out=out, show_progress=False, prepared=tiny_prepared)
    assert (out / "keep.txt").read_text() == "mine" and len(list(out.iterdir())) == 1
    m = compress(cfg(tiny_model_dir, bpw=5.0), out=out, overwrite=True, show_progress=False, prepared=tiny_prepared)
    assert not (out / "keep.txt").exists() and read_manifest(out) == m
    assert [p.name for p in tmp_path.iterdir()] == ["exists"]


def _copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_tampered_weights_refused(tiny_ckpt, tmp_path):
    d = _copy_ckpt(tiny_ckpt, tmp_path / "ck")
    w = d / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-10] ^= 0x01  # inside the tensor data: still a valid safetensors file
    w.write_bytes(bytes(data))
    with pytest.raises(QRecoverError, match=r"sha256.*changed or corrupted"):
        qrecover.load(d)
    qrecover.load(d, verify=False)  # the check is what refuses it, not a parse failure


def test_missing_weights_file(tiny_ckpt, tmp_path):
    d = _copy_ckpt(tiny_ckpt, tmp_path / "ck")
    (d / "model.safetensors").unlink()
    with pytest.raises(QRecoverError, match="missing"):
        qrecover.load(d)


def test_newer_format_version(tiny_ckpt, tmp_path):
    d = _copy_ckpt(tiny_ckpt, tmp_path / "ck")
    m = json.loads((d / "qrecover.json").read_text())
    m["format_version"] = 99
    (d / "qrecover.json").write_text(json.dumps(m))
    with pytest.raises(QRecoverError, match=r"format_version=99.*newer.*upgrade"):
        read_manifest(d)
    with pytest.raises(QRecoverError, match="newer"):
        qrecover.load(d)


def test_missing_and_corrupt_manifest(tmp_path):
    with pytest.raises(QRecoverError, match="not a qrecover checkpoint"):
        qrecover.load(tmp_path)
    with pytest.raises(QRecoverError, match="not a qrecover checkpoint"):
        read_manifest(tmp_path / "nope")
    (tmp_path / "qrecover.json").write_text("{not json")
    with pytest.raises(QRecoverError, match="not valid JSON"):
        read_manifest(tmp_path)
    (tmp_path / "qrecover.json").write_text(json.dumps({"format": "qrecover"}))
    with pytest.raises(QRecoverError, match="format_version=None"):
        read_manifest(tmp_path)


def test_compress_refuses_a_checkpoint_as_source(tiny_ckpt, tmp_path):
    with pytest.raises(QRecoverError, match="already a qrecover checkpoint"):
        compress(cfg(tiny_ckpt, bpw=None, bits=[4]), out=tmp_path / "x", show_progress=False)


# --- atomic writes -----------------------------------------------------------------------------------------


def _interrupt(*_a, **_k):
    raise KeyboardInterrupt


def test_interrupted_write_leaves_nothing(tiny_model_dir, tiny_prepared, tmp_path, monkeypatch):
    monkeypatch.setattr(stage_write, "save_file", _interrupt)
    out = tmp_path / "ck"
    with pytest.raises(KeyboardInterrupt):
        compress(cfg(tiny_model_dir, bpw=5.0), out=out, show_progress=False, prepared=tiny_prepared)
    assert not out.exists()
    assert list(tmp_path.iterdir()) == []  # no .ck.tmp-* sibling


def _exit_on_term(signum, _frame):
    raise SystemExit(128 + signum)


@pytest.mark.parametrize("kind", ["dir", "file"])
def test_a_second_signal_during_the_cleanup_does_not_cut_it_short(tmp_path, monkeypatch, kind):
    """torchrun's SIGTERM can arrive just after a broken collective raised in a process that is writing: the
    removal of the temporary directory (or file) already under way finishes first, then the signal is delivered."""
    real_rmtree, real_unlink = shutil.rmtree, Path.unlink

    def signalled(real):
        def run(*a, **k):
            os.kill(os.getpid(), signal.SIGTERM)  # without the mask, the handler raises here, before the removal
            return real(*a, **k)
        return run

    monkeypatch.setattr(shutil, "rmtree", signalled(real_rmtree))
    monkeypatch.setattr(Path, "unlink", signalled(real_unlink))
    old = signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        with pytest.raises(SystemExit) as e:
            with (atomic_dir(tmp_path / "ck") if kind == "dir" else atomic_file(tmp_path / "f.bin")) as tmp:
                (tmp / "part" if kind == "dir" else tmp).write_bytes(b"half")
                raise RuntimeError("a peer failed")
    finally:
        signal.signal(signal.SIGTERM, old)
    assert e.value.code == 128 + signal.SIGTERM
    assert list(tmp_path.iterdir()) == []


def test_interrupted_overwrite_keeps_old(tiny_model_dir, tiny_prepared, tmp_path, monkeypatch):
    out = tmp_path / "ck"
    out.mkdir()
    (out / "old.txt").write_text("old")
    monkeypatch.setattr(stage_write, "save_file", _interrupt)
    with pytest.raises(KeyboardInterrupt):
        compress(cfg(tiny_model_dir, bpw=5.0), out=out, overwrite=True, show_progress=False, prepared=tiny_prepared)
    assert (out / "old.txt").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]

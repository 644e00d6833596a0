"""`qrecover export`: GGUF and compressed-tensors round trips against `qrecover.load`, adapters, refusals."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_helpers import run

from qrecover.adapters.lora import attach_lora, base_identity, lora_modules, save_adapter
from qrecover.adapters.peft_quant import merge_and_unload
from qrecover.adapters.svd_init import lowrank_correction
from qrecover.api import compress
from qrecover.config import CompressConfig
from qrecover.errors import QRecoverError
from qrecover.evaluate.agreement import KLProbe
from qrecover.evaluate.perplexity import perplexity
from qrecover.export import export
from qrecover.export.common import integer_layout, read_checkpoint
from qrecover.export.gguf_format import encode_q4, map_layer, row_permutation
from qrecover.export.merge import calibration_windows
from qrecover.loading import load
from qrecover.models import load_model
from qrecover.qlinear import QuantLinear
from qrecover.schemes import get_quantizer

HAS_CT = importlib.util.find_spec("compressed_tensors") is not None
IDS = torch.tensor([[1, 504, 3458, 314, 253, 1345, 30, 2, 17, 42, 999, 12000]])


def _ckpt(tiny_model_dir, tmp_path_factory, name, **params):
    out = tmp_path_factory.mktemp("export") / name
    compress(CompressConfig(model=str(tiny_model_dir), bpw=None, bits=[4], scheme="blockwise", scheme_params=params,
                            embedding_bits="8", calib_samples=2, seq_len=64), out=out, show_progress=False)
    return out


@pytest.fixture(scope="module")
def asym_ckpt(tiny_model_dir, tmp_path_factory):
    return _ckpt(tiny_model_dir, tmp_path_factory, "b4a32", block_size=32, symmetric=False)


@pytest.fixture(scope="module")
def sym_ckpt(tiny_model_dir, tmp_path_factory):
    return _ckpt(tiny_model_dir, tmp_path_factory, "b4s64", block_size=64, symmetric=True)


@pytest.fixture(scope="module")
def adapter(sym_ckpt, tmp_path_factory):
    torch.manual_seed(1)
    model = attach_lora(load(sym_ckpt), rank=4)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.05)
    out = tmp_path_factory.mktemp("adapter") / "lora"
    save_adapter(model, out, base_identity(sym_ckpt), model.qrecover_manifest["parameters"]["model"])
    return out


def _flat(err: str) -> str:
    """The error without the console's line wrapping."""
    return " ".join(err.split())


def _logits(model):
    with torch.no_grad():
        return model(input_ids=IDS, use_cache=False).logits[0].double()


# --- pure pieces ------------------------------------------------------------------------------------------


def test_q4_blocks_hold_blockwise_codes_exactly():
    gguf = pytest.importorskip("gguf")
    torch.manual_seed(0)
    w = torch.randn(6, 64)
    for sym, qt in ((True, gguf.GGMLQuantizationType.Q4_0), (False, gguf.GGMLQuantizationType.Q4_1)):
        qw = get_quantizer("blockwise", block_size=32, symmetric=sym).quantize(w, 4, {})
        m = map_layer(qw)
        assert m["type"] == qt
        back = torch.from_numpy(gguf.quants.dequantize(m["data"], qt).copy())
        ref = qw.dequantize()
        if m["exact"]:
            assert torch.equal(back, ref)
        else:  # Q4_1 blocks whose m is not an fp16 number: off by at most half an fp16 ulp of |m|
            assert 0 < m["exact_blocks"][0] < m["exact_blocks"][1]
            assert (back - ref).abs().max() <= ref.abs().max() * 2**-11
    # the nibble order: code j in the low nibble, code j+16 in the high nibble of byte j
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).view(1, 32)
    data = encode_q4(codes, torch.ones(1, 1, dtype=torch.float16), None)
    assert list(data[0, 2:]) == [(j % 16) | ((j + 16) % 16) << 4 for j in range(16)]


def test_int8_symmetric_per_channel_is_q8_0_exactly_and_palettized_is_requantized():
    gguf = pytest.importorskip("gguf")
    torch.manual_seed(0)
    w = torch.randn(16, 96)
    qw = get_quantizer("blockwise", block_size=None, symmetric=True).quantize(w, 8, {})
    m = map_layer(qw)
    assert m["type"] == gguf.GGMLQuantizationType.Q8_0 and m["exact"]
    assert torch.equal(torch.from_numpy(gguf.quants.dequantize(m["data"], m["type"]).copy()), qw.dequantize())
    pal = get_quantizer("palettize", group_size=8, error_feedback=False).quantize(w, 4, {})
    assert integer_layout(pal) is None
    mp = map_layer(pal)
    assert mp["type"] == gguf.GGMLQuantizationType.Q5_1 and not mp["exact"]  # one bit above the 4-bit table


def test_row_permutation_matches_llama_cpp_and_transformers_undoes_it():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    w = torch.arange(8 * 3, dtype=torch.float32).view(8, 3)
    perm = row_permutation("model.layers.0.self_attn.q_proj", 8, n_head=2, n_kv=1)
    permuted = w[torch.from_numpy(perm)]
    # llama.cpp: reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)
    assert torch.equal(permuted, w.reshape(2, 2, 2, 3).swapaxes(1, 2).reshape(8, 3))
    back = LlamaTensorProcessor()._reverse_permute_weights(permuted.numpy(), 2, 2)
    assert np.array_equal(back, w.numpy())


# --- GGUF round trips -------------------------------------------------------------------------------------


def _read_gguf_layers(path, ckpt):
    import gguf
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(ckpt.path)
    reader = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg.num_hidden_layers)
    out = {}
    for n, qw in ckpt.layers.items():
        t = by_name[f"{names.get_name(n)}.weight"]
        w = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy()).reshape(qw.shape)
        perm = row_permutation(n, qw.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads)
        if perm is not None:
            inv = np.argsort(perm)
            w = w[torch.from_numpy(inv)]
        out[n] = (w, t.tensor_type.name)
    return reader, out


def test_gguf_export_reads_back_equal_to_the_checkpoint(sym_ckpt, asym_ckpt, tmp_path):
    ckpt = read_checkpoint(sym_ckpt)
    rep = export(sym_ckpt, "gguf", tmp_path / "sym")
    assert rep["exact_layers"] == rep["total_layers"] and rep["total_rel_error"] == 0.0
    reader, layers = _read_gguf_layers(tmp_path / "sym" / "model.gguf", ckpt)
    for n, (w, tname) in layers.items():
        assert torch.equal(w, ckpt.layers[n].dequantize()), n
        assert tname == ("Q8_0" if ckpt.kind(n) == "embedding" else "Q4_0")
    assert "output.weight" not in {t.name for t in reader.tensors}  # tied: llama.cpp reuses token_embd

    ackpt = read_checkpoint(asym_ckpt)
    arep = export(asym_ckpt, "gguf", tmp_path / "asym")
    _, alayers = _read_gguf_layers(tmp_path / "asym" / "model.gguf", ackpt)
    for n, (w, tname) in alayers.items():
        ref = ackpt.layers[n].dequantize()
        info = arep["layers"][n]
        assert tname == info["type"]
        if info["exact"]:
            assert torch.equal(w, ref), n
        else:  # the reported error is the measured one
            rel = float((w.double() - ref.double()).norm() / ref.double().norm())
            assert rel == pytest.approx(info["rel_error"], rel=1e-9) and rel < 2e-3
    assert json.loads((tmp_path / "asym" / "qrecover_export.json").read_text())["format"] == "gguf"


def test_gguf_export_loads_in_transformers_with_the_checkpoints_logits_and_tokenizer(sym_ckpt, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export(sym_ckpt, "gguf", tmp_path / "g")
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "g", gguf_file="model.gguf", dtype=torch.float32)
    ref = _logits(load(sym_ckpt))
    got = _logits(hf)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4), float((got - ref).abs().max())
    tok = AutoTokenizer.from_pretrained(tmp_path / "g", gguf_file="model.gguf")
    src = AutoTokenizer.from_pretrained(sym_ckpt)
    text = "def f(x):\n    return x ** 2  # héllo <|im_start|>"
    assert tok(text)["input_ids"] == src(text)["input_ids"]
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs, tokenize=False) == src.apply_chat_template(msgs, tokenize=False)
    # qrecover's own GGUF loading (each file parsed once, qrecover.models._gguf_parsed_once): the same tensors and
    # tokens as transformers' plain path above, and gguf's functions are its own again afterwards
    import gguf

    from qrecover.models import _load_gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    model, tok2 = _load_gguf(tmp_path / "g" / "model.gguf")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader, name_map)
    ours, theirs = model.state_dict(), hf.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]


def test_gguf_adapter_is_a_llama_cpp_lora_bound_to_the_exported_base(sym_ckpt, adapter, tmp_path):
    import gguf
    from safetensors.torch import load_file

    from qrecover.io_utils import sha256_file

    rep = export(sym_ckpt, "gguf", tmp_path / "g", adapter=adapter)
    path = tmp_path / "g" / "adapter" / "adapter.gguf"
    reader = gguf.GGUFReader(str(path))
    assert reader.fields["general.type"].contents() == "adapter"
    assert reader.fields["adapter.type"].contents() == "lora"
    assert reader.fields["adapter.lora.alpha"].contents() == pytest.approx(8.0)
    tensors = {t.name: torch.from_numpy(np.array(t.data)).reshape([int(d) for d in reversed(t.shape)]) for t in reader.tensors}
    peft = load_file(str(adapter / "adapter_model.safetensors"))
    a = peft["base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"].float()
    assert torch.equal(tensors["blk.1.ffn_down.weight.lora_a"], a)
    b = peft["base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight"].float()
    perm = torch.from_numpy(row_permutation("self_attn.k_proj", b.shape[0], 4, 2))
    assert torch.equal(tensors["blk.0.attn_k.weight.lora_b"], b[perm])
    assert len(tensors) == 2 * len([k for k in peft if "lora_A" in k])
    binding = json.loads((tmp_path / "g" / "adapter" / "qrecover_adapter_binding.json").read_text())
    assert binding["base"]["sha256"] == sha256_file(tmp_path / "g" / "model.gguf")
    assert rep["adapter"]["tensors"] == len(tensors)


# --- refusals ---------------------------------------------------------------------------------------------


def test_bad_input_is_one_line_exit_2_and_leaves_nothing(sym_ckpt, asym_ckpt, adapter, tmp_path, capsys, monkeypatch):
    out = tmp_path / "x"
    code, _, err = run(["export", asym_ckpt, "--format", "gguf", "--out", out, "--adapter", adapter], capsys)
    assert code == 2 and "was trained on checkpoint" in _flat(err)
    assert not out.exists() and not list(tmp_path.iterdir())
    out.mkdir()
    code, _, err = run(["export", sym_ckpt, "--format", "gguf", "--out", out], capsys)
    assert code == 2 and "already exists" in _flat(err) and "--overwrite" in _flat(err)
    out.rmdir()
    code, _, err = run(["export", sym_ckpt, "--format", "onnx", "--out", out], capsys)
    assert code == 2 and "gguf, compressed-tensors, coreml" in _flat(err)
    code, _, err = run(["export", sym_ckpt, "--format", "gguf", "--out", out, "--merge-adapter"], capsys)
    assert code == 2 and "--merge-adapter needs --adapter" in _flat(err) and _flat(err).count("error:") == 1
    code, _, err = run(["export", asym_ckpt, "--format", "gguf", "--out", out, "--adapter", adapter, "--merge-adapter"], capsys)
    assert code == 2 and "was trained on checkpoint" in _flat(err)
    code, _, err = run(["export", sym_ckpt, "--format", "gguf", "--out", out, "--adapter", adapter, "--merge-adapter",
                        "--merge-windows", "0"], capsys)
    assert code == 2 and "--merge-windows 0" in _flat(err)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "compressed_tensors" else real(name, *a))
    code, _, err = run(["export", sym_ckpt, "--format", "compressed-tensors", "--out", out], capsys)
    assert code == 2 and "pip install 'qrecover[export-ct]'" in _flat(err)
    assert not list(tmp_path.iterdir())


# --- compressed-tensors -----------------------------------------------------------------------------------

needs_ct = pytest.mark.skipif(not HAS_CT, reason="compressed-tensors is not installed (pip install 'qrecover[export-ct]')")


def _ct_model(path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model(input_ids=IDS[:, :2])  # compressed-tensors decompresses on the first forward
    return model


@needs_ct
def test_compressed_tensors_export_loads_in_transformers_with_the_checkpoints_logits(sym_ckpt, tmp_path):
    from safetensors import safe_open

    rep = export(sym_ckpt, "compressed-tensors", tmp_path / "ct")
    qc = json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    (group,) = qc["config_groups"].values()
    assert group["weights"] == {**group["weights"], "num_bits": 4, "group_size": 64, "strategy": "group", "symmetric": True}
    assert len(group["targets"]) == 14 and all(t.startswith("model.layers.") for t in group["targets"])
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.layers.0.mlp.down_proj.weight_packed").get_dtype() == "I32"
        assert f.get_slice("model.layers.0.mlp.down_proj.weight_scale").get_dtype() == "F16"
    assert rep["exact_layers"] == rep["total_layers"]
    got, ref = _logits(_ct_model(tmp_path / "ct")), _logits(load(sym_ckpt))
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), float((got - ref).abs().max())


@needs_ct
def test_compressed_tensors_asymmetric_layers_decompress_to_the_checkpoint(asym_ckpt, tmp_path):
    """Asymmetric layers: transformers 5.24 + compressed-tensors 0.20 cannot load them (upstream), so the
    library's own decompressor reads the exported tensors back."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file

    export(asym_ckpt, "compressed-tensors", tmp_path / "ct")
    qc = QuantizationConfig.model_validate(json.loads((tmp_path / "ct" / "config.json").read_text())["quantization_config"])
    state = load_file(str(tmp_path / "ct" / "model.safetensors"))
    ckpt = read_checkpoint(asym_ckpt)
    checked = 0
    for scheme in qc.config_groups.values():
        for name in scheme.targets:
            # as transformers does when loading with dtype=float32: floating tensors (the fp16 scales) upcast
            local = {k.removeprefix(name + "."): v.float() if v.is_floating_point() else v
                     for k, v in state.items() if k.startswith(name + ".")}
            assert "weight_zero_point" in local or scheme.weights.symmetric
            w = PackedQuantizationCompressor.decompress(local, scheme)["weight"].float()
            assert torch.equal(w, ckpt.layers[name].dequantize()), name
            checked += 1
    assert checked == 14
    assert torch.equal(state["model.embed_tokens.weight"], ckpt.layers["model.embed_tokens"].dequantize())


@needs_ct
def test_palettized_layers_are_refused_or_requantized_with_the_measured_loss(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "ct"
    code, _, err = run(["export", tiny_ckpt, "--format", "compressed-tensors", "--out", out], capsys)
    err = _flat(err)
    assert code == 2 and "palettized layer(s) (model.layers.0." in err and "--requantize int4/g64" in err
    assert not out.exists()
    rep = export(tiny_ckpt, "compressed-tensors", out, requantize="int4/g64")
    ckpt = read_checkpoint(tiny_ckpt)
    model = _ct_model(out)
    lossy = [n for n, v in rep["layers"].items() if not v["exact"]]
    assert len(lossy) == 14
    for n in lossy:
        ref = ckpt.layers[n].dequantize().double()
        rel = float((model.get_submodule(n).weight.double() - ref).norm() / ref.norm())
        assert rel == pytest.approx(rep["layers"][n]["rel_error"], rel=1e-6) and 0 < rel < 0.2


@needs_ct
def test_exported_peft_adapter_on_the_exported_base_equals_the_adapter_on_qrecover_load(sym_ckpt, adapter, tmp_path):
    from peft import PeftModel

    from qrecover.io_utils import sha256_file

    export(sym_ckpt, "compressed-tensors", tmp_path / "ct", adapter=adapter)
    binding = json.loads((tmp_path / "ct" / "adapter" / "qrecover_adapter_binding.json").read_text())
    assert binding["base"]["sha256"] == sha256_file(tmp_path / "ct" / "model.safetensors")
    got = _logits(PeftModel.from_pretrained(_ct_model(tmp_path / "ct"), str(tmp_path / "ct" / "adapter")))
    ref = _logits(load(sym_ckpt, adapter=adapter))
    base = _logits(load(sym_ckpt))
    assert (ref - base).abs().max() > 1e-2  # the adapter changes the output
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), float((got - ref).abs().max())


# --- Core ML ----------------------------------------------------------------------------------------------


@pytest.mark.skipif(importlib.util.find_spec("coremltools") is None,
                    reason="coremltools is not installed (pip install 'qrecover[export-coreml]')")
def test_coreml_package_holds_the_checkpoints_own_tables_and_indices(tiny_ckpt, tmp_path):
    """Palettized layers become per_grouped_channel LUTs: read back from the saved package, every group's
    table and indices equal the checkpoint's (running the package needs an Apple device: not checked)."""
    from qrecover.export.coreml import palettized_groups, read_tables

    rep = export(tiny_ckpt, "coreml", tmp_path / "cm")
    ckpt = read_checkpoint(tiny_ckpt)
    tables = read_tables(tmp_path / "cm" / "model.mlpackage")
    pal = [n for n, qw in ckpt.layers.items() if "lut" in qw.tensors]
    assert len(pal) == 14 and len(tables) == len(pal)
    for n in pal:
        info = rep["layers"][n]
        assert info["exact"]
        (lut, idx), = [v for k, v in tables.items() if k.startswith(info["coreml"])]  # coremltools appends a suffix
        g, ref_tables, codes = palettized_groups(ckpt.layers[n])
        o, i = codes.shape
        assert np.array_equal(lut.reshape(o // g, -1).astype(np.float16), ref_tables), n
        assert np.array_equal(idx.reshape(o, i), codes), n
    emb = rep["layers"]["model.embed_tokens"]
    assert emb["type"] == "fp16" and 0 < emb["rel_error"] < 1e-3


# --- --merge-adapter --------------------------------------------------------------------------------------

MERGE_KW = dict(merge_windows=2, cost_windows=2)


def _cost(model, tok, reference):
    """Held-out perplexity and KL to ``reference`` as the merge report measures them (2 windows x 512 tokens)."""
    probe = KLProbe(model, reference)
    r = perplexity(probe, tok, windows=2, seq_len=512, show_progress=False)
    return r["ppl"], probe.result()["kl"]


@pytest.fixture(scope="module")
def svd_adapter(sym_ckpt, tiny_model_dir, tmp_path_factory):
    """A recovery-like adapter: each ``scaling * B A`` the rank-4 SVD of its layer's quantization error (it brings
    the checkpoint nearer the original model, so the merge has a gain to keep or lose)."""
    original = dict(load_model(str(tiny_model_dir))[0].named_modules())
    model = attach_lora(load(sym_ckpt), rank=4)
    with torch.no_grad():
        for name, mod in lora_modules(model).items():
            err = original[name].weight - mod.get_base_layer().packed.dequantize()
            b, a = lowrank_correction(err, None, 4, mod.scaling["default"])
            mod.lora_A["default"].weight.copy_(a.float())
            mod.lora_B["default"].weight.copy_(b.float())
    out = tmp_path_factory.mktemp("adapter") / "svd"
    save_adapter(model, out, base_identity(sym_ckpt), model.qrecover_manifest["parameters"]["model"])
    return out


@pytest.fixture(scope="module")
def merged_reference(sym_ckpt, svd_adapter, tiny_model_dir):
    """What the export must reproduce: ``merge_and_unload`` on ``qrecover.load(..., adapter=)``, and the cost of
    base / unmerged / merged measured here independently."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(sym_ckpt)
    reference = load_model(str(tiny_model_dir))[0]
    peft_model = load(sym_ckpt, adapter=svd_adapter)
    with torch.no_grad():
        with peft_model.disable_adapter():
            base = _cost(peft_model, tok, reference)
        unmerged = _cost(peft_model, tok, reference)
        with pytest.warns(UserWarning):
            model = merge_and_unload(peft_model, calibration_windows(read_checkpoint(sym_ckpt), tok, 2))
        merged = _cost(model, tok, reference)
    return model, {"base": base, "unmerged": unmerged, "merged": merged}


def test_merged_gguf_export_is_merge_and_unload_and_reports_the_measured_cost(sym_ckpt, svd_adapter, merged_reference,
                                                                              tmp_path, capsys):
    model, cost = merged_reference
    out = tmp_path / "g"
    code, stdout, err = run(["export", sym_ckpt, "--format", "gguf", "--out", out, "--adapter", svd_adapter, "--merge-adapter",
                             "--merge-windows", "2", "--cost-windows", "2"], capsys)
    assert code == 0, err
    rep = json.loads((out / "qrecover_export.json").read_text())
    merge = rep["merge"]
    for k in ("base", "unmerged", "merged"):  # the reported numbers are the measured ones
        assert merge["cost"][k]["ppl"] == pytest.approx(cost[k][0], rel=1e-6), k
        assert merge["cost"][k]["kl"] == pytest.approx(cost[k][1], rel=1e-5), k
    (kb, ku, km) = (cost[k][1] for k in ("base", "unmerged", "merged"))
    assert ku < 0.8 * kb  # the SVD adapter recovers part of the quantization loss
    kept = (kb - km) / (kb - ku)
    assert merge["cost"]["kept"] == pytest.approx(kept, rel=1e-4)
    flat = _flat(stdout + err)  # the console writes to stderr
    assert "MERGE COST" in flat and f"{cost['merged'][0]:.4g}" in flat and "KL to the unquantized model" in flat
    assert f"keeps {100 * kept:.0f}% of the adapter's gain" in flat
    assert ("prefer exporting the adapter unmerged" in flat) == (kept < 0.9)
    assert not (out / "adapter").exists()  # merged: in the weights, not beside them
    # the export holds the merged packed weights: every layer Q4_0/Q8_0 exact, equal bit for bit to merge_and_unload's
    ckpt = read_checkpoint(sym_ckpt)
    merged_layers = {n: m.packed.dequantize() for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    assert rep["exact_layers"] == rep["total_layers"]
    _, layers = _read_gguf_layers(out / "model.gguf", ckpt)
    changed = 0
    for n, (w, _) in layers.items():
        ref = merged_layers.get(n, ckpt.layers[n].dequantize())
        assert torch.equal(w, ref), n
        changed += not torch.equal(w, ckpt.layers[n].dequantize())
    kept = merge["layers_kept_original"]
    assert changed == 14 - kept and changed > 0
    assert merge["layers"].keys() == merged_layers.keys()


@needs_ct
def test_merged_compressed_tensors_export_loads_with_the_merged_models_logits(sym_ckpt, svd_adapter, merged_reference,
                                                                               tmp_path):
    model, cost = merged_reference
    rep = export(sym_ckpt, "compressed-tensors", tmp_path / "ct", adapter=svd_adapter, merge_adapter=True, **MERGE_KW)
    assert rep["merge"]["cost"]["merged"]["ppl"] == pytest.approx(cost["merged"][0], rel=1e-6)
    got, ref = _logits(_ct_model(tmp_path / "ct")), _logits(model)
    assert (ref - _logits(load(sym_ckpt))).abs().max() > 1e-3  # the merge changed the model
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5), float((got - ref).abs().max())


@pytest.mark.skipif(importlib.util.find_spec("coremltools") is None,
                    reason="coremltools is not installed (pip install 'qrecover[export-coreml]')")
def test_merged_coreml_package_holds_the_merged_palettized_tables(tiny_ckpt, tmp_path):
    """Palettized layers re-quantized by the merge (with calibration statistics) stay palettized: the package's
    tables and indices are the merged model's, group by group."""
    from transformers import AutoTokenizer

    from qrecover.export.coreml import palettized_groups, read_tables

    torch.manual_seed(2)
    model = attach_lora(load(tiny_ckpt), rank=4)
    with torch.no_grad():
        for mod in lora_modules(model).values():
            mod.lora_B["default"].weight.normal_(0, 0.05)
    adapter_dir = tmp_path / "lora"
    save_adapter(model, adapter_dir, base_identity(tiny_ckpt), model.qrecover_manifest["parameters"]["model"])
    rep = export(tiny_ckpt, "coreml", tmp_path / "cm", adapter=adapter_dir, merge_adapter=True, **MERGE_KW)
    ckpt = read_checkpoint(tiny_ckpt)
    with pytest.warns(UserWarning):
        merged = merge_and_unload(load(tiny_ckpt, adapter=adapter_dir),
                                  calibration_windows(ckpt, AutoTokenizer.from_pretrained(tiny_ckpt), 2))
    packed = {n: m.packed for n, m in merged.named_modules() if isinstance(m, QuantLinear)}
    tables = read_tables(tmp_path / "cm" / "model.mlpackage")
    changed = 0
    for n, qw in packed.items():
        (lut, idx), = [v for k, v in tables.items() if k.startswith(rep["layers"][n]["coreml"])]
        g, ref_tables, codes = palettized_groups(qw)
        o, i = codes.shape
        assert np.array_equal(lut.reshape(o // g, -1).astype(np.float16), ref_tables), n
        assert np.array_equal(idx.reshape(o, i), codes), n
        changed += not torch.equal(qw.dequantize(), ckpt.layers[n].dequantize())
    assert changed == len(packed) - rep["merge"]["layers_kept_original"] and changed > 0


def test_gguf_refuses_a_sentencepiece_style_bpe_tokenizer(sym_ckpt, tmp_path):
    """A Metaspace ('▁') BPE tokenizer.json (Mistral's, Llama 2's) is a BPE too; written as GPT-2 BPE it would
    tokenize wrongly in llama.cpp, so it is refused with the reason and the alternative (nothing written)."""
    pytest.importorskip("gguf")
    from qrecover.export.gguf_format import is_byte_level_bpe

    ckpt = Path(shutil.copytree(sym_ckpt, tmp_path / "spm"))
    tj = json.loads((ckpt / "tokenizer.json").read_text())
    assert is_byte_level_bpe(tj)  # the default model's: GPT-2 style
    tj["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": False}
    tj["model"]["byte_fallback"] = True
    (ckpt / "tokenizer.json").write_text(json.dumps(tj))
    assert not is_byte_level_bpe(tj)
    assert is_byte_level_bpe({"model": {"type": "BPE"}, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
        {"type": "Split"}, {"type": "ByteLevel"}]}})
    with pytest.raises(QRecoverError, match="no byte-level BPE tokenizer.json.*Metaspace.*--format compressed-tensors"):
        export(ckpt, "gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()

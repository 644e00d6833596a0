"""Compression with one decoder layer resident (lazy loading from safetensors, :func:`qrecover.models.resident`).

Checks: a lazily loaded model holds its decoder layers on the meta device and reads exactly the saved
tensors (a sharded ``model.safetensors.index.json`` included, a tied output matrix stays tied); the lazy
path gives bit-identical checkpoints to the whole-model path (the same weights file sha256 in the manifest,
tensor for tensor) on the tiny Llama and on random Qwen2 (untied head, qkv biases, sharded files) and
Gemma-3 (scaled embedding, (1+w) norms, soft-capping) models, for palettize, blockwise, gptq and awq+gptq
encodings, finalize on and off, and a budget (the layer-wise gradient pass); a directory the lazy path
cannot map falls back to the whole-model load and its errors; compress subprocesses on a random model at 6
and 30 decoder layers (0.44 / 1.78 GB of fp32 weights) peak within 15% of the added weights of each other
and the larger below its own size (the child's own VmHWM).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers as T
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from qrecover.api import compress, prepare
from qrecover.config import CompressConfig
from qrecover.errors import QRecoverError
from qrecover.measure import peak_rss_command, read_peak_rss
from qrecover.models import decoder_layers, default_model_dir, lazy_weights, load_model, resident

BASE = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.125)
ARCHS = {
    "qwen2": (T.Qwen2Config, dict(tie_word_embeddings=False)),
    "gemma3": (T.Gemma3TextConfig, dict(tie_word_embeddings=True, head_dim=16, sliding_window=32, final_logit_softcapping=30.0)),
}
ENCODINGS = ("palettize:4", "blockwise:4/b32", "gptq:4/g32")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(d)
    return d


def _build(name: str, d: Path, tok_dir: Path) -> Path:
    cls, extra = ARCHS[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cls(**{**BASE, **extra}), dtype=torch.float32).eval()
    with torch.no_grad():  # norms and biases away from their 0/1 init
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    # qwen2 in shards: the lazy reader must follow model.safetensors.index.json
    model.save_pretrained(d, **({"max_shard_size": "1MB"} if name == "qwen2" else {}))
    for f in tok_dir.iterdir():
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="module", params=["tiny-llama", "qwen2", "gemma3"])
def model_dir(request, tiny_model_dir, tok_dir, tmp_path_factory):
    if request.param == "tiny-llama":
        return tiny_model_dir
    return _build(request.param, tmp_path_factory.mktemp(request.param), tok_dir)


def _cfg(d: Path, **kw) -> CompressConfig:
    return CompressConfig(model=str(d), calib_samples=2, seq_len=32, **kw)


def _same_checkpoint(a: Path, b: Path) -> None:
    ma, mb = (json.loads((x / "qrecover.json").read_text()) for x in (a, b))
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta.keys() == tb.keys()
    assert [k for k in ta if not torch.equal(ta[k], tb[k])] == []
    assert ma["weights_file"]["sha256"] == mb["weights_file"]["sha256"]
    assert ma["layers"] == mb["layers"] and ma["sensitivity"] == mb["sensitivity"]
    assert {k: v for k, v in ma["finalize"].items() if k != "seconds"} == {k: v for k, v in mb["finalize"].items() if k != "seconds"}
    assert ma["transforms"] == mb["transforms"] and ma["measured_bpw"] == mb["measured_bpw"]
    for f in ("config.json", "generation_config.json"):
        assert (a / f).exists() == (b / f).exists()
        if (a / f).exists():
            assert (a / f).read_text() == (b / f).read_text()


def test_lazy_load_reads_the_saved_tensors(model_dir):
    full, _, _ = load_model(str(model_dir), lazy=False)
    lazy, _, _ = load_model(str(model_dir), lazy=True)
    assert lazy_weights(full) is None and lazy_weights(lazy) is not None
    ref = full.state_dict()
    layers = decoder_layers(lazy)
    assert all(p.is_meta for p in layers.parameters())
    assert not any(p.is_meta for n, p in lazy.named_parameters() if ".layers." not in n)
    assert (lazy.get_output_embeddings().weight is lazy.get_input_embeddings().weight) == (
        full.get_output_embeddings().weight is full.get_input_embeddings().weight)
    for n, p in lazy.named_parameters():
        if not p.is_meta:
            assert torch.equal(p, ref[n]), n
    with resident(lazy, layers[1], "cpu"):
        for n, p in layers[1].named_parameters():
            assert torch.equal(p, ref[f"model.layers.1.{n}"]), n
    assert all(p.is_meta for p in layers[1].parameters())  # dropped again
    if (model_dir / "model.safetensors.index.json").exists():
        assert len({f for f in lazy_weights(lazy).where.values()}) > 1  # really read from several shards


def test_kept_changes_outlive_the_residency(tiny_model_dir):
    """A change made under ``keep=True`` (a transform's fold) is what later reads return; without it, dropped."""
    model, _, _ = load_model(str(tiny_model_dir), lazy=True)
    layer = decoder_layers(model)[0]
    with resident(model, layer, "cpu", keep=True):
        w = layer.mlp.up_proj.weight.detach().clone()
        layer.mlp.up_proj.weight.data.mul_(2.0)
    with resident(model, layer, "cpu"):
        assert torch.equal(layer.mlp.up_proj.weight, 2 * w)
        layer.mlp.up_proj.weight.data.zero_()
    with resident(model, layer, "cpu"):
        assert torch.equal(layer.mlp.up_proj.weight, 2 * w)


def test_lazy_equals_full_for_every_encoding(model_dir, tmp_path):
    """Candidates (with damage: the layer-wise gradient pass), then uniform checkpoints per encoding with
    finalize on and off, and one budgeted mixed checkpoint: bit-identical either way."""
    kw = dict(bpw=5.0, encodings=",".join(ENCODINGS))
    p = {lazy: prepare(_cfg(model_dir, **kw), show_progress=False, lazy=lazy) for lazy in (False, True)}
    assert lazy_weights(p[True].model) is not None and lazy_weights(p[False].model) is None
    assert p[True].grads["loss"] == p[False].grads["loss"]
    for n, u in p[False].units.items():
        for (qa, da), (qb, db) in zip(u.results, p[True].units[n].results):
            assert da == db and qa.tensors.keys() == qb.tensors.keys()
            assert all(torch.equal(qa.tensors[k], qb.tensors[k]) for k in qa.tensors), n
    for k, v in p[False].remainder.items():
        assert torch.equal(v, p[True].remainder[k]), k
    runs = [dict(bpw=None, encodings=e, finalize=f) for e in ENCODINGS for f in (True, False)] + [dict(kw, finalize=True)]
    for i, run in enumerate(runs):
        for lazy in (False, True):
            compress(_cfg(model_dir, **run), out=tmp_path / f"{i}-{lazy}", show_progress=False, prepared=p[lazy])
        _same_checkpoint(tmp_path / f"{i}-False", tmp_path / f"{i}-True")


def test_lazy_equals_full_with_awq(model_dir, tmp_path):
    """The AWQ fold made on a resident layer is kept (a scratch file) for calibration, finalize and write."""
    for fin in (True, False):
        for lazy in (False, True):
            compress(_cfg(model_dir, bpw=None, encodings="awq+gptq:4/g32", finalize=fin), out=tmp_path / f"{fin}-{lazy}",
                     show_progress=False, lazy=lazy)
        _same_checkpoint(tmp_path / f"{fin}-False", tmp_path / f"{fin}-True")
        ratios = [m["ratio"] for layer in json.loads((tmp_path / f"{fin}-True" / "qrecover.json").read_text())["transforms"]["layers"]["awq"]
                  for m in layer["mappings"] if "ratio" in m]
        assert any(r is not None for r in ratios)  # something was folded, so keeping the fold mattered


def test_unmappable_directory_falls_back_to_the_full_load(tmp_path, tiny_model_dir):
    """Weights whose names do not map onto the model (here: the untied head left out) are not read lazily:
    the whole-model load decides, with its own error."""
    src = tmp_path / "src"
    cls, extra = ARCHS["qwen2"]
    model = AutoModelForCausalLM.from_config(cls(**{**BASE, **extra}), dtype=torch.float32)
    model.save_pretrained(src)
    state = load_file(src / "model.safetensors")
    del state["lm_head.weight"]
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / f, src / f)
    with pytest.raises(QRecoverError, match="weights lack.*lm_head.weight"):
        load_model(str(src), lazy=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_lazy_on_cuda_equals_full_on_cuda(tiny_model_dir, tmp_path):
    for lazy in (False, True):
        compress(_cfg(tiny_model_dir, bpw=5.0, encodings="gptq:4/g32,blockwise:4/b32", device="cuda"),
                 out=tmp_path / str(lazy), show_progress=False, lazy=lazy)
    _same_checkpoint(tmp_path / "False", tmp_path / "True")


# --- peak memory ---------------------------------------------------------------------------------------------

BIG = dict(vocab_size=49152, hidden_size=512, intermediate_size=8192, num_attention_heads=8, num_key_value_heads=8,
           tie_word_embeddings=True, max_position_embeddings=256)  # 56 MB of fp32 per decoder layer


def _write_random_model(d: Path, cfg: dict) -> int:
    """A random Llama saved one decoder layer per shard (bf16 on disk, written a tensor at a time: the test
    process never holds the model). Returns the model's fp32 bytes."""
    config = T.LlamaConfig(**cfg)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    config.save_pretrained(d)
    shards: dict[str, dict[str, torch.Tensor]] = {}
    gen = torch.Generator().manual_seed(0)
    cache: dict[tuple, torch.Tensor] = {}  # one random tensor per shape: writing, not drawing, is the cost
    for name, p in meta.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        shard = name.split(".")[2] if ".layers." in name else "rest"
        if p.shape not in cache:
            cache[p.shape] = (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)
        shards.setdefault(shard, {})[name] = cache[p.shape] + 1 if p.dim() == 1 else cache[p.shape]
    weight_map = {}
    for shard, tensors in shards.items():
        fname = f"model-{shard}.safetensors"
        save_file({k: v.clone() for k, v in tensors.items()}, str(d / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return 4 * sum(p.numel() for p in meta.parameters())




def _imports_rss() -> int:
    """Peak resident set size in bytes of a child that only imports what ``qrecover compress`` imports."""
    code = ("import torch, transformers, qrecover.api, qrecover.stages\n"
            "from transformers.models.llama import modeling_llama\n"
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')))")
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    return int(subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True).stdout) * 1024


def _peak_rss(cli_args: list[str], tmp_path) -> int:
    """Peak resident set size in bytes of a ``qrecover`` CLI child process (its VmHWM at exit)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    report = tmp_path / "vmhwm.txt"
    proc = subprocess.run(peak_rss_command(report, cli_args), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert proc.returncode == 0, proc.stdout.decode()[-3000:]
    return read_peak_rss(report)


@pytest.mark.slow
def test_peak_memory_does_not_grow_with_the_layers(tmp_path, tok_dir):
    """The same model at 6 and at 30 decoder layers (0.44 and 1.78 GB of fp32 weights): compressing the
    larger one peaks about one packed output's growth higher, not 24 layers of weights higher, and far
    below its own size (the whole-model path needs more than the fp32 model)."""
    peaks, sizes = {}, {}
    for n in (6, 30):
        src = tmp_path / f"big-{n}"
        src.mkdir()
        sizes[n] = _write_random_model(src, {**BIG, "num_hidden_layers": n})
        for f in tok_dir.iterdir():
            shutil.copy(f, src / f.name)
        peaks[n] = _peak_rss(["compress", "--model", str(src), "--out", str(tmp_path / f"out-{n}"),
                              "--uniform", "--encodings", "blockwise:2/b64", "--embedding-encodings", "blockwise:4/b64",
                              "--calib-samples", "2", "--seq-len", "32", "--device", "cpu", "--procs", "1", "--json"], tmp_path)
        manifest = json.loads((tmp_path / f"out-{n}" / "qrecover.json").read_text())
        assert manifest["parameters"]["model"] * 4 == sizes[n]
        shutil.rmtree(src)
    imports = _imports_rss()  # measured 0.47 GB with torch 2.13's CPU build, 0.89 GB with 2.11's CUDA build (on a CPU)
    grown, added = peaks[30] - peaks[6], sizes[30] - sizes[6]
    # the 2-bit output of 24 more layers is ~7% of their fp32 bytes, held once until the write (a uniform model
    # with finalize skips the candidate pass; measured -1.9%, i.e. within the noise; before that change, with
    # the candidates held beside the finalized copy, 24.5%); holding their weights would be 100%
    assert grown < 0.15 * added, (peaks, sizes)
    assert peaks[30] - imports < sizes[30], (peaks, sizes, imports)


@pytest.mark.parametrize("name", sorted(ARCHS))
def test_gradient_pass_reads_each_layer_once_when_the_model_fits(name, tmp_path, tok_dir, monkeypatch):
    """On the CPU a lazily loaded model that fits in memory takes the whole-model gradient pass: each decoder layer
    read once for the pass (not twice per window) and the full model's statistics to the bit; short of memory, the
    layer-wise pass (two reads per layer and window), the same statistics to float tolerance; the layers are
    dropped again after either."""
    from qrecover import grad_pass
    from qrecover.models import LazyWeights

    d = _build(name, tmp_path / name, tok_dir)
    full, _, _ = load_model(str(d), lazy=False)
    lazy, _, _ = load_model(str(d), lazy=True)
    windows = torch.randint(0, 2000, (3, 16), generator=torch.Generator().manual_seed(0))
    reads = []
    real_read = LazyWeights.read
    monkeypatch.setattr(LazyWeights, "read", lambda self, keys: reads.append(keys) or real_read(self, keys))
    n_layers = len(decoder_layers(lazy))

    ref = grad_pass.gradient_stats(full, windows, False)
    whole = grad_pass.gradient_stats(lazy, windows, False)
    assert len(reads) == n_layers
    for k in ref["out_grad_sq"]:
        assert torch.equal(whole["out_grad_sq"][k], ref["out_grad_sq"][k]), k
    assert torch.equal(whole["emb_fisher"], ref["emb_fisher"]) and whole["loss"] == ref["loss"]
    assert all(p.is_meta for n, p in lazy.named_parameters() if ".layers." in n)

    reads.clear()
    monkeypatch.setattr(grad_pass, "available_memory", lambda: 0)
    layerwise = grad_pass.gradient_stats(lazy, windows, False)
    assert len(reads) == 2 * len(windows) * n_layers
    for k in ref["out_grad_sq"]:
        torch.testing.assert_close(layerwise["out_grad_sq"][k], ref["out_grad_sq"][k], rtol=1e-4, atol=0)
    assert all(p.is_meta for n, p in lazy.named_parameters() if ".layers." in n)

"""Online R4 (qrecover.transforms.online_r4, hadamard.rotate): the fast transform equals the dense rotation in
float64; the fused half plus the online half preserve the logits on every dense architecture (alone and under
R1/R2); a compressed checkpoint reloads through qrecover.load with the in-memory model's logits; export refuses it
naming the option that avoids it; models it cannot rotate are one-line errors, exit 2, before any work."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest
import torch
from cli_helpers import run as cli
from test_rotate import ARCHS, BASE, _model, _rel, tiny_dir  # noqa: F401  (tiny_dir: a fixture)

from qrecover import export as export_pkg
from qrecover.api import compress, load, prepare
from qrecover.config import CompressConfig
from qrecover.errors import QRecoverError
from qrecover.export import export
from qrecover.qlinear import _Packed
from qrecover.transforms import get_transform
from qrecover.transforms.hadamard import fast_factors, fwht, rotate, rotation
from qrecover.transforms.online_r4 import OnlineInputRotation

DENSE = sorted(n for n in ARCHS if n not in ("mixtral", "qwen2_moe"))


@pytest.mark.parametrize("n", [8, 12, 96, 576, 1536, 3584, 14336])
def test_fast_rotation_is_the_dense_rotation(n):
    x = torch.randn(3, 2, n, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
    r = rotation(n, "fwht", seed=5)
    k = max(1, n // 256)  # every k-th row against all: orthonormal rows (the whole r r^T at 14336 took 60 s of CI)
    assert (r[::k] @ r.T - torch.eye(n, dtype=torch.float64)[::k]).abs().max() < 1e-12
    assert (rotate(x, n, "fwht", 5) - x @ r).abs().max() < 1e-12 * n ** 0.5
    assert (rotate(x.float(), n, "fwht", 5).double() - x @ r).abs().max() < 1e-5
    p, b = fast_factors(n)
    assert p * b == n and b & (b - 1) == 0 and (p == 1 or p % 4 == 0)
    h = fwht(torch.eye(b, dtype=torch.float64))  # the butterflies build Sylvester's matrix: symmetric, H H = b I
    assert torch.equal(h, h.T) and torch.equal(h @ h, b * torch.eye(b, dtype=torch.float64))


def test_no_fast_rotation_for_an_odd_order():
    with pytest.raises(QRecoverError, match="no fast Hadamard transform of order 18"):
        fast_factors(18)


@pytest.mark.parametrize("tfs", [("r4",), ("rot", "r4")])
@pytest.mark.parametrize("name", DENSE)
def test_r4_preserves_logits(name, tfs):
    model = _model(*ARCHS[name])
    ref = copy.deepcopy(model)
    ids = torch.randint(0, BASE["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(1))
    infos = [get_transform(t).apply_model(model, "cpu") for t in tfs]
    with torch.no_grad():
        want, got = ref(ids).logits, model(ids).logits
    assert float((got - want).abs().max() / want.abs().max()) < 1e-6, name
    down, ref_down = model.model.layers[1].mlp.down_proj, ref.model.layers[1].mlp.down_proj
    assert not torch.allclose(down.weight, ref_down.weight)  # the fused half: W R4
    online = infos[-1]["online"]
    assert set(online) == {f"model.layers.{i}.mlp.down_proj" for i in range(BASE["num_hidden_layers"])}
    assert all(s["side"] == "input" and s["size"] == ref_down.in_features for s in online.values())
    down._forward_pre_hooks.clear()  # without the online half the function changes
    with torch.no_grad():
        assert float((model(ids).logits - want).abs().max() / want.abs().max()) > 1e-3


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_r4_refuses_experts(name):
    with pytest.raises(QRecoverError, match="r4 rotates the input of each decoder layer's mlp.down_proj online") as e:
        get_transform("r4").check(_model(*ARCHS[name]))
    assert "\n" not in str(e.value) and "drop r4+" in str(e.value)


def test_online_input_rotation_hook():
    lin = torch.nn.Linear(12, 5).double()
    x = torch.randn(4, 12, dtype=torch.float64)
    want = lin(x @ rotation(12, "fwht", 7))
    OnlineInputRotation(lin, {"size": 12, "kind": "fwht", "seed": 7})
    assert torch.allclose(lin(x), want, atol=1e-12)


def test_r4_checkpoint_reloads_with_the_in_memory_logits_and_export_refuses_it(tmp_path, tiny_dir, capsys, monkeypatch):  # noqa: F811
    cfg = CompressConfig(model=str(tiny_dir), bpw=None, encodings="rot+r4+gptq:4/g16", embedding_bits="8",
                         calib_samples=2, seq_len=32)
    prepared = prepare(cfg, show_progress=False, lazy=False)
    rotated = copy.deepcopy(prepared.model)  # the in-memory transformed model, online halves included
    manifest = compress(cfg, out=tmp_path / "q", prepared=prepared, show_progress=False)
    online = manifest["transforms"]["online"]
    assert online["model.layers.1.mlp.down_proj"] == {"size": 96, "kind": "fwht", "seed": 2000, "side": "input",
                                                      "why": "r4: down_proj's input"} and "model.norm" in online
    q = load(tmp_path / "q")
    ids = torch.randint(0, 49152, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        for p in rotated.parameters():  # the remainder (norms) is stored in 16 bits
            p.data = p.data.half().float()
        for n, m in q.named_modules():  # the in-memory model with the stored (dequantized) weights
            if isinstance(m, _Packed):
                rotated.get_submodule(n).weight.data = m.dequantize()
        got, exact = q(ids).logits, rotated(ids).logits
        for n in online:
            if n.endswith("down_proj"):
                q.get_submodule(n)._forward_pre_hooks.clear()
        without = q(ids).logits
    assert _rel(got, exact) < 1e-5 and _rel(without, exact) > 1e-3  # the re-attached online half is what makes it exact
    # the refusal comes before the format's library is asked for: coreml's library made missing here
    monkeypatch.setitem(export_pkg._EXTRAS, "coreml", ("qrecover_no_such_module", "export-coreml"))
    for fmt in ("gguf", "coreml"):  # compressed-tensors carries it (test below)
        with pytest.raises(QRecoverError, match=f"runs an online rotation at model.layers.0.mlp.down_proj, "
                                                f"model.layers.1.mlp.down_proj \\(r4\\+.*--format {fmt} cannot hold it: "
                                                "compress without r4\\+ in --encodings, or export it with "
                                                "--format compressed-tensors") as e:
            export(tmp_path / "q", fmt, tmp_path / fmt)
        assert "\n" not in str(e.value) and not (tmp_path / fmt).exists()
    code, out, err = cli(["info", str(tmp_path / "q")], capsys)
    text = " ".join((err + out).replace("│", " ").split())
    assert code == 0 and "rot+r4" in text and "3 rotation(s) at run time" in text
    assert "compressed-tensors carries them; GGUF and Core ML refuse r4" in text  # as export does above


@pytest.mark.skipif(importlib.util.find_spec("compressed_tensors") is None, reason="needs compressed-tensors ([export-ct])")
def test_r4_checkpoint_exports_to_compressed_tensors_with_its_transform(tmp_path, tiny_dir):  # noqa: F811
    """compressed-tensors carries R4 as its transform config (the matrix stored once) and the tied head's final-norm
    rotation as an untied head; the online transform applied as vLLM does (compressed-tensors' own transform module,
    the stored matrix over sqrt(n)) gives qrecover.load's logits, and without it they differ."""
    from compressed_tensors.transform import TransformConfig
    from compressed_tensors.transform.factory.hadamard import HadamardTransform
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    cfg = CompressConfig(model=str(tiny_dir), bpw=None, encodings="rot+r4+gptq:4/g16/symmetric=true", embedding_bits="8",
                         calib_samples=2, seq_len=32)
    compress(cfg, out=tmp_path / "q", show_progress=False)
    from qrecover.adapters.lora import attach_lora, base_identity, save_adapter

    model = attach_lora(load(tmp_path / "q"), rank=2)
    save_adapter(model, tmp_path / "lora", base_identity(tmp_path / "q"), model.qrecover_manifest["parameters"]["model"])
    with pytest.raises(QRecoverError, match="exporting an adapter with it is not supported yet"):
        export(tmp_path / "q", "compressed-tensors", tmp_path / "ct", adapter=tmp_path / "lora")
    assert not (tmp_path / "ct").exists()
    rep = export(tmp_path / "q", "compressed-tensors", tmp_path / "ct")
    assert rep["exact_layers"] == rep["total_layers"] and rep["untied_head"]["from"] == "model.norm"
    assert rep["transforms"]["R4"] == {"type": "random-hadamard", "size": 96, "kind": "fwht", "modules": 2, "dtype": "float16",
                                       "stored": "model.layers.0.mlp.down_proj.R4_input.weight"}
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    tcfg = TransformConfig.model_validate(config["quantization_config"]["transform_config"])
    (scheme,) = tcfg.config_groups.values()
    downs = ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    assert [(a.location, a.inverse, a.targets) for a in scheme.apply] == [("input", False, downs), ("weight_input", True, downs)]
    assert config["tie_word_embeddings"] is False
    with safe_open(str(tmp_path / "ct" / "model.safetensors"), framework="pt") as f:
        stored = f.get_tensor(rep["transforms"]["R4"]["stored"])
        assert sum(k.endswith("R4_input.weight") for k in f.keys()) == 1  # shared: stored once
    assert stored.dtype == torch.float16 and torch.equal(stored.abs(), torch.ones_like(stored))
    assert torch.allclose(stored.double() / 96**0.5, rotation(96, "fwht", 2000), atol=1e-12)

    served = AutoModelForCausalLM.from_pretrained(tmp_path / "ct", dtype=torch.float32).eval()
    assert served.lm_head.weight is not served.model.embed_tokens.weight and torch.all(served.model.norm.weight == 1)
    ids = torch.randint(0, 49152, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = load(tmp_path / "q")(ids).logits
        without = served(ids).logits  # (also decompresses the packed layers)
        for args in (a for a in scheme.apply if a.location == "input"):
            weight = torch.nn.Parameter(stored.float(), requires_grad=False)
            for name in args.targets:
                t = HadamardTransform(weight, None, scheme, args, torch.nn.Linear)
                served.get_submodule(name).register_forward_pre_hook(lambda _m, a, t=t: (t(a[0]), *a[1:]))
        got = served(ids).logits
    # the untied head is stored in fp16 (relative rounding 2^-11 per value)
    assert _rel(got, ref) < 1e-3 and _rel(without, ref) > 0.1, (_rel(got, ref), _rel(without, ref))


def test_cli_refuses_r4_on_experts(tmp_path, capsys):
    from transformers import AutoTokenizer

    from qrecover.models import default_model_dir

    d, out = tmp_path / "mixtral", tmp_path / "out"
    _model(ARCHS["mixtral"][0], {**ARCHS["mixtral"][1], "vocab_size": 49152}, dtype=torch.float32).save_pretrained(d)
    AutoTokenizer.from_pretrained(default_model_dir()).save_pretrained(d)
    code, _, err = cli(["compress", "--model", str(d), "--encodings", "r4+gptq:4/g16", "--out", str(out)], capsys)
    assert code == 2 and "r4 rotates the input of each decoder layer's mlp.down_proj" in err and not out.exists()

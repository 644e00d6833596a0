"""The output-head adapter (qrecover/adapters/head_lora.py), 8-bit adapter weights and the WSD schedule.

Checks that a LoRA on the tied packed head adds exactly ``scaling * (h A^T) B^T`` to the logits (float64 reference
from the head's own inputs) and nothing to the embedding lookup, that its svd init removes part of the head's
quantization error, that the exported directory is a PEFT adapter with ``lm_head`` LoRA tensors of exactly
``2 r (hidden + vocab)`` bytes which qrecover and plain PEFT on the unquantized model both load, that merging it is
refused, that int8 adapter weights round-trip within half a step per row with counted bytes ``rows * cols + 2 rows``,
and that the WSD schedule holds the peak lr and decays only at the end.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from qrecover.adapters.head_lora import QuantLoraHead, head_config
from qrecover.adapters.int8 import INT8_FILE, dequantize_rows, expand_int8_file, load_int8, quantize_rows
from qrecover.adapters.lora import adapter_summary, attach_lora, base_identity, lora_modules, peft_from_pretrained, save_adapter
from qrecover.adapters.svd_init import init_error_svd
from qrecover.errors import QRecoverError
from qrecover.loading import load
from qrecover.recovery.config import RecoverConfig
from qrecover.recovery.schedule import lr_scheduler

# PEFT warns of every layer class it does not know; qrecover's head adapter is made for QuantLMHead: no such warning
pytestmark = pytest.mark.filterwarnings("error:Unsupported layer type:UserWarning")


def _randomize(model, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(0.05 * torch.randn(p.shape, generator=g))


def _head_input_and_logits(model, ids):
    captured = {}
    head = dict(model.named_modules())["base_model.model.lm_head"]
    handle = head.register_forward_hook(lambda m, inp, out: captured.update(h=inp[0].detach()))
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    handle.remove()
    return captured["h"], logits


def test_head_lora_adds_the_low_rank_term_to_the_logits_only(tiny_ckpt):
    ids = torch.randint(0, 49152, (1, 12), generator=torch.Generator().manual_seed(1))
    model = attach_lora(load(tiny_ckpt), rank=4, head_rank=6)
    head = dict(model.named_modules())["base_model.model.lm_head"]
    assert isinstance(head, QuantLoraHead)
    a, b = head.lora_A["default"].weight, head.lora_B["default"].weight
    assert a.shape == (6, 64) and b.shape == (49152, 6) and head.scaling["default"] == 2.0
    embedding = model.get_input_embeddings()
    _randomize(model)
    h, logits = _head_input_and_logits(model, ids)
    ref = h.double() @ head.base_layer.weight.double().T + 2.0 * (h.double() @ a.double().T) @ b.double().T
    assert torch.allclose(logits.double(), ref, rtol=1e-4, atol=1e-4)
    # the input lookup is untouched: still the packed embedding's rows
    assert torch.equal(embedding(ids), embedding.dequantize()[ids])
    with torch.no_grad():  # the head adapter's term is really there (not a zero contribution)
        b.zero_()
    _, without = _head_input_and_logits(model, ids)
    assert (logits - without).abs().max() > 1e-3


def test_head_lora_svd_init_removes_head_error(tiny_ckpt, tiny_model_dir):
    from qrecover.data.corpus import token_windows
    from qrecover.models import load_model

    teacher, tok, _ = load_model(str(tiny_model_dir))
    model = attach_lora(load(tiny_ckpt), rank=2, head_rank=8)
    captured = init_error_svd(model, teacher, token_windows(tok, "python-docs", "calib", 2, 64))
    assert "lm_head" in lora_modules(model) and 0.0 < captured["lm_head"] < 1.0


def test_head_adapter_exports_as_peft_and_loads_in_qrecover_and_plain_peft(tiny_ckpt, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    model = attach_lora(load(tiny_ckpt), rank=2, head_rank=8)
    _randomize(model, 3)
    ids = torch.randint(0, 49152, (1, 10), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    params = model.qrecover_manifest["parameters"]["model"] if hasattr(model, "qrecover_manifest") else 10**6
    meta = save_adapter(model, tmp_path / "ad", base_identity(tiny_ckpt), params)
    with safe_open(str(tmp_path / "ad" / "adapter_model.safetensors"), framework="pt") as f:
        head_keys = sorted(k for k in f.keys() if ".lm_head." in k)
        assert head_keys == ["base_model.model.lm_head.lora_A.weight", "base_model.model.lm_head.lora_B.weight"]
        assert f.get_tensor(head_keys[1]).shape == (49152, 8)
    projections = sum(2 * 2 * (m.in_features + m.out_features) for n, m in lora_modules(model).items() if n != "lm_head")
    assert meta["bytes"]["tensors"] == projections + 2 * 8 * (64 + 49152)
    config = json.loads((tmp_path / "ad" / "adapter_config.json").read_text())
    assert "lm_head" in config["target_modules"] and config["rank_pattern"] == {"lm_head": 8}
    # qrecover's loader
    again = peft_from_pretrained(load(tiny_ckpt), tmp_path / "ad")
    with torch.no_grad():
        assert torch.allclose(again(input_ids=ids).logits, before, atol=2e-3)
    assert isinstance(dict(again.named_modules())["base_model.model.lm_head"], QuantLoraHead)
    # plain PEFT on the unquantized model reads the same directory: the head LoRA lands on its nn.Linear head
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(tmp_path / "ad"))
    plain_head = dict(plain.named_modules())["base_model.model.lm_head"]
    assert torch.equal(plain_head.lora_B["default"].weight.half(),
                       dict(again.named_modules())["base_model.model.lm_head"].lora_B["default"].weight.half())
    with pytest.raises(QRecoverError, match="cannot be merged"):
        dict(again.named_modules())["base_model.model.lm_head"].merge()


def test_head_rank_needs_a_tied_packed_head(tiny_model_dir):
    from qrecover.models import load_model

    plain, _, _ = load_model(str(tiny_model_dir))
    with pytest.raises(QRecoverError, match="--head-rank 4"):
        head_config(plain, 4)
    assert head_config(plain, 0) == ([], {})
    with pytest.raises(QRecoverError, match="--head-rank -1"):
        RecoverConfig(head_rank=-1)


def test_int8_rows_round_trip_and_bytes(tmp_path):
    w = torch.randn(7, 33, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    w[3] = 0.0
    q, s = quantize_rows(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and q.shape == (7, 33) and s.shape == (7,)
    back = dequantize_rows(q, s, torch.float64)
    # error within half a step of each row's own scale; the row maximum is a code of +-127
    step = s.double()[:, None]
    assert ((back - w).abs() <= 0.5 * step + 1e-12).all()
    assert torch.equal(q[3], torch.zeros(33, dtype=torch.int8))
    assert (q.abs().amax(dim=1)[[0, 1, 2, 4, 5, 6]] == 127).all()


def test_int8_adapter_file_counted_bytes_and_expansion(tiny_ckpt, tmp_path):
    model = attach_lora(load(tiny_ckpt), rank=4)
    _randomize(model, 5)
    meta = save_adapter(model, tmp_path / "ad", base_identity(tiny_ckpt), 10**6, bits=8)
    layers = lora_modules(model).values()
    expected = sum(4 * (m.in_features + m.out_features) + 2 * (4 + m.out_features) for m in layers)
    assert meta["bytes"]["tensors"] == expected and math.isclose(meta["bpw_cost"], expected * 8 / 10**6)
    assert adapter_summary(tmp_path / "ad", {"parameters": {"model": 10**6}})["bpw_cost"] == pytest.approx(expected * 8 / 10**6)
    from safetensors.torch import load_file

    fp16 = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    int8 = load_int8(tmp_path / "ad" / INT8_FILE)
    assert fp16.keys() == int8.keys() and all(torch.equal(fp16[k], int8[k]) for k in fp16)
    (tmp_path / "ad" / "adapter_model.safetensors").unlink()
    expand_int8_file(tmp_path / "ad")
    assert all(torch.equal(v, int8[k]) for k, v in load_file(str(tmp_path / "ad" / "adapter_model.safetensors")).items())
    with pytest.raises(QRecoverError, match="--adapter-bits 9"):
        RecoverConfig(adapter_bits=9)


def test_wsd_holds_the_peak_then_decays_at_the_end():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    cfg = RecoverConfig(schedule="wsd", warmup=0.1, decay_fraction=0.2, min_lr_ratio=0.1)
    sched = lr_scheduler(opt, cfg, 100)
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    lrs.append(opt.param_groups[0]["lr"])
    assert lrs[0] < 0.2 and all(x == pytest.approx(1.0) for x in lrs[10:80])
    assert all(a >= b for a, b in zip(lrs[80:], lrs[81:])) and lrs[-1] == pytest.approx(0.1)
    cosine = lr_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0), RecoverConfig(), 100)
    assert cosine.lr_lambdas[0](50) < 0.7  # the default cosine is well below peak at mid-run, WSD is not
    with pytest.raises(QRecoverError, match="--schedule"):
        RecoverConfig(schedule="linear")


def test_cli_refuses_bad_lever_options_before_any_model_loads(tiny_ckpt, tmp_path, capsys):
    from cli_helpers import run as cli

    for args, message in ((["--adapter-bits", "9"], "--adapter-bits 9"), (["--schedule", "step"], "--schedule 'step'"),
                          (["--head-rank", "-2"], "--head-rank -2")):
        code, _, err = cli(["recover", str(tiny_ckpt), "--out", str(tmp_path / "o"), *args], capsys)
        assert code == 2 and message in " ".join(err.split()), err
        assert not (tmp_path / "o").exists()


def test_head_adapter_trains_alike_with_and_without_the_chunked_loss(tiny_ckpt, text_mix, tmp_path):
    """The head adapter's weights train, so the chunked loss must take its recompute path (not the fused one that
    treats the head as frozen): a head-adapter run with chunks of 24 positions ends with the unchunked run's adapter."""
    from qrecover.recovery.api import recover

    runs = {}
    for chunk in (0, 24):
        cfg = RecoverConfig(rank=2, head_rank=4, tokens=64 * 2 * 2, mix=str(text_mix), seq_len=64, batch_size=2, objective="mix",
                            lr=1e-2, decontaminate=False, checkpoint_every=0, precision="fp32", init="zero", loss_chunk=chunk)
        recover(tiny_ckpt, tmp_path / str(chunk), cfg, show_progress=False)
        model = load(tiny_ckpt, adapter=tmp_path / str(chunk))
        runs[chunk] = {n: p.detach().float() for n, p in model.named_parameters() if "lora_" in n}
    head = [n for n in runs[0] if "lm_head" in n]
    assert head and runs[0].keys() == runs[24].keys()
    assert any(runs[0][n].abs().max() > 0 for n in head if "lora_B" in n)  # the head adapter did train
    for n in runs[0]:
        assert torch.allclose(runs[0][n], runs[24][n], atol=1e-4, rtol=1e-3), n


def test_making_and_loading_adapters_warns_nothing_a_user_cannot_act_on(tiny_ckpt, tmp_path):
    """PEFT 0.21 on transformers 5 raises a FutureWarning (``is_gradient_checkpointing`` is deprecated) at every
    adapter made or loaded; qrecover silences that one warning, nothing else."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = attach_lora(load(tiny_ckpt), rank=2)
        save_adapter(model, tmp_path / "ad", base_identity(tiny_ckpt), 10**6)
        peft_from_pretrained(load(tiny_ckpt), tmp_path / "ad")
        warnings.warn("`is_gradient_checkpointing` is deprecated (outside qrecover's calls)", FutureWarning)
    found = [str(w.message) for w in caught if "is_gradient_checkpointing" in str(w.message)]
    assert found == ["`is_gradient_checkpointing` is deprecated (outside qrecover's calls)"]

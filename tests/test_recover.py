"""Recovery adapters: LoRA on QuantLinear through PEFT, export/load, base binding, the training loop.

Checks that LoRA leaves the base output unchanged at initialisation and trains only adapter weights, that the
exported adapter is a standard PEFT directory of 16-bit tensors of exactly ``2 r (in + out)`` bytes per layer
that ``PeftModel.from_pretrained(qrecover.load(CKPT), DIR)`` reproduces, that an adapter trained on another
checkpoint is refused, that an interrupted run resumed from its checkpoint ends with the same weights as an
uninterrupted one (its checkpoints loading with ``weights_only=True``; one holding a pickled object that would
run code is refused), that a feature adapter starts from the recovery adapter, and every bad input: refused
with exit 2 and a one-line message before any model loads, no output directory left behind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
from cli_helpers import run as cli

import qrecover.loading
import qrecover.recovery.api
from qrecover.adapters.lora import attach_lora, check_base
from qrecover.adapters.svd_init import init_error_svd, lowrank_correction
from qrecover.errors import QRecoverError
from qrecover.loading import load
from qrecover.qlinear import QuantLinear
from qrecover.recovery.api import finetune, init_feature_model, recover
from qrecover.recovery.config import RecoverConfig
from qrecover.recovery.train import NonFiniteLoss, latest_checkpoint, mixed_precision, native_bf16

# tiny and fast: 64-token sequences, 2 per step
FAST = dict(seq_len=64, batch_size=2, objective="ce", lr=1e-2, decontaminate=False, checkpoint_every=0)



@pytest.fixture(scope="module")
def adapter_dir(tiny_ckpt, text_mix, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ad") / "r4"
    recover(tiny_ckpt, out, RecoverConfig(rank=4, tokens=64 * 2 * 3, mix=str(text_mix), **FAST), show_progress=False)
    return out


def _lora_params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_lora_init_equals_base_and_only_adapters_get_gradients(tiny_ckpt):
    base = load(tiny_ckpt)
    ids = torch.randint(0, 49152, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = base(input_ids=ids).logits.detach()
    packed_before = [(b, b.clone()) for b in base.buffers()]
    model = attach_lora(base, rank=4)
    assert torch.equal(model(input_ids=ids).logits, ref)  # B = 0 at init
    loss = model(input_ids=ids).logits.logsumexp(-1).mean()
    loss.backward()
    with_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert with_grad and all("lora_" in n for n in with_grad)
    n_quant = sum(isinstance(m, QuantLinear) for m in base.modules())
    assert len(with_grad) == 2 * n_quant  # A and B of every quantized projection
    assert all(not b.requires_grad for b in model.buffers())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    opt.step()
    assert packed_before and all(torch.equal(b, before) for b, before in packed_before)  # packed weights untouched


def _spd(n: int, seed: int) -> torch.Tensor:
    """A random input second moment E[x x^T] with a wide spread of scales, like real activations."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4 * n, n, generator=g, dtype=torch.float64) * torch.logspace(-1, 1, n, dtype=torch.float64)
    return x.T @ x / x.shape[0]


def _weighted_sq(m: torch.Tensor, gram: torch.Tensor) -> float:
    return float(torch.einsum("oi,ij,oj->", m, gram, m))  # E_x ||m x||^2 = tr(m H m^T)


def test_lowrank_correction_is_exact_for_low_rank_errors_and_optimal_in_the_input_norm():
    g = torch.Generator().manual_seed(1)
    out_f, in_f, rank, scaling = 24, 40, 4, 2.0
    gram = _spd(in_f, 2)
    low = torch.randn(out_f, 3, generator=g, dtype=torch.float64) @ torch.randn(3, in_f, generator=g, dtype=torch.float64)
    b, a = lowrank_correction(low, gram, rank, scaling)
    assert b.shape == (out_f, rank) and a.shape == (rank, in_f)
    assert torch.allclose(scaling * b @ a, low, atol=1e-9)  # a rank-3 error is reproduced exactly by rank 4

    err = torch.randn(out_f, in_f, generator=g, dtype=torch.float64)
    b, a = lowrank_correction(err, gram, rank, scaling, damp=0.0)
    weighted = _weighted_sq(err - scaling * b @ a, gram)
    s = torch.linalg.svdvals(err @ torch.linalg.cholesky(gram))  # same singular values as err @ gram^(1/2)
    assert math.isclose(weighted, float((s[rank:] ** 2).sum()), rel_tol=1e-9)  # Eckart-Young in the input norm
    u, sv, vh = torch.linalg.svd(err, full_matrices=False)
    plain = u[:, :rank] * sv[:rank] @ vh[:rank]  # the unweighted truncated SVD is worse on these inputs
    assert weighted < _weighted_sq(err - plain, gram)
    b0, a0 = lowrank_correction(err, None, rank, scaling)
    assert torch.allclose(scaling * b0 @ a0, plain, atol=1e-9)
    assert torch.allclose(b0.T @ b0, a0 @ a0.T, atol=1e-9)  # singular values shared evenly between B and A


def test_svd_init_moves_the_quantized_model_towards_the_original(tiny_ckpt, tiny_model_dir):
    from qrecover.data.corpus import token_windows
    from qrecover.models import load_model

    teacher, tok, _ = load_model(str(tiny_model_dir))
    windows = token_windows(tok, "python-docs", "calib", 2, 64)
    held_out = token_windows(tok, "python-docs", "eval", 2, 64)
    ref = teacher(input_ids=held_out).logits.log_softmax(-1)

    def kl(model) -> float:
        with torch.no_grad():
            lp = model(input_ids=held_out).logits.log_softmax(-1)
        return float(torch.nn.functional.kl_div(lp, ref, log_target=True, reduction="batchmean"))

    model = attach_lora(load(tiny_ckpt), rank=16)
    before = kl(model)
    captured = init_error_svd(model, teacher, windows)
    total = captured.pop("_total")
    assert 0.0 < total < 1.0 and all(0.0 <= v <= 1.0 for v in captured.values())
    assert len(captured) == sum(isinstance(m, QuantLinear) for m in load(tiny_ckpt).modules())
    # held-out text: measurably closer to the unquantized model (0.0179 -> 0.0133 when written; the 4-bit embedding,
    # which no adapter touches, holds most of the rest)
    assert kl(model) < 0.85 * before


def test_recover_records_its_initialisation(adapter_dir, tiny_ckpt, text_mix, tmp_path):
    meta = json.loads((adapter_dir / "qrecover_adapter.json").read_text())
    assert meta["config"]["init"] == "svd" and meta["init"]["method"] == "svd"
    assert 0.0 < meta["init"]["output_error_removed"] < 1.0
    assert meta["init"]["calibration"] == {"source": "python-docs", "split": "calib", "tokens": 8 * 512}
    zero = recover(tiny_ckpt, tmp_path / "zero", RecoverConfig(rank=4, tokens=128, mix=str(text_mix), init="zero", **FAST),
                   show_progress=False)
    assert zero["init"] == {"method": "zero"}


def test_adapter_is_peft_16bit_exact_size_and_round_trips(adapter_dir, tiny_ckpt):
    from peft import PeftModel
    from safetensors import safe_open

    assert {"adapter_config.json", "adapter_model.safetensors", "qrecover_adapter.json"} <= {p.name for p in adapter_dir.iterdir()}
    assert not (adapter_dir / "checkpoints").exists() and not (adapter_dir / "run.json").exists()
    meta = json.loads((adapter_dir / "qrecover_adapter.json").read_text())
    base = load(tiny_ckpt)
    expected = 0
    for m in base.modules():
        if isinstance(m, QuantLinear):
            expected += 16 * 4 * (m.in_features + m.out_features) // 8  # 16 bits x r x (in + out)
    with safe_open(str(adapter_dir / "adapter_model.safetensors"), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert all(t.dtype == torch.float16 for t in tensors.values())
    assert sum(t.numel() * 2 for t in tensors.values()) == expected == meta["bytes"]["tensors"] == meta["bytes"]["expected_16bit"]
    manifest = json.loads((tiny_ckpt / "qrecover.json").read_text())
    assert meta["bpw_cost"] == pytest.approx(expected * 8 / manifest["parameters"]["model"])
    assert any(t.abs().max() > 0 for k, t in tensors.items() if "lora_B" in k)  # it trained
    tr = meta["training"]  # tokens/s is over training steps alone; the data's first read is timed apart
    assert tr["tokens"] == 64 * 2 * 3 and tr["seconds"] > 0 and tr["data_setup_seconds"] >= 0
    assert tr["tok_per_s"] == pytest.approx(tr["tokens"] / tr["seconds"])

    # plain PEFT loads it, and qrecover.load(adapter=) gives the same model
    ids = torch.randint(0, 49152, (1, 24), generator=torch.Generator().manual_seed(1))
    peft_model = PeftModel.from_pretrained(load(tiny_ckpt), str(adapter_dir))
    ours = load(tiny_ckpt, adapter=adapter_dir)
    a, b = peft_model(input_ids=ids).logits, ours(input_ids=ids).logits
    assert torch.equal(a, b)
    assert not torch.allclose(a, base(input_ids=ids).logits)  # the adapter changes the output
    # the loaded adapter values are the stored fp16 values
    loaded = {n: p for n, p in ours.named_parameters() if "lora_B" in n}
    some = next(iter(loaded))
    key = next(k for k in tensors if k.endswith(some.split("base_model.model.")[-1].replace(".default", "")))
    assert torch.equal(loaded[some].detach().half(), tensors[key])


def test_adapter_of_another_base_is_refused(adapter_dir, tiny_model_dir, tmp_path):
    from qrecover.api import compress
    from qrecover.config import CompressConfig

    other = tmp_path / "other"
    compress(CompressConfig(model=str(tiny_model_dir), bpw=4.6, calib_samples=2, seq_len=64), out=other, show_progress=False)
    with pytest.raises(QRecoverError, match="was trained on checkpoint .*--allow-foreign-adapter"):
        load(other, adapter=adapter_dir)
    model = load(other, adapter=adapter_dir, allow_foreign_adapter=True)  # the explicit override
    assert any("lora_A" in n for n, _ in model.named_parameters())


def test_cli_adapter_option_refuses_foreign_base(adapter_dir, tiny_model_dir, capsys):
    code, _, err = cli(["ppl", str(tiny_model_dir), "--adapter", str(adapter_dir), "--windows", "1", "--seq-len", "16"], capsys)
    assert code == 2 and "unquantized model" in err


def _run(ckpt, out, mix, callback=None, resume=False, **kw):
    cfg = RecoverConfig(rank=4, tokens=64 * 2 * 6, mix=str(mix), **{**FAST, "checkpoint_every": 2, **kw})
    return recover(ckpt, out, cfg, show_progress=False, resume=resume, callback=callback, keep_checkpoints=True)


def test_resume_ends_where_an_uninterrupted_run_ends(tiny_ckpt, text_mix, tmp_path):
    _run(tiny_ckpt, tmp_path / "full", text_mix)
    full = load(tiny_ckpt, adapter=tmp_path / "full")

    class Crash(Exception):
        pass

    def crash_after_step_3(info):
        if info["step"] == 3:
            raise Crash

    with pytest.raises(Crash):
        _run(tiny_ckpt, tmp_path / "cut", text_mix, callback=crash_after_step_3)
    assert latest_checkpoint(tmp_path / "cut").name == "step-0000002.pt"
    assert not (tmp_path / "cut" / "qrecover_adapter.json").exists()  # nothing loadable half-trained
    with pytest.raises(QRecoverError, match="--resume"):
        _run(tiny_ckpt, tmp_path / "cut", text_mix)  # exists: refused without --resume/--overwrite
    _run(tiny_ckpt, tmp_path / "cut", text_mix, resume=True)
    resumed = load(tiny_ckpt, adapter=tmp_path / "cut")
    a, b = _lora_params(full), _lora_params(resumed)
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n], b[n]), n
    log_full = (tmp_path / "full" / "train_log.jsonl").read_text().splitlines()
    log_cut = (tmp_path / "cut" / "train_log.jsonl").read_text().splitlines()
    assert [json.loads(x)["loss"] for x in log_full] == [json.loads(x)["loss"] for x in log_cut]


def test_resume_with_other_settings_is_refused(tiny_ckpt, text_mix, tmp_path):
    def stop(info):
        if info["step"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(tiny_ckpt, tmp_path / "r", text_mix, callback=stop)
    assert sorted(os.listdir(tmp_path / "r")) == ["checkpoints", "run.json"]  # resumable state only
    with pytest.raises(QRecoverError, match="different settings.*lr"):
        _run(tiny_ckpt, tmp_path / "r", text_mix, resume=True, lr=5e-3)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tiny_ckpt, text_mix, tmp_path):
    def poison(info):  # after step 2 (checkpointed), make the adapter produce inf
        if info["step"] == 2:
            with torch.no_grad():
                for n, p in info["model"].named_parameters():
                    if "lora_B" in n:
                        p.fill_(float("inf"))

    with pytest.raises(NonFiniteLoss, match=r"loss became .* at step 3.*step-0000002\.pt.*--resume"):
        _run(tiny_ckpt, tmp_path / "nan", text_mix, callback=poison)
    assert latest_checkpoint(tmp_path / "nan").name == "step-0000002.pt"
    state = torch.load(latest_checkpoint(tmp_path / "nan"), weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["adapter"].values())


def test_feature_adapter_starts_from_recovery_adapter(adapter_dir, tiny_ckpt, tmp_path, monkeypatch):
    checks = []  # (adapter, checkpoint) of every base-identity check, wherever it is called from

    def counted(adapter, checkpoint, allow_foreign=False):
        checks.append((str(adapter), str(checkpoint)))
        return check_base(adapter, checkpoint, allow_foreign)

    for module in (qrecover.loading, qrecover.recovery.api):
        monkeypatch.setattr(module, "check_base", counted)
    model = init_feature_model(tiny_ckpt, adapter_dir)
    assert len(checks) == 1
    recovery = _lora_params(load(tiny_ckpt, adapter=adapter_dir))
    start = _lora_params(model)
    assert recovery.keys() == start.keys()
    assert all(torch.equal(recovery[n], start[n]) for n in recovery)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == set(start)  # only the adapter trains; the base is frozen

    data = tmp_path / "feature.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Summarise item {i}."},
                          {"role": "assistant", "content": f"Item {i} is short and sweet."}]} for i in range(20)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = RecoverConfig(tokens=64 * 2 * 2, **FAST)
    checks.clear()
    meta = finetune(tiny_ckpt, adapter_dir, str(data), tmp_path / "feature", cfg, show_progress=False)
    assert meta["rank"] == 4 and meta["init_adapter"] == str(adapter_dir.resolve())
    # the pair's base is checked once along finetune's path (it was 3 times: finetune, init_feature_model, load_adapter)
    assert len(checks) == 1 and checks[0][0] == str(adapter_dir) and Path(checks[0][1]).resolve() == Path(tiny_ckpt).resolve()
    tuned = _lora_params(load(tiny_ckpt, adapter=tmp_path / "feature"))
    assert any(not torch.equal(tuned[n], start[n]) for n in start)


def test_precision_setting_resolves_per_device():
    assert mixed_precision(RecoverConfig(precision="fp32")) == "no"
    assert mixed_precision(RecoverConfig(precision="bf16")) == "bf16"
    assert mixed_precision(RecoverConfig(precision="auto")) == ("bf16" if native_bf16() else "no")
    with pytest.raises(QRecoverError, match="--precision 'fp8' must be one of auto, bf16, fp32"):
        RecoverConfig(precision="fp8")


def test_bf16_autocast_training_tracks_fp32(tiny_ckpt, text_mix, tmp_path):
    """bf16 autocast (the 'auto' choice on CPUs with AVX512-BF16) really runs and follows the fp32 run's losses
    closely."""
    runs = {}
    for precision in ("fp32", "bf16"):
        cfg = RecoverConfig(rank=4, tokens=64 * 2 * 4, mix=str(text_mix), precision=precision, **FAST)
        meta = recover(tiny_ckpt, tmp_path / precision, cfg, show_progress=False)
        assert meta["training"]["mixed_precision"] == ("no" if precision == "fp32" else "bf16")
        runs[precision] = [json.loads(line)["loss"] for line in (tmp_path / precision / "train_log.jsonl").read_text().splitlines()]
    fp32, bf16 = runs["fp32"], runs["bf16"]
    assert len(fp32) == len(bf16) == 4 and all(math.isfinite(x) for x in bf16)
    assert fp32 != bf16  # bf16 really ran: it rounds differently
    assert all(abs(a - b) < 0.05 * a for a, b in zip(fp32, bf16)), (fp32, bf16)


@pytest.mark.parametrize("argv, message", [
    (["--precision", "fp16"], "--precision 'fp16' must be one of"),
    (["--init", "pissa"], "--init 'pissa' must be one of svd, zero"),
    (["--rank", "0"], "--rank 0 must be a positive integer"),
    (["--tokens", "-5"], "--tokens -5 must be a positive"),
    (["--objective", "mse"], "--objective 'mse' must be one of"),
    (["--targets", "top:0"], "--targets 'top:0'"),
    (["--log-every", "0"], "--log-every 0 must be a positive number of steps"),
    (["--mix", "/nonexistent/mix.toml"], "--mix '/nonexistent/mix.toml' does not exist"),
])
def test_bad_recover_arguments_exit_2(tiny_ckpt, tmp_path, capsys, argv, message):
    code, _, err = cli(["recover", str(tiny_ckpt), "--out", str(tmp_path / "x"), *argv], capsys)
    assert code == 2, err
    assert message in " ".join(err.split())
    assert not (tmp_path / "x").exists()


def test_unquantized_model_is_refused(tiny_model_dir, tmp_path, capsys):
    code, _, err = cli(["recover", str(tiny_model_dir), "--out", str(tmp_path / "x")], capsys)
    err = " ".join(err.split())  # the console wraps long lines at its width (the temporary path's length varies)
    assert code == 2 and "unquantized model" in err and "qrecover compress" in err


def test_existing_adapter_dir_is_refused_without_flag(adapter_dir, tiny_ckpt, capsys):
    code, _, err = cli(["recover", str(tiny_ckpt), "--out", str(adapter_dir), "--tokens", "128"], capsys)
    assert code == 2 and "already exists" in err and "--overwrite" in err and "--resume" in err


def test_cli_ranks_suite_writes_one_adapter_per_rank(tiny_ckpt, text_mix, tmp_path, capsys):
    code, out, err = cli(["recover", str(tiny_ckpt), "--ranks", "2,4", "--tokens", "128", "--seq-len", "64",
                          "--batch-size", "2", "--objective", "ce", "--mix", str(text_mix), "--no-decontaminate",
                          "--out", str(tmp_path / "suite"), "--json"], capsys)
    assert code == 0, err
    rows = json.loads(out)
    assert [r["rank"] for r in rows] == [2, 4]
    assert rows[1]["bytes"] == 2 * rows[0]["bytes"]  # size is linear in the rank
    for r in (2, 4):
        assert json.loads((tmp_path / "suite" / f"rank-{r}" / "adapter_config.json").read_text())["r"] == r


def test_top_n_targets_adapt_only_the_most_damaged_layers(tiny_ckpt, text_mix, tmp_path):
    meta = recover(tiny_ckpt, tmp_path / "top", RecoverConfig(rank=2, tokens=128, mix=str(text_mix), targets="top:3", **FAST),
                   show_progress=False)
    manifest = json.loads((tiny_ckpt / "qrecover.json").read_text())
    damage = sorted(((v["damage"], n) for n, v in manifest["layers"].items() if v["kind"] == "linear"), reverse=True)
    assert meta["target_modules"] == sorted(n for _, n in damage[:3])
    assert math.isclose(meta["bpw_cost"], meta["bytes"]["tensors"] * 8 / manifest["parameters"]["model"])


def test_public_api_exposes_the_stages():
    import qrecover
    from qrecover.evaluate import runner
    from qrecover.recovery import api as recovery_api

    assert qrecover.recover is recovery_api.recover and qrecover.finetune is recovery_api.finetune
    assert qrecover.evaluate.evaluate is runner.evaluate and callable(qrecover.evaluate)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        qrecover.nope  # noqa: B018


# --- untrusted checkpoints, bad input before any model loads, no partial output ---------------------------


class _WritesMarker:
    """Unpickling this runs ``open(marker, "w")``: what a malicious checkpoint would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_checkpoint_with_pickled_code_is_refused(tiny_ckpt, text_mix, tmp_path):
    def stop(info):
        if info["step"] == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(tiny_ckpt, tmp_path / "r", text_mix, callback=stop)
    ckpt = latest_checkpoint(tmp_path / "r")
    state = torch.load(ckpt, weights_only=True)  # what resume reads: tensors and plain values
    assert set(state["rng"]) >= {"python", "numpy", "torch"}
    marker = tmp_path / "pwned"
    state["loader"]["evil"] = _WritesMarker(marker)
    torch.save(state, ckpt)
    with pytest.raises(QRecoverError, match=r"holds more than tensors and plain values.*refusing to load it"):
        _run(tiny_ckpt, tmp_path / "r", text_mix, resume=True)
    assert not marker.exists()
    assert ckpt.exists()  # resumable state is not deleted by a failed resume


def test_interrupted_before_the_first_checkpoint_leaves_no_output(tiny_ckpt, text_mix, tmp_path):
    def stop(info):
        if info["step"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _run(tiny_ckpt, tmp_path / "r", text_mix, callback=stop)  # checkpoints every 2 steps
    assert not (tmp_path / "r").exists()


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if anything loads a model, a tokenizer or attaches an adapter."""
    import qrecover.loading
    import qrecover.recovery.api as recovery_api

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was validated")

    monkeypatch.setattr(qrecover.loading, "load", refuse)
    monkeypatch.setattr(recovery_api, "load", refuse)  # recovery.api's own import of qrecover.loading.load
    monkeypatch.setattr(recovery_api, "attach_adapter", refuse)
    monkeypatch.setattr(recovery_api, "load_model", refuse)
    monkeypatch.setattr(recovery_api, "attach_lora", refuse)
    monkeypatch.setattr(recovery_api, "init_feature_model", refuse)
    monkeypatch.setenv("COLUMNS", "1000")  # the CLI's error line is not wrapped: one message, one line


BAD_MIXES = [
    ('[[source]]\nname = "docs"\nkind = "text"\npath = "d/*.txt"\nweight = 1\nwieght = 2\n',
     "source 'docs' (kind 'text'): unknown key 'wieght'; allowed keys: name, kind, weight, path"),
    ('[[source]]\nname = "docs"\nkind = "text"\npath = "missing/*.txt"\nweight = 1\n',
     "source 'docs': path 'missing/*.txt'"),
    ('[[source]]\nname = "docs"\nkind = "text"\npath = "d/*.txt"\nweight = -1\n',
     "source 'docs': weight = -1 must be a finite number >= 0"),
    ('[[source]\nname = "docs"\n', "is not valid TOML"),
    ('description = "nothing"\n', "the mix has no sources; add at least one [[source]] table"),
    ('[[source]]\nname = "chat"\nkind = "selfgen"\nweight = 1\nmodel = "no/such/model"\n',
     "source 'chat': model = 'no/such/model' does not exist"),
]


@pytest.mark.parametrize("text, message", BAD_MIXES)
def test_bad_mix_is_refused_before_any_model_loads(tiny_ckpt, tmp_path, capsys, no_model_loads, text, message):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "a.txt").write_text("some text\n")
    (tmp_path / "mix.toml").write_text(text)
    code, out, err = cli(["recover", tiny_ckpt, "--mix", tmp_path / "mix.toml", "--out", tmp_path / "x"], capsys)
    assert code == 2, err
    assert message in err and str(tmp_path / "mix.toml") in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err and out == ""
    assert not (tmp_path / "x").exists()


def test_bad_mix_through_the_api_is_refused_before_any_model_loads(tiny_ckpt, tmp_path, no_model_loads):
    (tmp_path / "mix.toml").write_text(BAD_MIXES[2][0].replace("d/*.txt", str(tmp_path / "*.toml")))
    with pytest.raises(QRecoverError, match="weight = -1 must be"):
        recover(tiny_ckpt, tmp_path / "x", RecoverConfig(mix=str(tmp_path / "mix.toml")), show_progress=False)
    assert not (tmp_path / "x").exists()


def test_missing_teacher_is_refused_before_any_model_loads(tiny_ckpt, tmp_path, capsys, no_model_loads):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    manifest = json.loads((ckpt / "qrecover.json").read_text())
    manifest["source"]["path"] = str(tmp_path / "gone")
    (ckpt / "qrecover.json").write_text(json.dumps(manifest))
    code, _, err = cli(["recover", ckpt, "--out", tmp_path / "x"], capsys)  # kd + svd init need the original
    assert code == 2 and "needs the unquantized model" in err and "gone" in err and "--objective ce --init zero" in err
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args, message", [
    (["--init-adapter", "{tmp}/none"], "--init-adapter '{tmp}/none' is not an adapter directory"),
    (["--init-adapter", "{adapter}", "--data", "{tmp}/missing.jsonl"], "--data '{tmp}/missing.jsonl'"),
])
def test_bad_finetune_input_is_refused_before_any_model_loads(adapter_dir, tiny_ckpt, tmp_path, capsys,
                                                             no_model_loads, args, message):
    args = [a.format(tmp=tmp_path, adapter=adapter_dir) for a in args]
    if "--data" not in args:
        args += ["--data", str(tmp_path / "d.jsonl")]
    code, _, err = cli(["finetune", tiny_ckpt, *args, "--out", tmp_path / "f"], capsys)
    assert code == 2, err
    assert message.format(tmp=tmp_path) in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "f").exists()


def test_finetune_on_a_non_main_process_exits_quietly(tiny_ckpt, tmp_path, capsys, monkeypatch):
    """Under torchrun every process runs the command; the training API returns {} on all but the main one, which
    alone reports (as ``recover`` does): the others exit 0 without reading the empty summary."""
    import qrecover.recovery.api as rapi

    monkeypatch.setattr(rapi, "finetune", lambda *a, **k: {})
    code, out, err = cli(["finetune", tiny_ckpt, "--init-adapter", tmp_path, "--data", tmp_path / "d.jsonl",
                          "--out", tmp_path / "f"], capsys)
    assert code == 0 and out == "", err


# --- an unreadable adapter directory is refused before any model loads (issue 10, item 8) ---------------------


def _broken_adapter(adapter_dir: Path, tmp_path: Path, how: str) -> Path:
    bad = tmp_path / f"adapter-{how}"
    bad.mkdir()
    for f in adapter_dir.iterdir():  # a flat directory of small files
        (bad / f.name).write_bytes(f.read_bytes())
    weights = bad / "adapter_model.safetensors"
    if how == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif how == "garbage":
        weights.write_bytes(b"\x00" * 100)
    elif how == "missing":
        weights.unlink()
    elif how == "config":
        (bad / "adapter_config.json").write_text('{"r": 4,')
    elif how == "no-peft-type":
        (bad / "adapter_config.json").write_text('{"r": 4}')
    return bad


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if a model is built: the adapter check must come first."""
    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the adapter files were checked")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_config", refuse)


@pytest.mark.parametrize("how, message", [("truncated", "adapter_model.safetensors' are truncated or corrupt"),
                                          ("garbage", "adapter_model.safetensors' are truncated or corrupt"),
                                          ("missing", "has no adapter_model.safetensors"),
                                          ("config", "adapter_config.json' is not valid JSON"),
                                          ("no-peft-type", "adapter_config.json' is not a PEFT adapter config")])
def test_unreadable_adapter_is_refused_before_the_load(adapter_dir, tiny_ckpt, tmp_path, capsys, no_model_load, how, message):
    bad = _broken_adapter(adapter_dir, tmp_path, how)
    for allow in (False, True):  # --allow-foreign-adapter does not let an unreadable file through
        with pytest.raises(QRecoverError, match=message):
            load(tiny_ckpt, adapter=bad, allow_foreign_adapter=allow)
    code, _, err = cli(["ppl", tiny_ckpt, "--adapter", bad, "--windows", "1", "--seq-len", "16"], capsys)
    flat = "".join(err.split())  # the console wraps long lines, even inside a path
    assert code == 2 and "".join(message.split("'")[-1].split()) in flat and "Traceback" not in err
    out = tmp_path / "feature"
    data = tmp_path / "d.jsonl"
    data.write_text('{"text": "hello world"}\n')
    code, _, err = cli(["finetune", tiny_ckpt, "--init-adapter", bad, "--data", data, "--out", out, "--tokens", "64"], capsys)
    flat = "".join(err.split())
    assert code == 2 and "Traceback" not in err and bad.name in flat and not out.exists()
    if how != "config":
        assert "re-exportorcopytheadapteragain" in flat


def test_checkpoint_rng_holds_and_restores_only_the_training_gpu(monkeypatch):
    """A checkpoint holds the generator state of the GPU the adapter trains on, not every visible GPU's, and restores it
    onto the GPU the process trains on at resume; an older checkpoint's list of every GPU's states gives that GPU's entry
    and nothing else (a resume with fewer visible GPUs used to index past them). CUDA's calls are recorded, no GPU."""
    from qrecover.recovery import checkpoints

    states = {i: torch.full((4,), i, dtype=torch.uint8) for i in range(8)}
    got, put = [], []
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda d="cuda": got.append(torch.device(d).index) or states[torch.device(d).index])
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("every GPU's state read"))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, d="cuda": put.append((torch.device(d).index, int(s[0]))))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda s: pytest.fail("every GPU's state written"))
    state = checkpoints.rng_state(torch.device("cuda", 3))
    assert got == [3] and torch.equal(state["cuda"], states[3])
    checkpoints.set_rng_state(state, torch.device("cuda", 0))  # resumed where the process now sees its GPU as cuda:0
    assert put == [(0, 3)]
    put.clear()
    old = dict(state, cuda=[states[i] for i in range(8)])  # the format before: every visible GPU
    checkpoints.set_rng_state(old, torch.device("cuda", 5))
    checkpoints.set_rng_state(dict(old, cuda=old["cuda"][:2]), torch.device("cuda", 5))  # saved with 2 visible: no entry
    assert put == [(5, 5)]
    assert "cuda" not in checkpoints.rng_state("cpu")
    checkpoints.set_rng_state(state, "cpu")  # a CPU run ignores a GPU state
    assert put == [(5, 5)]

"""``qrecover tune``: a checkpoint's tables, scales, norms and embedding trained through its frozen codes.

Checks that the gradient of a table entry and of a scale equals a float64 central finite difference of the loss
(on the tiny model's palettized layers and GPTQ embedding, and on a blockwise ``nn.Linear(8, 6)``); that a tuned
checkpoint has the source's exact byte count, changes only the tuned tensors (codes bit-identical), loads with
``qrecover.load``, runs the kernels' reference path and exports as before, and that ``recover`` trains on it; that
lr 0 is the identity (bit-identical weights file); that an interrupted run resumed ends where an uninterrupted run
ends; that ``qrecover info`` shows the tuning; and that bad input exits 2 with one line before any model loads.
With ``--params ...,codes``: each scheme's ``encode`` gives the nearest code and ``decode`` inverts it, the master
weight's gradient is dL/dW straight through, codes change only in linear layers, bytes are kept, lr 0 is the identity.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from cli_helpers import run as cli
from safetensors.torch import load_file

from qrecover import kernels
from qrecover.api import compress, load
from qrecover.checkpoint import read_manifest
from qrecover.config import CompressConfig
from qrecover.errors import QRecoverError
from qrecover.export import export
from qrecover.qlinear import QuantLinear
from qrecover.recovery import objective
from qrecover.recovery import tune as tune_module
from qrecover.recovery.api import recover
from qrecover.recovery.config import RecoverConfig
from qrecover.recovery.train import latest_checkpoint
from qrecover.recovery.tune import TuneConfig, make_tunable, plan, tune
from qrecover.schemes import get_quantizer

FAST = dict(seq_len=64, batch_size=2, objective="ce", lr=1e-3, decontaminate=False, checkpoint_every=0, rounding_windows=1)


def _tuned(ckpt, out, mix, callback=None, resume=False, **kw):
    cfg = TuneConfig(mix=str(mix), **{"tokens": 64 * 2 * 4, **FAST, **kw})
    return tune(ckpt, out, cfg, show_progress=False, resume=resume, callback=callback, keep_checkpoints=True)


@pytest.fixture(scope="module")
def tuned_dir(tiny_ckpt, text_mix, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tuned") / "t"
    _tuned(tiny_ckpt, out, text_mix)
    return out


def _loss64(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return objective.cross_entropy(model(input_ids=ids, use_cache=False).logits, ids)


def _fd_check(model: nn.Module, master: torch.Tensor, loss, h: float = 1e-6) -> None:
    """The analytic gradient of ``loss()`` at the entry of ``master`` with the largest gradient vs a central difference."""
    model.zero_grad(set_to_none=True)
    loss().backward()
    i = int(master.grad.abs().argmax())
    analytic = float(master.grad.view(-1)[i])
    with torch.no_grad():
        keep = float(master.view(-1)[i])
        master.view(-1)[i] = keep + h
        up = float(loss())
        master.view(-1)[i] = keep - h
        down = float(loss())
        master.view(-1)[i] = keep
    assert analytic != 0.0
    assert abs(analytic - (up - down) / (2 * h)) <= 1e-6 * abs(analytic) + 1e-9, (analytic, (up - down) / (2 * h))


def _rms_norm_in_input_dtype(self, x: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm computes in float32 whatever the input: in float64 here, so the loss is float64 throughout."""
    return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def test_table_and_scale_gradients_equal_float64_finite_differences(tiny_ckpt, monkeypatch):
    model = load(tiny_ckpt)
    monkeypatch.setattr(type(model.model.norm), "forward", _rms_norm_in_input_dtype)
    layers, norms = plan(model.qrecover_manifest, ("tables", "embedding"))
    assert layers["model.layers.0.self_attn.q_proj"] == ("lut",) and layers["model.embed_tokens"] == ("scale",)
    make_tunable(model, layers, norms)
    model.double()
    ids = torch.randint(0, 49152, (2, 12), generator=torch.Generator().manual_seed(0))
    q = model.get_submodule("model.layers.0.self_attn.q_proj")
    assert q.lut_master.dtype == torch.float64 and q.lut_master.requires_grad
    _fd_check(model, q.lut_master, lambda: _loss64(model, ids))  # a table entry of a palettized layer
    emb = model.get_submodule("model.embed_tokens")
    _fd_check(model, emb.scale_master, lambda: _loss64(model, ids))  # a GPTQ scale of the (tied) embedding


def test_blockwise_scale_gradient_on_a_small_linear():
    torch.manual_seed(0)
    w = torch.randn(6, 8)
    layer = QuantLinear(get_quantizer("blockwise", block_size=4, symmetric=False).quantize(w, 3, {}))
    layer.set_masters(("scale",))
    layer.double()
    x = torch.randn(5, 8, dtype=torch.float64)
    _fd_check(layer, layer.scale_master, lambda: (layer(x) ** 2).sum())


def test_tuned_checkpoint_has_the_source_bytes_and_only_tables_norms_and_scales_change(tuned_dir, tiny_ckpt):
    src, new = json.loads((tiny_ckpt / "qrecover.json").read_text()), json.loads((tuned_dir / "qrecover.json").read_text())
    assert (tuned_dir / "model.safetensors").stat().st_size == (tiny_ckpt / "model.safetensors").stat().st_size
    assert new["bytes"] == src["bytes"] and new["measured_bpw"] == src["measured_bpw"]
    assert new["weights_file"]["sha256"] != src["weights_file"]["sha256"]
    t = new["tuning"]
    assert t["source"]["weights_sha256"] == src["weights_file"]["sha256"]
    assert t["params"] == ["tables", "scales", "norms", "embedding"] and t["tokens"] == 64 * 2 * 4
    a, b = load_file(str(tiny_ckpt / "model.safetensors")), load_file(str(tuned_dir / "model.safetensors"))
    assert a.keys() == b.keys()
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert all(a[k].dtype == b[k].dtype and a[k].shape == b[k].shape for k in a)
    assert all(k.endswith((".lut", ".scale")) or "norm" in k for k in changed)
    assert any(k.endswith(".lut") for k in changed) and "model.embed_tokens.scale" in changed
    assert any("norm" in k for k in changed)
    assert all(torch.equal(a[k], b[k]) for k in a if k.endswith((".qdata", ".zero_point")))  # codes frozen
    assert set(t["tensors"]) == {k for k in a if k.endswith((".lut", ".scale")) or "norm" in k}
    r = t["rounding"]
    assert r["ppl_fp32_masters"] > 0 and r["ppl_rounded"] > 0


def test_tuned_checkpoint_loads_and_the_fused_kernel_reads_its_tables(tuned_dir, tiny_ckpt):
    model = load(tuned_dir)
    ids = torch.randint(0, 49152, (1, 16), generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(model(input_ids=ids).logits).all()
    q, q0 = model.get_submodule("model.layers.1.mlp.down_proj"), load(tiny_ckpt).get_submodule("model.layers.1.mlp.down_proj")
    assert not torch.equal(q.lut, q0.lut)
    if not kernels.triton_available():
        pytest.skip("triton is not installed")
    x = torch.randn(3, q.in_features, generator=torch.Generator().manual_seed(2))
    ref = x.double() @ q.dequantize(torch.float64).T  # the reference path, float64
    y = kernels.fused_linear(q, x)  # under TRITON_INTERPRET=1 on CPU (conftest)
    assert float((y.double() - ref).norm() / ref.norm()) < 1e-5


@pytest.fixture(scope="module")
def blockwise_ckpt(tiny_model_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bw") / "b4s64"
    compress(CompressConfig(model=str(tiny_model_dir), bpw=None, bits=[4], scheme="blockwise",
                            scheme_params={"block_size": 64, "symmetric": True}, embedding_bits="8", calib_samples=2,
                            seq_len=64), out=out, show_progress=False)
    return out


def test_tuned_scales_export_to_gguf_exactly(blockwise_ckpt, text_mix, tmp_path):
    manifest = _tuned(blockwise_ckpt, tmp_path / "t", text_mix, params="scales,norms", lr=1e-2)
    assert manifest["tuning"]["layers"] == 14 and manifest["bytes"] == read_manifest(blockwise_ckpt)["bytes"]
    a, b = load_file(str(blockwise_ckpt / "model.safetensors")), load_file(str(tmp_path / "t" / "model.safetensors"))
    assert not torch.equal(a["model.layers.0.mlp.up_proj.scale"], b["model.layers.0.mlp.up_proj.scale"])
    assert torch.equal(a["model.embed_tokens.scale"], b["model.embed_tokens.scale"])  # 'embedding' not asked for
    rep = export(tmp_path / "t", "gguf", tmp_path / "gguf")
    assert rep["exact_layers"] == rep["total_layers"] and rep["total_rel_error"] == 0.0


def test_lr_zero_is_the_identity(tiny_ckpt, text_mix, tmp_path):
    manifest = _tuned(tiny_ckpt, tmp_path / "zero", text_mix, lr=0.0)
    assert manifest["weights_file"]["sha256"] == json.loads((tiny_ckpt / "qrecover.json").read_text())["weights_file"]["sha256"]
    assert (tmp_path / "zero" / "model.safetensors").read_bytes() == (tiny_ckpt / "model.safetensors").read_bytes()


def test_resume_ends_where_an_uninterrupted_run_ends(tiny_ckpt, text_mix, tmp_path):
    _tuned(tiny_ckpt, tmp_path / "full", text_mix, checkpoint_every=2)

    class Crash(Exception):
        pass

    def crash_after_step_3(info):
        if info["step"] == 3:
            raise Crash

    with pytest.raises(Crash):
        _tuned(tiny_ckpt, tmp_path / "cut", text_mix, checkpoint_every=2, callback=crash_after_step_3)
    assert latest_checkpoint(tmp_path / "cut").name == "step-0000002.pt"
    assert not (tmp_path / "cut" / "qrecover.json").exists()  # nothing loadable half-tuned
    with pytest.raises(QRecoverError, match="--resume"):
        _tuned(tiny_ckpt, tmp_path / "cut", text_mix, checkpoint_every=2)
    _tuned(tiny_ckpt, tmp_path / "cut", text_mix, checkpoint_every=2, resume=True)
    assert (tmp_path / "cut" / "model.safetensors").read_bytes() == (tmp_path / "full" / "model.safetensors").read_bytes()
    log = [(tmp_path / d / "train_log.jsonl").read_text().splitlines() for d in ("full", "cut")]
    assert [json.loads(x)["loss"] for x in log[0]] == [json.loads(x)["loss"] for x in log[1]]


def test_block_wise_reconstruction_lowers_every_blocks_output_error_and_keeps_the_bytes(tiny_ckpt, text_mix, tmp_path, capsys,
                                                                                       monkeypatch):
    manifest = _tuned(tiny_ckpt, tmp_path / "blocks", text_mix, tokens=0, block_tokens=64 * 4, block_epochs=3, block_lr=3e-3)
    b = manifest["tuning"]["blocks"]
    assert b["tokens"] == 64 * 4 and b["windows"] == 4 and b["steps"] == len(b["per_block"]) * 3 * 4
    assert manifest["tuning"]["tokens"] == 0 and manifest["bytes"] == read_manifest(tiny_ckpt)["bytes"]
    for block in b["per_block"]:  # each block fitted to the unquantized block's outputs on the quantized inputs
        assert block["after"] < block["before"], block
    # the reconstruction is in the written checkpoint (its tables and scales moved), kept for --resume beside it
    assert (tmp_path / "blocks" / "model.safetensors").read_bytes() != (tiny_ckpt / "model.safetensors").read_bytes()
    assert (tmp_path / "blocks" / "blocks.pt").is_file()  # (keep_checkpoints=True; removed with the checkpoints otherwise)
    ids = torch.arange(1, 33).unsqueeze(0)
    assert not torch.equal(load(tiny_ckpt)(ids).logits, load(tmp_path / "blocks")(ids).logits)
    monkeypatch.setenv("COLUMNS", "400")
    code, out, err = cli(["info", tmp_path / "blocks"], capsys)
    assert code == 0 and "block-wise on 256 tokens x 3" in out + err and "end to end on 0 tokens" in out + err


def test_block_wise_result_is_kept_for_resume(tiny_ckpt, text_mix, tmp_path, monkeypatch):
    """Interrupted in the end-to-end pass before its first checkpoint, the run keeps the block-wise result and a resume
    starts from it, ending with the bytes of an uninterrupted run."""
    kw = dict(block_tokens=64 * 2, block_epochs=1)
    _tuned(tiny_ckpt, tmp_path / "full", text_mix, **kw)

    class Crash(Exception):
        pass

    def crash(info):
        if info["step"] == 1:
            raise Crash

    with pytest.raises(Crash):
        _tuned(tiny_ckpt, tmp_path / "cut", text_mix, callback=crash, **kw)
    assert (tmp_path / "cut" / "blocks.pt").is_file() and latest_checkpoint(tmp_path / "cut") is None

    def not_again(*_a, **_k):
        raise AssertionError("the resumed run reconstructed the blocks again instead of loading blocks.pt")

    monkeypatch.setattr(tune_module, "reconstruct_blocks", not_again)
    manifest = _tuned(tiny_ckpt, tmp_path / "cut", text_mix, resume=True, **kw)
    assert manifest["tuning"]["blocks"]["per_block"] == read_manifest(tmp_path / "full")["tuning"]["blocks"]["per_block"]
    assert (tmp_path / "cut" / "model.safetensors").read_bytes() == (tmp_path / "full" / "model.safetensors").read_bytes()


def test_info_shows_the_tuning(tuned_dir, tiny_ckpt, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "400")
    code, out, err = cli(["info", tuned_dir], capsys)
    assert code == 0, err
    text = out + err  # the table goes to the console (stderr)
    assert "tuned" in text and "tables, scales, norms, embedding" in text and "512 tokens" in text and "fp16 rounding" in text


def test_recover_on_a_tuned_checkpoint_works_unchanged(tuned_dir, text_mix, tmp_path):
    meta = recover(tuned_dir, tmp_path / "lora", RecoverConfig(rank=2, tokens=64 * 2, mix=str(text_mix), seq_len=64,
                   batch_size=2, objective="ce", init="zero", decontaminate=False, checkpoint_every=0), show_progress=False)
    assert meta["base"]["weights_sha256"] == json.loads((tuned_dir / "qrecover.json").read_text())["weights_file"]["sha256"]
    assert load(tuned_dir, adapter=tmp_path / "lora") is not None


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if anything loads a model."""
    import qrecover.recovery.tune as tune_mod

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was validated")

    monkeypatch.setattr(tune_mod, "load", refuse)
    monkeypatch.setattr(tune_mod, "load_teacher", refuse)
    monkeypatch.setenv("COLUMNS", "1000")


def test_bad_input_exits_2_with_one_line_before_any_model_loads(tiny_ckpt, text_mix, tmp_path, capsys, no_model_loads):
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    cases = [
        ([tiny_ckpt, "--params", "scales"], "selects nothing to tune"),  # palettized linears have tables, not scales
        ([adapter], "is an adapter directory, not a checkpoint"),
        ([tiny_ckpt, "--params", "tables,weights"], "--params 'tables,weights'"),
        ([tiny_ckpt, "--params", "codes", "--codes-lr", "-1"], "--codes-lr -1.0 must be >= 0"),
        ([tiny_ckpt, "--lr", "-1"], "--lr -1.0 must be positive"),
        ([tiny_ckpt, "--mix", tmp_path / "none.toml"], "does not exist"),
    ]
    for argv, message in cases:
        out = tmp_path / "x"
        code, stdout, err = cli(["tune", *argv, "--out", out], capsys)
        assert code == 2, (argv, err)
        assert message in err and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
        assert not out.exists()
    code, _, err = cli(["tune", tiny_ckpt, "--out", tiny_ckpt, "--mix", text_mix], capsys)
    assert code == 2 and "is the checkpoint being tuned" in err


def test_nothing_left_when_interrupted_before_the_first_checkpoint(tiny_ckpt, text_mix, tmp_path):
    def stop(info):
        if info["step"] == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _tuned(tiny_ckpt, tmp_path / "r", text_mix, checkpoint_every=2, callback=stop)
    assert not (tmp_path / "r").exists()
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_config_refuses_bad_block_wise_settings():
    with pytest.raises(QRecoverError, match="--block-tokens 10 must be 0"):
        TuneConfig(block_tokens=10, seq_len=64)
    with pytest.raises(QRecoverError, match="--block-epochs 0"):
        TuneConfig(block_tokens=1024, block_epochs=0)
    with pytest.raises(QRecoverError, match="--tokens 0 must be a positive"):
        TuneConfig(tokens=0)  # nothing would train
    assert TuneConfig(tokens=0, block_tokens=1024).tokens == 0


def test_config_refuses_what_tuning_cannot_do():
    with pytest.raises(QRecoverError, match="does not shard the base"):
        TuneConfig(shard_base=True)
    with pytest.raises(QRecoverError, match="--params 'code'"):
        TuneConfig(params="code")
    assert TuneConfig(lr=0.0).lr == 0.0  # the identity run; recovery itself refuses lr 0
    with pytest.raises(QRecoverError, match="--lr 0.0 must be positive"):
        RecoverConfig(lr=0.0)


# --- the codes (--params codes): re-assigned to the nearest entry of a master weight, straight-through gradient ------

CODE_SCHEMES = [("palettize", {}), ("palettize", {"block_size": 32}), ("blockwise", {"block_size": 32}),
                ("blockwise", {"block_size": 32, "symmetric": False}), ("gptq", {"group_size": 32})]


@pytest.mark.parametrize("scheme,params", CODE_SCHEMES)
@pytest.mark.parametrize("bits", [2, 3, 4])
def test_encode_is_the_nearest_code_and_decode_inverts_it(scheme, params, bits):
    from qrecover.packing import unpack

    torch.manual_seed(bits)
    w = torch.randn(32, 64)
    q = get_quantizer(scheme, **params)
    qw = q.quantize(w, bits, {"hessian": torch.eye(64) + 0.1, "input_sq": torch.ones(64)})
    dense = q.dequantize(qw)
    stored = unpack(qw.tensors["qdata"], bits, w.numel()).long().view(32, 64)
    assert torch.equal(q.decode(qw, stored), dense)
    assert torch.equal(q.decode(qw, q.encode(qw, dense)), dense)  # a dequantized weight re-encodes to itself
    # any weight: its code's value is at least as near as every other code's (float64 brute force over all codes)
    x = torch.randn(32, 64) * 1.5
    got = (x.double() - q.decode(qw, q.encode(qw, x)).double()).abs()
    every = torch.stack([q.decode(qw, torch.full_like(stored, k)).double() for k in range(2**bits)])
    best = (x.double() - every).abs().min(0).values
    assert torch.all(got <= best + 1e-6)


def test_codes_master_forward_is_the_quantized_layer_and_its_gradient_goes_straight_through():
    torch.manual_seed(0)
    qw = get_quantizer("palettize").quantize(torch.randn(32, 64), 3, {"input_sq": torch.ones(64)})
    layer, plain = QuantLinear(qw), QuantLinear(qw)
    layer.set_masters(("lut", "qdata"), code_step=4.0)
    plain.set_masters(("lut",))
    x = torch.randn(5, 64, dtype=torch.float64)
    layer.double(), plain.double()
    y = layer(x)
    assert torch.equal(y, plain(x))  # step 0: the codes as stored
    y.square().sum().backward()
    plain(x).square().sum().backward()
    w = qw.dequantize(torch.float64).requires_grad_(True)
    (x @ w.T).square().sum().backward()  # dL/dW of the dense layer, float64
    assert torch.allclose(layer.qdata_master.grad, w.grad * layer.qdata_unit, rtol=1e-10, atol=1e-12)
    assert float(layer.qdata_unit.mean() / plain.lut_unit.mean()) > 3  # code_step scales the codes' unit
    assert torch.allclose(layer.lut_master.grad, plain.lut_master.grad, rtol=1e-10, atol=1e-12)


def test_a_master_past_the_midpoint_takes_its_neighbours_code_and_commit_packs_it():
    torch.manual_seed(0)
    q = get_quantizer("blockwise", block_size=32)
    qw = q.quantize(torch.randn(4, 32), 3, {})
    layer = QuantLinear(qw)
    layer.set_masters(("qdata",))
    scale = float(qw.tensors["scale"][0, 0])
    w0 = float(layer.dequantize().detach()[0, 0])
    with torch.no_grad():  # move element (0, 0) by 0.6 of a grid step towards zero: past the midpoint, inside the grid
        layer.qdata_master[0, 0] += (-0.6 if w0 > 0 else 0.6) * scale / float(layer.qdata_unit[0])
    moved = layer.dequantize().detach()
    assert moved[0, 0] == w0 + (-scale if w0 > 0 else scale) and torch.equal(moved[1:], qw.dequantize()[1:])
    stored = layer.commit_masters()
    assert set(stored) == {"qdata"} and stored["qdata"].dtype == torch.uint8
    assert stored["qdata"].shape == qw.tensors["qdata"].shape and torch.equal(layer.dequantize(), moved)


def test_tuning_the_codes_changes_codes_only_in_linear_layers_and_keeps_the_bytes(tiny_ckpt, text_mix, tmp_path):
    manifest = _tuned(tiny_ckpt, tmp_path / "c", text_mix, params="tables,codes", codes_lr=0.3)
    src = read_manifest(tiny_ckpt)
    assert manifest["bytes"] == src["bytes"] and manifest["measured_bpw"] == src["measured_bpw"]
    assert manifest["tuning"]["params"] == ["tables", "codes"]
    a, b = load_file(str(tiny_ckpt / "model.safetensors")), load_file(str(tmp_path / "c" / "model.safetensors"))
    changed = {k for k in a if not torch.equal(a[k], b[k])}
    assert any(k.endswith(".qdata") for k in changed) and any(k.endswith(".lut") for k in changed)
    assert "model.embed_tokens.qdata" not in changed and all(k.endswith((".qdata", ".lut")) for k in changed)
    model = load(tmp_path / "c")
    ids = torch.randint(0, 49152, (1, 16), generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(model(input_ids=ids).logits).all()


def test_lr_zero_with_the_codes_is_the_identity(tiny_ckpt, text_mix, tmp_path):
    _tuned(tiny_ckpt, tmp_path / "zero", text_mix, lr=0.0, params="tables,scales,norms,embedding,codes")
    assert (tmp_path / "zero" / "model.safetensors").read_bytes() == (tiny_ckpt / "model.safetensors").read_bytes()

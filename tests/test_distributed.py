"""Data-parallel recovery training: 2 CPU processes (gloo) against 1, and resume on another number of processes.

``torchrun`` runs ``qrecover recover`` on 2 processes of 1 sequence x 2 accumulated micro-batches each (a global
batch of 4 sequences, gradient checkpointing on); one process then trains the same run as 4 sequences x 1, and
another resumes the 2-process run's step-2 checkpoint as 1 sequence x 4 micro-batches. All three must give the
same adapter to float tolerance (the loss is the token mean over the global batch, so the split into processes,
micro-batches and accumulation does not matter; the mix has chat data whose masked labels make the token counts
differ between sequences); the same on prepared token shards. A resume that changes the global batch is
refused, naming the fix; FSDP and DeepSpeed launches are refused with the reason.

``--shard-base`` (torch FSDP2 over the frozen packed base, the adapter whole on every process): the same 2-process
run gives the 1-process adapter, each process holds half the packed base bytes (the DDP run: all of them), and
checkpoints cross between sharded 2-process and unsharded 1-process runs in both directions.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from qrecover.errors import QRecoverError
from qrecover.loading import load
from qrecover.recovery.api import recover
from qrecover.recovery.config import RecoverConfig
from qrecover.recovery.train import load_checkpoint

pytestmark = pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                                reason="torch.distributed with the gloo backend is not available in this torch build")

SEQ, STEPS, GLOBAL = 64, 4, 4  # 4 optimizer steps of 4 sequences of 64 tokens
RUN = dict(rank=4, tokens=SEQ * GLOBAL * STEPS, seq_len=SEQ, objective="mix", lr=1e-2, checkpoint_every=2,
           precision="fp32", decontaminate=False)


@pytest.fixture(scope="module")
def chat_text_mix(tmp_path_factory) -> Path:
    """Half plain text (every token has a label), half chats (only assistant tokens have one)."""
    from qrecover.data.corpus import documents

    d = tmp_path_factory.mktemp("dist-mix")
    for i, t in enumerate(documents("python-docs", "train")[:4]):
        (d / f"doc{i}.txt").write_text(t)
    with open(d / "chat.jsonl", "w") as f:
        for i in range(24):
            q = f"What is {i} times {i + 3}? Explain briefly." + " Please." * (i % 5)
            a = f"{i} times {i + 3} is {i * (i + 3)}." + " It is a product of two integers." * (i % 3)
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n")
    recipe = d / "mix.toml"
    recipe.write_text(f'[[source]]\nname = "docs"\nkind = "text"\npath = "{d}/*.txt"\nweight = 1.0\n\n'
                      f'[[source]]\nname = "chat"\nkind = "jsonl"\npath = "{d}/chat.jsonl"\nweight = 1.0\n')
    return recipe


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _lora(ckpt: Path, adapter: Path) -> dict[str, torch.Tensor]:
    model = load(ckpt, adapter=adapter)
    return {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def _assert_same_adapter(ckpt: Path, run_a: Path, run_b: Path) -> None:
    """The fp32 adapter weights at the last step (in the kept checkpoints), then the exported fp16 adapters."""
    last = f"checkpoints/step-{STEPS:07d}.pt"
    for a, b, rtol, atol in ((load_checkpoint(run_a / last)["adapter"], load_checkpoint(run_b / last)["adapter"], 1e-4, 1e-5),
                             (_lora(ckpt, run_a), _lora(ckpt, run_b), 1e-3, 1e-5)):  # fp16: 1 unit is 2^-11 relative
        assert a.keys() == b.keys() and a
        for n in a:
            torch.testing.assert_close(a[n], b[n], rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")


def _losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "train_log.jsonl").read_text().splitlines()]


def _torchrun_recover(ckpt: Path, out: Path, data: Path, *extra: str) -> dict:
    """``qrecover recover`` under torchrun: 2 processes x batch 1 x grad_accum 2, checkpoints kept; its JSON report."""
    root = Path(__file__).parents[1]  # this checkout's qrecover, whatever the environment has installed
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), "-m", "qrecover.cli", "recover", str(ckpt), "--out", str(out),
           "--mix", str(data), "--rank", "4", "--tokens", str(RUN["tokens"]), "--seq-len", str(SEQ),
           "--objective", "mix", "--lr", "1e-2", "--checkpoint-every", "2", "--precision", "fp32", "--no-decontaminate",
           "--batch-size", "1", "--grad-accum", "2", "--keep-checkpoints", "--json", *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    report, end = json.JSONDecoder().raw_decode(proc.stdout.strip())
    assert end == len(proc.stdout.strip()), proc.stdout  # one report (the main process's); the other prints nothing
    assert report["tokens"] == RUN["tokens"] and report["out"] == str(out)
    return report


@pytest.fixture(scope="module")
def two_process_run(tiny_ckpt, chat_text_mix, tmp_path_factory) -> Path:
    """On the data mix, with gradient checkpointing."""
    out = tmp_path_factory.mktemp("ddp") / "r4"
    _torchrun_recover(tiny_ckpt, out, chat_text_mix, "--gradient-checkpointing")
    return out


@pytest.fixture(scope="module")
def one_process_run(tiny_ckpt, chat_text_mix, tmp_path_factory) -> Path:
    """The reference: the same run on 1 process x batch 4 x grad_accum 1 (the same global batch)."""
    out = tmp_path_factory.mktemp("one") / "r4"
    recover(tiny_ckpt, out, RecoverConfig(mix=str(chat_text_mix), batch_size=4, grad_accum=1, **RUN), show_progress=False,
            keep_checkpoints=True)
    return out


@pytest.fixture(scope="module")
def sharded_run(tiny_ckpt, chat_text_mix, tmp_path_factory) -> Path:
    """The 2-process run with the packed base sharded (FSDP2) and gradient checkpointing."""
    out = tmp_path_factory.mktemp("fsdp") / "r4"
    _torchrun_recover(tiny_ckpt, out, chat_text_mix, "--gradient-checkpointing", "--shard-base")
    return out


def _training(run: Path) -> dict:
    return json.loads((run / "qrecover_adapter.json").read_text())["training"]


def test_two_processes_give_the_adapter_of_one_with_the_same_global_batch(two_process_run, one_process_run, tiny_ckpt):
    meta = json.loads((two_process_run / "qrecover_adapter.json").read_text())
    assert meta["training"]["world_size"] == 2 and meta["training"]["steps"] == STEPS
    assert meta["training"]["tokens"] == RUN["tokens"]  # counted over both processes
    state = load_checkpoint(two_process_run / "checkpoints" / "step-0000002.pt")
    assert state["world"] == 2 and state["tokens"] == 2 * GLOBAL * SEQ
    assert state["loader"]["sequences"] == 2 * GLOBAL  # the data position is global, not one process's share

    _assert_same_adapter(tiny_ckpt, two_process_run, one_process_run)
    assert _losses(two_process_run) == pytest.approx(_losses(one_process_run), rel=1e-4)


def test_sharded_base_gives_the_adapter_of_one_process(sharded_run, one_process_run, tiny_ckpt):
    """2 processes x batch 1 x grad_accum 2 with the base sharded: the 1-process adapter and losses, to float tolerance."""
    training = _training(sharded_run)
    assert training["shard_base"] is True and training["world_size"] == 2 and training["steps"] == STEPS
    assert _training(one_process_run)["shard_base"] is False
    _assert_same_adapter(tiny_ckpt, sharded_run, one_process_run)
    assert _losses(sharded_run) == pytest.approx(_losses(one_process_run), rel=1e-4)


def test_sharded_base_puts_half_the_packed_bytes_on_each_process(sharded_run, two_process_run, one_process_run):
    """Measured inside the runs (local shards of the packed tensors): DDP holds the whole base on each process,
    the sharded run half of it on each (FSDP splits every packed tensor along dim 0)."""
    (whole,) = _training(one_process_run)["packed_bytes_per_process"]
    assert whole > 1_000_000  # the tiny model's packed embedding and layers
    assert _training(two_process_run)["packed_bytes_per_process"] == [whole, whole]
    shards = _training(sharded_run)["packed_bytes_per_process"]
    assert len(shards) == 2 and sum(shards) == whole and max(shards) <= 0.51 * whole


def test_sharded_checkpoint_resumes_unsharded_on_one_process_and_back(sharded_run, one_process_run, tiny_ckpt,
                                                                      chat_text_mix, tmp_path):
    """A checkpoint holds the whole adapter and optimizer state however the run was split: the sharded 2-process
    step-2 checkpoint finishes on 1 process (unsharded, batch 1 x grad_accum 4) as the sharded run did, and the
    1-process step-2 checkpoint finishes on 2 sharded processes as the 1-process run did."""
    cut = tmp_path / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copy(sharded_run / "checkpoints" / "step-0000002.pt", cut / "checkpoints")
    recover(tiny_ckpt, cut, RecoverConfig(mix=str(chat_text_mix), batch_size=1, grad_accum=4, **RUN), resume=True,
            show_progress=False, keep_checkpoints=True)
    _assert_same_adapter(tiny_ckpt, sharded_run, cut)
    assert _losses(cut)[2:] == pytest.approx(_losses(sharded_run)[2:], rel=1e-4)

    back = tmp_path / "back"
    (back / "checkpoints").mkdir(parents=True)
    shutil.copy(one_process_run / "checkpoints" / "step-0000002.pt", back / "checkpoints")
    _torchrun_recover(tiny_ckpt, back, chat_text_mix, "--shard-base", "--resume")
    assert _training(back)["shard_base"] is True
    _assert_same_adapter(tiny_ckpt, one_process_run, back)
    assert _losses(back)[2:] == pytest.approx(_losses(one_process_run)[2:], rel=1e-4)


def test_shard_base_on_one_process_warns_and_trains_unsharded(tiny_ckpt, chat_text_mix, tmp_path):
    cfg = RecoverConfig(**{**RUN, "tokens": SEQ * 2, "objective": "ce", "checkpoint_every": 0}, mix=str(chat_text_mix),
                        init="zero", shard_base=True)
    with pytest.warns(UserWarning, match="--shard-base on one process changes nothing"):
        meta = recover(tiny_ckpt, tmp_path / "one", cfg, show_progress=False)
    assert meta["training"]["shard_base"] is False and meta["training"]["steps"] == 2


def test_packed_tensors_as_frozen_parameters_keep_names_dtypes_and_outputs(tiny_ckpt):
    """What FSDP shards: the packed tensors as frozen parameters, the model otherwise the same (state-dict names,
    stored dtypes through ``.to(dtype)``, logits), the dense cache off. Every parameter is floating (FSDP2 before
    torch 2.12 fails on an integer one: pytorch/pytorch#177844); read by name, each tensor is the stored one."""
    from qrecover.qlinear import _Packed, local_packed_bytes, packed_as_parameters

    model = load(tiny_ckpt)
    ids = torch.arange(1, 17).unsqueeze(0)
    with torch.no_grad():
        before, names, nbytes = model(input_ids=ids).logits, list(model.state_dict()), local_packed_bytes(model)
    packed = [m for m in model.modules() if isinstance(m, _Packed)]
    held = {(i, n): getattr(m, n).clone() for i, m in enumerate(packed) for n in m._tensor_names}
    assert any(not t.is_floating_point() for t in held.values())  # codes: integers
    packed_as_parameters(model)
    assert all(p.is_floating_point() for p in model.parameters())
    for (i, n), t in held.items():
        now = getattr(packed[i], n)
        assert now.dtype == t.dtype and torch.equal(now, t), n
        assert packed[i].packed.tensors[n].dtype == t.dtype
    assert [type(m).__name__ for m in packed] == [type(m).__name__ for m in load(tiny_ckpt).modules()
                                                  if isinstance(m, _Packed)]
    assert all(not m.cache and m._dense is None for m in packed)
    tensor_names = {n for m in packed for n in m._tensor_names}  # e.g. qdata, scale, zero_point, lut
    frozen = {n: p for n, p in model.named_parameters() if n.rsplit(".", 1)[-1] in tensor_names}
    assert frozen and not any(p.requires_grad for p in frozen.values())
    assert not any(n in frozen for n, _ in model.named_buffers())
    assert list(model.state_dict()) == names and local_packed_bytes(model) == nbytes
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, before, rtol=0, atol=0)
    stored = {n: p.dtype for n, p in frozen.items()}
    model.to(torch.float16)
    assert {n: p.dtype for n, p in model.named_parameters() if n in frozen} == stored
    assert all(isinstance(p, torch.nn.Parameter) for n, p in model.named_parameters() if n in frozen)
    layer = next(m for m in packed if "qdata" in m._tensor_names and hasattr(m, "set_packed"))
    layer.set_packed(layer.packed)  # the merge's path: its tensors become buffers again, read as stored
    assert layer.qdata.dtype == held[packed.index(layer), "qdata"].dtype and torch.equal(
        layer.qdata, held[packed.index(layer), "qdata"])


def test_two_process_checkpoint_resumes_on_one_process(two_process_run, tiny_ckpt, chat_text_mix, tmp_path):
    cut = tmp_path / "cut"
    (cut / "checkpoints").mkdir(parents=True)
    shutil.copy(two_process_run / "checkpoints" / "step-0000002.pt", cut / "checkpoints")

    with pytest.raises(QRecoverError, match=r"global batch was 4 .*2 processes.*now it would be 2.*--grad-accum"):
        recover(tiny_ckpt, cut, RecoverConfig(mix=str(chat_text_mix), batch_size=1, grad_accum=2, **RUN),
                resume=True, show_progress=False)
    with pytest.raises(QRecoverError, match=r"different settings.*'lr': \(0\.01, 0\.02\)"):
        recover(tiny_ckpt, cut, RecoverConfig(mix=str(chat_text_mix), batch_size=1, grad_accum=4, **{**RUN, "lr": 2e-2}),
                resume=True, show_progress=False)
    assert sorted(os.listdir(cut / "checkpoints")) == ["step-0000002.pt"]  # refusals change nothing

    recover(tiny_ckpt, cut, RecoverConfig(mix=str(chat_text_mix), batch_size=1, grad_accum=4, **RUN), resume=True,
            show_progress=False, keep_checkpoints=True)
    _assert_same_adapter(tiny_ckpt, two_process_run, cut)
    assert _losses(cut)[:2] == _losses(two_process_run)[:2]  # the history comes from the checkpoint
    assert _losses(cut)[2:] == pytest.approx(_losses(two_process_run)[2:], rel=1e-4)
    report = json.loads((cut / "data_report.json").read_text())
    assert report["sequences"] == STEPS * GLOBAL  # every sequence of the run read exactly once


@pytest.mark.parametrize("kind", ["FSDP", "DEEPSPEED"])
def test_fsdp_and_deepspeed_launches_are_refused_with_the_reason(kind, tmp_path, monkeypatch):
    """``accelerate launch --use_fsdp`` sets ACCELERATE_USE_FSDP: refused before accelerate builds its plugin (whose
    own error on a machine without GPUs says nothing about why), before any data is read or anything written."""
    from qrecover.recovery.train import train

    monkeypatch.setenv(f"ACCELERATE_USE_{kind}", "true")
    fix = "torchrun .*--shard-base" if kind == "FSDP" else "torchrun"
    with pytest.raises(QRecoverError, match=rf"{kind}.*not supported.*{fix}"):
        train(torch.nn.Linear(8, 6), RecoverConfig(objective="ce"), loader=None, run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_world_of_a_checkpoint_without_the_record_is_derived_from_its_tokens():
    from qrecover.recovery.train import checkpoint_world

    cfg = RecoverConfig(batch_size=2, grad_accum=3, seq_len=64).to_dict()
    assert checkpoint_world({"config": cfg, "step": 5, "tokens": 5 * 2 * 3 * 64 * 4}) == 4  # written before "world" existed
    assert checkpoint_world({"config": cfg, "step": 5, "tokens": 5 * 2 * 3 * 64, "world": 1}) == 1


def test_two_processes_on_prepared_shards_give_the_adapter_of_one(tiny_ckpt, chat_text_mix, tmp_path):
    """The same on data from ``qrecover data prepare``: each process reads only its sequences (``batches``)."""
    from transformers import AutoTokenizer

    from qrecover.data.prepare import prepare_data

    data = tmp_path / "shards"
    prepare_data(chat_text_mix, data, tokenizer=AutoTokenizer.from_pretrained(tiny_ckpt), workers=1, decontaminate=False,
                 show_progress=False)
    _torchrun_recover(tiny_ckpt, tmp_path / "two", data)
    recover(tiny_ckpt, tmp_path / "one", RecoverConfig(mix=str(data), batch_size=2, grad_accum=2, **RUN), show_progress=False,
            keep_checkpoints=True)
    _assert_same_adapter(tiny_ckpt, tmp_path / "two", tmp_path / "one")
    report = json.loads((tmp_path / "two" / "data_report.json").read_text())
    assert report["kind"] == "shards" and report["sequences"] == STEPS * GLOBAL

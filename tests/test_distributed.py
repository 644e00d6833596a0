"""Data-parallel recovery training: 2 CPU processes (gloo) against 1, and resume on another number of processes.

``torchrun`` runs ``qrecover recover`` on 2 processes of 1 sequence x 2 accumulated micro-batches each (a global
batch of 4 sequences, gradient checkpointing on); one process then trains the same run as 4 sequences x 1, and
another resumes the 2-process run's step-2 checkpoint as 1 sequence x 4 micro-batches. All three must give the
same adapter to float tolerance (the loss is the token mean over the global batch, so the split into processes,
micro-batches and accumulation does not matter; the mix has chat data whose masked labels make the token counts
differ between sequences); the same on prepared token shards. A resume that changes the global batch is
refused, naming the fix; FSDP and DeepSpeed launches are refused with the reason.
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

from qrecover.api import load
from qrecover.errors import QRecoverError
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
    from qrecover.data import documents

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


def test_two_processes_give_the_adapter_of_one_with_the_same_global_batch(two_process_run, tiny_ckpt, chat_text_mix,
                                                                          tmp_path):
    meta = json.loads((two_process_run / "qrecover_adapter.json").read_text())
    assert meta["training"]["world_size"] == 2 and meta["training"]["steps"] == STEPS
    assert meta["training"]["tokens"] == RUN["tokens"]  # counted over both processes
    state = load_checkpoint(two_process_run / "checkpoints" / "step-0000002.pt")
    assert state["world"] == 2 and state["tokens"] == 2 * GLOBAL * SEQ
    assert state["loader"]["sequences"] == 2 * GLOBAL  # the data position is global, not one process's share

    one = tmp_path / "one"
    recover(tiny_ckpt, one, RecoverConfig(mix=str(chat_text_mix), batch_size=4, grad_accum=1, **RUN), show_progress=False,
            keep_checkpoints=True)
    _assert_same_adapter(tiny_ckpt, two_process_run, one)
    assert _losses(two_process_run) == pytest.approx(_losses(one), rel=1e-4)


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
    fix = "--no-cache-dequantized" if kind == "FSDP" else "torchrun"
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

    from qrecover.recovery.prepare import prepare_data

    data = tmp_path / "shards"
    prepare_data(chat_text_mix, data, tokenizer=AutoTokenizer.from_pretrained(tiny_ckpt), workers=1, decontaminate=False,
                 show_progress=False)
    _torchrun_recover(tiny_ckpt, tmp_path / "two", data)
    recover(tiny_ckpt, tmp_path / "one", RecoverConfig(mix=str(data), batch_size=2, grad_accum=2, **RUN), show_progress=False,
            keep_checkpoints=True)
    _assert_same_adapter(tiny_ckpt, tmp_path / "two", tmp_path / "one")
    report = json.loads((tmp_path / "two" / "data_report.json").read_text())
    assert report["kind"] == "shards" and report["sequences"] == STEPS * GLOBAL

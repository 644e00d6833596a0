"""benchmarks/train_speed.py end to end on the CPU with a tiny config (``--tiny``): build, compress, train, table.

Checks that it reports steady-state tokens/s and MFU apart from the warm-up, zero host synchronisations per
steady-state step and a non-zero dispatch count (counted around the trainer's optimizer step), that
``--micro-batch auto`` is a no-op on a CPU (micro-batch 1, said so), that ``--budget-s`` prints whether the run
fitted and exits 1 when it did not, and that a bad option exits 2 with the value named.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "train_speed.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), "--tiny", *args], capture_output=True, text=True, env=env,
                          timeout=900)


def test_tiny_run_reports_steady_state_warmup_and_counts(tmp_path):
    p = _run("--micro-batch", "auto", "--budget-s", "900", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "--micro-batch auto: no CUDA device, nothing to probe; micro-batch 1" in p.stdout
    assert "| micro-batch | steady tokens/s | TFLOP/s | MFU | warm-up (steps, s) |" in p.stdout
    assert "budget:" in p.stdout and "(within)" in p.stdout
    result = json.loads((tmp_path / "train_speed-cpu-tiny.json").read_text())
    (row,) = result["rows"]
    assert row["batch"] == 1 and row["steps"] == 4 and row["warmup_steps"] == 2
    assert row["warmup_s"] > 0 and row["tok_per_s"] > 0 and row["mfu"] > 0
    # steady state: the 2 tokens-steps after the warm-up over the time after it
    steady_s = row["train_s"] - row["warmup_s"]
    assert abs(row["tok_per_s"] - (row["tokens"] / 2) / steady_s) <= 1e-6 * row["tok_per_s"]
    assert row["syncs_per_step"] == 0 and row["dispatches_per_step"] > 100
    assert sum(row["ops_per_step"].values()) == row["dispatches_per_step"]
    assert row["attention"] == "qrecover_causal_sdpa"
    assert set(result["projection_hours"]) == {"1e+09 tokens, 1 GPU(s)", "1e+09 tokens, 8 GPU(s)",
                                                "1e+10 tokens, 1 GPU(s)", "1e+10 tokens, 8 GPU(s)"}


def test_over_budget_exits_1_and_bad_options_exit_2(tmp_path):
    p = _run("--micro-batch", "1", "--budget-s", "0.001", "--out", str(tmp_path))
    assert p.returncode == 1 and "OVER BUDGET" in p.stdout, p.stderr[-2000:]
    p = _run("--micro-batch", "x", "--out", str(tmp_path / "bad"))
    assert p.returncode == 2 and "--micro-batch 'x'" in p.stderr
    p = _run("--micro-batch", "4,0", "--out", str(tmp_path / "bad"))
    assert p.returncode == 2 and "--micro-batch '4,0' must be 'auto' or positive integers" in p.stderr
    p = _run("--loss-chunk", "1024,-1", "--out", str(tmp_path / "bad"))
    assert p.returncode == 2 and "--loss-chunk '1024,-1' must be integers >= 0" in p.stderr
    assert not (tmp_path / "bad").exists()


def test_loss_chunk_sizes_run_one_each_and_name_the_chunk(tmp_path):
    """``--loss-chunk 16,0``: one run per chunk size, each row labelled with it, both free of host reads (0: the full
    logits' loss, which masks its unlabelled rows instead of indexing them out)."""
    p = _run("--micro-batch", "1", "--loss-chunk", "16,0", "--steps", "3", "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr[-2000:]
    assert "| 1 x 64, loss chunk 16 |" in p.stdout and "| 1 x 64, loss chunk 0 |" in p.stdout
    rows = json.loads((tmp_path / "train_speed-cpu-tiny.json").read_text())["rows"]
    assert [r["loss_chunk"] for r in rows] == [16, 0] and all(r["syncs_per_step"] == 0 for r in rows)

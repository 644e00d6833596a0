"""benchmarks/compress_gpu.py on toy configs (``--tiny``, CPU): it builds both models, compresses them at the default
menu and --bpw 3.7, times every stage, and under a budget too small for the larger one runs it on fewer layers
and projects the rest (the projection labelled, its arithmetic checked here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
STAGES = ["load", "windows", "gradients", "layers + candidates", "embedding candidates", "finalize", "write"]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("compress-gpu")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/compress_gpu.py", "--tiny", "--budget-s", "1", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| 8b-2layers PROJECTED to 3 layers (not measured) |" in proc.stdout
    return json.loads((out / "compress_gpu-tiny.json").read_text())


def test_every_stage_is_timed_and_the_budget_is_met_from_the_bytes(report):
    one, eight, projected = report["rows"]
    assert (one["model"], one["layers"], eight["model"], eight["layers"]) == ("1b", 2, "8b-2layers", 2)
    for r in (one, eight):
        assert list(r["stages_s"]) == STAGES
        assert all(v >= 0 for v in r["stages_s"].values()) and sum(r["stages_s"].values()) <= r["total_s"] + 0.05
        assert 3.0 < r["measured_bpw"] <= 3.7  # measured from the written file: the budget, used
        assert r["gpu_peak_gb"] is None and r["host_peak_gb"] > 0


def test_the_projection_scales_the_per_layer_stages_only(report):
    _, eight, projected = report["rows"]
    assert projected["projected"] is True and projected["layers"] == 3 and projected["gpu_peak_gb"] is None
    for k, v in eight["stages_s"].items():
        want = v * 1.5 if k in ("gradients", "layers + candidates", "finalize") else v
        assert projected["stages_s"][k] == pytest.approx(want, abs=0.01)
    grown = sum(projected["stages_s"].values()) - sum(eight["stages_s"].values())
    assert projected["total_s"] == pytest.approx(eight["total_s"] + grown, abs=0.02)

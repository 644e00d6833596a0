"""benchmarks/compress_dispatches.py: the candidates of one layer counted with and without the GPU's batched paths
(fused error-feedback launches, batched range search, sparse k-means reads), in one run, settings restored after."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from qrecover.schemes import feedback, gptq, palettize

pytest.importorskip("triton")


def test_batched_paths_launch_far_fewer_operators_and_restore_the_settings():
    spec = importlib.util.spec_from_file_location("compress_dispatches", Path(__file__).parents[1] / "benchmarks" / "compress_dispatches.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    settings = (feedback.NUMPY_ON_CPU, set(feedback.FUSED_DEVICES), set(gptq.BATCHED_SEARCH), dict(palettize.KMEANS_CHECK_EVERY),
                set(palettize.BATCHED_KMEANS))
    menu = "palettize:2/refit=1,palettize:3/refit=1,gptq:4/g64/mse=true"
    before, after = bench.count(menu, 64, 192, False), bench.count(menu, 64, 192, True)
    assert [r[0] for r in before] == [r[0] for r in after] == ["palettize:2/refit=1 / palettize:3/refit=1", "gptq:4/g64/mse=true"]
    (_, pal0, _, k0), (_, gptq0, _, _) = before
    (_, pal1, _, k1), (_, gptq1, _, g1) = after
    assert k0 == 0 and k1 == 192 // 32 and g1 == 2  # one feedback pass of 6 blocks (refit=1 reassigns none); GPTQ: 2 blocks
    assert pal1 < pal0 / 2 and gptq1 < gptq0 / 20, (before, after)  # (k-means, unchanged, is most of the rest here)
    assert settings == (feedback.NUMPY_ON_CPU, feedback.FUSED_DEVICES, gptq.BATCHED_SEARCH, palettize.KMEANS_CHECK_EVERY,
                        palettize.BATCHED_KMEANS)

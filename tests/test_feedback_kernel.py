"""Error feedback's fused block kernel (``qrecover.kernels.feedback_kernel``, what a GPU runs when the rounding rule is
given as data) writes exactly the codes and tables of the per-column path, and launches once per block of columns.

On the CPU the kernel runs under triton's interpreter (``feedback.FUSED_DEVICES`` gets "cpu"), compared with the numpy
steps; on a GPU with the torch ops on the same device (the same operations in the same order, no fused multiply-add).
Checked: palettization (three widths stacked, +inf edge padding, whole-row and per-block tables, refits), GPTQ with
act order (static groups) and without (group grids set as columns are reached, groups starting inside a block and
straddling block edges), symmetric and not.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_feedback import _assert_same_weights, _layer

from qrecover.schemes import feedback, get_quantizer

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


@pytest.fixture(scope="module")
def fk():
    from kernel_helpers import interpreted_kernels

    yield from interpreted_kernels(("qrecover.kernels.feedback_kernel",), main="qrecover.kernels.feedback_kernel")


def _per_column_then_fused(monkeypatch, fn, launches=None):
    """``fn()`` on the per-column path (numpy steps on the CPU, torch ops on a GPU), then with the fused kernel."""
    monkeypatch.setattr(feedback, "FUSED_DEVICES", set())
    plain = fn()
    monkeypatch.setattr(feedback, "FUSED_DEVICES", {DEV})
    return plain, fn()


def _on(stats):
    return {k: v.to(DEV) for k, v in stats.items()}


@pytest.mark.parametrize("shape,params", [((48, 96), {}), ((32, 128), dict(block_size=32)), ((32, 192), dict(block_size=64, refit=1))])
def test_fused_palettization_equals_per_column(fk, monkeypatch, shape, params):
    w, stats = _layer(*shape)
    pal = get_quantizer("palettize", **params)
    plain, fused = _per_column_then_fused(monkeypatch, lambda: pal.quantize_many(w.to(DEV), [2, 3, 4], _on(stats)))
    _assert_same_weights(plain, fused)


@pytest.mark.parametrize("group_size,symmetric,act_order", [(32, False, False), (48, True, False), (32, False, True), (None, False, True)])
def test_fused_gptq_equals_per_column(fk, monkeypatch, group_size, symmetric, act_order):
    """Blocks of 64 columns: groups of 32 start inside them, groups of 48 straddle their edges."""
    w, stats = _layer(24, 192, seed=2)
    gptq = get_quantizer("gptq", group_size=group_size, symmetric=symmetric, act_order=act_order, block=64)
    plain, fused = _per_column_then_fused(monkeypatch, lambda: gptq.quantize_many(w.to(DEV), [2, 3, 4], _on(stats)))
    _assert_same_weights(plain, fused)


def test_fused_path_launches_once_per_block_segment(fk, monkeypatch):
    """One kernel launch per block of 32 columns for palettization (GPTQ: per segment between group starts), and a few
    operators per block around it, where the per-column torch path dispatches dozens per column."""
    from torch.utils._python_dispatch import _disable_current_modes

    from qrecover.kernels import feedback_kernel
    from qrecover.recovery.host_sync import HostSyncCounter

    w, stats = _layer(32, 256)
    pal = get_quantizer("palettize")
    st = dict(_on(stats), hessian_inv_chol=pal.shared_factor(stats["hessian"]).to(DEV))
    factor = st["hessian_inv_chol"]
    luts = [t.tensors["lut"] for t in pal.quantize_many(w.to(DEV), [2, 3], {})]
    calls = []
    real = feedback_kernel.run

    def counted(*args):  # the launch itself, out of the operator count (the interpreter copies tensors in and out)
        calls.append(args[5:])
        with _disable_current_modes():
            real(*args)

    monkeypatch.setattr(feedback_kernel, "run", counted)
    monkeypatch.setattr(feedback, "NUMPY_ON_CPU", False)
    monkeypatch.setattr(feedback, "FUSED_DEVICES", set())
    with HostSyncCounter() as per_column:
        plain = pal._assign_with_feedback(w.to(DEV), factor, luts, 16, 256)
    monkeypatch.setattr(feedback, "FUSED_DEVICES", {DEV})
    with HostSyncCounter() as fused_count:
        fused = pal._assign_with_feedback(w.to(DEV), factor, luts, 16, 256)
    assert all(torch.equal(a, b) for a, b in zip(plain, fused))
    assert calls == [(b0, 0, 32) for b0 in range(0, 256, 32)]  # (first column, first and end column in the block)
    assert per_column.dispatches / 256 > 20, per_column.ops
    assert fused_count.dispatches / 256 < 1, fused_count.ops
    print(f"operators per column: per-column path {per_column.dispatches / 256:.1f}, fused {fused_count.dispatches / 256:.2f} "
          f"+ {len(calls) / 256:.3f} kernel launches")


def test_fused_kernel_compiles_for_h100_exactly_and_race_free():
    """Compiled for sm_90 by triton's own compiler (no GPU needed): correctly rounded divisions and no fused multiply-add
    in the PTX (one would round ``w - u * e`` once where the torch path rounds twice: other bits on a GPU), and every
    row-vector load and store in one layout of one element per thread, 128 threads for 128 rows: each thread reads back
    only what it wrote, which is why the kernel needs no barrier. Aligned as the launcher specializes, and not."""
    pytest.importorskip("triton")
    script = ("import json; from qrecover.kernels import feedback_kernel as fk\n"
              "print(json.dumps([fk.compiled_facts(m, aligned=a) for m in (fk.TABLE, fk.GRID) for a in (True, False)]))")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # the option the launch passes wins over the default
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parents[1], timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    facts = json.loads(r.stdout.splitlines()[-1])
    assert [(f["fma"], f["div_rn"], f["div_approx"]) for f in facts] == [(0, 1, 0)] * 2 + [(0, 2, 0)] * 2, facts
    for f in facts:
        (layout,) = f["row_layouts"]
        per_thread, lanes, warps = (re.search(rf"{k} = \[([\d, ]+)\]", layout).group(1) for k in ("sizePerThread", "threadsPerWarp", "warpsPerCTA"))
        assert per_thread == "1" and int(lanes) * int(warps) == 128 and int(warps) == f["num_warps"], layout


def test_a_kernel_that_fails_to_compile_falls_back_to_the_per_column_steps_with_one_warning(fk, monkeypatch):
    """A compile or launch failure on the GPU (the kernel never ran) leaves the codes of the per-column path, warns once
    naming the error and ``QRECOVER_KERNELS=0``, and the process stops trying the kernel; ``QRECOVER_KERNELS=0`` never
    tries it."""
    from qrecover.kernels import feedback_kernel

    w, stats = _layer(32, 96)
    pal = get_quantizer("palettize")
    monkeypatch.setattr(feedback, "FUSED_DEVICES", set())
    plain = pal.quantize_many(w.to(DEV), [2, 3], _on(stats))
    tries = []

    def broken(*args):
        tries.append(args[5:])
        raise RuntimeError("PTX assembly failed: ptxas fatal")

    monkeypatch.setattr(feedback_kernel, "run", broken)
    monkeypatch.setattr(feedback, "FUSED_DEVICES", {DEV})
    monkeypatch.setattr(feedback, "_FUSED_FAILED", [])
    with pytest.warns(UserWarning, match=r"error-feedback kernel failed \(RuntimeError: PTX assembly failed.*QRECOVER_KERNELS=0"):
        fell_back = pal.quantize_many(w.to(DEV), [2, 3], _on(stats))
    _assert_same_weights(plain, fell_back)
    assert len(tries) == 1
    again = pal.quantize_many(w.to(DEV), [2, 3], _on(stats))  # no second try, no second warning
    _assert_same_weights(plain, again)
    assert len(tries) == 1
    monkeypatch.setattr(feedback, "_FUSED_FAILED", [])
    monkeypatch.setenv("QRECOVER_KERNELS", "0")
    assert not feedback.fused_steps(w.to(DEV), torch.float32)
    monkeypatch.delenv("QRECOVER_KERNELS")
    assert feedback.fused_steps(w.to(DEV), torch.float32)


def test_the_gpu_benchmark_compares_both_paths_and_their_bytes(fk, monkeypatch, capsys):
    """benchmarks/feedback_speed.py --device cuda, its plumbing on the CPU: tiny shapes, the kernel under the
    interpreter, CUDA's timing calls stubbed. Each family is run both ways (one operator after another; the batched
    paths and the fused kernel) and its bytes compared; the settings are restored after."""
    if CUDA:
        pytest.skip("a GPU runs the benchmark itself: bash benchmarks/gpu_session.sh feedback")
    import importlib.util

    spec = importlib.util.spec_from_file_location("feedback_speed", Path(__file__).parents[1] / "benchmarks" / "feedback_speed.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setattr(bench, "GPU_SHAPES", {"tiny": (16, 192)})  # b192 becomes 2 blocks of 96 columns
    monkeypatch.setitem(bench.GPU_CANDIDATES, "gptq 3/4 g64 (act order)", ("gptq", dict(group_size=64, block=32), [3, 4]))
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self: self)
    for name, fn in (("synchronize", lambda: None), ("get_device_name", lambda: "CPU (interpreter)"), ("empty_cache", lambda: None)):
        monkeypatch.setattr(torch.cuda, name, fn)
    from qrecover.schemes import gptq, palettize

    settings = (set(feedback.FUSED_DEVICES), set(gptq.BATCHED_SEARCH), set(palettize.BATCHED_KMEANS), dict(palettize.KMEANS_CHECK_EVERY))
    bench.gpu_main(1)
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| tiny")]
    assert len(rows) == 3 and all(row.split("|")[6].strip() == "True" for row in rows), rows
    assert settings == (feedback.FUSED_DEVICES, gptq.BATCHED_SEARCH, palettize.BATCHED_KMEANS, palettize.KMEANS_CHECK_EVERY)


@pytest.mark.parametrize("bits,every", [([2, 3, 4], 1), ([2, 3, 4], 8), ([4, 2, 8], 3), ([3], 8)])
def test_kmeans_of_every_width_at_once_gives_each_widths_tables(monkeypatch, bits, every):
    """k-means as a GPU runs it (``palettize.BATCHED_KMEANS``, forced on the CPU here): every width side by side, the
    convergence read every ``every`` iterations. The tables and codes of each width's own k-means tested every
    iteration (widths in any order, 8-bit included), far fewer host reads, and for three widths read every iteration
    a third fewer operator dispatches."""
    from qrecover.recovery.host_sync import HostSyncCounter
    from qrecover.schemes import palettize

    w, stats = _layer(64, 96, seed=5)
    pal = get_quantizer("palettize", error_feedback=False)
    with HostSyncCounter() as one_by_one:
        plain = pal.quantize_many(w, bits, stats)
    monkeypatch.setattr(palettize, "BATCHED_KMEANS", {"cpu"})
    monkeypatch.setattr(palettize, "KMEANS_CHECK_EVERY", {"cpu": every})
    with HostSyncCounter() as batched:
        together = pal.quantize_many(w, bits, stats)
    _assert_same_weights(plain, together)
    reads_each, reads_few = one_by_one.by_name["aten.equal"], batched.by_name["aten._local_scalar_dense"]
    assert reads_each > 3 * every and 0 < reads_few <= reads_each // every + 1, (batched.by_name, one_by_one.by_name)
    if every == 1 and len(bits) == 3:
        assert batched.dispatches < 0.7 * one_by_one.dispatches, (batched.dispatches, one_by_one.dispatches)

"""benchmarks/kernels.py without a GPU: ``--dry-run --quick`` builds every case of the quick table at its real shape
(the issue's three layers x three formats x batch 1/16), measures the one-time repacks and runs no kernel; the
L2-cold copy counts are checked here. The GPU figures themselves come from ``python benchmarks/kernels.py --quick``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kernel_timing import n_copies  # noqa: E402


def test_l2_cold_copies_exceed_three_times_l2():
    l2 = 50 << 20
    assert n_copies(4096 * 14336 * 2, l2) == 2  # fp16 4096x14336 (117 MB): two copies already exceed 150 MB
    assert n_copies(6_300_000, l2) == 25 and 25 * 6_300_000 > 3 * l2  # 3-bit 4096x4096
    assert n_copies(100, l2) == 64  # capped
    # the tuner's copies (qrecover.kernels.timing.tensor_copies): 2x L2, at most 16
    assert n_copies(22_020_096, l2, factor=2, cap=16) == 5 and 5 * 22_020_096 > 2 * l2  # palettize-3 4096x14336
    assert n_copies(100, l2, factor=2, cap=16) == 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the tuner times on CUDA only")
def test_tuner_keeps_the_fastest_cold_time_and_its_copies_read_the_same_buffers(monkeypatch):
    from qrecover.kernels import qmatmul, timing
    from qrecover.kernels.formats import Format

    fmt = Format(0, 3, 256, 1024, 16, 1024, False)
    tensors = {"qdata": torch.randint(0, 255, (256 * 1024 * 3 // 8,), dtype=torch.uint8, device="cuda"),
               "lut": torch.randn(16, 8, device="cuda").half()}
    tensors["lut_alias"] = tensors["lut"]
    sets = timing.tensor_copies(tensors, 1 << 20)
    assert len(sets) == 16 and all(torch.equal(s["qdata"], tensors["qdata"]) for s in sets)
    assert sets[1]["qdata"].data_ptr() != tensors["qdata"].data_ptr() and sets[1]["lut_alias"] is sets[1]["lut"]
    configs = qmatmul.candidate_configs(fmt, 1)[:4]
    times = dict(zip(configs, (3.0, 1.0, 2.0, 4.0)))
    monkeypatch.setattr(qmatmul, "_time", lambda x, f, sets, bias, cfg, cold: times[cfg])
    monkeypatch.setattr(qmatmul, "TUNE_LIMIT", 4)
    monkeypatch.setattr(qmatmul, "_TUNED", {})
    x = torch.randn(1, 1024, device="cuda", dtype=torch.float16)
    assert qmatmul._tune(x, fmt, tensors, None) == configs[1]


def test_tuner_skips_configs_that_do_not_compile_and_names_them():
    """A candidate that runs out of resources is skipped quietly; one whose compile fails otherwise (PTX the
    assembler rejects: the register-table and fp16-pair variants were never compiled on a GPU when written) is
    skipped with a warning naming it; if none compiles, the error says how to run the dense path."""
    from triton.runtime.errors import OutOfResources, PTXASError

    from qrecover.kernels import qmatmul
    from qrecover.kernels.formats import Format

    configs = qmatmul.candidate_configs(Format(0, 3, 256, 1024, 16, 1024, False), 1)[:4]
    errors = {configs[0]: OutOfResources(300, 255, "registers"), configs[1]: PTXASError("Unknown modifier '.f16x3'")}
    times = dict(zip(configs, (1.0, 1.0, 3.0, 2.0)))

    def time_one(cfg):
        if cfg in errors:
            raise errors[cfg]
        return times[cfg]

    with pytest.warns(UserWarning, match=r"did not compile on this GPU.*PTXASError.*f16x3") as seen:
        assert qmatmul._fastest(configs, time_one) == configs[3]
    assert len(seen) == 1 and str(configs[1]) in str(seen[0].message)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="QRECOVER_KERNELS=0"):
        qmatmul._fastest(configs[:2], time_one)


def test_tuner_skips_a_config_whose_result_differs_from_the_reference():
    """A candidate whose output differs from the dequantize-then-matmul path's (a variant miscompiled on this GPU or
    this triton: most of the decode kernel's variants have never run on a GPU) is skipped with a warning naming it,
    however fast it is, and is never timed; rounding-level differences (bf16) pass; if none agrees, the error says how
    to run the dense path."""
    from qrecover.kernels import qmatmul
    from qrecover.kernels.formats import Format

    configs = qmatmul.candidate_configs(Format(0, 3, 256, 1024, 16, 1024, False), 1)[:4]
    ref = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    outputs = {configs[0]: ref.bfloat16(), configs[1]: -ref, configs[2]: torch.full_like(ref, float("nan")),
               configs[3]: ref.half()}
    times = dict(zip(configs, (3.0, 1.0, 0.5, 2.0)))
    timed = []

    def time_one(cfg):
        timed.append(cfg)
        return times[cfg]

    record = {}
    with pytest.warns(UserWarning, match="differs from the reference path") as seen:
        assert qmatmul._fastest(configs, time_one, lambda c: qmatmul._agrees(outputs[c], ref), record) == configs[3]
    assert record == {configs[0]: 3.0, configs[1]: "differs from the reference", configs[2]: "differs from the reference",
                      configs[3]: 2.0}
    # benchmarks/kernels.py prints what the tuner measured of every candidate, the fastest marked
    sys.path.insert(0, str(ROOT))
    from benchmarks.kernels import _candidate_lines, config_label
    row = {"shape": "4096x4096", "format": "palettize-3", "batch": 1,
           "candidates": [[config_label(c), t * 1e-3 if isinstance(t, float) else t] for c, t in record.items()]}
    text = "\n".join(_candidate_lines({"layers": [row]}))
    assert "2.0 us (best)" in text and "3.0 us;" in text and text.count("differs from the reference") == 2
    assert config_label(configs[0]).startswith("gemv 1x") and " asm" in config_label(configs[0])
    assert [str(configs[1]) in str(w.message) for w in seen] == [True, False]
    assert str(configs[2]) in str(seen[1].message) and timed == [configs[0], configs[3]]
    assert not qmatmul._agrees(ref * (1 + 2 * qmatmul.CHECK_TOL), ref)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="agreed with the reference.*QRECOVER_KERNELS=0"):
        qmatmul._fastest(configs[1:3], time_one, lambda c: qmatmul._agrees(outputs[c], ref))
    # the tuner's check: against a finite reference only (an input with NaN or inf leaves nothing to judge by, and the
    # layer must still run), and none without a reference
    assert qmatmul._checker(ref, outputs.get)(configs[3]) and not qmatmul._checker(ref, outputs.get)(configs[1])
    assert qmatmul._checker(outputs[configs[2]], outputs.get) is None and qmatmul._checker(None, outputs.get) is None


def test_fused_linear_gives_the_tuner_its_layers_reference_path(interp, monkeypatch):
    """What the tuner checks its candidates against (on a GPU) is the layer's own reference path, bias included."""
    from kernel_helpers import DEV, make_layer

    from qrecover import kernels
    from qrecover.kernels import reference

    layer = make_layer("palettize", 3, 32, 64)
    x = torch.randn(2, 64, device=DEV)
    seen, real = {}, interp._tune

    def spy(x, fmt, tensors, bias, reference=None):
        seen["ref"] = reference(x)
        return real(x, fmt, tensors, bias, reference)

    monkeypatch.setattr(interp, "_tune", spy)
    monkeypatch.setattr(interp, "_TUNED", {})
    y = kernels.fused_linear(layer, x)
    assert torch.equal(seen["ref"], reference.linear(layer, x)) and layer.bias is not None
    assert float((y - seen["ref"]).norm() / seen["ref"].norm()) < 1e-5


def test_dry_run_builds_every_quick_case(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "benchmarks/kernels.py", "--dry-run", "--quick", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "Dry run, no kernel ran" in proc.stdout and "18 cases built" in proc.stdout
    result = json.loads((tmp_path / "kernels-cpu-layers-quick-dry-run.json").read_text())
    rows = result["layers"]
    assert {(r["shape"], r["format"], r["batch"]) for r in rows} == {
        (s, f, b) for s in ("4096x14336", "14336x4096", "4096x4096") for f in ("palettize-3", "palettize-4", "blockwise-4-b64")
        for b in (1, 16)}
    for r in rows:
        out_f, in_f = map(int, r["shape"].split("x"))
        bits = 3 if r["format"] == "palettize-3" else 4
        assert r["packed_bytes"] >= out_f * in_f * bits // 8
        if r["format"].startswith("palettize"):  # (out/16) whole-row tables, each as fp32 pairs and fp32 singles,
            n = 1 << bits  # and as register-table byte planes (2 bytes per entry, as stored)
            assert r["repack_MB"] * 1e6 == pytest.approx(out_f // 16 * (n * n * 8 + n * 4 + n * 2))
        if r["format"] == "palettize-3":  # nibble codes (made only where the tuner picks them): as many bytes as the codes
            assert r["nibble_MB"] * 1e6 == pytest.approx(out_f * in_f * 3 / 8)
        else:
            assert "nibble_MB" not in r
        if r["format"] == "blockwise-4-b64":  # torch's int4 layout: codes + (K/64, N, 2) bf16 scales and zeros
            assert r["int4_MB"] * 1e6 == pytest.approx(out_f * in_f // 2 + in_f // 64 * out_f * 2 * 2)
        else:
            assert "int4_MB" not in r


def test_decode_part_runs_a_whole_compressed_model_through_the_kernels(tmp_path):
    """``--device cpu --interpret --parts decode``: a toy Llama compressed whole to 3.7 bpw (its tied embedding 4-bit)
    decodes greedily with every linear layer and the tied head through the interpreted kernels, the same tokens as the
    reference path; the row counts the weight bytes a token reads, packed and as fp16."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/kernels.py", "--device", "cpu", "--interpret", "--parts", "decode",
                           "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    d = json.loads((tmp_path / "kernels-cpu-decode.json").read_text())["decode"]
    assert d["head"].startswith("packed") and d["kernel_layers"] == "14/14"
    assert d["greedy_tokens_match"] == 1.0 and d["prompt_logits_rel_err"] < 1e-5
    assert d["measured_bpw"]["model"] <= 3.7
    # the head (512 x 64) packed at 4.625 bits, the linears at about 3.2: over 3.5x fewer bytes than fp16
    assert d["bandwidth_bound_vs_fp16"] == pytest.approx(d["weight_mb_per_token_fp16"] / d["weight_mb_per_token"])
    assert d["bandwidth_bound_vs_fp16"] > 3.5


def test_tune_off_leaves_out_the_named_variant_kinds(monkeypatch):
    """``QRECOVER_TUNE_OFF``: the tuner leaves out the kinds of kernel variant it names (to measure around one that
    faults on a GPU); an unknown kind, or a list that leaves nothing, is an error naming the value."""
    from qrecover.kernels import gemv, qmatmul
    from qrecover.kernels.formats import Format

    fmt = Format(0, 3, 4096, 14336, 16, 14336, False)
    configs = qmatmul.candidate_configs(fmt, 1, fp16=True)
    seen = set().union(*(qmatmul.variant_kinds(c, fmt) for c in configs))
    assert {"pipe", "serial", "asm", "regs", "h2", "nibbles"} <= seen
    kept = qmatmul.without_variants(configs, fmt, {"QRECOVER_TUNE_OFF": "pipe, serial,regs"})
    assert kept and all(not c.pipe and not c.serial and c.lut < gemv.LUT_REGS for c in kept)
    assert kept[0] == configs[0] and qmatmul.without_variants(configs, fmt, {}) == configs
    blockwise = Format(1, 4, 4096, 14336, 1, 64, False)
    assert all(c.lut != gemv.BLOCKWISE_H2 for c in qmatmul.without_variants(
        qmatmul.candidate_configs(blockwise, 1, fp16=True), blockwise, {"QRECOVER_TUNE_OFF": "h2"}))
    with pytest.raises(ValueError, match="unknown kinds \\['pipes'\\]; choose from pipe, serial"):
        qmatmul.without_variants(configs, fmt, {"QRECOVER_TUNE_OFF": "pipes"})
    with pytest.raises(ValueError, match="leaves no kernel config.*QRECOVER_KERNELS=0"):
        qmatmul.without_variants(configs[:1], fmt, {"QRECOVER_TUNE_OFF": "asm"})


def test_tune_limit_and_compile_threads_read_the_environment():
    """``QRECOVER_TUNE_LIMIT``: how many candidates the tuner times per layer kind (default 16 of up to 75; ``all``);
    ``QRECOVER_COMPILE_THREADS``: how many compile ahead at once (default one per core, at most 16). A bad value is an
    error naming it."""
    from qrecover.kernels import qmatmul
    from qrecover.kernels.formats import Format

    assert qmatmul.tune_limit({}) == qmatmul.TUNE_LIMIT == 16
    assert len(qmatmul.candidate_configs(Format(0, 3, 4096, 14336, 16, 14336, False), 1, fp16=True)) > 16
    for fmt in (Format(0, 3, 4096, 14336, 16, 14336, False), Format(1, 4, 4096, 14336, 1, 64, False)):
        for batch in (1, 2, 4, 16, 32, 64):  # the first 16 hold every variant kind the list offers
            configs = qmatmul.candidate_configs(fmt, batch, fp16=True)
            kinds = [qmatmul.variant_kinds(c, fmt) for c in configs]
            assert set().union(*kinds[:qmatmul.TUNE_LIMIT]) == set().union(*kinds), (fmt, batch)
    assert qmatmul.tune_limit({"QRECOVER_TUNE_LIMIT": " all "}) is None
    assert qmatmul.tune_limit({"QRECOVER_TUNE_LIMIT": "6"}) == 6
    for bad in ("0", "-3", "six"):
        with pytest.raises(ValueError, match=f"QRECOVER_TUNE_LIMIT='{bad}': give a positive number.*or 'all'"):
            qmatmul.tune_limit({"QRECOVER_TUNE_LIMIT": bad})
    assert qmatmul.compile_threads({}) == max(1, min(16, os.cpu_count() or 1))
    assert qmatmul.compile_threads({"QRECOVER_COMPILE_THREADS": "3"}) == 3
    with pytest.raises(ValueError, match="QRECOVER_COMPILE_THREADS='0': give a positive number of threads"):
        qmatmul.compile_threads({"QRECOVER_COMPILE_THREADS": "0"})


def test_compile_ahead_warms_every_candidate_inside_triton_async_compile_mode():
    """Each candidate's launch runs once with ``warmup=True`` while triton's ``AsyncCompileMode`` is active (so its
    compilation goes to the thread pool); a candidate whose warm-up raises is left to the timing loop; with one
    thread, or one candidate, nothing is compiled ahead; a failure of the step itself is one warning, never an
    error."""
    from concurrent.futures import ThreadPoolExecutor

    import triton
    from triton.runtime import _async_compile

    from qrecover.kernels import qmatmul
    from qrecover.kernels.formats import Format

    configs = qmatmul.candidate_configs(Format(0, 3, 4096, 14336, 16, 14336, False), 1, fp16=True)[:5]
    warmed = []

    def warm(cfg):
        assert _async_compile.active_mode.get() is not None
        warmed.append(cfg)
        if cfg is configs[1]:
            raise ValueError("a split this kernel refuses")

    qmatmul.compile_ahead(configs, warm, threads=4)
    assert warmed == configs and _async_compile.active_mode.get() is None
    warmed.clear()
    qmatmul.compile_ahead(configs, warm, threads=1)
    qmatmul.compile_ahead(configs[:1], warm, threads=4)
    assert warmed == []
    with ThreadPoolExecutor(1) as pool, triton.AsyncCompileMode(pool):  # one already active: triton refuses a second
        with pytest.warns(UserWarning, match="compiling the kernel candidates ahead failed.*each compiles when it is"):
            qmatmul.compile_ahead(configs, warm, threads=4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles for the GPU")
def test_compile_ahead_leaves_nothing_for_the_timing_loop_to_compile():
    """On a GPU: after :func:`compile_ahead` with 4 threads, launching each candidate compiles nothing more (triton's
    in-memory kernel caches do not grow), and every launch gives the reference path's output."""
    from qrecover.kernels import gemv, qmatmul, qmm_dot
    from qrecover.kernels.formats import Format

    fmt = Format(0, 3, 512, 2048, 16, 2048, False)
    g = torch.Generator(device="cuda").manual_seed(0)
    tensors = {"qdata": torch.randint(0, 255, (512 * 2048 * 3 // 8,), dtype=torch.uint8, device="cuda", generator=g),
               "lut": torch.randn(32, 8, device="cuda", generator=g).half()}
    kernels = (gemv._gemv_kernel, qmm_dot._dot_decode_kernel, qmatmul._qmm_kernel, qmatmul._splitk_reduce)

    def cached():
        return sum(len(cache[0]) for k in kernels for cache in k.device_caches.values())

    for batch in (1, 16):
        x = torch.randn(batch, 2048, device="cuda", dtype=torch.float16, generator=g)
        configs = qmatmul.candidate_configs(fmt, batch, fp16=True)[:8]
        before = cached()
        qmatmul.compile_ahead(configs, lambda cfg: qmatmul._launch(x, fmt, tensors, None, cfg, warmup=True), threads=4)
        after = cached()
        assert after > before
        ref = torch.nn.functional.linear(x, _dequantized(fmt, tensors).half())
        for cfg in configs:
            assert qmatmul._agrees(qmatmul._launch(x, fmt, tensors, None, cfg), ref), cfg
        assert cached() == after


def _dequantized(fmt, tensors) -> torch.Tensor:
    """The dense fp32 weight of a palettize layer's packed tensors (per 16 rows, whole-row tables)."""
    from qrecover import packing

    codes = packing.unpack(tensors["qdata"].cpu(), fmt.bits, fmt.out_f * fmt.in_f).long().view(fmt.out_f, fmt.in_f)
    lut = tensors["lut"].cpu().float()
    return lut[torch.arange(fmt.out_f).unsqueeze(1) // fmt.group, codes].to("cuda")


def test_compile_ahead_compiles_the_real_kernels_for_sm90_without_a_gpu():
    """``benchmarks/tuner_compile.py``: with a driver that only answers what a compilation asks (sm_90), the tuner's
    warm-up launches compile its candidates in threads through triton's ``AsyncCompileMode``, and warming them again
    compiles nothing more: what the timing loop finds on a GPU."""
    from benchmarks.tuner_compile import run_one

    r = run_one(threads=2, batch=1, candidates=4, out_f=64, in_f=1024)
    assert r["candidates"] == 4 and r["kernels"] >= 4 and r["compiled_again"] == 0 and r["failed"] == [], r


def test_every_training_and_serving_kernel_compiles_for_sm90_through_its_launch():
    """``benchmarks/launch_compile.py``: Liger's fused layers (forward and backward), the distillation loss, the
    multi-adapter shrink and expand and r4's rotation, each called as qrecover calls it, compile for sm_90 (only the
    launch fails, no GPU)."""
    pytest.importorskip("liger_kernel")
    from benchmarks.launch_compile import check

    r = check("bfloat16")
    assert len(r["rows"]) == 12 and all(row["compiled"] for row in r["rows"]), r

"""The tuner's first use on the CPU: its candidates compiled for sm_90 one after another and in threads, same kernels.

On a GPU the tuner compiles each candidate launch configuration before timing it
(:func:`qrecover.kernels.qmatmul.compile_ahead`: triton's ``AsyncCompileMode``, one thread per core up to 16). The
compilation runs on the CPU, so it can be measured here: triton's JIT is given a driver that only answers what a
compilation asks (target sm_90, device 0; nothing can be launched), and each candidate's launch runs with
``warmup=True``, as the tuner does. Every run uses a fresh triton cache, and checks that warming the candidates again
compiles nothing more (what the timing loop will find on a GPU).

    python benchmarks/tuner_compile.py                      # palettize-3 14336 inputs, batch 1 and 16, 1 and 2 threads
    python benchmarks/tuner_compile.py --threads 1,4 --candidates 8 --batches 1
    python benchmarks/tuner_compile.py --every-candidate    # a check, not a timing: every candidate the tuner would
        # time (its first 16) of palettize-3/4 and blockwise-4 b64 at 4096 and 14336 inputs, and of palettize 2/8-bit,
        # palettize 3/4-bit with block tables and blockwise 2/3/4/8-bit (zero points, blocks 32-128) at 2048 inputs,
        # batch 1-64, fp16 and bf16, compiled for sm_90 through its real launch; lists any that fail (17 min on 2
        # cores with triton 3.6; --quick-formats: the first six, ~7 min)

Each configuration runs in a process of its own (triton's in-memory caches, and TRITON_INTERPRET, are per process).
Run it on an otherwise idle machine: the threads compete with anything else for the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: the start of each child: triton's JIT given a driver that answers only what a compilation asks (sm_90, device 0)
DRIVER = r"""
import json, os, sys, time
import torch, triton
from triton.backends.compiler import GPUTarget


class CompileOnlyDriver:
    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


triton.runtime.driver.set_active(CompileOnlyDriver())
"""

_CHILD = DRIVER + r"""
from qrecover.kernels import gemv, qmatmul, qmm_dot
from qrecover.kernels.formats import Format

threads, batch, n, out_f, in_f = (int(v) for v in sys.argv[1:6])
fmt = Format(0, 3, out_f, in_f, 16, in_f, False)
g = torch.Generator().manual_seed(0)
tensors = {"qdata": torch.randint(0, 255, (out_f * in_f * 3 // 8,), dtype=torch.uint8, generator=g),
           "lut": torch.randn(out_f // 16, 8, generator=g).half()}
x = torch.randn(batch, in_f, dtype=torch.float16, generator=g)
configs = qmatmul.without_variants(qmatmul.candidate_configs(fmt, batch, fp16=True), fmt)[:n]
kernels = (gemv._gemv_kernel, qmm_dot._dot_decode_kernel, qmatmul._qmm_kernel, qmatmul._splitk_reduce)


def cached():
    return sum(len(c[0]) for k in kernels for c in k.device_caches.values())


def warm(cfg):
    qmatmul._launch(x, fmt, tensors, None, cfg, warmup=True)


failed = []
t = time.perf_counter()
if threads > 1:
    qmatmul.compile_ahead(configs, warm, threads)
else:
    for cfg in configs:
        try:
            warm(cfg)
        except Exception as e:
            failed.append(f"{type(e).__name__}: {str(e)[:120]}")
seconds = time.perf_counter() - t
compiled = cached()
for cfg in configs:
    try:
        warm(cfg)
    except Exception as e:
        failed.append(f"{type(e).__name__}: {str(e)[:120]}")
print(json.dumps({"threads": threads, "batch": batch, "candidates": len(configs), "kernels": compiled,
                  "seconds": seconds, "compiled_again": cached() - compiled, "failed": failed,
                  "triton": triton.__version__}))
"""


_EVERY = DRIVER + r"""
import json, sys
import torch
from qrecover.kernels import gemv, qmatmul
from qrecover.kernels.formats import BLOCKWISE, PALETTIZE, Format
from qrecover.packing import packed_nbytes

cases = [(PALETTIZE, bits, None, False, in_f) for bits in (3, 4) for in_f in (14336, 4096)]  # the --quick table's
cases += [(BLOCKWISE, 4, 64, False, in_f) for in_f in (14336, 4096)]
cases += [(PALETTIZE, 2, None, False, 2048), (PALETTIZE, 8, None, False, 2048),  # the other stored formats, at a
          (PALETTIZE, 3, 256, False, 2048), (PALETTIZE, 4, 256, False, 2048),      # 1B Llama's hidden width
          (BLOCKWISE, 4, 32, True, 2048), (BLOCKWISE, 3, 128, True, 2048), (BLOCKWISE, 2, 64, True, 2048),
          (BLOCKWISE, 8, 128, False, 2048)]
if len(sys.argv) > 1 and sys.argv[1] == "quick":
    cases = cases[:6]
limit, failed, warmed = qmatmul.tune_limit(), [], 0
g = torch.Generator().manual_seed(0)
for scheme, bits, block, zp, in_f in cases:
    out_f, cblock = 512, block or in_f
    fmt = Format(scheme, bits, out_f, in_f, 16 if scheme == PALETTIZE else 1, cblock, zp)
    tensors = {"qdata": torch.randint(0, 256, (packed_nbytes(out_f * in_f, bits),), dtype=torch.uint8, generator=g)}
    if scheme == PALETTIZE:
        tensors["lut"] = torch.randn(out_f // 16 * (in_f // cblock), 2**bits, generator=g).half()
    else:
        tensors["scale"] = torch.rand(out_f, in_f // cblock, generator=g).half()
        if zp:
            tensors["zero_point"] = torch.randint(0, 256, (packed_nbytes(out_f * in_f // cblock, bits),),
                                                  dtype=torch.uint8, generator=g)
    for batch in (1, 2, 4, 16, 32, 64):
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(batch, in_f, dtype=dtype, generator=g)
            configs = qmatmul.candidate_configs(fmt, batch, False, dtype == torch.float16)
            if not gemv.fp16_chains_allowed(x):
                configs = [c for c in configs if c.use_dot or c.lut not in gemv.H2_MODES]
            for cfg in configs[:limit]:
                warmed += 1
                try:
                    qmatmul._launch(x, fmt, tensors, None, cfg, warmup=True)
                except Exception as e:
                    failed.append([str(fmt), batch, str(dtype), str(cfg), f"{type(e).__name__}: {str(e)[:300]}"])
    print(f"{fmt}: {len(failed)} failures so far", file=sys.stderr, flush=True)
print(json.dumps({"warmed": warmed, "failed": failed}))
"""


def child_env(cache: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=cache, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TRITON_DEFAULT_FP_FUSION="1")
    return env


def every_candidate(quick: bool = False) -> dict:
    """Warm (compile) every candidate the tuner would time at the cases above (``quick``: the --quick table's formats
    only), one process, a fresh cache."""
    with tempfile.TemporaryDirectory() as cache:
        proc = subprocess.run([sys.executable, "-c", _EVERY, "quick" if quick else "all"], env=child_env(cache),
                              stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the check failed to run (exit {proc.returncode})")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_one(threads: int, batch: int, candidates: int, out_f: int, in_f: int) -> dict:
    """One configuration in a fresh process with a fresh triton cache (compiled kernels are cached on disk)."""
    with tempfile.TemporaryDirectory() as cache:
        proc = subprocess.run([sys.executable, "-c", _CHILD, str(threads), str(batch), str(candidates), str(out_f),
                               str(in_f)], env=child_env(cache), capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the compile run failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", default="1,2", help="comma-separated thread counts (1: one after another)")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--candidates", type=int, default=16, help="the tuner's first N candidates (its default limit: 16)")
    ap.add_argument("--shape", default="512x14336", help="out x in (palettize-3; the input width is what the kernels "
                                                        "specialize on; the rows only cost the host-side repacks)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "tuner_compile.json"))
    ap.add_argument("--every-candidate", action="store_true", help="check that every candidate the tuner would time "
                    "compiles for sm_90 (no timing); exit 1 if any fails")
    ap.add_argument("--quick-formats", action="store_true", help="with --every-candidate: the --quick table's formats only")
    args = ap.parse_args(argv)
    if args.every_candidate:
        t0 = time.perf_counter()
        r = every_candidate(args.quick_formats)
        for f in r["failed"]:
            print("FAILED:", *f)
        print(f"{r['warmed']} candidate launches compiled for sm_90 in {time.perf_counter() - t0:.0f} s, "
              f"{len(r['failed'])} failed")
        return 1 if r["failed"] else 0
    out_f, in_f = (int(v) for v in args.shape.lower().split("x"))
    rows = []
    print("| batch | threads | candidates | kernels compiled | seconds | vs 1 thread | compiled again |")
    print("|---|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        base = None
        for threads in (int(t) for t in args.threads.split(",")):
            t0 = time.perf_counter()
            r = run_one(threads, batch, args.candidates, out_f, in_f)
            r["wall_s"] = time.perf_counter() - t0
            base = r["seconds"] if base is None else base
            rows.append(r)
            print(f"| {batch} | {threads} | {r['candidates']} | {r['kernels']} | {r['seconds']:.1f} | "
                  f"{base / r['seconds']:.2f}x | {r['compiled_again']} |", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"shape": args.shape, "cpus": os.cpu_count(), "rows": rows}, indent=1))
    tmp.replace(out)
    print(f"wrote {out} (triton {rows[0]['triton']}, {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

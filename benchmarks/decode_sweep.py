"""Batch-1 decode kernel: every launch configuration of a grid, timed L2-cold, beside fp16 in the same run (issue 24).

The tuner (``qrecover.kernels.qmatmul._tune``) times a short candidate list with ``triton.testing.do_bench``;
``benchmarks/kernels.py --quick`` times only its first 6. This sweep asks what the kernel can do at all on one
shape: tile shapes x warps x inline-PTX loads x table layouts x word pipelining (``Config.pipe``), each at split-K 1-64, every call reading another
copy of the weights inside one CUDA graph (``kernel_timing.cold_ms``, the protocol of ``kernels.py``), and prints
the fastest configurations per format against fp16, with the tuner's own pick for comparison. GPU only:

    python benchmarks/decode_sweep.py --budget-s 90                 # 4096x14336, the three quick formats
    python benchmarks/decode_sweep.py --shape 4096x4096 --formats palettize-3

Compilation dominates (each tile/warps/asm/layout variant is one triton compile; split-K is a runtime value), so
the sweep stops starting new variants after ``--budget-s`` and prints what it has.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kernel_timing import cold_ms, l2_bytes, n_copies  # noqa: E402
from benchmarks.kernels import random_layer  # noqa: E402
from qrecover import kernels  # noqa: E402
from qrecover.io_utils import write_text_atomic  # noqa: E402

TILES = ((64, 128), (128, 256), (32, 128), (32, 256), (128, 128), (16, 256), (64, 256),
         (64, 64), (128, 64), (256, 64), (32, 64))  # block_k 64: blockwise B=64
SPLITS = (1, 2, 4, 8, 16, 32, 64)


def variants(fmt, gemv) -> list:
    """(block_n, block_k, warps, asm, lut, pipe) variants, the likeliest first (each pipelined one after its twin)."""
    from qrecover.kernels import qmatmul
    from qrecover.kernels.formats import Config

    modes = gemv.table_modes(fmt) if fmt.scheme == 0 else ((gemv.BLOCKWISE_H2, -1) if fmt.bits == 4 else (-1,))
    out = []
    for bn, bk in TILES:
        if fmt.cblock % bk:
            continue
        for warps in (4, 8, 2):
            if bn * bk // (32 * warps) < 16 and warps > 2:  # fewer than 16 weights per thread: warps idle
                continue
            for asm in (True, False):  # inline PTX reads code words of every width (and fp32/pair tables)
                for lut in modes:
                    if (lut in gemv.register_modes(fmt) or lut in gemv.H2_MODES) and not asm:  # the interpreter's stand-in
                        continue
                    out.append(Config(1, bn, bk, 1, False, warps, 2, asm, lut))
                    if asm:  # its twin with the code words through triton's pipeliner (Config.pipe; reads them plainly)
                        out.append(Config(1, bn, bk, 1, False, warps, 2, asm, lut, pipe=qmatmul.PIPE_STAGES))
    # 4 warps and asm first; on the first three tiles every register-table mode (never timed before: nibble codes and
    # fp16 pair FMAs first) and the default table layout (the 2026-11-27 sweep's best), then the other tiles, then the rest
    order = [m for m in (gemv.LUT_REGS_NIBBLES_H2, gemv.LUT_REGS_NIBBLES, gemv.LUT_REGS_H2, gemv.LUT_REGS)
             if m in gemv.register_modes(fmt) or (fmt.scheme == 1 and m in modes)] + [-1, modes[0]]

    def rank(c):
        return order.index(c.lut) if c.lut in order else len(order)
    return sorted(out, key=lambda c: (c.num_warps != 4, not c.asm, rank(c) == len(order),
                                      TILES.index((c.block_n, c.block_k)) >= 3, rank(c)))


def sweep(name: str, out_f: int, in_f: int, budget_s: float, t_end: float) -> dict:
    from qrecover.kernels import gemv, qmatmul

    layer = random_layer(name, out_f, in_f, "cuda")
    fmt = kernels.layer_format(layer)
    l2 = l2_bytes()
    x = torch.randn(1, in_f, device="cuda", dtype=torch.float16)
    w16 = layer.dequantize(torch.float16)
    fp16 = [w16] + [w16.clone() for _ in range(n_copies(w16.numel() * 2, l2) - 1)]
    t_fp16 = cold_ms([lambda w=w: torch.matmul(x, w.T) for w in fp16])
    del fp16
    layers = [layer] + [copy.deepcopy(layer) for _ in range(n_copies(layer.nbytes, l2) - 1)]
    tensors = [kernels.kernel_tensors(m, fmt) for m in layers]
    if gemv.register_modes(fmt):  # nibble codes for the LUT_REGS_NIBBLES variants, made once per copy (not timed)
        tensors = [{**t, "qdata_nibbles": gemv.nibble_codes(fmt, qmatmul.code_words(t["qdata"]))} for t in tensors]
    ref = torch.matmul(x.float(), w16.float().T)
    qmatmul._TUNED.clear()
    qmatmul.TUNE_LIMIT = 6  # what kernels.py --quick times
    with torch.no_grad():
        kernels.fused_linear(layer, x)
    tuner = next(c for k, c in qmatmul._TUNED.items() if k[0] == fmt)
    rows, t0 = [], time.time()
    bases, threads = variants(fmt, gemv), qmatmul.compile_threads()
    chunk = 4 * threads  # compiled ahead a chunk at a time, in parallel (split-K 1 and >1 compile apart; the budget holds)
    for i, base in enumerate(bases):
        if time.time() > min(t0 + budget_s, t_end):
            break
        if i % chunk == 0:
            ahead = [dataclasses.replace(b, split_k=s) for b in bases[i:i + chunk] for s in (1, 2) if b.block_k * s <= in_f]
            qmatmul.compile_ahead(ahead, lambda cfg: qmatmul._launch(x, fmt, tensors[0], layer.bias, cfg, warmup=True),
                                  threads)
        for s in SPLITS:
            if base.block_k * s > in_f:
                continue
            cfg = dataclasses.replace(base, split_k=s)
            try:
                y = qmatmul.quant_matmul(x, fmt, tensors[0], layer.bias, cfg)
                err = float((y.float() - ref).norm() / ref.norm())
                ms = cold_ms([lambda t=t: qmatmul.quant_matmul(x, fmt, t, None, cfg) for t in tensors], min_calls=100,
                             replays=3)
            except Exception as e:  # out of resources, a compile failure: recorded, the sweep goes on
                rows.append({"config": str(cfg), "error": f"{type(e).__name__}: {str(e)[:120]}"})
                break
            rows.append({"config": str(cfg), "ms": ms, "speedup_vs_fp16": t_fp16 / ms, "rel_err": err,
                         "GBps": layer.nbytes / (ms * 1e-3) / 1e9})
    t_tuner = cold_ms([lambda t=t: qmatmul.quant_matmul(x, fmt, t, None, tuner) for t in tensors], min_calls=100, replays=3)
    return {"format": name, "shape": f"{out_f}x{in_f}", "packed_MB": layer.nbytes / 1e6, "ms_fp16_cold": t_fp16,
            "tuner_config": str(tuner), "ms_tuner_cold": t_tuner, "rows": rows, "sweep_s": time.time() - t0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="4096x14336", help="out x in")
    ap.add_argument("--formats", default="palettize-3,palettize-4,blockwise-4-b64")
    ap.add_argument("--budget-s", type=float, default=90, help="stop starting new variants after this many seconds in all")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_sweep.py times GPU kernels: no CUDA device here (the CPU-side measure is "
                 "`python -m qrecover.kernels.compile_check --isa`)")
    out_f, in_f = (int(v) for v in args.shape.lower().split("x"))
    names = args.formats.split(",")
    t_end = time.time() + args.budget_s
    results = []
    for i, name in enumerate(names):
        share = (t_end - time.time()) / (len(names) - i)
        r = sweep(name, out_f, in_f, share, t_end)
        results.append(r)
        ok = sorted((x for x in r["rows"] if "ms" in x), key=lambda x: x["ms"])
        print(f"\n{name} {r['shape']} batch 1, L2-cold: fp16 {r['ms_fp16_cold'] * 1e3:.1f} us; tuner's pick "
              f"{r['ms_tuner_cold'] * 1e3:.1f} us ({r['ms_fp16_cold'] / r['ms_tuner_cold']:.2f}x) {r['tuner_config']}; "
              f"{len(ok)} configs in {r['sweep_s']:.0f} s", flush=True)
        print("| config | us | vs fp16 | GB/s of packed weights | rel. err |\n|---|---|---|---|---|")
        for x in ok[:args.top]:
            print(f"| {x['config']} | {x['ms'] * 1e3:.1f} | {x['speedup_vs_fp16']:.2f}x | {x['GBps']:,.0f} | {x['rel_err']:.1e} |")
        for x in r["rows"]:
            if "error" in x:
                print(f"  failed: {x['config']}: {x['error']}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out / "decode_sweep.json", json.dumps({"device": torch.cuda.get_device_name(), "results": results}, indent=2))


if __name__ == "__main__":
    main()

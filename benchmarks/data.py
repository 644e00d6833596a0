"""Prepared data: how fast ``qrecover data prepare`` tokenizes, and how fast the trainer's loader reads the shards.

    OMP_NUM_THREADS=1 python benchmarks/data.py                       # the default mix, 1 worker, 8 x 2048 batches
    python benchmarks/data.py --workers 8 --world 8 --steps 200       # on a machine with the cores

- **prepare**: ``prepare_data`` on the mix (default: the shipped mix without its self-generated sources, whose
  cost is the teacher's generation, not tokenization; ``--with-selfgen`` keeps them), with and without
  decontamination, ``--workers`` processes; tokens/s and tokens/s per worker process. The tokenizer and the
  decontamination index are loaded first (cached, not timed).
- **loader**: :class:`qrecover.data.shards.ShardLoader` ``.batches(batch, rank, world)`` exactly as the
  trainer calls it, ``--steps`` micro-batches of ``batch x seq_len`` per rank (torch int64 tensors ready for
  ``.to(device)``), for 1 rank and for each of ``--world`` ranks' slices (one after another in this process;
  each rank reads only its own sequences). Shards are in the page cache (just written).
- **target**: the loader must feed at least 20x what one H100 consumes training a 1B-parameter model with
  distillation: ``6 N`` FLOPs per token for the student (forward + backward) plus ``2 N`` for the teacher's
  forward, at 40% MFU of the H100's 989 TFLOP/s dense bf16.

Prints a Markdown table; writes benchmarks/out/data.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qrecover.data.decontam import build_index  # noqa: E402
from qrecover.data.mix_recipe import Mix, load_mix  # noqa: E402
from qrecover.data.prepare import load_tokenizer, prepare_data  # noqa: E402
from qrecover.data.shards import ShardLoader  # noqa: E402
from qrecover.io_utils import write_text_atomic  # noqa: E402
from qrecover.recipes import DEFAULT_MIX, shipped_path  # noqa: E402

PARAMS = 1e9
FLOPS_PER_TOKEN = 6 * PARAMS + 2 * PARAMS  # student forward+backward, teacher forward
H100_BF16 = 989e12
MFU = 0.40
CONSUMED = MFU * H100_BF16 / FLOPS_PER_TOKEN  # tokens/s one H100 trains on
TARGET = 20 * CONSUMED


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the prepare workers)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def time_loader(data: Path, tok, seq_len: int, batch: int, world: int, steps: int, seed: int = 0) -> dict:
    """Per rank: seconds to build the loader and to read ``steps`` micro-batches of its slice."""
    ranks = []
    for rank in range(world):
        t0 = time.perf_counter()
        loader = ShardLoader(data, tok, seq_len=seq_len, total_tokens=steps * batch * world * seq_len, seed=seed)
        t1 = time.perf_counter()
        n = 0
        for ids, labels in loader.batches(batch, rank, world):
            n += ids.numel()
            assert ids.shape == labels.shape == (batch, seq_len)
        t2 = time.perf_counter()
        ranks.append({"rank": rank, "setup_s": t1 - t0, "seconds": t2 - t1, "tokens": n, "tok_per_s": n / (t2 - t1)})
    slowest = min(r["tok_per_s"] for r in ranks)
    return {"world": world, "batch": batch, "seq_len": seq_len, "steps": steps, "ranks": ranks,
            "tok_per_s_slowest_rank": slowest, "tok_per_s_all_ranks_one_core": sum(r["tokens"] for r in ranks) / sum(r["seconds"] for r in ranks)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mix", default=str(shipped_path(DEFAULT_MIX)), help="data-mix TOML (default: the shipped mix)")
    ap.add_argument("--with-selfgen", action="store_true", help="keep self-generated sources (generates them on a cache miss)")
    ap.add_argument("--model", default=None, help="tokenizer's model (default: the built-in SmolLM2-135M)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--steps", type=int, default=64, help="micro-batches per rank")
    ap.add_argument("--no-decontaminate-row", action="store_true", help="skip the prepare row without decontamination")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "data.json"))
    args = ap.parse_args()

    mix = load_mix(args.mix)
    dropped = [s.name for s in mix.sources if s.kind == "selfgen" and not args.with_selfgen]
    mix = Mix([s for s in mix.sources if s.name not in dropped], mix.description, mix.base_dir)
    tok, _ = load_tokenizer(args.model)
    index = build_index()  # cached after the first run; not timed
    rows, results = [], {"mix": args.mix, "sources": [s.name for s in mix.sources], "dropped_selfgen": dropped,
                         "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                                     "omp_threads": os.environ.get("OMP_NUM_THREADS")}}
    with tempfile.TemporaryDirectory(prefix="qrecover-data-bench-") as tmp:
        prep = []
        for decontam in ([True] if args.no_decontaminate_row else [True, False]):
            out = Path(tmp) / f"prep-{int(decontam)}"
            t0, c0 = time.perf_counter(), _cpu()
            m = prepare_data(mix, out, workers=args.workers, tokenizer=tok, exclude=index if decontam else None,
                             decontaminate=False, show_progress=False)
            dt, cpu = time.perf_counter() - t0, _cpu() - c0
            tokens = m["totals"]["tokens"]
            prep.append({"decontaminate": decontam, "workers": args.workers, "tokens": tokens, "documents": m["totals"]["documents"],
                         "seconds": dt, "cpu_seconds": cpu, "tok_per_s": tokens / dt, "tok_per_s_per_worker": tokens / dt / args.workers,
                         "tok_per_cpu_s": tokens / cpu,
                         "bytes": sum(f["bytes"] for s in m["sources"] for sh in s["shards"] for f in (sh["tokens"], sh["mask"]))})
            rows.append(f"| prepare, decontamination {'on' if decontam else 'off'}, {args.workers} worker(s) | {tokens:,} tokens, "
                        f"{m['totals']['documents']:,} documents | {dt:.1f} s ({cpu:.1f} CPU s) | {tokens / dt:,.0f} | "
                        f"{tokens / dt / args.workers:,.0f} per worker; {tokens / cpu:,.0f} per CPU second |")
        results["prepare"] = prep
        data = Path(tmp) / "prep-1"
        results["loader"] = []
        for world in sorted({1, args.world}):
            r = time_loader(data, tok, args.seq_len, args.batch, world, args.steps)
            results["loader"].append(r)
            tokens = sum(x["tokens"] for x in r["ranks"])
            rows.append(f"| loader, {world} rank(s), batch {args.batch} x {args.seq_len} | {tokens:,} tokens "
                        f"({args.steps} micro-batches per rank) | {sum(x['seconds'] for x in r['ranks']):.2f} s | "
                        f"{r['tok_per_s_slowest_rank']:,.0f} (slowest rank) | "
                        f"{r['tok_per_s_slowest_rank'] / CONSUMED:.0f}x one H100's consumption (target 20x) |")
    results["target"] = {"params": PARAMS, "flops_per_token": FLOPS_PER_TOKEN, "h100_bf16_flops": H100_BF16, "mfu": MFU,
                         "consumed_tok_per_s": CONSUMED, "target_tok_per_s": TARGET,
                         "met": all(r["tok_per_s_slowest_rank"] >= TARGET for r in results["loader"])}
    print("| what | data | time | tokens/s | note |\n|---|---|---:|---:|---|")
    print("\n".join(rows))
    print(f"\nTarget: a 1B model with distillation needs (6 + 2) x 1e9 = 8e9 FLOPs per token; one H100 at 40% MFU of 989 TFLOP/s "
          f"trains on {MFU * H100_BF16:.4g} / 8e9 = {CONSUMED:,.0f} tokens/s; 20x that = {TARGET:,.0f} tokens/s per rank. "
          f"{'Met' if results['target']['met'] else 'NOT met'} by every loader row (slowest rank).")
    if dropped:
        print(f"Left out (self-generated; their cost is the teacher's generation): {', '.join(dropped)}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out, json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()

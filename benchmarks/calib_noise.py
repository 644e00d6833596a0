"""How much a compressed checkpoint's held-out quality moves with its calibration sample, and whether a change of
settings moves it by more than that: each configuration compressed on several disjoint calibration draws, every
checkpoint scored on the held-out domains of ``benchmarks/heldout.py``, and each configuration compared with the
first draw by draw (paired: the same calibration text on both sides).

Draw 0 is the shipped calibration (the Python docs' ``calib`` split). Draw k >= 1 is a directory of links to Python
docs of the ``train`` split (every (draws-1)-th document in hash order, from the (k-1)-th), named so that each falls
in a text source's ``calib`` split (qrecover.data.corpus): disjoint from each other, from draw 0 and from the
``eval`` split the python-docs column scores.

    python benchmarks/calib_noise.py --draws 4 --config quick="--encodings quick" \\
        --config grad16="--encodings quick --grad-samples 16" --out reports/calib-noise.md

Compress runs as ``qrecover compress --bpw 3.7 --calib-data DRAW ARGS`` (its own processes: ``--procs auto``); the
scoring runs here afterwards, so one thing computes at a time. Rerunning resumes: a checkpoint already written is
not compressed again, a row already in the .json is not scored again.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

# run as a script, this directory is sys.path[0]; its kernels.py would shadow the ``kernels`` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def make_draws(root: Path, draws: int) -> list[str]:
    """Calibration sources: ``python-docs``, then ``draws - 1`` directories of disjoint train-split documents."""
    from qrecover.data.corpus import PYTHON_DOCS, SPLITS, _bucket, source_files

    _, files = source_files("python-docs")
    train = sorted((h, f) for f in files for b, h in [_bucket(str(f.relative_to(PYTHON_DOCS)))] if b in SPLITS["train"])
    out = ["python-docs"]
    for k in range(1, draws):
        d = root / f"draw{k}"
        if not d.is_dir():
            tmp = root / f".draw{k}.partial"  # renamed when complete: an interrupted run leaves no half draw in use
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            for j, (_, f) in enumerate(train[k - 1::draws - 1]):
                salt = 0
                while _bucket(f"doc{j:04d}-{salt}.txt")[0] not in SPLITS["calib"]:
                    salt += 1
                (tmp / f"doc{j:04d}-{salt}.txt").symlink_to(f)
            tmp.rename(d)
        out.append(str(d))
    return out


def ratio(row: dict, col: str, domains: list[str]) -> float:
    """A row's ratio to the original in column ``col``: a domain's, or ``worst`` (the largest of ``domains``)."""
    return max(row["ratio"][d] for d in domains) if col == "worst" else row["ratio"][col]


def summary(rows: list[dict], configs: list[str], domains: list[str]) -> list[str]:
    """Per configuration: mean, sd and range of each ratio over the draws; against the first configuration, the mean
    paired difference and on how many draws it is worse. A row's ``wall_s`` is None where it was not compressed
    by this script (resumed from a checkpoint on disk, or scored elsewhere)."""

    cols = ["python-docs", *domains, "worst"]
    by = {(r["config"], r["draw"]): r for r in rows}
    draws = sorted({r["draw"] for r in rows})
    lines = ["| configuration | draws | " + " | ".join(cols) + " | compress wall (s) |", "|---|---|" + "---|" * (len(cols) + 1)]
    for c in configs:
        mine = [by[c, k] for k in draws if (c, k) in by]
        if not mine:
            continue
        cells = []
        for d in cols:
            v = [ratio(r, d, domains) for r in mine]
            sd = statistics.stdev(v) if len(v) > 1 else float("nan")
            cells.append(f"{statistics.mean(v):.3f} ± {sd:.3f} ({min(v):.3f}-{max(v):.3f})")
        timed = [r["wall_s"] for r in mine if r["wall_s"] is not None]
        wall = f"{statistics.mean(timed):.0f} ({len(timed)} runs)" if timed else "-"
        lines.append(f"| {c} | {len(mine)} | " + " | ".join(cells) + f" | {wall} |")
    base = configs[0]
    lines += ["", f"Paired against `{base}` (the same draw on both sides): mean difference of the ratio, and draws on "
              "which it is worse.", "", "| configuration | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for c in configs[1:]:
        pairs = [(by[base, k], by[c, k]) for k in draws if (base, k) in by and (c, k) in by]
        if not pairs:
            continue
        cells = []
        for d in cols:
            diff = [ratio(b, d, domains) - ratio(a, d, domains) for a, b in pairs]
            cells.append(f"{statistics.mean(diff):+.3f} (worse {sum(x > 0 for x in diff)}/{len(diff)})")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draws", type=int, default=4, help="calibration draws per configuration (draw 0: the shipped one)")
    ap.add_argument("--config", action="append", required=True, metavar="NAME=ARGS",
                    help="a configuration: its name and compress's arguments; the first is the one others are paired with")
    ap.add_argument("--bpw", type=float, default=3.7)
    ap.add_argument("--windows", type=int, default=8, help="512-token windows per held-out domain")
    ap.add_argument("--work", type=Path, default=Path("benchmarks/out/calib-noise"))
    ap.add_argument("--out", type=Path, required=True, help="markdown report (a .json with the same stem beside it)")
    ap.add_argument("--note", default="", help="a paragraph added at the end of the report (e.g. what else ran meanwhile)")
    args = ap.parse_args()
    configs = {}
    for spec in args.config:
        name, sep, rest = spec.partition("=")
        if not sep or not name:
            ap.error(f"--config {spec!r}: give NAME=ARGS, e.g. quick=\"--encodings quick\"")
        configs[name] = shlex.split(rest)
    if args.draws < 2:
        ap.error(f"--draws {args.draws}: at least 2 (draw 0 is the shipped calibration)")

    import qrecover
    from benchmarks.common import domain_ppl, domain_windows
    from qrecover.checkpoint import MANIFEST
    from qrecover.evaluate.heldout import HELD_OUT
    from qrecover.models import load_model

    sources = make_draws(args.work / "draws", args.draws)
    store = args.out.with_suffix(".json")
    state = json.loads(store.read_text()) if store.exists() else {"windows": args.windows, "rows": []}
    if state["windows"] != args.windows:
        raise SystemExit(f"{store} was scored on {state['windows']} windows per domain, not {args.windows}")
    model, tok, _ = load_model(None)
    texts = domain_windows(tok, args.windows)
    if "original" not in state:
        state["original"] = domain_ppl(model.eval(), texts)
    del model
    done = {(r["config"], r["draw"]) for r in state["rows"]}
    exe = Path(sys.executable).with_name("qrecover")
    for name, extra in configs.items():
        for k, src in enumerate(sources):
            if (name, k) in done:
                continue
            ck = args.work / f"{name}-d{k}"
            cmd = [str(exe), "compress", "--bpw", str(args.bpw), "--calib-data", src, "--out", str(ck), *extra]
            wall = None
            if not (ck / MANIFEST).exists():
                print("$", shlex.join(cmd), flush=True)
                t0 = time.perf_counter()
                subprocess.run(cmd, check=True)
                wall = time.perf_counter() - t0
            m = qrecover.load(ck)
            ppl = domain_ppl(m.eval(), texts)
            row = {"config": name, "args": shlex.join(extra), "draw": k, "source": src, "wall_s": wall,
                   "bpw": m.qrecover_manifest["measured_bpw"]["model"], "ppl": ppl,
                   "ratio": {d: ppl[d] / state["original"][d] for d in ppl}}
            del m
            state["rows"].append(row)
            store.parent.mkdir(parents=True, exist_ok=True)
            store.write_text(json.dumps(state, indent=1) + "\n")
            print(json.dumps(row), flush=True)

    rows = [r for r in state["rows"] if r["config"] in configs]
    lines = ["# Calibration-draw noise of held-out quality (benchmarks/calib_noise.py)", "",
             f"`qrecover compress --bpw {args.bpw}` on {args.draws} disjoint calibration draws per configuration; ratios "
             f"of perplexity to the original's (python-docs: 32 x 512 tokens of the eval split; {', '.join(HELD_OUT)}: "
             f"{args.windows} x 512 each); worst = the largest held-out ratio. Mean ± sd (min-max) over the draws.", "",
             *summary(rows, list(configs), list(HELD_OUT)), "", "Every run:", "",
             "| configuration | arguments | draw | python-docs | " + " | ".join(HELD_OUT) + " | worst | wall (s) |",
             "|---|---|---|---|" + "---|" * len(HELD_OUT) + "---|---|"]
    for r in sorted(rows, key=lambda r: (list(configs).index(r["config"]), r["draw"])):
        lines.append(f"| {r['config']} | `{r['args']}` | {r['draw']} | {r['ratio']['python-docs']:.3f} | "
                     + " | ".join(f"{r['ratio'][d]:.3f}" for d in HELD_OUT)
                     + f" | {ratio(r, 'worst', list(HELD_OUT)):.3f} | "
                     + ("- |" if r["wall_s"] is None else f"{r['wall_s']:.0f} |"))
    if args.note:
        lines += ["", args.note]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

"""Held-out perplexity of compressed checkpoints on domains unlike the calibration text, and the worst of them.

``benchmarks/schemes.py`` scores the README protocol (the Python docs' eval split: the calibration domain). This
scores checkpoints, next to the unquantized model, on that split and on the held-out domains of
:mod:`qrecover.evaluate.heldout` (shakespeare, gsm8k, mmlu), and reports each ratio to the original and the worst.

    python benchmarks/heldout.py benchmarks/out/schemes-work/{default-3.7,mixed-3.7,mixed-awq-3.7} --out reports/schemes-heldout.md
    python benchmarks/heldout.py benchmarks/out/schemes-work/blocks-3.7 --out reports/schemes-heldout.md --append

One process, one checkpoint at a time; set OMP_NUM_THREADS for its threads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

# run as a script, this directory is sys.path[0]; its kernels.py would shadow the ``kernels`` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="+", type=Path, help="qrecover checkpoint directories")
    ap.add_argument("--windows", type=int, default=8, help="512-token windows per held-out domain")
    ap.add_argument("--out", type=Path, required=True, help="markdown report (a .json with the same stem beside it)")
    ap.add_argument("--append", action="store_true",
                    help="keep the rows already in --out's .json (same windows) and add or replace these checkpoints' rows")
    args = ap.parse_args()

    import qrecover
    from benchmarks.common import domain_ppl, domain_windows
    from qrecover.models import load_model

    model, tok, _ = load_model(None)
    texts = domain_windows(tok, args.windows)  # tokenized once, scored for every model
    domains = [d for d in texts if d != "python-docs"]
    old = args.out.with_suffix(".json")
    if args.append and old.exists():
        kept = json.loads(old.read_text())
        if kept["windows"] != args.windows:
            raise SystemExit(f"--append: {old} was scored on {kept['windows']} windows per domain, not {args.windows}")
        names = {ck.name for ck in args.checkpoints}
        rows = [r for r in kept["rows"] if r["name"] not in names]
    else:
        rows = [{"name": "original", "bpw": None, "ppl": domain_ppl(model.eval(), texts)}]
        print(json.dumps(rows[-1]), flush=True)
    del model
    for ck in args.checkpoints:
        model = qrecover.load(ck)
        m = model.qrecover_manifest
        rows.append({"name": ck.name, "bpw": m["measured_bpw"]["model"], "encodings": m["config"].get("encodings"),
                     "ppl": domain_ppl(model.eval(), texts)})
        del model
        print(json.dumps(rows[-1]), flush=True)

    cols = list(texts)
    base = rows[0]["ppl"]
    lines = ["# Held-out perplexity of compressed checkpoints (benchmarks/heldout.py)", "",
             f"python-docs: the README protocol (32 x 512 tokens of the eval split, the calibration domain); "
             f"{', '.join(domains)}: {args.windows} x 512 tokens each (qrecover.evaluate.heldout). Ratio to the "
             f"original; worst = the largest of the held-out domains' ratios. CPU, OMP_NUM_THREADS="
             f"{os.environ.get('OMP_NUM_THREADS', 'default')}.", "",
             "| checkpoint | bpw | " + " | ".join(f"{c} (ratio)" for c in cols) + " | worst held-out |",
             "|---|---|" + "---|" * len(cols) + "---|"]
    for r in rows:
        ratios = {c: r["ppl"][c] / base[c] for c in cols}
        bpw = "16 (bf16)" if r["bpw"] is None else f"{r['bpw']:.3f}"
        lines.append(f"| {r['name']} | {bpw} | " + " | ".join(f"{r['ppl'][c]:.3f} ({ratios[c]:.3f})" for c in cols)
                     + f" | {max(ratios[d] for d in domains):.3f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"windows": args.windows, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

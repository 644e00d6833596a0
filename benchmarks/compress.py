"""Compression benchmark on the default model: quality, size and cost at several budgets, with baselines.

Rows (all on the same held-out text, same perplexity protocol, same process):

- the original (unquantized) model;
- qrecover at 4.0, 3.7 and 3.5 measured whole-model bpw (sensitivity allocation, importance-weighted
  palettization: the defaults);
- at 3.7 bpw: the same candidates allocated by position instead of by sensitivity (the uniform baseline),
  and unweighted k-means with the same sensitivity allocation;
- coremltools' own k-means palettization (4-bit, per_grouped_channel, groups of 16, linear layers
  only, embedding unquantized), when coremltools is installed (`pip install coremltools==9.0`).

One calibration (`qrecover.api.prepare`) serves every budget of a scheme; its time is reported once and
each row adds its own allocation + packing + save time. Peak memory is the process's peak RSS so far.

    python benchmarks/compress.py                # full run (~15 min on 2 CPU cores)
    python benchmarks/compress.py --quick        # fewer windows, for a smoke test

Writes reports/compress.md and reports/compress.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qrecover import api  # noqa: E402
from qrecover.config import CompressConfig  # noqa: E402
from qrecover.models import load_model  # noqa: E402


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 calibration and 8 evaluation windows (default: 32 and 16)")
    ap.add_argument("--budgets", default="4.0,3.7,3.5")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    ap.add_argument("--report", default=str(ROOT / "reports"))
    args = ap.parse_args()
    torch.manual_seed(0)
    calib, windows = (4, 8) if args.quick else (32, 16)
    out, rows = Path(args.out), []

    def ppl_of(model, tok) -> dict:
        return api.perplexity(model, tok, windows=windows, seq_len=512, show_progress=False)

    def add(name: str, bpw_model: float, bpw_linear: float, r: dict, seconds: float, note: str = "") -> None:
        rows.append({"name": name, "bpw_model": bpw_model, "bpw_linear": bpw_linear, "ppl": r["ppl"],
                     "ratio": r["ppl"] / rows[0]["ppl"] if rows else 1.0, "seconds": seconds,
                     "peak_rss_mb": peak_rss_mb(), "note": note})
        print(json.dumps(rows[-1]), flush=True)

    t = time.time()
    model, tok, _ = load_model(None)
    add("original (fp32)", 32.0, 32.0, ppl_of(model, tok), time.time() - t)
    del model
    gc.collect()

    def run_budgets(label: str, base: CompressConfig, budgets: list[float], allocations=("sensitivity",), pin_emb=None,
                    extra_bits: tuple = ()):
        t = time.time()
        prep = api.prepare(base, show_progress=False)
        prep_s = time.time() - t
        print(f"prepare {label}: {prep_s:.0f} s", flush=True)
        chosen_emb = None
        for bpw in budgets:
            for alloc in allocations:
                emb = pin_emb or ("auto" if alloc == "sensitivity" else chosen_emb.get(bpw, "auto"))
                cfg = CompressConfig(**{**base.to_dict(), "bpw": bpw, "allocation": alloc, "embedding_bits": emb})
                t = time.time()
                d = out / f"{label}-{alloc}-{bpw}"
                m = api.compress(cfg, out=d, overwrite=True, show_progress=False, prepared=prep)
                finalize_s = time.time() - t
                if alloc == "sensitivity":
                    emb_layer = next(v for v in m["layers"].values() if v["kind"] == "embedding")
                    chosen_emb = chosen_emb or {}
                    chosen_emb[bpw] = str(emb_layer["bits"])
                qm = api.load(d, cache=True)
                mix = sorted({v["label"] for v in m["layers"].values() if v["kind"] == "linear"})
                emb_label = next(v["label"] for v in m["layers"].values() if v["kind"] == "embedding")
                add(f"{label}, {alloc} allocation, budget {bpw}", m["measured_bpw"]["model"], m["measured_bpw"]["linear"],
                    ppl_of(qm, tok), prep_s + finalize_s, f"linear {mix}, embedding {emb_label}; prepare {prep_s:.0f} s + {finalize_s:.0f} s")
                del qm
                gc.collect()
        for bits in extra_bits:  # the same calibration, a narrower set of widths (e.g. AFM's 2,4)
            cfg = CompressConfig(**{**base.to_dict(), "bpw": 3.7, "bits": list(bits)})
            d = out / f"{label}-bits{''.join(map(str, bits))}-3.7"
            t = time.time()
            m = api.compress(cfg, out=d, overwrite=True, show_progress=False, prepared=prep)
            qm = api.load(d, cache=True)
            emb_label = next(v["label"] for v in m["layers"].values() if v["kind"] == "embedding")
            add(f"{label}, sensitivity allocation, --bits {','.join(map(str, bits))}, budget 3.7", m["measured_bpw"]["model"],
                m["measured_bpw"]["linear"], ppl_of(qm, tok), prep_s + time.time() - t, f"embedding {emb_label}")
            del qm
        del prep
        gc.collect()

    budgets = [float(b) for b in args.budgets.split(",")]
    base = CompressConfig(calib_samples=calib)
    run_budgets("qrecover palettize (weighted)", base, budgets, allocations=("sensitivity", "position"), extra_bits=((2, 4), (3, 4)))
    unweighted = CompressConfig(calib_samples=calib, scheme_params={"weighted": False})
    run_budgets("qrecover palettize (unweighted k-means)", unweighted, [3.7])

    try:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from coreml_peer import coreml_palettize

        model, tok, _ = load_model(None)
        t = time.time()
        info = coreml_palettize(model, n_bits=4, group_size=16)
        n_all = sum(p.numel() for p in model.parameters())
        n_lin = sum(m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n)
        bpw_model = (info["linear_bpw"] * n_lin + 16 * (n_all - n_lin)) / n_all  # embedding and norms in 16-bit
        add("coremltools palettize 4-bit, per_grouped_channel g16, linear only", bpw_model, info["linear_bpw"],
            ppl_of(model, tok), time.time() - t, f"coremltools {info['coremltools_version']}; model bpw counts a 16-bit embedding")
    except ImportError as e:
        print(f"skipping coremltools peer: {e}")

    write_report(rows, Path(args.report), windows, calib)


def write_report(rows: list[dict], report: Path, windows: int, calib: int) -> None:
    report.mkdir(parents=True, exist_ok=True)
    (report / "compress.json").write_text(json.dumps({"rows": rows, "protocol": api.PPL_PROTOCOL, "eval_windows": windows,
                                                      "calib_windows": calib}, indent=1))
    lines = ["| model | bpw (whole model) | bpw (linear) | held-out ppl | x original | time (s) | peak RSS (MB) | notes |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['bpw_model']:.3f} | {r['bpw_linear']:.3f} | {r['ppl']:.3f} | {r['ratio']:.3f} | "
                     f"{r['seconds']:.0f} | {r['peak_rss_mb']:.0f} | {r['note']} |")
    md = "\n".join(lines)
    (report / "compress.md").write_text(
        f"# Compression benchmark (`python benchmarks/compress.py`)\n\nHeld-out perplexity: {windows} windows x 512 tokens "
        f"of the Python-docs eval split; calibration: {calib} windows x 512 tokens of the calib split.\n\n{md}\n")
    print(md)


if __name__ == "__main__":
    main()

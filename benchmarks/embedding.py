"""The embedding's encodings alone (issue 11: "the embedding's encodings become specs"): on the default model, whose
tied embedding (49152 x 576) is 21% of its weights and also its output head, quantize only that matrix with each
encoding, everything else unquantized, and measure held-out perplexity on the README protocol's python-docs eval
split and on three held-out domains (:mod:`qrecover.evaluate.heldout`: shakespeare, gsm8k, mmlu), next to the
damage qrecover's allocator predicts for it (:func:`qrecover.stages.candidates.embedding_stats`, the statistics
``qrecover compress`` uses, from the same 32 x 512 calibration windows).

It answers: what does the embedding cost at each width, and how much does choosing its codes by GPTQ against the
tied head's Hessian (``gptq:4/g32``) save over rounding to nearest on the same grid (``blockwise:4/b32/asym``).
Each GPTQ row of a tied embedding is also run with the head's Hessian alone (``H = mean(g) H_head``, row "head H
only"), without the lookup term ``diag(F)`` that ``qrecover compress`` adds: which of the two generalises.

    python benchmarks/embedding.py                                  # the default rows (about 3 min each, one core)
    python benchmarks/embedding.py --encodings gptq:2/g32,blockwise:2/b32/asym

Writes reports/embedding.md and reports/embedding.json. One process; set OMP_NUM_THREADS for its threads.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

# run as a script, this directory is sys.path[0]; its kernels.py would shadow the ``kernels`` package that
# transformers probes for on import
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

DEFAULT = "blockwise:4/b32/asym,gptq:4/g32,blockwise:3/b32/asym,gptq:3/g32,gptq:2/g32"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--encodings", default=DEFAULT, help="embedding encodings, comma-separated specs")
    ap.add_argument("--model", default=None, help="model (default: the built-in default model)")
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--heldout-windows", type=int, default=8, help="512-token windows per held-out domain")
    ap.add_argument("--report", default=str(ROOT / "reports"))
    args = ap.parse_args()

    from benchmarks.common import domain_ppl, domain_windows
    from qrecover.calibrate import gradient_stats
    from qrecover.data.corpus import token_windows
    from qrecover.models import is_tied, load_model
    from qrecover.stages.candidates import embedding_stats, quantize_unit
    from qrecover.stages.specs import parse_encodings

    model, tok, source = load_model(args.model)
    model.eval()
    emb = model.get_input_embeddings()
    w0 = emb.weight.detach().clone()
    tied = is_tied(model)
    encs = parse_encodings(args.encodings, what="--encodings")
    t0 = time.time()
    grads = gradient_stats(model, token_windows(tok, "python-docs", "calib", args.calib_samples, 512), show_progress=False)
    (stats, damage_fn), _ = embedding_stats(grads, tuple(w0.shape), tied, "cpu")
    print(f"calibration: {time.time() - t0:.0f} s", flush=True)
    texts = domain_windows(tok, args.heldout_windows)

    def measure() -> dict[str, float]:
        return domain_ppl(model, texts)

    rows = [{"encoding": "original (bf16 weights in fp32)", "bpw": 16.0, "damage": 0.0, "ppl": measure()}]
    base = rows[0]["ppl"]
    print(json.dumps(rows[0]), flush=True)
    runs = [(enc, enc.label, stats) for enc in encs]
    if tied:  # the GPTQ rows again without the lookup term in their Hessian
        head_h = grads["head"]["out_grad_sq"].mean() * grads["head"]["hessian"]
        runs += [(e, f"{e.label} (head H only)", {**stats, "hessian": head_h}) for e in encs if "hessian" in e.quantizer.needs]
    for enc, label, st in runs:
        t = time.time()
        qw, damage = quantize_unit(w0, [enc], st, damage_fn)[0]
        with torch.no_grad():
            emb.weight.copy_(qw.dequantize().to(w0.dtype))
        try:
            ppl = measure()
        finally:
            with torch.no_grad():
                emb.weight.copy_(w0)
        rows.append({"encoding": label, "bpw": 8 * qw.nbytes / w0.numel(), "damage": damage, "ppl": ppl,
                     "seconds": time.time() - t})
        print(json.dumps(rows[-1]), flush=True)

    report = Path(args.report)
    report.mkdir(parents=True, exist_ok=True)
    meta = {"model": source.name, "tied": tied, "shape": list(w0.shape), "calib_windows": args.calib_samples,
            "heldout_windows": args.heldout_windows, "threads": os.environ.get("OMP_NUM_THREADS", "default")}
    (report / "embedding.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    cols = list(texts)
    lines = [
        "# The embedding alone (benchmarks/embedding.py)",
        "",
        f"Model {source.name}: embedding {w0.shape[0]} x {w0.shape[1]}, {'tied to the output head' if tied else 'untied'}. "
        "Only the embedding is quantized; everything else stays as loaded. Perplexity: python-docs = the README protocol "
        f"(32 x 512 tokens of the eval split); the held-out domains {args.heldout_windows} x 512 tokens each "
        "(qrecover.evaluate.heldout). Ratio = to the original; worst = the largest ratio of the four. Predicted = the "
        f"damage `qrecover compress` estimates (nats of mean loss), calibration {args.calib_samples} x 512 python-docs "
        f"tokens. CPU, OMP_NUM_THREADS={meta['threads']}.",
        "",
        "| encoding | embedding bpw | predicted (nats) | " + " | ".join(f"{c} ppl (ratio)" for c in cols) + " | worst ratio |",
        "|---|---|---|" + "---|" * len(cols) + "---|",
    ]
    for r in rows:
        ratios = {c: r["ppl"][c] / base[c] for c in cols}
        lines.append(f"| `{r['encoding']}` | {r['bpw']:.3f} | {r['damage']:.4f} | "
                     + " | ".join(f"{r['ppl'][c]:.3f} ({ratios[c]:.3f})" for c in cols)
                     + f" | {max(ratios.values()):.3f} |")
    real = [(r["damage"], math.log(r["ppl"]["python-docs"] / base["python-docs"])) for r in rows[1:]]
    lines += ["", "Predicted vs measured loss increase on python-docs (nats): "
              + ", ".join(f"`{r['encoding']}` {p:.4f} vs {m:.4f}" for r, (p, m) in zip(rows[1:], real)) + "."]
    (report / "embedding.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {report / 'embedding.md'}")


if __name__ == "__main__":
    main()

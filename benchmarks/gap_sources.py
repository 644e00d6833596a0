"""Where a checkpoint's held-out perplexity gap sits: restore one group of its packed layers to the unquantized
weights (in the checkpoint's basis, so ``rot+`` checkpoints compare like with like) and score again.

For each group (the embedding lookup, the tied head, each projection type, each third of the decoder, each bit
width) it reports the share of each held-out domain's gap (quantized - original perplexity) that restoring the
group alone removes. Shares need not add up to 100% (the errors interact); they say which layers a recovery lever
must reach.

    OMP_NUM_THREADS=2 python benchmarks/gap_sources.py benchmarks/out/recover-rot-3.5/ckpt-3.5 --out reports/gap-sources-3.5.md
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def groups(manifest: dict) -> dict[str, list[str]]:
    """Group name -> the manifest layer names (or 'lm_head') it restores."""
    layers = [n for n, i in manifest["layers"].items() if i["kind"] == "linear"]
    depth = 1 + max(int(n.split(".")[2]) for n in layers)
    third = lambda n: min(3 * int(n.split(".")[2]) // depth, 2)  # noqa: E731
    g: dict[str, list[str]] = {"all": list(manifest["layers"]) + ["lm_head"],
                               "embedding (lookup)": [n for n, i in manifest["layers"].items() if i["kind"] == "embedding"],
                               "head (tied)": ["lm_head"]}
    for p in PROJ:
        g[p] = [n for n in layers if n.endswith(p)]
    for t, name in enumerate(("layers, first third", "layers, second third", "layers, last third")):
        g[name] = [n for n in layers if third(n) == t]
    for b in sorted({manifest["layers"][n]["bits"] for n in layers}):
        g[f"{b}-bit layers"] = [n for n in layers if manifest["layers"][n]["bits"] == b]
    return {k: v for k, v in g.items() if v}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--windows", type=int, default=8, help="512-token windows per held-out domain")
    ap.add_argument("--out", type=Path, required=True, help="markdown report (a .json beside it)")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    import qrecover
    from qrecover.evaluate.heldout import HELD_OUT, heldout_windows, windows_perplexity
    from qrecover.recovery.api import load_teacher

    torch.set_grad_enabled(False)
    model = qrecover.load(args.checkpoint, cache=True).eval()
    manifest = model.qrecover_manifest
    teacher = load_teacher(manifest).eval()
    tok = AutoTokenizer.from_pretrained(args.checkpoint)  # the checkpoint carries its tokenizer
    texts = {d: heldout_windows(tok, d, args.windows, 512) for d in HELD_OUT}
    score = lambda m: {d: windows_perplexity(m, w)["ppl"] for d, w in texts.items()}  # noqa: E731
    orig, quant = score(teacher), score(model)
    print("original", orig, "\nquantized", quant, flush=True)

    rows = []
    for gname, names in groups(manifest).items():
        t0 = time.time()
        swapped = []
        for n in names:
            parent_name, _, child = n.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            swapped.append((parent, child, getattr(parent, child)))
            src = teacher.get_submodule(n)
            if n == "lm_head":  # the teacher's head ties its (rotated) embedding: a copy so the lookup stays packed
                src = torch.nn.Linear(src.in_features, src.out_features, bias=False)
                src.weight = torch.nn.Parameter(teacher.get_submodule(n).weight.detach().clone())
            setattr(parent, child, src)
        ppl = score(model)
        for parent, child, old in swapped:
            setattr(parent, child, old)
        closed = {d: (quant[d] - ppl[d]) / (quant[d] - orig[d]) for d in HELD_OUT}
        rows.append({"group": gname, "layers": len(names), "ppl": ppl, "closed": closed})
        print(json.dumps(rows[-1]), f"{time.time() - t0:.0f}s", flush=True)

    lines = [f"# Where the held-out gap of `{args.checkpoint.name}` sits (benchmarks/gap_sources.py)", "",
             f"Each row restores one group of packed layers to the unquantized weights (in the checkpoint's basis) and "
             f"gives the share of each held-out domain's perplexity gap it removes; {args.windows} x 512 tokens per domain.",
             f"Original: {', '.join(f'{d} {orig[d]:.2f}' for d in HELD_OUT)}. Quantized: "
             f"{', '.join(f'{d} {quant[d]:.2f}' for d in HELD_OUT)} ({manifest['measured_bpw']['model']:.2f} bpw).", "",
             "| restored | packed layers | " + " | ".join(HELD_OUT) + " | smallest share |",
             "|---|---|" + "---|" * len(HELD_OUT) + "---|"]
    for r in rows:
        lines.append(f"| {r['group']} | {r['layers']} | " + " | ".join(f"{r['ppl'][d]:.2f} ({100 * r['closed'][d]:.0f}%)"
                                                                       for d in HELD_OUT)
                     + f" | {100 * min(r['closed'].values()):.0f}% |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("\n".join(lines) + "\n")
    args.out.with_suffix(".json").write_text(json.dumps({"original": orig, "quantized": quant, "rows": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

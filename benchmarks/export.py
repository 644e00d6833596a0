"""Export benchmark: each checkpoint in each format -- size on disk, bits per weight, held-out perplexity of
what the runtime loads (where it can run here) against the checkpoint's own, export time.

Checkpoints (of the default model, compressed once and reused from --out): 4-bit blockwise blocks of 32,
asymmetric and symmetric (embedding 8-bit per channel), and 4-bit palettized (AFM's scheme). Perplexity of a
GGUF is that of transformers' GGUF loader (it dequantizes to float32: the weights llama.cpp would use, not
llama.cpp's kernels); of a compressed-tensors export that of transformers with compressed-tensors, when it
can load it (not for asymmetric layers with compressed-tensors 0.20, see docs/export.md).

    python benchmarks/export.py              # 16 windows x 512 tokens
    python benchmarks/export.py --quick      # 4 windows
    python benchmarks/export.py --only-merged  # only the --merge-adapter row

The merged row: a rank-16 SVD-initialised adapter (each ``B A`` the input-weighted rank-16 approximation of its
layer's quantization error, ``qrecover recover --init svd`` before training) on the symmetric 4-bit checkpoint,
exported to GGUF with ``--merge-adapter``; the export's own merge report gives the cost (perplexity and KL to the
unquantized model of the checkpoint without the adapter / with it unmerged / merged, on --merge-cost-windows
held-out windows); the GGUF's perplexity is then measured like the other rows.

Writes benchmarks/out/export.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import svd_adapter  # noqa: E402
from qrecover import api  # noqa: E402
from qrecover.checkpoint import read_manifest  # noqa: E402
from qrecover.config import CompressConfig  # noqa: E402
from qrecover.errors import QRecoverError  # noqa: E402
from qrecover.export import export  # noqa: E402

CHECKPOINTS = {
    "blockwise 4-bit b32 asym": dict(scheme="blockwise", scheme_params={"block_size": 32, "symmetric": False}),
    "blockwise 4-bit b32 sym": dict(scheme="blockwise", scheme_params={"block_size": 32, "symmetric": True}),
    "palettize 4-bit": dict(scheme="palettize", scheme_params={}),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="4 evaluation windows (default 16)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "export"))
    ap.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                    help="use an existing checkpoint for a row instead of compressing (names: " + ", ".join(CHECKPOINTS) + ")")
    ap.add_argument("--only-merged", action="store_true", help="only the --merge-adapter row")
    ap.add_argument("--merge-cost-windows", type=int, default=None, help="held-out windows of the merge report (default: "
                                                                          "as many as the perplexity rows)")
    args = ap.parse_args()
    windows = 4 if args.quick else 16
    out = Path(args.out)
    given = dict(kv.split("=", 1) for kv in args.checkpoint)
    rows = []

    def ppl(model, tok) -> float:
        r = api.perplexity(model, tok, windows=windows, seq_len=512, show_progress=False)
        return r["ppl"]

    def checkpoint(label: str) -> Path:
        ckpt = Path(given.get(label) or out / label.replace(" ", "-"))
        if not (ckpt / "qrecover.json").is_file():
            t = time.time()
            api.compress(CompressConfig(bpw=None, bits=[4], embedding_bits="8", calib_samples=8, **CHECKPOINTS[label]),
                         out=ckpt, show_progress=False)
            print(f"compressed {label} in {time.time() - t:.0f} s", flush=True)
        return ckpt

    for label, spec in CHECKPOINTS.items():
        if args.only_merged:
            break
        ckpt = checkpoint(label)
        manifest = read_manifest(ckpt)
        model, tok, _ = api.load_any(str(ckpt))
        base_ppl = ppl(model, tok)
        del model
        gc.collect()
        rows.append({"checkpoint": label, "format": "qrecover", "bytes": (ckpt / "model.safetensors").stat().st_size,
                     "bpw": manifest["measured_bpw"]["model"], "ppl": base_ppl, "ckpt_ppl": base_ppl,
                     "exact": "-", "rel_error": 0.0, "seconds": None})
        formats = ["gguf", "compressed-tensors"] + (["coreml"] if spec["scheme"] == "palettize" else [])
        for fmt in formats:
            if importlib.util.find_spec({"compressed-tensors": "compressed_tensors", "coreml": "coremltools"}.get(fmt, "gguf")) is None:
                continue
            dest = out / f"{label.replace(' ', '-')}.{fmt}"
            requant = "int4/g64" if (fmt == "compressed-tensors" and spec["scheme"] == "palettize") else None
            try:
                rep = export(ckpt, fmt, dest, requantize=requant, overwrite=True)
            except QRecoverError as e:
                rows.append({"checkpoint": label, "format": fmt, "note": str(e)})
                continue
            row = {"checkpoint": label, "format": fmt + (f" (--requantize {requant})" if requant else ""),
                   "bytes": sum(p.stat().st_size for p in (dest / rep["file"]).rglob("*") if p.is_file())
                   if (dest / rep["file"]).is_dir() else (dest / rep["file"]).stat().st_size, "bpw": rep["bpw"], "ckpt_ppl": base_ppl,
                   "exact": f"{rep['exact_layers']}/{rep['total_layers']}", "rel_error": rep["total_rel_error"],
                   "seconds": rep["seconds"], "types": rep.get("types") or rep.get("config_groups")}
            try:
                from transformers import AutoModelForCausalLM

                if fmt == "coreml":
                    raise RuntimeError("Core ML runs only on Apple devices")
                if fmt == "gguf":
                    m = AutoModelForCausalLM.from_pretrained(dest, gguf_file=rep["file"], dtype=torch.float32)
                else:
                    if any(p["weights"].get("symmetric") is False for p in rep["config_groups"].values()):
                        raise RuntimeError("asymmetric compressed-tensors layers do not load in transformers 5.24 + compressed-tensors 0.20")
                    m = AutoModelForCausalLM.from_pretrained(dest, dtype=torch.float32)
                m.eval()
                row["ppl"] = ppl(m, tok)
                del m
            except (RuntimeError, ValueError, OSError) as e:
                row["ppl"] = None
                row["note"] = f"not run here: {str(e).splitlines()[0][:120]}"
            gc.collect()
            rows.append(row)
            print(json.dumps(row, default=str), flush=True)

    rows.append(merged_row(checkpoint(MERGED), out, windows, args.merge_cost_windows or windows, ppl))
    out.mkdir(parents=True, exist_ok=True)
    result = json.dumps({"windows": windows, "seq_len": 512, "rows": rows}, indent=1, default=str)
    (out.parent / ("export_merged.json" if args.only_merged else "export.json")).write_text(result)
    print("\n| checkpoint | format | size (bytes) | bpw | exact layers | weight rel. error | ppl | checkpoint ppl | export s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if "bytes" not in r:
            print(f"| {r['checkpoint']} | {r['format']} | refused: {r['note']} | | | | | | |")
            continue
        p = f"{r['ppl']:.3f}" if r.get("ppl") else r.get("note", "-")
        print(f"| {r['checkpoint']} | {r['format']} | {r['bytes']:,} | {r['bpw']:.3f} | {r['exact']} | "
              f"{r['rel_error']:.2e} | {p} | {r['ckpt_ppl']:.3f} | {r['seconds'] if r['seconds'] is not None else '-'} |")
    for r in rows:
        if "merge_cost" in r:
            c = r["merge_cost"]
            print(f"\nmerge cost ({r['merge_cost_windows']} held-out windows x 512; base / unmerged / merged): "
                  f"ppl {c['base']['ppl']:.3f} / {c['unmerged']['ppl']:.3f} / {c['merged']['ppl']:.3f}; "
                  f"KL {c['base'].get('kl', float('nan')):.4f} / {c['unmerged'].get('kl', float('nan')):.4f} / "
                  f"{c['merged'].get('kl', float('nan')):.4f}; kept {c['kept']}; merge {r['merge_seconds']} s")


MERGED = "blockwise 4-bit b32 sym"


def merged_row(ckpt: Path, out: Path, windows: int, cost_windows: int, ppl) -> dict:
    """The --merge-adapter row: an SVD-initialised rank-16 adapter of ``ckpt`` merged and exported to GGUF."""
    from transformers import AutoModelForCausalLM

    adapter = out / "svd-r16-adapter"
    t = time.time()
    if (info := svd_adapter(ckpt, adapter)) is not None:
        print(f"svd-initialised rank-16 adapter in {time.time() - t:.0f} s (captures {info['_total']:.2f} of the "
              "output error)", flush=True)
    dest = out / f"{MERGED.replace(' ', '-')}.merged-svd-r16.gguf"
    rep = export(ckpt, "gguf", dest, adapter=adapter, merge_adapter=True, overwrite=True, cost_windows=cost_windows)
    m = AutoModelForCausalLM.from_pretrained(dest, gguf_file=rep["file"], dtype=torch.float32)
    m.eval()
    _, tok, _ = api.load_any(str(ckpt))
    row = {"checkpoint": MERGED + " + svd r16 adapter", "format": "gguf (--merge-adapter)",
           "bytes": (dest / rep["file"]).stat().st_size, "bpw": rep["bpw"], "ckpt_ppl": rep["merge"]["cost"]["base"]["ppl"],
           "exact": f"{rep['exact_layers']}/{rep['total_layers']}", "rel_error": rep["total_rel_error"],
           "seconds": rep["seconds"], "ppl": ppl(m, tok), "merge_cost": rep["merge"]["cost"],
           "merge_cost_windows": cost_windows, "merge_seconds": rep["merge"]["seconds"],
           "layers_kept_original": rep["merge"]["layers_kept_original"], "merged_layers": len(rep["merge"]["layers"])}
    print(json.dumps(row, default=str), flush=True)
    return row


if __name__ == "__main__":
    main()

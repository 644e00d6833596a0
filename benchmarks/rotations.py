"""Which rotation matrix (issue 25): the default model fake-quantized by round-to-nearest with and without each
rotation, scored on a few windows. A quick comparison of the matrices, not the README protocol (that is
``benchmarks/schemes.py``'s rot rows).

For each kind (``none``; ``rot`` = randomised Kronecker/Paley Hadamard, ``rot-block`` = block-diagonal Hadamard,
``rot-random`` = seeded random orthogonal; R1 + R2 each) the transform is applied to the unquantized model, every
decoder linear is replaced by its dequantized ``blockwise:BITS/b64/asym`` (RTN), the embedding by 8-bit per channel
(as the uniform rows of reports/schemes.md), and the perplexity measured on the first ``--windows`` x 512 tokens of
the python-docs eval split (the README protocol's windows, fewer of them). The unquantized rotated model's largest
relative logit difference to the original is reported too (the fold is exact up to float32).

    OMP_NUM_THREADS=1 python benchmarks/rotations.py --bits 3 --windows 8 --out reports/rotations-rtn.json
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

# run as a script, this directory is sys.path[0]; its kernels.py would shadow the ``kernels`` package
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@torch.no_grad()
def score(kind: str, bits: int, windows: torch.Tensor) -> dict:
    """Perplexity of the ``kind``-rotated default model with RTN decoder linears; ``windows (n, 512)``."""
    from qrecover.evaluate.heldout import windows_perplexity
    from qrecover.models import decoder_layers, linear_layers, load_model
    from qrecover.schemes import get_quantizer
    from qrecover.transforms import get_transform

    t0, c0 = time.time(), _cpu()
    model, _, _ = load_model(None)
    model.eval()
    drift = None
    if kind != "none":
        ref = model(windows[:1]).logits
        get_transform(kind).apply_model(model, "cpu")
        got = model(windows[:1]).logits
        drift = float((got - ref).abs().max() / ref.abs().max())
    rtn = get_quantizer("blockwise", block_size=64, symmetric=False)
    for layer in decoder_layers(model):
        for lin in linear_layers(layer).values():
            lin.weight.data = rtn.quantize(lin.weight.data, bits, {}).dequantize().to(lin.weight.dtype)
    emb = model.get_input_embeddings()
    emb.weight.data = get_quantizer("blockwise", block_size=None, symmetric=True).quantize(emb.weight.data, 8, {}).dequantize()
    ppl = windows_perplexity(model, windows)["ppl"]
    return {"kind": kind, "bits": bits, "ppl": ppl, "fold_max_rel_logit_diff": drift, "seconds": time.time() - t0,
            "cpu_seconds": _cpu() - c0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bits", type=int, default=3)
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--kinds", default="none,rot,rot-block,rot-random")
    ap.add_argument("--out", type=Path, required=True, help="JSON rows (rows already there for other kinds are kept)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from qrecover.data import token_windows
    from qrecover.models import default_model_dir

    windows = token_windows(AutoTokenizer.from_pretrained(default_model_dir()), "python-docs", "eval", args.windows, 512)
    rows = json.loads(args.out.read_text())["rows"] if args.out.exists() else []
    for kind in args.kinds.split(","):
        rows = [r for r in rows if (r["kind"], r["bits"]) != (kind, args.bits)]
        rows.append(score(kind, args.bits, windows))
        print(json.dumps(rows[-1]), flush=True)
        args.out.write_text(json.dumps({"windows": args.windows, "seq_len": 512, "threads": 1, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

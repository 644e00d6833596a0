"""Per-layer damage of quantizer options on the default model, before any whole-model run.

Statistics (input Hessian, input energies, output-gradient moments) are fitted on calibration windows
and the damage is measured with the same statistics from held-out windows: the predicted loss increase
``0.5 * sum_i g_i (dW H dW^T)_ii`` (what the allocator uses) and the plain output error ``tr(dW H dW^T)``,
summed over 16 linears (q, o, gate, down of layers 2, 12, 22, 28), at 2, 3 and 4 bits, as ratios to
palettize's default, with each option's bits per weight (codes, tables, scales). Compares palettize's input vs
Fisher weighting, its least-squares table refit and tables per block of 192 columns, and gptq's options against RTN.

    python benchmarks/layer_damage.py [--windows 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qrecover.calibrate import gradient_stats  # noqa: E402
from qrecover.data.corpus import token_windows  # noqa: E402
from qrecover.models import decoder_layers, load_model, module_name  # noqa: E402
from qrecover.schemes import get_quantizer  # noqa: E402
from qrecover.sensitivity import linear_damage  # noqa: E402

CONFIGS = {
    "palettize (input p0.5)": ("palettize", {}),
    "palettize input p1": ("palettize", {"importance_power": 1.0}),
    "palettize fisher p0.5": ("palettize", {"weighting": "fisher"}),
    "palettize fisher p1": ("palettize", {"weighting": "fisher", "importance_power": 1.0}),
    "palettize refit=2": ("palettize", {"refit": 2}),
    "palettize b192": ("palettize", {"block_size": 192}),
    "palettize b192 refit=2": ("palettize", {"block_size": 192, "refit": 2}),
    "rtn g64 asym": ("blockwise", {"block_size": 64, "symmetric": False}),
    "gptq g64 sym": ("gptq", {"group_size": 64, "symmetric": True}),
    "gptq g64 sym act": ("gptq", {"group_size": 64, "symmetric": True, "act_order": True}),
    "gptq g64 asym": ("gptq", {"group_size": 64, "symmetric": False}),
    "gptq g64 asym act": ("gptq", {"group_size": 64, "symmetric": False, "act_order": True}),
}
BITS = (2, 3, 4)


def layer_stats(model, tok, names: list[str], split: str, n: int) -> dict[str, dict[str, torch.Tensor]]:
    wins = token_windows(tok, "python-docs", split, n, 512)
    grads = gradient_stats(model, wins, show_progress=False)
    mods = dict(model.named_modules())
    sums: dict[str, torch.Tensor] = {}
    count = [0]

    def hook(name: str):
        def fwd(_m, inp, _out):
            x = inp[0].reshape(-1, inp[0].shape[-1]).double()
            sums[name] = sums[name] + x.T @ x if name in sums else x.T @ x
        return fwd

    hooks = [mods[n].register_forward_hook(hook(n)) for n in names]
    try:
        with torch.no_grad():
            for w in wins:
                model(input_ids=w.unsqueeze(0), use_cache=False)
                count[0] += w.numel()
    finally:
        for h in hooks:
            h.remove()
    out = {}
    for n in names:
        h = (sums[n] / count[0]).float()
        out[n] = {"hessian": h, "input_sq": h.diagonal().clone(), "out_grad_sq": grads["out_grad_sq"][n]}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--windows", type=int, default=8, help="windows of 512 tokens for each of calib and held-out")
    args = ap.parse_args()
    model, tok, _ = load_model(None)
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    names = [f"{prefix}.{i}.{n}" for i in (2, 12, 22, 28)
             for n in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")]
    t0 = time.time()
    cal = layer_stats(model, tok, names, "calib", args.windows)
    ev = layer_stats(model, tok, names, "eval", args.windows)
    print(f"statistics: {time.time() - t0:.0f} s")
    mods = dict(model.named_modules())
    damage = {(c, b): [0.0, 0.0, 0] for c in CONFIGS for b in BITS}
    seconds = dict.fromkeys(CONFIGS, 0.0)
    for n in names:
        w = mods[n].weight.detach()
        for c, (scheme, params) in CONFIGS.items():
            t = time.time()
            q = get_quantizer(scheme, **params)
            qws = q.quantize_many(w, list(BITS), cal[n])
            seconds[c] += time.time() - t
            for b, qw in zip(BITS, qws):
                damage[(c, b)][2] += q.nbytes(tuple(w.shape), b)
                dw = (w - qw.dequantize()).double()
                damage[(c, b)][0] += linear_damage(dw, ev[n]["hessian"], ev[n]["out_grad_sq"])
                damage[(c, b)][1] += float(torch.einsum("oi,ij,oj->", dw, ev[n]["hessian"].double(), dw))
    base = next(iter(CONFIGS))
    n_weights = sum(mods[n].weight.numel() for n in names)
    print("| bits | option | bpw | predicted loss increase | ratio | output error | ratio |")
    print("|---|---|---|---|---|---|---|")
    for b in BITS:
        ref = damage[(base, b)]
        for c in CONFIGS:
            d = damage[(c, b)]
            print(f"| {b} | {c} | {8 * d[2] / n_weights:.3f} | {d[0]:.4g} | {d[0] / ref[0]:.3f} | {d[1]:.4g} | {d[1] / ref[1]:.3f} |")
    print("quantize seconds (3 widths x 16 layers):", {c: round(s, 1) for c, s in seconds.items()})


if __name__ == "__main__":
    main()

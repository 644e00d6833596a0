"""Time the adapters' SVD initialisation on one layer of 3B and 8B shapes: the former exact path against the new one.

Former (``lowrank_correction`` as ``init_error_svd`` called it): the layer's input Gram matrix ``H = X^T X / n`` in
float64 (``input_moments``), a float64 eigendecomposition of ``H``, ``H^(1/2)`` and ``H^(-1/2)``, a full SVD of
``E H^(1/2)``; cubic in the width. New (``randomized_correction`` from the inputs, what ``init_error_svd`` runs on
layers wider than ``EXACT_MAX_WIDTH``): subspace iteration on ``E H E^T`` in float32 with products by ``X`` only,
plus the captured-error statistic ``||X E^T||^2`` (one product, ``n * in * out``). Random layers: an error with a
decaying spectrum, ``n = 4096`` inputs (8 x 512 tokens, as the init uses) with decaying channel scales and outliers.

The former path runs only on layers whose width is at most ``--old-max-width`` (it takes minutes above); for wider
layers its time is extrapolated from the measured 3072-wide layer, each step by its flop count (Gram ``n in^2``,
eigendecomposition and the two square-root products ``in^3``, ``E S`` ``out in^2``, SVD ``max * min^2``), and marked
so. Whole-model projections multiply by the number of such layers (q, k, v, o, gate, up, down per decoder layer);
the teacher's forward pass over the calibration windows is not included.

    OMP_NUM_THREADS=1 python benchmarks/svd_init.py [--out reports/svd_init.json]
    OMP_NUM_THREADS=1 python benchmarks/svd_init.py --grouped SmolLM2-135M   # one decoder layer, grouped by input
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qrecover.adapters.svd_init import lowrank_correction, randomized_correction, randomized_corrections  # noqa: E402

# (out, in) of every adapted linear of one decoder layer: q, k, v, o, gate, up, down
MODELS = {
    "Llama-3.2-3B": {"layers": 28, "linears": [(3072, 3072), (1024, 3072), (1024, 3072), (3072, 3072), (8192, 3072),
                                               (8192, 3072), (3072, 8192)]},
    "Llama-3-8B": {"layers": 32, "linears": [(4096, 4096), (1024, 4096), (1024, 4096), (4096, 4096), (14336, 4096),
                                             (14336, 4096), (4096, 14336)]},
}
RANK, SCALING, TOKENS = 16, 2.0, 4096
# one decoder layer's linears grouped by the input they read (q, k, v | o | gate, up | down): what init_error_svd
# batches; SmolLM2-135M is the default model (30 layers), Llama-3.2-1B the GPU benchmark's geometry (16 layers)
GROUPED = {
    "SmolLM2-135M": {"layers": 30, "groups": [[(576, 576), (192, 576), (192, 576)], [(576, 576)],
                                              [(1536, 576), (1536, 576)], [(576, 1536)]]},
    "Llama-3.2-1B": {"layers": 16, "groups": [[(2048, 2048), (512, 2048), (512, 2048)], [(2048, 2048)],
                                              [(8192, 2048), (8192, 2048)], [(2048, 8192)]]},
}


def grouped(name: str, tokens: int) -> dict:
    """One decoder layer of ``name``: the float64 exact path (Gram + eigendecomposition + full SVD per layer, what
    ``auto`` runs on a CPU for layers up to 2048 wide), the float32 randomized one layer at a time, and batched per
    input group (``randomized_corrections``); seconds per decoder layer and for the whole model."""
    spec, out = GROUPED[name], {"exact_f64": 0.0, "randomized_f32": 0.0, "batched_f32": 0.0, "rank_r_rel_error": []}
    for gi, group in enumerate(spec["groups"]):
        layers = [make_layer(*shape, tokens, seed=gi * 10 + li) for li, shape in enumerate(group)]
        x = layers[0][1]
        errors = [e for e, _ in layers]
        t0 = time.process_time()
        xd = x.double()
        gram = xd.T @ xd / xd.shape[0]
        exact = [lowrank_correction(e.double(), gram, RANK, SCALING) for e in errors]
        out["exact_f64"] += time.process_time() - t0
        t0 = time.process_time()
        single = [randomized_correction(e, RANK, SCALING, inputs=x) for e in errors]
        out["randomized_f32"] += time.process_time() - t0
        t0 = time.process_time()
        randomized_corrections(errors, [RANK] * len(errors), [SCALING] * len(errors), inputs=x)
        out["batched_f32"] += time.process_time() - t0
        for (b0, a0), (b, a) in zip(exact, single):
            out["rank_r_rel_error"].append(float((b @ a - b0 @ a0).norm() / (b0 @ a0).norm()))
    out["whole_model"] = {k: out[k] * spec["layers"] for k in ("exact_f64", "randomized_f32", "batched_f32")}
    return out


def make_layer(out_f: int, in_f: int, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``E (out, in)`` float32 with a decaying spectrum (256 directions ``i^-0.7`` plus noise), ``X (tokens, in)``."""
    g = torch.Generator().manual_seed(seed)
    m = 256
    s = torch.arange(1, m + 1, dtype=torch.float32) ** -0.7
    e = (torch.randn(out_f, m, generator=g) * s) @ torch.randn(m, in_f, generator=g) / in_f ** 0.5
    e += 0.02 * float(s[-1]) * torch.randn(out_f, in_f, generator=g)
    scale = torch.linspace(1.0, 0.1, in_f)
    scale[torch.randperm(in_f, generator=g)[:8]] = 20.0
    return e, torch.randn(tokens, in_f, generator=g) * scale


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def old_path(e: torch.Tensor, x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, float]]:
    """The former init's work for one layer, step by step (the same operations as ``lowrank_correction``)."""
    steps = {}
    xd = x.double()
    gram, steps["gram"] = timed(lambda: xd.T @ xd / xd.shape[0])
    (b, a), steps["correction"] = timed(lambda: lowrank_correction(e.double(), gram, RANK, SCALING))
    # the pieces of the correction, for the extrapolation: eigh + two in^3 products, E S, SVD
    h = gram + 0.01 * gram.diagonal().mean() * torch.eye(gram.shape[0], dtype=torch.float64)
    (ev, v), steps["eigh"] = timed(lambda: torch.linalg.eigh(h))
    s_half, steps["sqrt_products"] = timed(lambda: ((v * ev.sqrt()) @ v.T, (v / ev.sqrt()) @ v.T)[0])
    m, steps["e_times_s"] = timed(lambda: e.double() @ s_half)
    _, steps["svd"] = timed(lambda: torch.linalg.svd(m, full_matrices=False))
    return (b, a), steps


def extrapolate(steps: dict[str, float], ref: tuple[int, int], shape: tuple[int, int], tokens: int) -> float:
    """The former path's seconds on ``shape`` from its steps measured on ``ref``, each scaled by its flop count."""
    (o0, i0), (o, i) = ref, shape
    svd = max(o, i) * min(o, i) ** 2 / (max(o0, i0) * min(o0, i0) ** 2)
    rest = steps["correction"] - steps["eigh"] - steps["sqrt_products"] - steps["e_times_s"] - steps["svd"]
    return (steps["gram"] * (i / i0) ** 2 + (steps["eigh"] + steps["sqrt_products"]) * (i / i0) ** 3
            + steps["e_times_s"] * o * i ** 2 / (o0 * i0 ** 2) + steps["svd"] * svd + max(rest, 0.0) * o * i / (o0 * i0))


def new_path(e: torch.Tensor, x: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, float]]:
    steps = {}
    (b, a), steps["correction"] = timed(lambda: randomized_correction(e, RANK, SCALING, inputs=x))
    _, steps["captured_statistic"] = timed(lambda: float((x @ e.T).double().square().sum()))
    return (b, a), steps


def weighted_error(e: torch.Tensor, x: torch.Tensor, b: torch.Tensor, a: torch.Tensor) -> float:
    """``||X (E - s B A)^T||^2 / n``: the layer's output error on its inputs (undamped)."""
    r = x @ e.T - SCALING * (x @ a.float().T) @ b.float().T
    return float(r.double().square().sum()) / x.shape[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--old-max-width", type=int, default=3072, help="run the former path only up to this width")
    ap.add_argument("--tokens", type=int, default=TOKENS)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--grouped", choices=sorted(GROUPED), default=None,
                    help="time one decoder layer of this model: float64 exact vs float32 randomized vs batched by input")
    args = ap.parse_args()
    if args.grouped:
        r = grouped(args.grouped, args.tokens)
        print(json.dumps({"model": args.grouped, "threads": torch.get_num_threads(), "tokens": args.tokens, **r}, indent=1))
        return
    shapes = sorted({s for m in MODELS.values() for s in m["linears"]}, key=lambda s: (s[0] * s[1], s))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s), rank {RANK}, {args.tokens} input tokens")
    rows, ref = {}, None
    for shape in shapes:
        e, x = make_layer(*shape, args.tokens)
        (b, a), new = new_path(e, x)
        row = {"shape": list(shape), "new_seconds": new["correction"] + new["captured_statistic"], "new_steps": new,
               "new_error_left": weighted_error(e, x, b, a) / weighted_error(e, x, 0 * b, a)}
        if max(shape) <= args.old_max_width:
            (b0, a0), old = old_path(e, x)
            ref = (shape, old) if ref is None or shape[0] * shape[1] > ref[0][0] * ref[0][1] else ref
            row.update(old_seconds=old["gram"] + old["correction"], old_measured=True, old_steps=old,
                       old_error_left=weighted_error(e, x, b0, a0) / weighted_error(e, x, 0 * b0, a0))
        rows[shape] = row
        print(f"{shape[0]:>6} x {shape[1]:<6} new {row['new_seconds']:7.2f} s"
              + (f"   old {row['old_seconds']:7.1f} s (measured)   error left new/old "
                 f"{row['new_error_left'] / row['old_error_left']:.5f}" if "old_seconds" in row else ""), flush=True)
    if ref is None:
        sys.exit("no layer was narrow enough for the former path; raise --old-max-width")
    for shape, row in rows.items():
        if "old_seconds" not in row:
            row.update(old_seconds=extrapolate(ref[1], ref[0], shape, args.tokens), old_measured=False)
            print(f"{shape[0]:>6} x {shape[1]:<6} old {row['old_seconds']:7.0f} s (extrapolated from "
                  f"{ref[0][0]}x{ref[0][1]})")
    models = {}
    for name, m in MODELS.items():
        old = m["layers"] * sum(rows[s]["old_seconds"] for s in m["linears"])
        new = m["layers"] * sum(rows[s]["new_seconds"] for s in m["linears"])
        exact = all(rows[s].get("old_measured") for s in m["linears"])
        models[name] = {"layers": m["layers"], "old_seconds": old, "new_seconds": new, "old_all_measured": exact}
        print(f"{name}: whole-model init (linear algebra only) old {old / 3600:.1f} h{'' if exact else ' (partly extrapolated)'}, "
              f"new {new / 60:.1f} min, {old / new:.0f}x")
    if args.out:
        args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "torch": torch.__version__, "rank": RANK,
                                        "tokens": args.tokens, "layers": [rows[s] for s in shapes], "models": models},
                                       indent=1) + "\n")


if __name__ == "__main__":
    main()

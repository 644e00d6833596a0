"""What compressing one layer launches on a GPU, counted on the CPU: operator dispatches and host reads per candidate
family, with the GPU's batched paths (the fused error-feedback kernel, the batched GPTQ range search, k-means of every
width at once with sparse convergence reads) and without them (one operator after another, as a GPU ran it until 2026-11-29), in one run.

The candidates stage of one linear layer (random weight, a Hessian from inputs of uneven channel scales) at a menu's
encodings, through ``qrecover.stages.candidates.quantize_unit`` (damage estimates included), on the torch path a GPU
takes (``feedback.NUMPY_ON_CPU = False``), each family under ``HostSyncCounter``. The fused kernel's launch is
stubbed and counted apart (its arithmetic is tested under the interpreter: tests/test_feedback_kernel.py). A count,
not a time: ``python benchmarks/feedback_speed.py --device cuda`` and ``benchmarks/compress_gpu.py`` time it on a GPU.

    python benchmarks/compress_dispatches.py                       # the full default menu and the quick one, ~1 min
    python benchmarks/compress_dispatches.py --menu quick --shape 4096x4096
"""

from __future__ import annotations

import argparse
import contextlib

import torch
from torch.utils._python_dispatch import _disable_current_modes

from qrecover.recovery.host_sync import HostSyncCounter
from qrecover.schemes import feedback, gptq, palettize
from qrecover.sensitivity import linear_damage
from qrecover.stages.candidates import quantize_unit
from qrecover.stages.specs import parse_encodings


@contextlib.contextmanager
def gpu_paths(batched: bool, launches: list):
    """The settings a GPU runs with (``batched``) or the one-operator-after-another paths, on this CPU; the fused
    kernel's launch stubbed (counted into ``launches``, its codes zero-filled)."""
    from qrecover.kernels import feedback_kernel

    def stub(rule, wb, errs, u, codes, j0, k0, k1):
        launches.append(1)
        with _disable_current_modes():
            codes[j0 + k0:j0 + k1].zero_()
            errs[k0:k1].zero_()

    saved = (feedback.NUMPY_ON_CPU, feedback.FUSED_DEVICES, gptq.BATCHED_SEARCH, palettize.KMEANS_CHECK_EVERY,
             palettize.BATCHED_KMEANS, feedback_kernel.run)
    feedback.NUMPY_ON_CPU = False
    feedback.FUSED_DEVICES = {"cpu"} if batched else set()
    gptq.BATCHED_SEARCH = {"cpu"} if batched else set()
    palettize.KMEANS_CHECK_EVERY = {"cpu": 8 if batched else 1}
    palettize.BATCHED_KMEANS = {"cpu"} if batched else set()
    feedback_kernel.run = stub
    try:
        yield
    finally:
        (feedback.NUMPY_ON_CPU, feedback.FUSED_DEVICES, gptq.BATCHED_SEARCH, palettize.KMEANS_CHECK_EVERY,
         palettize.BATCHED_KMEANS, feedback_kernel.run) = saved


def _layer(out_f: int, in_f: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4096, in_f, generator=g) * torch.rand(in_f, generator=g).add(0.05)
    h = (x.T @ x).double() / 4096
    gs = torch.rand(out_f, generator=g)
    return torch.randn(out_f, in_f, generator=g) * 0.02, {"hessian": h, "input_sq": h.diagonal().float(), "out_grad_sq": gs}


def count(menu: str, out_f: int, in_f: int, batched: bool) -> list[tuple[str, int, int, int]]:
    """``[(family, dispatches, host reads, kernel launches)]`` for the candidates of one ``out_f x in_f`` layer."""
    w, st = _layer(out_f, in_f)
    h, gs = st["hessian"].float(), st["out_grad_sq"]
    families: dict[str, list] = {}
    for e in parse_encodings(menu):
        families.setdefault(e.key, []).append(e)
    rows = []
    for encs in families.values():
        launches: list = []
        with gpu_paths(batched, launches), HostSyncCounter() as c:
            quantize_unit(w, encs, st, lambda dw: linear_damage(dw, h, gs), {})
        rows.append((" / ".join(e.label for e in encs), c.dispatches, c.syncs, len(launches)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--menu", action="append", help="encodings or a preset (repeatable; default: mixed-blocks and quick)")
    ap.add_argument("--shape", default="1536x576", help="OUTxIN of the layer (default: the default model's gate/up)")
    args = ap.parse_args()
    out_f, in_f = (int(v) for v in args.shape.split("x"))
    torch.set_num_threads(1)
    print(f"one {out_f} x {in_f} layer's candidates on the torch path a GPU takes, counted on the CPU (torch {torch.__version__})\n")
    print("| menu | family | dispatches, one after another | dispatches, GPU's batched paths (+ fused launches) | "
          "host reads: before -> after |")
    print("|---|---|---|---|---|")
    for menu in args.menu or ["mixed-blocks", "quick"]:
        before, after = count(menu, out_f, in_f, False), count(menu, out_f, in_f, True)
        for (fam, d0, s0, _), (_, d1, s1, k1) in zip(before, after):
            print(f"| {menu} | {fam} | {d0:,} ({d0 / in_f:.1f} per column) | {d1:,} ({d1 / in_f:.1f}) + {k1} | {s0} -> {s1} |")
        t0, t1 = sum(r[1] for r in before), sum(r[1] for r in after)
        print(f"| {menu} | all | {t0:,} | {t1:,} + {sum(r[3] for r in after)} ({t0 / t1:.1f}x fewer) | "
              f"{sum(r[2] for r in before)} -> {sum(r[2] for r in after)} |")


if __name__ == "__main__":
    main()

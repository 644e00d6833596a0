"""Error feedback on the CPU: numpy per-column steps against torch ops throughout, in the same run, same bytes.

``qrecover.schemes.feedback.NUMPY_ON_CPU`` runs the per-column steps of GPTQ-style error feedback (palettization's
code assignment, GPTQ) on numpy views of the same memory; False is torch ops throughout (a GPU without the fused kernel). This times both
on the default model's (SmolLM2-135M) layer shapes with random weights and a Hessian from random inputs of uneven
channel scales, the candidates of the quick menu (palettize 2/3/4 whole-row and b192 tables, GPTQ 3/4-bit g64), one
thread, and checks that every stored tensor is equal. It also counts, on the torch path (what a GPU runs), the ATen
dispatches per input column and the host reads of a device value (``HostSyncCounter``): a CPU-side proxy for the
launches and waits of compression on a GPU, which has not been timed; and the same count with the fused block kernel
that a GPU runs instead of the per-column operators (``qrecover.kernels.feedback_kernel``; its launch stubbed here).

    python benchmarks/feedback_speed.py            # ~1 min on one core
    python benchmarks/feedback_speed.py --repeat 3 # best of 3 per cell
    python benchmarks/feedback_speed.py --device cuda   # on a GPU: one operator after another against the batched
                                                        # paths, the default model's and Llama-3.1-8B's shapes (~1-2 min)

On a GPU (``--device cuda``) each candidate family's whole ``quantize_many`` (k-means included, the quick menu's
families) is timed both ways after a warm-up call each (the kernel's compile, reported apart), and the stored tensors
compared: one operator after another (the per-column error feedback, k-means width by width with a read every
iteration), as a GPU ran compression until 2026-11-29, against the fused error-feedback kernel and k-means of every
width at once.
"""

from __future__ import annotations

import argparse
import contextlib
import time

import torch
from torch.utils._python_dispatch import _disable_current_modes

from qrecover.recovery.host_sync import HostSyncCounter
from qrecover.schemes import feedback, get_quantizer, gptq, palettize

SHAPES = {"q/o/gate/up (576 in)": (1536, 576), "down (1536 in)": (576, 1536), "k/v (576 in)": (192, 576)}
CANDIDATES = {"palettize 2/3/4": ("palettize", {}, [2, 3, 4]),
              "palettize 2/3/4 b192": ("palettize", dict(block_size=192, block_fit="nearest"), [2, 3, 4]),
              "gptq 3/4 g64": ("gptq", dict(group_size=64, act_order=False), [3, 4])}


def _layer(out_f: int, in_f: int):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2048, in_f, generator=g) * torch.rand(in_f, generator=g).add(0.05)
    return torch.randn(out_f, in_f, generator=g) * 0.02, {"hessian": (x.T @ x).double(), "input_sq": (x**2).mean(0)}


def _time(fn, repeat: int):
    best, out = float("inf"), None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t)
    return best, out


def _fused_count(fn, in_f: int) -> str:
    """Operators dispatched and kernel launches per input column with the fused block kernel (what a GPU runs,
    :mod:`qrecover.kernels.feedback_kernel`), counted on the CPU: the launch is replaced by a stub that counts it and
    zero-fills its codes (the kernel's arithmetic is tested under the interpreter, tests/test_feedback_kernel.py)."""
    try:
        from qrecover.kernels import feedback_kernel
    except ImportError:
        return "(triton not installed)"
    launches = []

    def stub(rule, wb, errs, u, codes, j0, k0, k1):
        launches.append(1)
        with _disable_current_modes():
            codes[j0 + k0:j0 + k1].zero_()
            errs[k0:k1].zero_()

    real, devices = feedback_kernel.run, feedback.FUSED_DEVICES
    feedback_kernel.run, feedback.FUSED_DEVICES = stub, {"cpu"}
    try:
        with HostSyncCounter() as counted:
            fn()
    finally:
        feedback_kernel.run, feedback.FUSED_DEVICES = real, devices
    return f"{counted.dispatches / in_f:.2f} + {len(launches) / in_f:.3f}"


GPU_SHAPES = {**{f"default model {k}": v for k, v in SHAPES.items()},
              "8B q/o": (4096, 4096), "8B k/v": (1024, 4096), "8B gate/up": (14336, 4096), "8B down": (4096, 14336)}
GPU_CANDIDATES = {**{k: v for k, v in CANDIDATES.items() if k.startswith("palettize")},
                  "gptq 3/4 g64 (act order)": ("gptq", dict(group_size=64), [3, 4])}


def _cuda_time(fn, repeat: int):
    best, out = float("inf"), None
    for _ in range(repeat):
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best, out


@contextlib.contextmanager
def _gpu_paths(device: str, batched: bool):
    """The GPU's batched compression paths on ``device`` (the fused error-feedback kernel, the batched GPTQ range
    search, k-means of every width at once read every 8 iterations) or none of them: one operator after another, as a
    GPU ran compression until 2026-11-29."""
    saved = (feedback.FUSED_DEVICES, gptq.BATCHED_SEARCH, palettize.BATCHED_KMEANS, palettize.KMEANS_CHECK_EVERY)
    on = {device} if batched else set()
    feedback.FUSED_DEVICES, gptq.BATCHED_SEARCH, palettize.BATCHED_KMEANS = set(on), set(on), set(on)
    palettize.KMEANS_CHECK_EVERY = {**saved[3], device: 8 if batched else 1}
    try:
        yield
    finally:
        feedback.FUSED_DEVICES, gptq.BATCHED_SEARCH, palettize.BATCHED_KMEANS, palettize.KMEANS_CHECK_EVERY = saved


def _both_paths(q, w: torch.Tensor, stats: dict, bits: list[int], repeat: int):
    """``{path: (warm-up s, best s, results)}`` one operator after another ("torch") and with the batched paths and
    the fused kernel ("fused")."""
    runs = {}
    for name, batched in (("torch", False), ("fused", True)):
        with _gpu_paths(w.device.type, batched):
            warm, _ = _cuda_time(lambda: q.quantize_many(w, bits, stats), 1)
            runs[name] = (warm, *_cuda_time(lambda: q.quantize_many(w, bits, stats), repeat))
    return runs


def gpu_main(repeat: int) -> None:
    """One operator after another against the batched paths and the fused block kernel, on the GPU, same bytes."""
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}; seconds per layer (all widths of a family in one "
          f"pass, k-means included), best of {repeat} after a warm-up call each\n")
    print("| layer (out x in) | candidate family | one operator after another (s) | batched paths + fused kernel (s) | "
          "speed-up | bytes equal | warm-up calls (s): before / after |")
    print("|---|---|---|---|---|---|---|")
    totals = [0.0, 0.0]
    for shape_name, (rows, cols) in GPU_SHAPES.items():
        w, stats = _layer(rows, cols)
        w, stats = w.cuda(), {k: v.cuda() for k, v in stats.items()}
        for cand, (scheme, params, bits) in GPU_CANDIDATES.items():
            runs = _both_paths(get_quantizer(scheme, **params), w, stats, bits, repeat)
            (warm_t, best_t, out_t), (warm_f, best_f, out_f) = runs["torch"], runs["fused"]
            same = all(torch.equal(a.tensors[k], b.tensors[k]) for a, b in zip(out_t, out_f) for k in a.tensors)
            totals[0] += best_t
            totals[1] += best_f
            print(f"| {shape_name}: {rows} x {cols} | {cand} | {best_t:.3f} | {best_f:.3f} | {best_t / best_f:.1f}x | {same} | "
                  f"{warm_t:.2f} / {warm_f:.2f} |", flush=True)
        torch.cuda.empty_cache()
    print(f"| all | | {totals[0]:.2f} | {totals[1]:.2f} | {totals[0] / totals[1]:.1f}x | | |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=1, help="best of this many runs per cell")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: the per-column torch path against "
                    "the fused block kernel on the GPU")
    args = ap.parse_args()
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device here; run it on a GPU machine (benchmarks/gpu_session.sh feedback)")
        return gpu_main(args.repeat)
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; seconds per layer (all widths of the candidate in one pass)\n")
    print("| layer (out x in) | candidate | torch ops (s) | numpy steps (s) | speed-up | bytes equal | torch path: dispatches "
          "per column | fused block kernel (GPU path): operators + launches per column | host reads |")
    print("|---|---|---|---|---|---|---|---|---|")
    totals = [0.0, 0.0]
    for shape_name, (out_f, in_f) in SHAPES.items():
        w, stats = _layer(out_f, in_f)
        for cand, (scheme, params, bits) in CANDIDATES.items():
            q = get_quantizer(scheme, **params)
            feedback.NUMPY_ON_CPU = False
            slow_s, slow = _time(lambda: q.quantize_many(w, bits, stats), args.repeat)
            feedback.NUMPY_ON_CPU = True
            fast_s, fast = _time(lambda: q.quantize_many(w, bits, stats), args.repeat)
            same = all(torch.equal(a.tensors[k], b.tensors[k]) for a, b in zip(fast, slow) for k in a.tensors)
            totals[0] += slow_s
            totals[1] += fast_s
            feedback.NUMPY_ON_CPU = False
            with HostSyncCounter() as counted:  # a run of its own: the counting slows it
                q.quantize_many(w, bits, stats)
            fused = _fused_count(lambda: q.quantize_many(w, bits, stats), in_f)
            feedback.NUMPY_ON_CPU = True
            print(f"| {shape_name}: {out_f} x {in_f} | {cand} | {slow_s:.3f} | {fast_s:.3f} | {slow_s / fast_s:.2f}x | {same} | "
                  f"{counted.dispatches / in_f:.1f} | {fused} | {counted.syncs} |")
            if not same:
                raise SystemExit("the numpy steps changed the bytes")
    print(f"| all | | {totals[0]:.2f} | {totals[1]:.2f} | {totals[0] / totals[1]:.2f}x | | | | |")


if __name__ == "__main__":
    main()

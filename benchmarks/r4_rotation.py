"""r4's online rotation on a GPU: the Triton kernel (qrecover/kernels/fwht.py) against the torch reference (butterflies,
``hadamard.rotate`` with kernels off) and a dense ``x @ R``, beside the fp16 ``down_proj`` matmul it precedes.

For each intermediate size (the default model's 1536, Llama-3.2-1B's 8192, Llama-3.1-8B's 14336) and row count (1
decode token, 16, 2048 prefill tokens), fp16: the kernel's largest error against the float64 rotation, then
microseconds per call, L2-cold for the ``down_proj`` weight (``benchmarks/kernel_timing.cold_ms``: copies rotated
inside one CUDA graph; the activations are small and stay in L2 for every row alike). Warm-up (compilation) is
excluded and reported apart.

    python benchmarks/r4_rotation.py                 # CUDA: the table (about 30 s on an H100)
    python benchmarks/r4_rotation.py --out DIR       # also DIR/r4_rotation.json

Without CUDA it checks the kernel under triton's interpreter at one small size and says that timings need a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

SIZES = {1536: 576, 8192: 2048, 14336: 4096}  # intermediate size -> hidden size (down_proj's outputs)
ROWS = (1, 16, 2048)
SEED = 2000


def error(n: int, device: str) -> float:
    from qrecover.kernels import fwht
    from qrecover.transforms.hadamard import fwht_operands, kernel_factor, rotation

    x = torch.randn(4, n, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    want = x @ rotation(n, "fwht", SEED)
    got = fwht.rotate_rows(x.to(device, torch.float16), fwht_operands(n, SEED, device, torch.float32)[0], kernel_factor(n, device))
    return float((got.double().cpu() - want).abs().max() / want.abs().max())


def row(n: int, m: int) -> dict:
    from kernel_timing import cold_ms, l2_bytes, n_copies

    from qrecover.kernels import fwht
    from qrecover.transforms.hadamard import fwht_operands, kernel_factor, rotate, rotation

    hidden = SIZES[n]
    x = torch.randn(m, n, device="cuda", dtype=torch.float16)
    s, a = fwht_operands(n, SEED, "cuda", torch.float32)[0], kernel_factor(n, "cuda")
    t0 = time.perf_counter()
    fwht.rotate_rows(x, s, a)
    torch.cuda.synchronize()
    warm = time.perf_counter() - t0
    dense_r = rotation(n, "fwht", SEED).to("cuda", torch.float16)
    copies = n_copies(hidden * n * 2, l2_bytes())
    ws = [torch.randn(hidden, n, device="cuda", dtype=torch.float16) for _ in range(copies)]
    os.environ["QRECOVER_KERNELS"] = "0"
    ref_us = cold_ms([lambda: rotate(x, n, "fwht", SEED)]) * 1e3
    os.environ.pop("QRECOVER_KERNELS")
    return {"n": n, "rows": m, "warmup_s": round(warm, 3),
            "kernel_us": cold_ms([lambda: fwht.rotate_rows(x, s, a)]) * 1e3,
            "torch_butterflies_us": ref_us,
            "dense_xR_us": cold_ms([lambda: x @ dense_r]) * 1e3,
            "down_proj_fp16_us": cold_ms([lambda w=w: x @ w.T for w in ws]) * 1e3}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).parent))
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
        print(f"no CUDA: interpreter check only; max relative error at 1536 (fp16): {error(1536, 'cpu'):.2e}; "
              "timings need a GPU (bash benchmarks/gpu_session.sh r4)")
        return 0
    print(f"{torch.cuda.get_device_name()}: r4 rotation, fp16, microseconds per call (down_proj L2-cold)")
    print("| intermediate | rows | max rel. error | kernel | torch butterflies | dense x @ R | down_proj fp16 | kernel / down_proj | warm-up s |")
    print("|---|---|---|---|---|---|---|---|---|")
    rows = []
    for n in SIZES:
        err = error(n, "cuda")
        for m in ROWS:
            r = dict(row(n, m), max_rel_error=err)
            rows.append(r)
            print(f"| {n} | {m} | {err:.1e} | {r['kernel_us']:.1f} | {r['torch_butterflies_us']:.1f} | {r['dense_xR_us']:.1f} | "
                  f"{r['down_proj_fp16_us']:.1f} | {r['kernel_us'] / r['down_proj_fp16_us']:.2f} | {r['warmup_s']:.2f} |", flush=True)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "r4_rotation.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

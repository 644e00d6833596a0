"""Every GPU kernel of a training step and of serving, compiled for sm_90 through its real launch, on the CPU.

A check, not a timing. Triton's JIT is given a driver that answers only what a compilation asks
(``benchmarks/tuner_compile.py``); each kernel is called as qrecover calls it, with CPU tensors of the real shapes
and dtypes: triton specializes and compiles it for sm_90, and only the launch itself then fails (no GPU). A kernel
that does not compile (an error of triton's front end, or PTX that ptxas rejects) fails before that, and is named.
Covered: Liger Kernel's RMSNorm, SwiGLU and rotary embedding (the training step's fused layers, forward and backward), the
distillation loss kernel, the multi-adapter LoRA shrink and expand (fp16 and int8 adapters), r4's Hadamard rotation. The
tuner's dequant-matmul candidates: ``tuner_compile.py --every-candidate``.

    python benchmarks/launch_compile.py                   # bf16 and fp16, ~30 s on 2 cores
    .venv-gpu/bin/python benchmarks/launch_compile.py     # with the GPU machine's triton 3.6 (scripts/gpu_versions_venv.sh)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.tuner_compile import DRIVER, child_env  # noqa: E402

_CHILD = DRIVER + r"""
import torch

LAUNCH = "compile-only driver"


def _refuse(self, name):  # after a compilation, the launch asks the driver for more: say so by name
    raise RuntimeError(f"{LAUNCH}: no {name}")


CompileOnlyDriver.__getattr__ = _refuse


def attempt(label, fn):
    try:
        fn()
    except Exception as e:  # the launch's refusal means the compilation went through
        return {"kernel": label, "compiled": LAUNCH in str(e), "error": "" if LAUNCH in str(e) else
                f"{type(e).__name__}: {str(e)[:400]}"}
    return {"kernel": label, "compiled": False, "error": "it ran: the driver was not the compile-only one"}


rows = []
for name in sys.argv[1].split(","):
    dt = getattr(torch, name)
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction
    from liger_kernel.ops.rope import LigerRopeFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    from qrecover.kernels import fwht, kd_loss
    from qrecover.kernels import multi_adapter as ma

    rows.append(attempt(f"Liger RMSNorm {name}", lambda: LigerRMSNormFunction.apply(
        torch.randn(64, 2048, dtype=dt), torch.ones(2048, dtype=dt), 1e-6)))
    rows.append(attempt(f"Liger SwiGLU {name}", lambda: LigerSiLUMulFunction.apply(
        torch.randn(2, 16, 8192, dtype=dt), torch.randn(2, 16, 8192, dtype=dt))))
    rows.append(attempt(f"Liger rotary embedding {name}", lambda: LigerRopeFunction.apply(
        torch.randn(1, 32, 16, 64, dtype=dt), torch.randn(1, 8, 16, 64, dtype=dt), torch.randn(1, 16, 64, dtype=dt),
        torch.randn(1, 16, 64, dtype=dt))))
    # their backward kernels, called as the autograd functions call them (liger-kernel 0.8.5's module functions)
    from liger_kernel.ops.rms_norm import _str_to_casting_mode, rms_norm_backward
    from liger_kernel.ops.rope import rope_backward
    from liger_kernel.ops.swiglu import swiglu_backward
    from liger_kernel.ops.utils import calculate_settings

    block, warps = calculate_settings(2048)
    rows.append(attempt(f"Liger RMSNorm backward {name}", lambda: rms_norm_backward(
        torch.randn(64, 2048, dtype=dt), torch.randn(64, 2048, dtype=dt), torch.ones(2048, dtype=dt), torch.ones(64),
        0.0, _str_to_casting_mode["llama"], block, warps, False, None)))
    rows.append(attempt(f"Liger SwiGLU backward {name}", lambda: swiglu_backward(
        torch.randn(2, 16, 8192, dtype=dt), torch.randn(2, 16, 8192, dtype=dt), torch.randn(2, 16, 8192, dtype=dt))))
    rows.append(attempt(f"Liger rotary embedding backward {name}", lambda: rope_backward(
        torch.randn(1, 32, 16, 64, dtype=dt), torch.randn(1, 8, 16, 64, dtype=dt), torch.randn(1, 16, 64, dtype=dt),
        torch.randn(1, 16, 64, dtype=dt))))
    rows.append(attempt(f"distillation loss {name}", lambda: kd_loss.kd_loss_and_grad(
        torch.randn(8, 49152, dtype=dt), torch.randn(8, 49152, dtype=dt))))
    x, y, idx, s = torch.randn(16, 4096, dtype=dt), torch.zeros(16, 4096, dtype=dt), torch.arange(16) % 8, torch.ones(8)
    a16, b16 = torch.randn(8, 16, 4096, dtype=dt), torch.randn(8, 4096, 16, dtype=dt)
    a8, b8 = torch.randint(-127, 127, (8, 16, 4096), dtype=torch.int8), torch.randint(-127, 127, (8, 4096, 16), dtype=torch.int8)
    a_scale, b_scale = torch.ones(8, 16, dtype=torch.float16), torch.ones(8, 4096, dtype=torch.float16)
    partials = torch.randn(4, 16, 16)  # the shrink's per-split sums, as the expand reads them
    rows.append(attempt(f"multi-adapter shrink, fp16 adapters {name}", lambda: ma.lora_shrink(x, a16, idx)))
    rows.append(attempt(f"multi-adapter shrink, int8 adapters {name}", lambda: ma.lora_shrink(x, a8, idx, a_scale)))
    rows.append(attempt(f"multi-adapter expand, fp16 adapters {name}", lambda: ma.lora_expand(partials, b16, s, idx, y)))
    rows.append(attempt(f"multi-adapter expand, int8 adapters {name}", lambda: ma.lora_expand(partials, b8, s, idx, y,
                                                                                                b_scale)))
    P, B = fwht.split(2048, 1, 2048)
    rows.append(attempt(f"r4 Hadamard rotation {name}", lambda: fwht.rotate_rows(
        torch.randn(16, 2048, dtype=dt), torch.ones(2048), torch.ones(P, P))))
print(json.dumps({"triton": triton.__version__, "rows": rows}))
"""


def check(dtypes: str = "bfloat16,float16") -> dict:
    """Compile every kernel above for sm_90 in a fresh process and triton cache; one row per kernel and dtype."""
    with tempfile.TemporaryDirectory() as cache:
        proc = subprocess.run([sys.executable, "-c", _CHILD, dtypes], env=child_env(cache), capture_output=True,
                              text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"the check failed to run:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtypes", default="bfloat16,float16")
    args = ap.parse_args(argv)
    r = check(args.dtypes)
    for row in r["rows"]:
        print(f"{'compiled' if row['compiled'] else 'FAILED  '}  {row['kernel']}{'  ' + row['error'] if row['error'] else ''}")
    failed = [row for row in r["rows"] if not row["compiled"]]
    print(f"{len(r['rows']) - len(failed)} of {len(r['rows'])} kernels compiled for sm_90 (triton {r['triton']})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

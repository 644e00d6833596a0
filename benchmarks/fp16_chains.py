"""Numerics of the fp16 pair-FMA decode kernels (``LUT_REGS_H2``, ``LUT_REGS_NIBBLES_H2``) against float64.

The register-table decode kernel can multiply looked-up fp16 weight pairs by fp16 activation pairs with
``fma.rn.f16x2`` in short chains (at most 8 products) flushed to fp32 (docs/kernels.md, "Register tables"); the tuner
times those variants only where torch allows reduced-precision fp16 reductions. This prints the relative error of
each accumulation against float64 on a palettize-3 (or ``--bits 2/4``) layer, beside the fp16 output's own rounding, for Gaussian
activations and for activations with 0.2% of entries 100x larger. It runs the real kernels: under triton's
interpreter on a CPU (``TRITON_INTERPRET=1`` is set when there is no GPU; a few minutes), compiled on a GPU.

    python benchmarks/fp16_chains.py [--rows 64] [--cols 14336] [--bits 3]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from qrecover import kernels  # noqa: E402
from qrecover.kernels import gemv  # noqa: E402
from qrecover.kernels.formats import Config  # noqa: E402
from qrecover.qlinear import QuantLinear  # noqa: E402
from qrecover.schemes import get_quantizer  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=14336)
    ap.add_argument("--bits", type=int, default=3, choices=[2, 3, 4],
                    help="palettize bits (2/4-bit: each fp16 chain spans 2/4 tiles of 32 inputs)")
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    w = torch.randn(args.rows, args.cols, generator=g) * 0.02
    layer = QuantLinear(get_quantizer("palettize").quantize(w, args.bits, {})).to(dev).eval()
    ref_w = layer.dequantize(torch.float64)
    # 4-bit codes are nibbles already: the register tables read them in place
    modes = (gemv.LUT_REGS, gemv.LUT_REGS_H2) if args.bits == 4 else (gemv.LUT_REGS_NIBBLES, gemv.LUT_REGS_NIBBLES_H2)
    names = ("LUT_REGS", "LUT_REGS_H2") if args.bits == 4 else ("LUT_REGS_NIBBLES", "LUT_REGS_NIBBLES_H2")
    print(f"palettize-{args.bits} {args.rows}x{args.cols}, batch 1, fp16 activations ({dev}); relative error to float64:")
    print(f"| activations | fp32 accumulation ({names[0]}) | fp16 pair chains ({names[1]}) | fp16 output rounding |")
    print("|---|---|---|---|")
    for name, scale in (("Gaussian", None), ("0.2% of entries x100", 100.0)):
        x = torch.randn(1, args.cols, generator=g)
        if scale:
            x = x * torch.where(torch.rand(1, args.cols, generator=g) < 0.002, scale, 1.0)
        x = x.half().to(dev)
        ref = x.double() @ ref_w.T
        errs = []
        for mode in modes:
            y = kernels.fused_linear(layer, x, config=Config(1, 32, 256, 4, False, asm=dev == "cuda", lut=mode))
            errs.append(float((y.double() - ref).norm() / ref.norm()))
        rounding = float((ref.half().double() - ref).norm() / ref.norm())
        print(f"| {name} | {errs[0]:.1e} | {errs[1]:.1e} | {rounding:.1e} |")


if __name__ == "__main__":
    main()

"""Compile the kernels for an NVIDIA architecture without a GPU, and report their registers and spills.

The interpreter (``TRITON_INTERPRET=1``) checks what the kernels compute, not whether they compile:
it accepts constructs the GPU compiler rejects and says nothing about register pressure. Triton ships its
compiler and ``ptxas``, so this compiles each kernel variant to a cubin for ``--arch`` (90 = H100/H200)
on any machine, and reads the resource usage with the bundled ``cuobjdump``:

    python -m qrecover.kernels.compile_check            # a representative set, sm_90
    python -m qrecover.kernels.compile_check --all      # every format x bits x path x dtype
    python -m qrecover.kernels.compile_check --smoke    # two variants and the small kernels (the test suite)
    python -m qrecover.kernels.compile_check --isa      # + instructions per decoded weight in the main loop (isa.py)

Run it without ``TRITON_INTERPRET`` set (the kernels must be compiled functions, not interpreted ones).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from . import feedback_kernel, fwht, gemv, isa, kd_loss, multi_adapter_kernels, qmatmul, qmm_dot

_INTS = ("M", "N", "K", "n_cblocks", "zp_nbytes", "k_split", "stride_xm", "stride_om", "stride_os")


#: integer arguments that are multiples of 16 at the benchmark's shapes (4096/14336 features, split-K tiles), which
#: triton's launcher specializes as such at run time (``--aligned``)
ALIGNED_INTS = ("N", "K", "row_words", "k_split", "stride_xm", "stride_om", "stride_os")
#: compile as the launcher specializes at run time: 16-byte aligned pointers, ALIGNED_INTS divisible by 16, M == 1
#: for batch-1 tiles (set by ``--aligned``; off by default, the setting of the tables in docs/kernels.md before 11-28)
ALIGNED = False


def _compile(fn, signature: dict[str, str], constexprs: dict[str, object], target: GPUTarget, **options):
    if ALIGNED and constexprs.get("BLOCK_M") == 1 and "M" in signature:
        signature = {k: v for k, v in signature.items() if k != "M"}
        constexprs = dict(constexprs, M=1)
    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    names = [n for n in fn.arg_names]
    sig = {n: sig[n] for n in names if n in sig}
    attrs = {}
    if ALIGNED:
        attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in signature.items()
                 if v.startswith("*") or k in ALIGNED_INTS}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    return triton.compile(src, target=target, options=options)


def _tool(name: str) -> Path:
    """A CUDA binary tool: triton's bundled copy, else the CUDA toolkit's."""
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    return bundled if bundled.exists() else Path("/usr/local/cuda/bin") / name


def sass(kernel) -> str | None:
    """The kernel's SASS from ``nvdisasm`` (None when no disassembler is found: use ``kernel.asm['ptx']``)."""
    tool = _tool("nvdisasm")
    if not tool.exists():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        return subprocess.run([str(tool), "-c", str(cubin)], capture_output=True, text=True, check=True).stdout


def isa_row(kernel, num_warps: int, weights_per_iter: int, every: int = 1) -> dict:
    """Thread instructions per decoded weight by kind (main loop, SASS or else PTX), and the loop's length. ``every``:
    the blocks a forward branch inside the loop skips run once per ``every`` iterations (the decode kernel's flush of
    its fp16 chains, :func:`chain_tiles`)."""
    text = sass(kernel)
    ptx = text is None
    always, skipped = isa.loop_parts(kernel.asm["ptx"] if ptx else text, ptx=ptx)
    counts = isa.categorise(always, ptx)
    for k, v in isa.categorise(skipped, ptx).items():
        counts[k] += v / every
    row = isa.per_weight(counts, num_warps, weights_per_iter)
    return dict(row, loop=len(always) + len(skipped), source="ptx" if ptx else "sass")


def chain_tiles(const: dict) -> int:
    """Tiles per fp16 chain of a decode-kernel variant (``gemv``'s ``CHAIN_TILES``: 1 unless fp16 pair FMAs on 2/4-bit
    codes), i.e. how often its flush block runs."""
    if const.get("LUT", 0) not in gemv.H2_MODES:
        return 1
    codes_per_group = 32 if const["BITS"] == 3 else 32 // const["BITS"]  # gemv's CPG
    return 32 // codes_per_group


def resources(kernel) -> dict[str, int]:
    """``{"REG": registers per thread, "STACK": spill stack bytes, "SHARED": static shared bytes, ...}``."""
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "k.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        tool = _tool("cuobjdump")
        out = subprocess.run([str(tool), "--dump-resource-usage", str(cubin)], capture_output=True, text=True,
                             check=True).stdout
    return {k: int(v) for k, v in re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", out)}


def qmm_variants(level: str):
    """``(label, signature, constexprs, options)`` for the dequant-matmul kernel; level: smoke, default or all."""
    dtypes = [("fp16", False), ("bf16", False), ("fp32", True)] if level == "all" else [("fp16", False)]
    formats = [(0, b, False) for b in (2, 3, 4, 8)] + [(1, b, zp) for b in (2, 3, 4, 8) for zp in (False, True)]
    if level != "all":
        formats = [(0, 3, False), (0, 4, False), (1, 4, False), (1, 3, True)]
    paths = [(False, False, 1, 32, 128, 4, 2), (False, True, 16, 64, 64, 4, 2), (True, True, 64, 128, 64, 8, 3)]
    combos = [(d, f, p) for d in dtypes for f in formats for p in paths]
    if level == "smoke":  # one GEMV and one tiled variant, the 3-bit straddling decode in both
        combos = [(dtypes[0], formats[0], paths[0]), (dtypes[0], formats[3], paths[2])]
    for (dt, ieee), (scheme, bits, zp), (direct, dot, bm, bn, bk, warps, stages) in combos:
        sig = {"x_ptr": f"*{dt}", "qw_ptr": "*i32", "lut_ptr": "*fp16", "scale_ptr": "*fp16", "zp_ptr": "*u8",
               "bias_ptr": f"*{dt}", "out_ptr": f"*{dt}" if direct else "*fp32", **{k: "i32" for k in _INTS}}
        const = dict(SCHEME=scheme, BITS=bits, GROUP=16 if scheme == 0 else 1, CBLOCK=4096 if scheme == 0 else 64,
                     HAS_ZP=zp, HAS_BIAS=True, DIRECT=direct, USE_DOT=dot, IEEE=ieee, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
        label = (f"{'palettize' if scheme == 0 else 'blockwise'}-{bits}{'-zp' if zp else ''} {dt} "
                 f"{'tiled' if bm > 16 else 'gemv'} {bm}x{bn}x{bk} w{warps}")
        yield label, sig, const, dict(num_warps=warps, num_stages=stages)


def _lut_type(scheme: int, lut: int) -> str:
    """The pointer type of a decode kernel's tables in layout ``lut`` (``gemv.LUT_*``; blockwise: its fp16 scales)."""
    if scheme != 0:
        return "*fp16"
    return ("*fp16", "*fp32", "*i64")[lut] if lut < gemv.LUT_REGS else "*i32"  # register tables: int32 byte planes


def gemv_variants(level: str, tiles: list[tuple[int, int, int, int]] | None = None, pipes: tuple[int, ...] = (0,)):
    """``(label, signature, constexprs, options)`` for the decode kernel (:mod:`.gemv`), batch 1, each lut mode;
    ``tiles``: ``(block_m, block_n, block_k, warps)`` in place of the two default tiles; ``pipes``: the code words'
    pipelining (``Config.pipe``: 0 by hand in registers, >= 2 triton's pipeliner through shared memory)."""
    dtypes = ["fp16", "bf16", "fp32"] if level == "all" else ["fp16"]
    formats = [(0, 2, False, gemv.LUT_PAIRS), (0, 3, False, gemv.LUT_PAIRS), (0, 3, False, gemv.LUT_FP32),
               (0, 3, False, gemv.LUT_FP16),
               (0, 4, False, gemv.LUT_PAIRS), (0, 4, False, gemv.LUT_FP32),
               (0, 4, False, gemv.LUT_FP16), (0, 8, False, gemv.LUT_FP32), (1, 2, False, 0), (1, 3, True, 0),
               (1, 4, False, 0), (1, 4, True, 0), (1, 8, False, 0), (1, 4, False, gemv.BLOCKWISE_H2),
               (1, 4, True, gemv.BLOCKWISE_H2)]
    formats += [(0, bits, False, mode) for bits in (3, 4, 2) for mode in gemv.register_modes(gemv.Format(0, bits, 16, 32, 16, 32, False))]
    if level != "all":
        formats = [f for f in formats if f[:2] in ((0, 3), (0, 4), (1, 4)) or f[2]]
    tiles = tiles or ([(1, 64, 128, 4), (1, 128, 256, 4)] if level != "smoke" else [(1, 64, 128, 4)])
    for dt in dtypes:
        for scheme, bits, zp, lut in formats[:1] if level == "smoke" else formats:
            if lut in gemv.H2_MODES and dt != "fp16":  # fp16 pair FMAs take fp16 activations only
                continue
            asms = (False, True) if (scheme == 0 and lut) or bits in (3, 4) else (False,)  # inline-PTX loads (tables, words)
            for (bm, bn, bk, warps), asm, pipe in [(t, a, p) for t in tiles for a in asms for p in pipes]:
                xp = {"fp16": gemv.X_FP16_PAIRS, "bf16": gemv.X_BF16_PAIRS}.get(dt, gemv.X_PLAIN)
                lut_t = _lut_type(scheme, lut)
                sig = {"x_ptr": "*i32" if xp else f"*{dt}", "qw_ptr": "*i32", "lut_ptr": lut_t, "scale_ptr": "*fp16",
                       "zp_ptr": "*u8", "bias_ptr": f"*{dt}", "out_ptr": "*fp32", "final_ptr": f"*{dt}", "cnt_ptr": "*i32",
                       **{k: "i32" for k in ("M", "N", "K", "row_words", "n_cblocks", "zp_nbytes", "k_split",
                                              "stride_xm", "stride_om", "stride_os")}}
                const = dict(SCHEME=scheme, BITS=bits, GROUP=16 if scheme == 0 else 1, CBLOCK=4096 if scheme == 0 else 64,
                             HAS_ZP=zp, HAS_BIAS=False, LUT=lut, DIRECT=False, XP=xp, ASM=asm, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                             ROW_TABLES=scheme == 0 and lut >= gemv.LUT_REGS, PIPE=pipe,  # register tables: loaded once
                             SERIAL=False, S_PAD=1)
                name = f"{'palettize' if scheme == 0 else 'blockwise'}-{bits}{'-zp' if zp else ''}"
                lut_name = ("", " fp32-lut", " pair-lut", " reg-lut", " reg-lut nibbles", " reg-lut h2",
                            " reg-lut nibbles h2")[lut] if scheme == 0 else (" h2" if lut == gemv.BLOCKWISE_H2 else "")
                yield (f"{name} {dt} decode {bm}x{bn}x{bk}{lut_name}{' asm' if asm else ''}{f' pipe{pipe}' if pipe else ''} w{warps}",
                       sig, const, dict(num_warps=warps, num_stages=2))


def dot_variants(level: str, pipes: tuple[int, ...] = (0,)):
    """``(label, signature, constexprs, options)`` for the batch 5-64 decode-and-dot kernel (:mod:`.qmm_dot`): the
    tuner's tiles for batch 16 (16x64x64, 16x64x128) and 64 (64x128x64), one stage (words prefetched by hand), or
    ``pipes`` (``Config.pipe``); the batch-16 tiles with 16-bit activations also as the transposed product
    (``Config.swap``, label ``swap``)."""
    dtypes = ["fp16", "bf16", "fp32"] if level == "all" else ["fp16"]
    formats = [(0, 2, False, gemv.LUT_PAIRS), (0, 3, False, gemv.LUT_PAIRS), (0, 4, False, gemv.LUT_PAIRS),
               (0, 4, False, gemv.LUT_FP32), (0, 8, False, gemv.LUT_FP32), (1, 2, True, 0), (1, 3, True, 0),
               (1, 4, False, 0), (1, 4, True, 0), (1, 8, False, 0), (0, 3, False, gemv.LUT_REGS),
               (0, 3, False, gemv.LUT_REGS_NIBBLES), (0, 2, False, gemv.LUT_REGS), (0, 2, False, gemv.LUT_REGS_NIBBLES),
               (0, 4, False, gemv.LUT_REGS), (1, 4, False, gemv.BLOCKWISE_H2), (1, 4, True, gemv.BLOCKWISE_H2)]
    if level != "all":
        formats = [f for f in formats if f[:3] in ((0, 3, False), (0, 4, False), (1, 4, False), (1, 3, True))]
    tiles = [(16, 64, 64, 4, 1), (16, 64, 128, 4, 1), (64, 128, 64, 8, 1)]
    if level == "smoke":
        formats, tiles = formats[:1], tiles[:1]
    for dt in dtypes:
        for scheme, bits, zp, lut in formats:
            if scheme == 1 and lut == gemv.BLOCKWISE_H2 and dt != "fp16":  # fp16 pairs: fp16 activations only
                continue
            # inline-PTX table loads; not for 3-bit codes, whose strided words they also read (more instructions)
            asms = (False, True) if (scheme == 0 and lut and (bits != 3 or lut >= gemv.LUT_REGS)) or lut == gemv.BLOCKWISE_H2 \
                else (False,)
            for (bm, bn, bk, warps, stages), asm, pipe, swap in [(t, a, p, w) for t in tiles for a in asms for p in pipes
                                                                 for w in (False, True) if not w or (t[0] < 64 and dt != "fp32")]:
                lut_t = _lut_type(scheme, lut)
                sig = {"x_ptr": f"*{dt}", "qw_ptr": "*i32", "lut_ptr": lut_t, "scale_ptr": "*fp16", "zp_ptr": "*u8",
                       "bias_ptr": f"*{dt}", "out_ptr": "*fp32",
                       **{k: "i32" for k in ("M", "N", "K", "row_words", "n_cblocks", "zp_nbytes", "k_split",
                                              "stride_xm", "stride_om", "stride_os")}}
                const = dict(SCHEME=scheme, BITS=bits, GROUP=16 if scheme == 0 else 1, CBLOCK=4096 if scheme == 0 else 64,
                             HAS_ZP=zp, HAS_BIAS=False, LUT=lut, DIRECT=False, IEEE=dt == "fp32", ASM=asm,
                             BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, ROW_TABLES=scheme == 0 and lut >= gemv.LUT_REGS,
                             PIPE=pipe, SWAP=swap)
                name = f"{'palettize' if scheme == 0 else 'blockwise'}-{bits}{'-zp' if zp else ''}"
                lut_name = ("", " fp32-lut", " pair-lut", " reg-lut", " reg-lut nibbles")[lut] if scheme == 0 else (
                    " h2" if lut == gemv.BLOCKWISE_H2 else "")
                yield (f"{name} {dt} dot-decode {bm}x{bn}x{bk}{lut_name}{' asm' if asm else ''}"
                       f"{f' pipe{pipe}' if pipe else ''}{' swap' if swap else ''} w{warps}", sig, const,
                       dict(num_warps=warps, num_stages=stages))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", type=int, default=90, help="compute capability x10 (80 = A100, 90 = H100/H200)")
    ap.add_argument("--all", action="store_true", help="every format, bit width and activation dtype")
    ap.add_argument("--smoke", action="store_true", help="two dequant-matmul variants and the small kernels (tests)")
    ap.add_argument("--isa", action="store_true", help="also thread instructions per decoded weight in the main loop, "
                    "by kind, and occupancy (sm_90 limits)")
    ap.add_argument("--match", default="", help="only the dequant-matmul variants whose label contains this text "
                    "(e.g. 'palettize-3 fp16 decode')")
    ap.add_argument("--aligned", action="store_true", help="compile as the launcher specializes at run time: aligned "
                    "pointers, shape integers divisible by 16, M = 1 at batch 1")
    ap.add_argument("--tiles", default="", help="decode-kernel tiles in place of the defaults, MxNxKwWARPS joined by "
                    "commas (e.g. '1x16x512w2,1x32x256w4')")
    ap.add_argument("--pipe", default="0", help="decode-kernel word pipelining to compile (Config.pipe), joined by "
                    "commas: 0 by hand in registers, >= 2 triton's pipeliner (e.g. '0,4')")
    args = ap.parse_args(argv)
    tiles = [tuple(int(v) for v in re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)", t).groups())
             for t in args.tiles.split(",") if t] or None
    pipes = tuple(int(p) for p in args.pipe.split(","))
    global ALIGNED
    ALIGNED = args.aligned
    if qmatmul.interpreting():
        print("TRITON_INTERPRET is set: the kernels are interpreted functions; unset it to compile", file=sys.stderr)
        return 2
    target = GPUTarget("cuda", args.arch, 32)
    print(f"triton {triton.__version__}, sm_{args.arch}")
    if args.isa:
        kinds = [k for k in isa.KINDS if k != "barrier"]
        print(f"| kernel | regs | spill B | occupancy | loop instrs | per weight: {' | '.join(kinds)} | total | "
              "weights/clk/SM ceiling (pipe) |")
        print("|---" * (7 + len(kinds)) + "|")
    else:
        print(f"| kernel (sm_{args.arch}) | registers | spill stack bytes |\n|---|---|---|")
    level = "all" if args.all else "smoke" if args.smoke else "default"
    variants = ([(qmatmul._qmm_kernel, *v) for v in qmm_variants(level)] + [(gemv._gemv_kernel, *v) for v in gemv_variants(level, tiles, pipes)]
                + [(qmm_dot._dot_decode_kernel, *v) for v in dot_variants(level, pipes)])
    for fn, label, sig, const, opts in [v for v in variants if args.match in v[1]]:
        kernel = _compile(fn, sig, const, target, **opts)
        r = resources(kernel)
        if args.isa:
            row = isa_row(kernel, opts["num_warps"], const["BLOCK_N"] * const["BLOCK_K"], chain_tiles(const))
            occ = isa.occupancy_sm90(r.get("REG", 0), kernel.metadata.shared, opts["num_warps"])
            print(f"| {label} | {r.get('REG')} | {r.get('STACK')} | {occ:.0%} | {row['loop']} | "
                  + " | ".join(f"{row[k]:.2f}" for k in kinds) + f" | **{row['total']:.2f}** | "
                  + "{:.1f} ({})".format(*isa.weights_per_clock_sm90(row)) + " |")
        else:
            print(f"| {label} | {r.get('REG')} | {r.get('STACK')} |")
    if args.isa:
        return 0
    others = [
        ("split-K reduce", qmatmul._splitk_reduce,
         {"ws_ptr": "*fp32", "bias_ptr": "*fp16", "out_ptr": "*fp16", "total": "i32", "N": "i32", "stride_os": "i32"},
         dict(SPLIT_K=4, HAS_BIAS=True, BLOCK=1024)),
        *[(f"lora shrink r16 {w}", multi_adapter_kernels._shrink_kernel,
           {"x_ptr": "*fp16", "a_ptr": f"*{w}", "a_scale_ptr": "*fp32", "idx_ptr": "*i64", "t_ptr": "*fp32", **{k: "i32" for k in (
               "M", "K", "R", "k_split", "stride_xm", "stride_an", "stride_ar")}}, dict(INT8=w == "i8", R_PAD=16, BLOCK_K=128))
          for w in ("fp16", "i8")],
        *[(f"lora expand r16 {w}", multi_adapter_kernels._expand_kernel,
           {"t_ptr": "*fp32", "b_ptr": f"*{w}", "b_scale_ptr": "*fp32", "scale_ptr": "*fp32", "idx_ptr": "*i64", "y_ptr": "*fp16",
            **{k: "i32" for k in ("M", "N", "R", "n_splits", "stride_bn", "stride_bo", "stride_ym")}},
           dict(INT8=w == "i8", R_PAD=16, BLOCK_N=128, S_PAD=64, FULL_R=True))
          for w in ("fp16", "i8")],
        *[(f"r4 rotation {n} ({P} x {B}) {dt}", fwht._fwht_rows,
           {"x_ptr": f"*{dt}", "s_ptr": "*fp32", "a_ptr": "*fp32", "out_ptr": f"*{dt}", "stride_x": "i32", "stride_o": "i32"},
           dict(P=P, P_PAD=max(16, triton.next_power_of_2(P)), B=B, LOG_B=B.bit_length() - 1, FP32_DOT=False),
           {"num_warps": 4 if P <= 16 else 8})
          for n, P, B, dt in ((1536, 12, 128, "fp16"), (14336, 112, 128, "fp16"), (4096, 32, 128, "bf16"))],
        *[(f"kd loss {dt}", kd_loss._kd_rows,
           {"s_ptr": f"*{dt}", "t_ptr": f"*{dt}", "g_ptr": f"*{dt}", "loss_ptr": "*fp32", "n_cols": "i32", "stride_s": "i32",
            "stride_t": "i32", "stride_g": "i32", "inv_temp": "fp32", "grad_scale": "fp32"}, dict(BLOCK=kd_loss.BLOCK), {"num_warps": 8})
          for dt in ("bf16", "fp32")],
        *[(f"error feedback block, {rule}", feedback_kernel._feedback_block_kernel, feedback_kernel.SIGNATURE,
           dict(MODE=mode, K=k, BLOCK_R=feedback_kernel.BLOCK_R), {"enable_fp_fusion": False, "num_warps": feedback_kernel.NUM_WARPS})
          for rule, mode, k in (("4-bit tables", feedback_kernel.TABLE, 16), ("integer grid", feedback_kernel.GRID, 2))],
    ]
    for label, fn, sig, const, *opts in others:  # opts: the compile options, where not the defaults
        r = resources(_compile(fn, sig, const, target, **(opts[0] if opts else {})))
        print(f"| {label} | {r.get('REG')} | {r.get('STACK')} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

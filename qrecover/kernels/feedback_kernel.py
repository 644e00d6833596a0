"""GPTQ-style error feedback inside one lazy block of columns, in one kernel launch (the GPU path of
:func:`qrecover.schemes.feedback.error_feedback`).

Error feedback walks the input columns one after another: round column ``k``, divide its error by the factor's
diagonal, subtract it (times row ``k`` of the factor) from every later column of the block. Rows never interact,
so one program owns a tile of rows and runs the whole sequential walk over the block's columns for them. Run as
torch operators instead, each column costs 26-31 dispatches (``benchmarks/feedback_speed.py``), which on a GPU
are as many kernel launches per column of every candidate: this is one launch per block of columns (32 by
default) and rule segment. The torch path stays what the CPU runs and what the tests compare against.

The operations and their order are the per-column steps' (``(w - q) / d``, then ``w_i - u_ki * e`` for each later
column, correctly rounded division, no fused multiply-add: ``enable_fp_fusion=False``), so the codes equal the
torch path's on the same device, and the numpy path's under the interpreter (tests/test_feedback_kernel.py).
Hand-written because no library runs GPTQ's inner loop with a caller's rounding rule (look-up tables per
row and column block); the rules are :class:`~qrecover.schemes.feedback.TableRule` and
:class:`~qrecover.schemes.feedback.GridRule`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: rows per program, one per thread of its 4 warps; each program walks the block's columns for its rows
BLOCK_R = 128
NUM_WARPS = 4
TABLE, GRID = 0, 1


@triton.jit
def _feedback_block_kernel(wb_ptr, err_ptr, u_ptr, codes_ptr, a_ptr, b_ptr, s_ptr, z_ptr, mq_ptr, grp_ptr,
                           R, n_cols, k0, k1, j0, stride_u, col_block,
                           MODE: tl.constexpr, K: tl.constexpr, BLOCK_R: tl.constexpr):
    """Columns ``k0 .. k1 - 1`` of the block ``wb (n_cols, R)`` (float32, updated in place; ``j0``: its first input
    column), each rounded, its error ``(w - q) / u[j, j]`` (``u (in, in)`` the factor, row stride ``stride_u``)
    written to ``err (n_cols, R)`` and subtracted from the block's later columns; codes into ``codes (in, R)`` int16
    at column ``j0 + k``.

    MODE TABLE: ``a (blocks, K - 1, R)`` decision edges (+inf padding), ``b (blocks, K, R)`` values; the code is the
    number of edges below ``w`` (``col_block`` input columns per table block). MODE GRID: per group of columns
    (``grp (in,)`` int32 the group of each column) ``a`` the divisor, ``s`` the scale, ``z`` the zero point
    ``(groups, R)``, ``mq (R,)`` the largest code: ``c = min(max(round(w / a) + z, 0), mq)`` (half to even), ``q = (c - z) * s``."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    mask = rows < R
    for k in range(k0, k1):
        j = j0 + k
        w = tl.load(wb_ptr + k * R + rows, mask=mask, other=0.0)
        if MODE == 0:
            blk = j // col_block
            code = tl.zeros([BLOCK_R], dtype=tl.int32)
            for e in range(K - 1):
                edge = tl.load(a_ptr + (blk * (K - 1) + e) * R + rows, mask=mask, other=0.0)
                code += (w > edge).to(tl.int32)
            q = tl.load(b_ptr + (blk * K + code) * R + rows, mask=mask, other=0.0)
        else:
            gi = tl.load(grp_ptr + j)
            z = tl.load(z_ptr + gi * R + rows, mask=mask, other=0.0)
            t = tl.math.div_rn(w, tl.load(a_ptr + gi * R + rows, mask=mask, other=1.0))
            t = tl.minimum(tl.maximum(t, -4194304.0), 4194304.0)  # |t| <= 2^22 (the clamp below gives the same codes)
            c = ((t + 12582912.0) - 12582912.0) + z  # round half to even, exactly (1.5 * 2^23: ulp 1 there)
            c = tl.minimum(tl.maximum(c, 0.0), tl.load(mq_ptr + rows, mask=mask, other=0.0))
            q = (c - z) * tl.load(s_ptr + gi * R + rows, mask=mask, other=0.0)
            code = c.to(tl.int32)
        tl.store(codes_ptr + j * R + rows, code.to(tl.int16), mask=mask)
        e = tl.math.div_rn(w - q, tl.load(u_ptr + j * stride_u + j))
        tl.store(err_ptr + k * R + rows, e, mask=mask)
        for i in range(k + 1, n_cols):  # each thread reads back only what it wrote (one row per thread): no barrier
            v = tl.load(wb_ptr + i * R + rows, mask=mask, other=0.0)
            tl.store(wb_ptr + i * R + rows, v - tl.load(u_ptr + j * stride_u + j0 + i) * e, mask=mask)


def run(rule, wb: torch.Tensor, errs: torch.Tensor, u: torch.Tensor, codes: torch.Tensor, j0: int, k0: int, k1: int) -> None:
    """Columns ``k0 .. k1 - 1`` of the block ``wb`` starting at input column ``j0`` (see :func:`_feedback_block_kernel`;
    ``u (in, in)`` the whole factor, contiguous) with ``rule``
    (:class:`~qrecover.schemes.feedback.TableRule` or :class:`~qrecover.schemes.feedback.GridRule`)."""
    n_cols, r = wb.shape
    grid = (triton.cdiv(r, BLOCK_R),)
    if rule.kind == "table":
        a, b, s, z, mq, grp = rule.edges, rule.tables, wb, wb, wb, codes
        mode, k, col_block = TABLE, rule.tables.shape[1], rule.cols
    else:
        a, b, s, z, mq, grp = rule.safe, wb, rule.scale, rule.zero, rule.maxq, rule.group_of
        mode, k, col_block = GRID, 2, 1
    _feedback_block_kernel[grid](wb, errs, u, codes, a, b, s, z, mq, grp, r, n_cols, k0, k1, j0, u.stride(0), col_block,
                                 MODE=mode, K=k, BLOCK_R=BLOCK_R, num_warps=NUM_WARPS, **({} if interpreting() else {"enable_fp_fusion": False}))


def interpreting() -> bool:
    """True when the kernel was built for triton's interpreter (``TRITON_INTERPRET=1`` at import)."""
    return type(_feedback_block_kernel).__name__ == "InterpretedFunction"


SIGNATURE = {**{k: "*fp32" for k in ("wb_ptr", "err_ptr", "u_ptr", "a_ptr", "b_ptr", "s_ptr", "z_ptr", "mq_ptr")},
             "codes_ptr": "*i16", "grp_ptr": "*i32",
             **{k: "i32" for k in ("R", "n_cols", "k0", "k1", "j0", "stride_u", "col_block")}}


def compiled_facts(mode: int, arch: int = 90, aligned: bool = True) -> dict[str, object]:
    """Compile the kernel for ``sm_{arch}`` with triton's own compiler (no GPU needed) and read what its exactness and
    its lack of barriers rest on: ``fma``/``div_rn``/``div_approx`` counts in the PTX, and ``row_layouts``, the
    layouts of its row-vector loads and stores (one layout of one element per thread, no replication, means every
    thread reads back only what it wrote). ``aligned``: pointers and ``R`` divisible by 16, as the launcher
    specializes them at run time when they are."""
    import re  # noqa: PLC0415

    from triton.backends.compiler import GPUTarget  # noqa: PLC0415
    from triton.compiler import ASTSource  # noqa: PLC0415

    fn = _feedback_block_kernel
    names = list(fn.arg_names)
    const = dict(MODE=mode, K=16 if mode == TABLE else 2, BLOCK_R=BLOCK_R)
    sig = {n: SIGNATURE.get(n, "constexpr") for n in names}
    attrs = {(names.index(k),): [["tt.divisibility", 16]] for k, v in SIGNATURE.items()
             if aligned and (v.startswith("*") or k in ("R", "stride_u"))}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()}, attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"enable_fp_fusion": False, "num_warps": NUM_WARPS})
    ptx, ttgir = kernel.asm["ptx"], kernel.asm["ttgir"]
    layouts = dict(re.findall(r"^(#\w+) = (#ttg\.\w+<.*>)$", ttgir, re.M))
    used = set(re.findall(rf"tt\.(?:load|store) [^\n]*tensor<{BLOCK_R}x!tt\.ptr<\w+>, (#\w+)>", ttgir))
    return {"fma": len(re.findall(r"\bfma\.", ptx)), "div_rn": len(re.findall(r"\bdiv\.rn\.f32", ptx)),
            "div_approx": len(re.findall(r"\bdiv\.(?:full|approx)", ptx)), "num_warps": kernel.metadata.num_warps,
            "row_layouts": sorted(layouts[u] for u in used)}

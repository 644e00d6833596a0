"""GPTQ's error feedback, for any rounding rule (pure function; shared by schemes that use it).

Columns are quantized in order; each column's rounding error, scaled by the inverse Hessian's Cholesky
factor, is pushed onto the columns not yet quantized (Frantar et al. 2022, "GPTQ", Algorithm 1, with
lazy block updates). ``round_fn(j, w) -> (q, codes)`` rounds column ``j``'s values ``w (out,)``.

A rounding rule whose grid depends on the weights themselves (GPTQ's group scales, computed "as the
columns are reached") passes ``group`` and ``on_group(j, cols)``: at every column ``j`` that starts a group
it receives ``cols (min(group, in - j), out)``, those columns as they stand at that moment, with the error
of every earlier column already applied (whatever the block size: the result does not depend on ``block``).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

#: Run the per-column steps of :func:`error_feedback` (and the rounding rules of palettization and GPTQ) on numpy views
#: of CPU tensors: the same IEEE operations in the same order, so the same bits, without torch's per-call overhead on
#: these short rows, which dominated them (0.4 ms per column of a 4608-row stack, 2026-11-29). False runs torch ops
#: throughout (what a GPU runs where the fused block kernel does not, :data:`FUSED_DEVICES`); tests/test_feedback.py compares the two.
NUMPY_ON_CPU = True


def numpy_steps(t: torch.Tensor) -> bool:
    """Whether the per-column steps on ``t`` run on numpy views (see :data:`NUMPY_ON_CPU`)."""
    return NUMPY_ON_CPU and t.device.type == "cpu"


def inverse_hessian_factor(hessian: torch.Tensor, damp: float = 0.01, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``, ``(in, in)`` in ``dtype``.

    Dead input channels (``H[j, j] == 0``: never active in calibration) get ``H[j, j] = 1`` first, as the
    reference GPTQ does, so the factor exists; their weights then do not affect the output at all.
    """
    h = hessian.double().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * h.diagonal().mean())
    # With J the order reversal and J H J = M M^T (Cholesky), H = R R^T for the upper triangular R = J M J,
    # so H^-1 = R^-T R^-1: the upper factor is R^-1. One Cholesky and one triangular solve, no product.
    r = torch.linalg.cholesky(h.flip(0, 1)).flip(0, 1)
    eye = torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    return torch.linalg.solve_triangular(r, eye, upper=True).to(dtype)


@dataclass
class TableRule:
    """A rounding rule as data, for the fused block kernel (:mod:`qrecover.kernels.feedback_kernel`): the nearest of a
    look-up table's values. ``edges (blocks, K - 1, R)`` float32 decision edges ascending (+inf padding), ``tables
    (blocks, K, R)`` the values; input column ``j`` reads table block ``j // cols``. The same codes as a ``round_fn``
    counting the edges below each value."""

    edges: torch.Tensor
    tables: torch.Tensor
    cols: int
    kind = "table"


@dataclass
class GridRule:
    """A rounding rule as data: an integer grid per group of columns, ``c = min(max(round(w / safe) + zero, 0), maxq)``,
    ``q = (c - zero) * scale``; ``safe, scale, zero (groups, R)`` (filled in place by ``on_group`` as groups are
    reached, if they depend on the weights), ``maxq (R,)``, ``group_of (in,)`` int32 the group of each column."""

    safe: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    maxq: torch.Tensor
    group_of: torch.Tensor
    kind = "grid"


#: devices whose error feedback runs each block of columns in one fused kernel launch when the caller gives its rounding
#: rule as data (``rule=``) and triton is installed; tests add "cpu" to run it under triton's interpreter
FUSED_DEVICES = {"cuda"}

#: why the fused kernel failed in this process, if it did (then :func:`fused_steps` says no from there on)
_FUSED_FAILED: list[str] = []


def fused_steps(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether :func:`error_feedback` on ``t`` runs its blocks in the fused kernel (given a ``rule``): a device of
    :data:`FUSED_DEVICES`, float32, triton installed, kernels not turned off (``QRECOVER_KERNELS=0``), no earlier
    failure of the kernel in this process."""
    if t.device.type not in FUSED_DEVICES or dtype != torch.float32 or _FUSED_FAILED:
        return False
    from .. import kernels  # noqa: PLC0415  (kernels imports nothing from schemes; keeps importing schemes light)
    return kernels.enabled() and kernels.triton_available()


def _launch(rule, wb, errs, u, codes, j0: int, k0: int, k1: int) -> bool:
    """One fused launch (:func:`qrecover.kernels.feedback_kernel.run`); False, with one warning per process, where it
    fails to compile or launch on this GPU (it has not run then: the caller steps these columns itself)."""
    from ..kernels import feedback_kernel  # noqa: PLC0415  (needs triton: imported only where it runs)

    try:
        feedback_kernel.run(rule, wb, errs, u, codes, j0, k0, k1)
        return True
    except Exception as e:  # a compile or launch failure: the per-column operators for the rest of the process
        _FUSED_FAILED.append(f"{type(e).__name__}: {str(e)[:200]}")
        warnings.warn(f"qrecover: the error-feedback kernel failed ({_FUSED_FAILED[0]}); error feedback runs column by "
                      "column in torch from here on (QRECOVER_KERNELS=0 chooses that from the start)", stacklevel=3)
        return False


def error_feedback(weight: torch.Tensor, hessian: torch.Tensor | None,
                   round_fn: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                   block: int = 32, damp: float = 0.01, *, factor: torch.Tensor | None = None,
                   group: int = 0, on_group: Callable[[int, torch.Tensor], None] | None = None,
                   dtype: torch.dtype = torch.float32, rule: TableRule | GridRule | None = None) -> torch.Tensor:
    """Quantize ``weight (out, in)`` column by column with error feedback; return codes ``(out, in)`` int64.

    ``factor``: the upper Cholesky factor of the damped inverse Hessian (:func:`inverse_hessian_factor`),
    when the caller shares one across layers with the same inputs; otherwise it is computed from
    ``hessian`` and ``damp``. ``group``/``on_group``: see the module docstring. ``dtype``: the arithmetic
    (float32; float64 for references). ``rule``: ``round_fn`` as data (:class:`TableRule`, :class:`GridRule`), which
    lets a GPU run each block's column steps in one kernel launch (:data:`FUSED_DEVICES`) instead of about 30
    operator launches per column: the same operations in the same order.

    Works on the transpose ``(in, out)`` so that every column is a contiguous row and the rank-1
    updates inside a block stream through memory; blocks of 32 columns keep those updates small and
    leave the bulk of the work to one matrix product per block.
    """
    wt = weight.detach().to(dtype).T.contiguous()  # (in, out)
    in_f, out_f = wt.shape
    u = (factor if factor is not None else inverse_hessian_factor(hessian, damp, dtype)).to(device=wt.device, dtype=dtype)
    if u.shape != (in_f, in_f):
        raise ValueError(f"inverse Hessian factor of shape {tuple(u.shape)} for a weight with {in_f} input columns")
    codes = torch.empty(in_f, out_f, dtype=torch.int16, device=wt.device)  # codes of up to 15 bits; int64 when returned
    fused = rule is not None and fused_steps(wt, dtype)
    if fused:
        u = u.contiguous()
    x = (lambda t: t.numpy()) if numpy_steps(wt) else (lambda t: t)  # matrix products stay in torch either way
    codesx = x(codes)
    for b0 in range(0, in_f, block):
        b1 = min(b0 + block, in_f)
        wb = wt[b0:b1].clone()
        errs = torch.empty_like(wb)
        ub = u[b0:b1, b0:b1]
        wbx, errx, ubx = x(wb), x(errs), x(ub)
        k = 0
        while k < b1 - b0:  # in segments that end where a group starts (on_group between them)
            j = b0 + k
            if on_group is not None and j % group == 0:
                end = min(j + group, in_f)
                if end <= b1:
                    cols = wb[k:end - b0]
                else:  # the group runs past this block: apply this block's pending errors to the rest
                    rest = wt[b1:end] - u[b0:j, b1:end].T @ errs[:k]
                    cols = torch.cat([wb[k:], rest])
                on_group(j, cols)
            stop = b1 - b0 if on_group is None else min(b1 - b0, (j // group + 1) * group - b0)
            fused = fused and _launch(rule, wb, errs, u, codes, b0, k, stop)
            if not fused:  # the per-column steps (also after a failed launch: the kernel has not run)
                for kk in range(k, stop):
                    j = b0 + kk
                    q, c = round_fn(j, wb[kk])
                    codesx[j] = x(c)
                    e = (wbx[kk] - x(q)) / ubx[kk, kk]
                    wbx[kk + 1:] -= ubx[kk, kk + 1:, None] * e[None, :]
                    errx[kk] = e
            k = stop
        wt[b1:] -= u[b0:b1, b1:].T @ errs  # the block's errors onto every later column at once
    return codes.T.contiguous().long()

"""GPTQ's error feedback, for any rounding rule (pure function; shared by schemes that use it).

Columns are quantized in order; each column's rounding error, scaled by the inverse Hessian's Cholesky
factor, is pushed onto the columns not yet quantized (Frantar et al. 2022, "GPTQ", Algorithm 1, with
lazy block updates). ``round_fn(j, w) -> (q, codes)`` rounds column ``j``'s values ``w (out,)``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def inverse_hessian_factor(hessian: torch.Tensor, damp: float = 0.01) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp * mean(diag H) * I)^-1``, ``(in, in)`` fp32."""
    h = hessian.double().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    h.diagonal().add_(damp * h.diagonal().mean())
    lower = torch.linalg.cholesky(h)
    # H^-1 = L^-T L^-1 (torch.cholesky_inverse is the same maths but many times slower on some CPU builds)
    lower_inv = torch.linalg.solve_triangular(lower, torch.eye(h.shape[0], dtype=h.dtype, device=h.device), upper=False)
    return torch.linalg.cholesky(lower_inv.T @ lower_inv, upper=True).float()


def error_feedback(weight: torch.Tensor, hessian: torch.Tensor,
                   round_fn: Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
                   block: int = 32, damp: float = 0.01) -> torch.Tensor:
    """Quantize ``weight (out, in)`` column by column with error feedback; return codes ``(out, in)`` int64.

    Works on the transpose ``(in, out)`` so that every column is a contiguous row and the rank-1
    updates inside a block stream through memory; blocks of 32 columns keep those updates small and
    leave the bulk of the work to one matrix product per block.
    """
    wt = weight.detach().float().T.contiguous()  # (in, out)
    in_f, out_f = wt.shape
    u = inverse_hessian_factor(hessian, damp)
    codes = torch.empty(in_f, out_f, dtype=torch.long, device=wt.device)
    for b0 in range(0, in_f, block):
        b1 = min(b0 + block, in_f)
        wb = wt[b0:b1].clone()
        errs = torch.empty_like(wb)
        ub = u[b0:b1, b0:b1]
        for k in range(b1 - b0):
            q, c = round_fn(b0 + k, wb[k])
            codes[b0 + k] = c
            e = (wb[k] - q) / ub[k, k]
            wb[k + 1:] -= ub[k, k + 1:].unsqueeze(1) * e.unsqueeze(0)
            errs[k] = e
        wt[b1:] -= u[b0:b1, b1:].T @ errs  # the block's errors onto every later column at once
    return codes.T.contiguous()

"""GPTQ: integer group quantization with Hessian-aware error feedback (Frantar et al. 2022).

Columns are rounded in order onto an integer grid; each column's rounding error, scaled by the upper
Cholesky factor of the damped inverse Hessian ``H = E[x x^T]``, is pushed onto the columns not yet
rounded (:func:`qrecover.schemes.feedback.error_feedback`, with lazy block updates). As the reference
does, a group's scale (and zero point) is computed when its first column is reached, from the columns as
they stand then (already updated by the errors of every earlier column); a per-channel grid
(``group_size=None``) is fixed from the original weights. Dead input channels (``H[j, j] == 0``) get zero
weights and ``H[j, j] = 1``.

Activation order (``act_order``) rounds the columns by decreasing ``H[j, j]`` (the most active inputs
first, while the most other columns remain to absorb their errors) with STATIC groups: every group's
scale is computed from the original weights of the group's columns in their original order before the
pass, so the stored layout stays plain row-major groups and dequantization is blockwise's.

Grid (the reference's, also llm-compressor's): symmetric ``scale = 2 * absmax / (2**bits - 1)`` and codes
``q = clamp(round(w / scale) + 2**(bits-1), 0, 2**bits - 1)``; asymmetric from ``min(w, 0)``/``max(w, 0)``
with a rounded zero point, as blockwise. Scales are rounded to fp16 before any code is chosen, so that
``dequantize`` reproduces exactly the values the error feedback assumed.

Stored tensors: exactly :mod:`qrecover.schemes.blockwise`'s, with ``B = group_size`` (or ``I``):

- ``qdata``: uint8 ``(ceil(O * I * bits / 8),)``, codes in row-major ``(O, I)`` order, bit-packed
- ``scale``: fp16 ``(O, I / B)``
- ``zero_point`` (asymmetric only): uint8 ``(ceil(O * I / B * bits / 8),)``, bit-packed like qdata

Statistics: ``hessian`` ``(I, I)``; optionally ``hessian_inv_chol``, the factor from
:func:`hessian_factor` with the same ``damp`` and ``act_order``, which layers reading the same inputs
(q/k/v, gate/up) share so that it is computed once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..errors import QRecoverError
from ..packing import pack
from .base import QuantizedWeight, doc_field, register_quantizer
from .blockwise import Blockwise
from .feedback import GridRule, error_feedback, fused_steps, inverse_hessian_factor, numpy_steps


@dataclass
class GPTQConfig:
    group_size: int | None = doc_field(128, "input columns per scale (32/64/128); None = one scale per output row")
    symmetric: bool = doc_field(False, "scale from absmax around a fixed mid-code (True) or min/max with a stored zero point (False; measured better "
                                       "on the default model: held-out predicted loss increase 0.0175 vs 0.045 at 4 bits, g64)")
    act_order: bool = doc_field(True, "round the columns by decreasing activation energy H[j, j], with static groups (same storage); measured on "
                                      "the default model, whole model, g64: held-out perplexity 1.133x the original's at 4 bits (1.201x without), "
                                      "1.739x at 3 bits (2.113x without); benchmarks/schemes.py")
    damp: float = doc_field(0.01, "dampening added to the Hessian's diagonal, as a fraction of its mean")
    mse: bool = doc_field(False, "shrink each group's range to the one that minimises its rounding error (the GPTQ "
                                 "reference's search: 80 shrink factors from 1 down to 0.2, error |w - q|^2.4) instead of "
                                 "min/max; same storage")
    block: int = doc_field(128, "columns per lazy update block (speed only: the result does not depend on it)")


def _perm(hessian: torch.Tensor, act_order: bool) -> torch.Tensor | None:
    """Column order of the pass: by decreasing ``H[j, j]`` (stable) under ``act_order``, else None."""
    if not act_order:
        return None
    return torch.argsort(hessian.diagonal(), descending=True, stable=True)


def hessian_factor(hessian: torch.Tensor, damp: float = 0.01, act_order: bool = False,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``(I, I)`` upper Cholesky factor of the damped inverse of ``hessian`` in the pass's column order
    (permuted by decreasing diagonal under ``act_order``): the ``hessian_inv_chol`` statistic."""
    perm = _perm(hessian, act_order)
    h = hessian if perm is None else hessian[perm][:, perm]
    return inverse_hessian_factor(h, damp, dtype)


#: the range search's shrink factors, from the full range (1) down to 0.2, in the order tried (ties: the earlier)
SHRINK = [1 - i / 100 for i in range(81)]
#: devices whose range search tries every shrink factor of a group in a few batched operations (``(factors, g, R)``
#: temporaries of at most :data:`BATCHED_ELEMENTS`) rather than one after another: on a GPU the loop is ~2,000 launches
#: per group; on the CPU it is faster (its ``(g, R)`` temporaries stay in cache). The same grids either way.
BATCHED_SEARCH = {"cuda"}
BATCHED_ELEMENTS = 2**25


def _grid(cols: torch.Tensor, maxq: torch.Tensor, symmetric: bool, mse: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Scale (fp16-representable, may be 0) and zero point of one group: ``cols (g, R)`` -> ``(R,), (R,)``; ``mse``:
    the range shrunk per row to the factor of :data:`SHRINK` (1 down to 0.2, 80 steps) with the least
    ``sum |w - q|^2.4``, the first such factor on ties."""
    lo, hi = cols.amin(0).clamp(max=0), cols.amax(0).clamp(min=0)
    if symmetric:
        hi = torch.maximum(-lo, hi)
    if mse and cols.device.type in BATCHED_SEARCH:
        return _grid_search_batched(cols, lo, hi, maxq, symmetric)
    best = _grid_at(lo, hi, maxq, symmetric)
    if not mse:
        return best
    err_best = _grid_error(cols, *best, maxq)
    for p in SHRINK[1:]:
        cand = _grid_at(lo * p, hi * p, maxq, symmetric)
        err = _grid_error(cols, *cand, maxq)
        better = err < err_best
        err_best = torch.where(better, err, err_best)
        best = tuple(torch.where(better, c, b) for c, b in zip(cand, best))
    return best


def _grid_search_batched(cols: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, maxq: torch.Tensor, symmetric: bool
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_grid`'s range search with the shrink factors as a batch dimension, in chunks: the same elementwise
    operations, the first minimum of each row (``argmin``, then strictly lower across chunks), so the same grids."""
    shrink = torch.tensor(SHRINK, dtype=lo.dtype, device=lo.device).unsqueeze(1)  # (81, 1)
    step = max(1, BATCHED_ELEMENTS // cols.numel())
    best = None
    for i0 in range(0, len(SHRINK), step):
        p = shrink[i0:i0 + step]
        scale, zero = _grid_at(lo * p, hi * p, maxq, symmetric)  # (P, R)
        zero = zero.expand_as(scale)
        err = _grid_error(cols, scale.unsqueeze(1), zero.unsqueeze(1), maxq)  # (P, R)
        idx = err.argmin(0, keepdim=True)
        cand = tuple(t.gather(0, idx)[0] for t in (err, scale, zero))
        best = cand if best is None else tuple(torch.where(cand[0] < best[0], c, b) for c, b in zip(cand, best))
    return best[1], best[2]


def _grid_at(lo: torch.Tensor, hi: torch.Tensor, maxq: torch.Tensor, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    if symmetric:
        return (2 * hi / maxq).half().to(hi.dtype), torch.floor((maxq + 1) / 2)  # 2**(bits-1), blockwise's zero point
    scale = ((hi - lo) / maxq).half().to(hi.dtype)
    s = torch.where(scale > 0, scale, torch.ones_like(scale))
    return scale, torch.minimum(torch.round(-lo / s).clamp_(min=0), maxq)


def _grid_error(cols: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, maxq: torch.Tensor) -> torch.Tensor:
    s = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (torch.minimum((torch.round(cols / s) + zero).clamp_(min=0), maxq) - zero) * scale
    return (q - cols).abs_().pow_(2.4).sum(-2)  # over the group's columns: (g, R) -> (R,), (P, g, R) -> (P, R)


def _gptq_rows(weight: torch.Tensor, hessian: torch.Tensor, maxq: torch.Tensor, g: int, symmetric: bool,
               act_order: bool, damp: float, block: int, factor: torch.Tensor | None, dtype: torch.dtype,
               mse: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GPTQ of ``weight (R, I)`` whose rows may use different grids (``maxq (R,)``: several widths stacked
    as extra rows share one pass). Returns codes ``(R, I)``, scale ``(R, I/g)`` and zero ``(R, I/g)``."""
    rows, in_f = weight.shape
    w = weight.detach().to(dtype).clone()
    dead = hessian.diagonal() == 0
    w[:, dead] = 0
    maxq = maxq.to(device=w.device, dtype=dtype)
    n_groups = in_f // g
    scale = torch.empty(n_groups, rows, dtype=dtype, device=w.device)
    zero = torch.empty_like(scale)
    safe = torch.empty_like(scale)  # the scale with 0 (an all-zero group) replaced by 1 for dividing
    perm = _perm(hessian, act_order)
    if factor is None:
        factor = hessian_factor(hessian, damp, act_order, dtype)

    def set_group(gi: int, cols: torch.Tensor) -> None:
        scale[gi], zero[gi] = _grid(cols, maxq, symmetric, mse)
        safe[gi] = torch.where(scale[gi] > 0, scale[gi], torch.ones_like(scale[gi]))

    on_group = None
    if perm is not None:  # static groups, from the original weights in the original order
        for gi in range(n_groups):
            set_group(gi, w[:, gi * g:(gi + 1) * g].T)
        group_of = (perm // g).tolist()
        w = w[:, perm]
    else:  # each group's grid when its first column is reached, from the columns as they stand then
        group_of = [j // g for j in range(in_f)]

        def on_group(j: int, cols: torch.Tensor) -> None:
            set_group(j // g, cols)

    if numpy_steps(w):  # the same operations on numpy views of the same memory: the same bits, less overhead
        scale_x, zero_x, safe_x, maxq_x = scale.numpy(), zero.numpy(), safe.numpy(), maxq.numpy()

        def round_fn(j: int, col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            gi = group_of[j]
            z = zero_x[gi]
            c = np.minimum(np.maximum(np.round(col.numpy() / safe_x[gi]) + z, 0), maxq_x)
            return torch.from_numpy((c - z) * scale_x[gi]), torch.from_numpy(c.astype(np.int16))
    else:
        def round_fn(j: int, col: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            gi = group_of[j]
            z = zero[gi]
            c = torch.minimum((torch.round(col / safe[gi]) + z).clamp_(min=0), maxq)
            return (c - z) * scale[gi], c.long()

    rule = None
    if fused_steps(w, dtype):  # one kernel launch per block of columns (a GPU), the same operations
        rule = GridRule(safe, scale, zero, maxq, torch.tensor(group_of, dtype=torch.int32, device=w.device))
    codes = error_feedback(w, None, round_fn, block, factor=factor, group=g, on_group=on_group, dtype=dtype, rule=rule)
    if perm is not None:
        codes = codes[:, torch.argsort(perm)]
    return codes, scale.T.contiguous(), zero.T.contiguous()


def _check_group(shape: tuple[int, int], group_size: int | None) -> int:
    in_f = shape[1]
    g = group_size or in_f
    if g <= 0 or in_f % g:
        divisors = [d for d in (32, 64, 128, 256) if in_f % d == 0]
        raise QRecoverError(
            f"gptq cannot cut the {in_f} input columns of weight {tuple(shape)} into groups of group_size={group_size}; "
            f"use a divisor of {in_f} (of 32/64/128/256: {divisors or 'none'}) or group_size=None (per channel)"
        )
    return g


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, bits: int, group_size: int | None = 128,
                  symmetric: bool = False, act_order: bool = False, damp: float = 0.01, block: int = 128,
                  factor: torch.Tensor | None = None, dtype: torch.dtype = torch.float32
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """GPTQ of ``weight (O, I)`` with ``hessian (I, I) = E[x x^T]`` onto a ``bits``-bit integer grid.

    Returns ``codes (O, I)`` int64 in ``[0, 2**bits)``, ``scale (O, I/B)`` fp16 and ``zero (O, I/B)`` int64
    (None when symmetric: the zero point is ``2**(bits-1)``), ``B = group_size or I``;
    ``w ~ (codes - zero) * scale``. ``factor``: :func:`hessian_factor` of the same settings, if shared.
    """
    g = _check_group(tuple(weight.shape), group_size)
    maxq = torch.full((weight.shape[0],), 2**bits - 1, dtype=dtype)
    codes, scale, zero = _gptq_rows(weight, hessian, maxq, g, symmetric, act_order, damp, block, factor, dtype)
    return codes, scale.half(), None if symmetric else zero.long()


@register_quantizer
class GPTQ(Blockwise):
    """Stored and dequantized exactly as :class:`~qrecover.schemes.blockwise.Blockwise` with
    ``block_size = group_size``; only the choice of codes and scales differs."""

    name = "gptq"
    supported_bits = (2, 3, 4, 8)
    needs = frozenset({"hessian"})
    Config = GPTQConfig

    def _block(self, shape: tuple[int, int]) -> int:
        return _check_group(tuple(shape), self.config.group_size)

    @property
    def factor_key(self) -> tuple[float, bool]:
        """What :meth:`shared_factor` depends on besides the Hessian: quantizers with equal keys share one factor."""
        return (self.config.damp, self.config.act_order)

    def shared_factor(self, hessian: torch.Tensor) -> torch.Tensor:
        """The ``hessian_inv_chol`` statistic for this config (``damp``, ``act_order``): layers that read the
        same inputs (q/k/v, gate/up) compute it once and share it."""
        return hessian_factor(hessian, self.config.damp, self.config.act_order)

    def quantize(self, weight: torch.Tensor, bits: int, stats: dict[str, torch.Tensor]) -> QuantizedWeight:
        return self.quantize_many(weight, [bits], stats)[0]

    def quantize_many(self, weight: torch.Tensor, bits_list: list[int], stats: dict[str, torch.Tensor]) -> list[QuantizedWeight]:
        """Every width in one error-feedback pass: the widths are stacked as extra rows (rows never
        interact in GPTQ, so each width's result is exactly its own pass's)."""
        shape = tuple(weight.shape)
        for bits in bits_list:
            self.check(shape, bits)
        if "hessian" not in stats:
            raise QRecoverError("gptq needs the 'hessian' calibration statistic (E[x x^T] of the layer's inputs)")
        cfg = self.config
        g = self._block(shape)
        out_f = shape[0]
        maxq = torch.tensor([2**b - 1 for b in bits_list], dtype=torch.float32).repeat_interleave(out_f)
        codes, scale, zero = _gptq_rows(weight.repeat(len(bits_list), 1), stats["hessian"].float(), maxq, g,
                                        cfg.symmetric, cfg.act_order, cfg.damp, cfg.block,
                                        stats.get("hessian_inv_chol"), torch.float32, cfg.mse)
        out = []
        for i, bits in enumerate(bits_list):
            rows = slice(i * out_f, (i + 1) * out_f)
            tensors = {"qdata": pack(codes[rows].to(torch.uint8), bits), "scale": scale[rows].half().contiguous()}
            if not cfg.symmetric:
                tensors["zero_point"] = pack(zero[rows].to(torch.uint8), bits)
            out.append(self._pack(bits, shape, tensors))
        return out

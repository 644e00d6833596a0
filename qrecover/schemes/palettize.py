"""Palettization: k-means look-up tables shared by groups of rows (AFM's on-device scheme).

Every group of ``group_size`` output rows (x ``block_size`` input columns, or the whole row when
``block_size`` is None) shares one table of ``2**bits`` fp16 values; each weight stores the index of
its table entry. The k-means objective is weighted per element (as SqueezeLLM weights its k-means by
sensitivity), so the weights that matter most are reproduced more precisely:

- ``weighting="input"``: ``(E[x_j**2])**p``, the per-input-channel importance from calibration;
- ``weighting="fisher"``: ``(g_i * E[x_j**2])**p`` with ``g_i = E[(dL/dy_i)**2]`` (``out_grad_sq``), the
  diagonal Fisher of the weight, so that within a table's group the rows whose outputs move the loss most
  pull the table towards their values. With every ``g_i`` equal it is exactly ``"input"`` (same ``p``):
  the weights are normalised to mean 1 per matrix.

(``p = importance_power``; an ``element_sq`` statistic, given for the embedding, replaces both.)

Stored tensors, for a weight ``(O, I)`` with ``G = group_size`` and ``C = block_size or I``:

- ``qdata``: uint8 ``(ceil(O * I * bits / 8),)``, the codes in row-major ``(O, I)`` order, bit-packed
- ``lut``: fp16 ``(O / G * I / C, 2**bits)``, the tables, in row-major ``(O / G, I / C)`` group order,
  each sorted ascending
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import QRecoverError
from ..packing import pack, packed_nbytes, take_rows, unpack
from .base import QuantizedWeight, Quantizer, doc_field, register_quantizer
from .feedback import TableRule, error_feedback, fused_steps, inverse_hessian_factor, numpy_steps


@dataclass
class PalettizeConfig:
    group_size: int = doc_field(16, "output rows that share one look-up table (AFM: 16)")
    block_size: int | None = doc_field(None, "input columns per table; None shares one table across the whole row")
    block_fit: str = doc_field("exact", "'exact': block_size must divide the layer's input width; 'nearest': each layer uses the multiple of "
                                        "32 dividing its width nearest to block_size (by ratio, within a factor 2; ties: the larger), "
                                        "stored as that exact block_size (e.g. b192 gives 192 columns on 576 or 1536, 256 on 2048 or 4096, "
                                        "224 on 14336); a layer with no such divisor does not fit")
    weighted: bool = doc_field(True, "weight the k-means objective per element (see weighting)")
    weighting: str = doc_field("input", "'input': weight E[x_j^2]**p; 'fisher': (g_i * E[x_j^2])**p with g_i the output-gradient moment "
                                        "(SqueezeLLM's diagonal Fisher; needs the backward calibration statistic out_grad_sq)")
    iters: int = doc_field(30, "Lloyd iterations (stops earlier once no assignment changes)")
    importance_power: float = doc_field(0.5, "k-means weight = importance**power; 0.5 measured best on true output error (1 over-fits the diagonal)")
    error_feedback: bool = doc_field(True, "after fitting the tables, assign codes column by column with GPTQ error feedback (needs the input "
                                           "Hessian)")
    refit: int = doc_field(0, "with error feedback: refit the table values to the layer's output error this many times (least squares in "
                              "the input Hessian for the fixed codes), reassigning the codes with feedback between refits; each width "
                              "keeps the tables and codes of lowest output error on the calibration Hessian")


WEIGHTINGS = ("input", "fisher")
BLOCK_FITS = ("exact", "nearest")


def nearest_block(in_f: int, target: int) -> int | None:
    """The multiple of 32 that divides ``in_f`` nearest to ``target`` by ratio, within a factor 2 and short of the
    whole row (ties: the larger, fewer table bytes); None when there is none."""
    fits = [c for c in range(32, in_f, 32) if in_f % c == 0 and target / 2 <= c <= 2 * target]
    return min(fits, key=lambda c: (abs(math.log(c / target)), -c), default=None)


def sort_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x (n, m)`` float32 sorted along rows: ``(values, indices)``, ties in index order (a stable sort). On the CPU
    numpy sorts one int64 key per value (the float's order-preserving integer image, then its index; x86's SIMD sort):
    about 5x faster than ``torch.sort`` on rows of 9,216 values, whose tie order is unspecified. Elsewhere
    ``torch.sort(stable=True)``."""
    if not numpy_steps(x) or x.shape[1] >= 2**31:
        order = x.sort(dim=1, stable=True).indices
    else:
        bits = (x.numpy() + np.float32(0)).view(np.int32).astype(np.int64)  # + 0: -0.0 ties with +0.0, as in torch
        keys = ((bits ^ ((bits >> 31) & 0x7FFFFFFF)) << 32) | np.arange(x.shape[1], dtype=np.int64)
        keys.sort(axis=1)
        order = torch.from_numpy(keys & 0xFFFFFFFF)
    return x.gather(1, order), order


#: k-means fits every width of a palettization at once on these devices (:meth:`SortedGroups.kmeans_many`), reading
#: its convergence test every ``KMEANS_CHECK_EVERY[device type]`` (default 8) Lloyd iterations: on a GPU each read waits
#: for the device (92 per palettization candidate when read every iteration, ``benchmarks/feedback_speed.py``) and a
#: third of the launches for three widths. On the CPU reads cost nothing, and the iterations that a later read, or a
#: width converging early, would add do.
BATCHED_KMEANS = {"cuda"}
KMEANS_CHECK_EVERY = {"cpu": 1}


class SortedGroups:
    """Rows of values sorted once, with weighted prefix sums: shared by k-means runs of every width.

    x, w: ``(n, m)`` values and non-negative weights (``w`` may broadcast to ``x``).
    """

    def __init__(self, x: torch.Tensor, w: torch.Tensor):
        self.n, self.m = x.shape
        self.xs, self.order = sort_rows(x.float().contiguous())
        ws = w.float().expand_as(x).gather(1, self.order).double()
        self.cw = F.pad(ws.cumsum(1), (1, 0))  # (n, m + 1); float64 against cancellation
        self.cwx = F.pad((ws * self.xs.double()).cumsum(1), (1, 0))

    def edges(self, centroids: torch.Tensor) -> torch.Tensor:
        """``(n, k + 1)`` cluster boundaries in sorted order: value i goes to the nearest centroid."""
        return self._edges_many(centroids.unsqueeze(1)).squeeze(1)

    def _edges_many(self, centroids: torch.Tensor) -> torch.Tensor:
        """:meth:`edges` of ``centroids (n, widths, K)``, each width's side by side: ``(n, widths, K + 1)``."""
        n, w, k = centroids.shape
        bounds = ((centroids[..., 1:].float() + centroids[..., :-1].float()) / 2).reshape(n, -1)
        inner = torch.searchsorted(self.xs, bounds.contiguous()).view(n, w, k - 1)
        return torch.cat([torch.zeros(n, w, 1, dtype=torch.long, device=inner.device), inner,
                          torch.full((n, w, 1), self.m, device=inner.device)], dim=-1)

    def codes(self, edges: torch.Tensor) -> torch.Tensor:
        """``(n, m)`` int64 cluster index of every value, in the original (unsorted) order."""
        marks = torch.zeros(self.n, self.m + 1, dtype=torch.int32, device=edges.device).scatter_add_(
            1, edges[:, 1:-1], torch.ones_like(edges[:, 1:-1], dtype=torch.int32)
        )
        codes_sorted = marks.cumsum(1, dtype=torch.int32)[:, : self.m].long()
        return torch.empty_like(codes_sorted).scatter_(1, self.order, codes_sorted)

    def _start(self, k: int) -> torch.Tensor:
        """``(n, k)`` the initial centroids: the weighted quantiles ``(i + 1/2) / k``."""
        total = self.cw[:, -1:]
        quantiles = (torch.arange(k, dtype=torch.float64, device=total.device) + 0.5) / k * total
        return self.xs.gather(1, torch.searchsorted(self.cw[:, 1:].contiguous(), quantiles).clamp_(max=self.m - 1))

    def kmeans(self, k: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Weighted 1-D k-means per row, deterministic: ``(centroids (n, k) ascending, edges (n, k+1))``.

        1-D clusters are contiguous in sorted order, so a Lloyd step needs ``k - 1`` binary searches per
        row and prefix-sum differences, not a pass over every value. Initialised at weighted quantiles;
        stops when no assignment changes (a fixed point of Lloyd's algorithm).
        """
        return self.kmeans_many([k], iters)[0]

    def kmeans_many(self, ks: list[int], iters: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """:meth:`kmeans` for every width in ``ks``. On the CPU one width after another, the convergence tested
        every iteration. On the devices of :data:`BATCHED_KMEANS` all at once, with no host read per iteration: the
        widths side by side along the centroid dimension, padded with +inf centroids (empty clusters past the
        sorted values, which keep their value), each width frozen once converged (c and e as they were then: the
        result of stopping there), the convergence read every :data:`KMEANS_CHECK_EVERY` iterations. The same
        operations on every real centroid, so the same tables either way, with a third of the launches for three
        widths."""
        if self.xs.device.type not in BATCHED_KMEANS:
            return [self._kmeans_one(k, iters) for k in ks]
        n, w, kmax = self.n, len(ks), max(ks)
        c = torch.full((n, w, kmax), float("inf"), device=self.xs.device)
        for i, k in enumerate(ks):
            c[:, i, :k] = self._start(k)
        e = self._edges_many(c)
        every = KMEANS_CHECK_EVERY.get(c.device.type, 8)
        done = torch.zeros(w, dtype=torch.bool, device=c.device)
        for it in range(iters):
            lo, hi = e[..., :-1].reshape(n, -1), e[..., 1:].reshape(n, -1)
            sw = (self.cw.gather(1, hi) - self.cw.gather(1, lo)).view(n, w, kmax)
            sx = (self.cwx.gather(1, hi) - self.cwx.gather(1, lo)).view(n, w, kmax)
            new_c = torch.where(sw > 0, sx / sw.clamp_min(1e-300), c.double()).float().sort(dim=-1).values
            new_e = self._edges_many(new_c)
            c = torch.where(done[:, None], c, new_c)
            done |= (new_e == e).all(-1).all(0)
            e = torch.where(done[:, None], e, new_e)
            if (it + 1) % every == 0 and bool(done.all()):
                break
        return [(c[:, i, :k].contiguous(), e[:, i, :k + 1].contiguous()) for i, k in enumerate(ks)]

    def _kmeans_one(self, k: int, iters: int) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`kmeans` on the CPU: one width, the convergence tested every iteration (free there)."""
        c = self._start(k)
        e = self.edges(c)
        for _ in range(iters):
            sw = self.cw.gather(1, e[:, 1:]) - self.cw.gather(1, e[:, :-1])
            sx = self.cwx.gather(1, e[:, 1:]) - self.cwx.gather(1, e[:, :-1])
            c = torch.where(sw > 0, sx / sw.clamp_min(1e-300), c.double()).float().sort(dim=1).values
            new_e = self.edges(c)
            if torch.equal(new_e, e):
                break
            e = new_e
        return c, e


def weighted_kmeans_1d(x: torch.Tensor, w: torch.Tensor, k: int, iters: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    """Weighted 1-D k-means of each row of ``x (n, m)``: ``(centroids (n, k), codes (n, m))``."""
    groups = SortedGroups(x, w)
    c, e = groups.kmeans(k, iters)
    return c, groups.codes(e)


@register_quantizer
class Palettize(Quantizer):
    name = "palettize"
    supported_bits = (2, 3, 4, 6, 8)
    Config = PalettizeConfig

    def __init__(self, config: PalettizeConfig | None = None, **params):
        super().__init__(config, **params)
        if self.config.weighting not in WEIGHTINGS:
            raise QRecoverError(f"palettize weighting={self.config.weighting!r} is unknown; choose from {list(WEIGHTINGS)}")
        if self.config.block_fit not in BLOCK_FITS:
            raise QRecoverError(f"palettize block_fit={self.config.block_fit!r} is unknown; choose from {list(BLOCK_FITS)}")
        if self.config.block_fit == "nearest" and self.config.block_size is None:
            raise QRecoverError("palettize block_fit='nearest' needs a target block_size, e.g. palettize:3/b192/block_fit=nearest")
        if self.config.refit < 0:
            raise QRecoverError(f"palettize refit={self.config.refit} must be 0 (k-means tables) or more (least-squares refits)")

    @property
    def needs(self) -> frozenset[str]:  # type: ignore[override]  # depends on the config
        cfg = self.config
        weights = ({"input_sq"} | ({"out_grad_sq"} if cfg.weighting == "fisher" else set())) if cfg.weighted else set()
        return frozenset(weights | ({"hessian"} if cfg.error_feedback else set()))

    def _geometry(self, shape: tuple[int, int]) -> tuple[int, int]:
        out_f, in_f = shape
        g, c = self.config.group_size, self.config.block_size or in_f
        if self.config.block_fit == "nearest":
            near = nearest_block(in_f, c)
            if near is None:
                raise QRecoverError(f"palettize block_size={c} block_fit='nearest': no multiple of 32 between {c // 2} and {2 * c} "
                                    f"divides weight {tuple(shape)}'s {in_f} columns; use whole-row tables (no bN) or another bN")
            c = near
        if out_f % g or in_f % c:
            raise QRecoverError(
                f"palettize cannot split weight {tuple(shape)} into groups of group_size={g} rows x "
                f"block_size={c} columns; pick sizes that divide {out_f} and {in_f}"
            )
        return g, c

    def check(self, shape: tuple[int, int], bits: int) -> None:
        super().check(shape, bits)
        self._geometry(shape)

    def nbytes(self, shape: tuple[int, int], bits: int) -> int:
        g, c = self._geometry(shape)
        n_groups = (shape[0] // g) * (shape[1] // c)
        return packed_nbytes(shape[0] * shape[1], bits) + n_groups * (2**bits) * 2

    def quantize(self, weight: torch.Tensor, bits: int, stats: dict[str, torch.Tensor]) -> QuantizedWeight:
        return self.quantize_many(weight, [bits], stats)[0]

    def quantize_many(self, weight: torch.Tensor, bits_list: list[int], stats: dict[str, torch.Tensor]) -> list[QuantizedWeight]:
        """Every width in ``bits_list`` from one sort of the weight's groups."""
        shape = tuple(weight.shape)
        for bits in bits_list:
            self.check(shape, bits)
        out_f, in_f = shape
        g, c = self._geometry(shape)
        imp = self.importance(shape, stats, weight.device)
        groups = SortedGroups(_to_groups(weight.detach().float(), g, c), _to_groups(imp, g, c))
        # fit every width's tables, stored in fp16; codes index the fp16 table, so dequantize() is lut[code]
        luts = [c.half() for c, _ in groups.kmeans_many([2**bits for bits in bits_list], self.config.iters)]
        if self.config.error_feedback and "hessian" in stats:
            h, weight = stats["hessian"], weight.detach()
            # one factorisation for every pass (and, from the candidates stage, every layer reading these inputs)
            factor = stats["hessian_inv_chol"] if "hessian_inv_chol" in stats else self.shared_factor(h)
            all_codes = self._assign_with_feedback(weight, factor, luts, g, c)
            if self.config.refit:
                # reassigning with refitted tables usually lowers the error further but need not: keep each width's best
                best = [(_output_error(weight, lut, codes, h, g, c), lut, codes) for lut, codes in zip(luts, all_codes)]
                for n in range(self.config.refit):
                    if n:
                        all_codes = self._assign_with_feedback(weight, factor, luts, g, c)
                    refits = [refit_tables(weight, codes, lut, h, g, c) for codes, lut in zip(all_codes, luts)]
                    luts, all_codes = [t for t, _ in refits], [k for _, k in refits]
                    best = [min(b, (_output_error(weight, lut, codes, h, g, c), lut, codes), key=lambda x: x[0])
                            for b, lut, codes in zip(best, luts, all_codes)]
                luts, all_codes = [b[1] for b in best], [b[2] for b in best]
        else:
            all_codes = [_from_groups(groups.codes(groups.edges(lut)), out_f, in_f, g, c) for lut in luts]
        return [self._pack(bits, shape, {"qdata": pack(codes, bits), "lut": lut.contiguous()})
                for bits, lut, codes in zip(bits_list, luts, all_codes)]

    def importance(self, shape: tuple[int, int], stats: dict[str, torch.Tensor],
                   device: torch.device | str | None = None) -> torch.Tensor:
        """``(O, I)`` k-means weights, mean 1 (see the module docstring); all ones (on ``device``) when
        unweighted or without statistics."""
        out_f, in_f = shape
        cfg = self.config
        if not cfg.weighted or not ("element_sq" in stats or "input_sq" in stats):
            return torch.ones(out_f, in_f, device=device)
        if "element_sq" in stats:
            imp = stats["element_sq"].float()
        elif cfg.weighting == "fisher":
            if "out_grad_sq" not in stats:
                raise QRecoverError("palettize weighting='fisher' needs the 'out_grad_sq' statistic (output-gradient "
                                    "moments from the backward calibration pass); use weighting='input' without it")
            imp = stats["out_grad_sq"].float().clamp_min(0).unsqueeze(1) * stats["input_sq"].float().clamp_min(0)
        else:
            imp = stats["input_sq"].float().expand(out_f, in_f)
        imp = imp.clamp_min(0) ** cfg.importance_power
        return imp / imp.mean().clamp_min(1e-30) + 1e-6  # never weight a value by exactly zero

    #: the error feedback's dampening (:func:`~qrecover.schemes.feedback.error_feedback`'s default); no column reordering
    damp = 0.01
    act_order = False

    @property
    def factor_key(self) -> tuple[float, bool]:
        """See :attr:`qrecover.schemes.gptq.GPTQ.factor_key` (equal keys, equal factors)."""
        return (self.damp, self.act_order)

    def shared_factor(self, hessian: torch.Tensor) -> torch.Tensor:
        """``(I, I)`` the ``hessian_inv_chol`` statistic the error feedback uses: exactly what
        :func:`~qrecover.schemes.feedback.error_feedback` computes from ``hessian`` itself, so that every pass of every
        width, and every layer reading the same inputs, shares one factorisation (the same as GPTQ's without act order)."""
        return inverse_hessian_factor(hessian, self.damp, torch.float32)

    @staticmethod
    def _assign_with_feedback(weight: torch.Tensor, factor: torch.Tensor, luts: list[torch.Tensor], g: int, c: int
                              ) -> list[torch.Tensor]:
        """Codes for every width's tables in one error-feedback pass: the widths are stacked as extra rows
        (tables padded to the largest with bounds at +inf), so the per-column loop runs once, not per width.
        ``factor``: :meth:`shared_factor` of the input Hessian."""
        out_f, in_f = weight.shape
        k_max = max(lut.shape[1] for lut in luts)
        bounds, tables = [], []
        for lut in luts:
            t = lut.float().view(out_f // g, in_f // c, -1)  # (row groups, column blocks, K)
            b = (t[..., 1:] + t[..., :-1]) / 2
            pad = k_max - t.shape[-1]
            b = torch.cat([b, torch.full((*b.shape[:2], pad), float("inf"), device=b.device)], dim=-1)
            t = torch.cat([t, t[..., -1:].expand(*t.shape[:2], pad)], dim=-1)
            bounds.append(b.repeat_interleave(g, dim=0))  # (out, column blocks, K_max - 1)
            tables.append(t.repeat_interleave(g, dim=0))  # (out, column blocks, K_max)
        bounds_t, tables_t = torch.cat(bounds), torch.cat(tables)
        bounds_by_block = [bounds_t[:, blk].contiguous() for blk in range(in_f // c)]
        tables_by_block = [tables_t[:, blk].contiguous() for blk in range(in_f // c)]

        sorted_edges = bool((bounds_t[..., 1:] >= bounds_t[..., :-1]).all())  # counting edges below = searchsorted
        rule = None
        if sorted_edges and fused_steps(weight, torch.float32):  # one kernel launch per block of columns (a GPU)
            rule = TableRule(bounds_t.permute(1, 2, 0).contiguous(), tables_t.permute(1, 2, 0).contiguous(), c)
        if numpy_steps(weight) and k_max <= 32 and sorted_edges:
            # The same codes on the CPU, several times faster per column: the number of sorted edges below each value
            # (what searchsorted returns) as one numpy compare-and-count over the (K-1, rows) edges, then a flat take.
            edges_np = [b.T.contiguous().numpy() for b in bounds_by_block]
            tables_np = [t.reshape(-1).numpy() for t in tables_by_block]
            row_base = np.arange(bounds_t.shape[0]) * k_max

            def round_fn(j: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                blk = j // c
                code = (w.numpy() > edges_np[blk]).sum(0, dtype=np.uint8)
                return torch.from_numpy(tables_np[blk][row_base + code]), torch.from_numpy(code)
        else:
            def round_fn(j: int, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
                blk = j // c
                code = torch.searchsorted(bounds_by_block[blk], w.unsqueeze(1).contiguous())
                return tables_by_block[blk].gather(1, code).squeeze(1), code.squeeze(1)

        codes = error_feedback(weight.repeat(len(luts), 1), None, round_fn, factor=factor, rule=rule)
        return list(codes.split(out_f))

    def _pack(self, bits: int, shape: tuple[int, int], tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        """Stored with the exact geometry: a 'nearest' block becomes the block_size this layer used, so that every
        reader of the parameters (kernels, exporters) sees plain columns per table."""
        if self.config.block_fit == "exact":
            return super()._pack(bits, shape, tensors)
        params = dataclasses.asdict(dataclasses.replace(self.config, block_size=self._geometry(shape)[1], block_fit="exact"))
        return QuantizedWeight(self.name, bits, tuple(shape), params, tensors)

    def dequantize(self, qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.decode(qw, unpack(qw.tensors["qdata"], qw.bits, qw.numel), dtype)

    def rows(self, qw: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """:meth:`Quantizer.rows`: each row's codes and its group's tables, looked up as :meth:`decode` does. None where
        a row's codes do not fill whole bytes."""
        out_f, in_f = qw.shape
        g, c = self._geometry(qw.shape)
        codes = take_rows(qw.tensors["qdata"], qw.bits, in_f, ids)
        if codes is None:
            return None
        k = 2**qw.bits
        lut = qw.tensors["lut"].reshape(out_f // g, (in_f // c) * k).index_select(0, ids // g).to(dtype)  # (n, I/C * K)
        codes = unpack(codes, qw.bits, ids.numel() * in_f).reshape(ids.numel(), in_f // c, c).long()
        base = torch.arange(in_f // c, device=codes.device).view(1, -1, 1) * k
        return lut.gather(1, (codes + base).reshape(ids.numel(), in_f))

    def decode(self, qw: QuantizedWeight, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out_f, in_f = qw.shape
        g, c = self._geometry(qw.shape)
        k = 2**qw.bits
        codes = codes.reshape(out_f // g, g, in_f // c, c).long()
        base = torch.arange((out_f // g) * (in_f // c), device=codes.device).view(out_f // g, 1, in_f // c, 1) * k
        return qw.tensors["lut"].to(dtype).reshape(-1)[codes + base].reshape(out_f, in_f)

    def encode(self, qw: QuantizedWeight, weight: torch.Tensor) -> torch.Tensor:
        """The nearest entry of each element's table: the tables sorted (they need not be while they train), the
        midpoints between neighbours as decision edges, one batched ``searchsorted``."""
        out_f, in_f = qw.shape
        g, c = self._geometry(qw.shape)
        values, order = qw.tensors["lut"].detach().float().sort(dim=-1)  # (groups, K)
        edges = ((values[:, 1:] + values[:, :-1]) / 2).contiguous()
        pos = torch.searchsorted(edges, _to_groups(weight.detach().float(), g, c).contiguous())
        return _from_groups(order.gather(1, pos), out_f, in_f, g, c)


def refit_tables(weight: torch.Tensor, codes: torch.Tensor, lut: torch.Tensor, hessian: torch.Tensor, g: int, c: int,
                 ridge: float = 1e-6, max_elements: int = 2**24) -> tuple[torch.Tensor, torch.Tensor]:
    """Table values that minimise the output error ``tr((W - Q) H (W - Q)^T)`` for fixed codes.

    ``Q``'s entries are table values, so for fixed codes ``Q`` is linear in them and the best tables solve a
    least-squares problem: for the table ``t`` of one group of ``g`` rows and one block of columns ``b``,
    ``A t = A t_old + sum_r M_r^T (e_r H)_b`` with ``M_r`` the one-hot ``(c, K)`` code matrix of row ``r`` in the
    block, ``A = sum_r M_r^T H_bb M_r`` and ``e_r = w_r - q_r`` the current error. The blocks of a row are
    coupled through ``H``; they are solved one after another, each with the others' latest values (one
    Gauss-Seidel sweep, exact when a table spans the whole row). Entries that no code uses keep their value.

    weight ``(O, I)``, codes ``(O, I)``, lut ``(O/g * I/c, K)`` (row-major ``(O/g, I/c)``, as stored).
    Returns ``(lut, codes)``: fp16 tables sorted ascending again and the codes renumbered to match.
    """
    weight = weight.detach()
    out_f, in_f = weight.shape
    k, nb, ng = lut.shape[1], in_f // c, out_f // g
    h = hessian.to(device=weight.device, dtype=torch.float32)
    t = lut.float().view(ng, nb, k).clone()
    codes = codes.view(out_f, nb, c)
    rows_t = t.repeat_interleave(g, dim=0)  # (O, nb, K)
    he = (weight.float() - rows_t.gather(2, codes).view(out_f, in_f)) @ h  # e H, (O, I); H symmetric
    step = max(1, max_elements // max(1, g * c * k)) * g  # rows per chunk: bounds the one-hot (rows, c, K)
    for b in range(nb):
        cols = slice(b * c, (b + 1) * c)
        h_bb = h[cols, cols]
        a = torch.zeros(ng, k, k, dtype=torch.float64, device=weight.device)
        r = torch.zeros(ng, k, dtype=torch.float64, device=weight.device)
        for r0 in range(0, out_f, step):
            r1 = min(out_f, r0 + step)
            oh = F.one_hot(codes[r0:r1, b], k).float()  # (rows, c, K)
            hm = (h_bb @ oh.permute(1, 0, 2).reshape(c, -1)).view(c, r1 - r0, k).permute(1, 0, 2)
            a[r0 // g:r1 // g] = (oh.transpose(1, 2) @ hm).view(-1, g, k, k).sum(1).double()
            r[r0 // g:r1 // g] = torch.einsum("nck,nc->nk", oh, he[r0:r1, cols]).view(-1, g, k).sum(1).double()
        diag = a.diagonal(dim1=1, dim2=2)
        unused = diag <= 0
        scale = diag.mean(-1, keepdim=True).clamp_min(1e-30)
        a = a + torch.diag_embed(ridge * scale.expand_as(diag) + unused.double() * scale)
        delta = torch.linalg.solve(a, r.unsqueeze(-1)).squeeze(-1).masked_fill(unused, 0.0)
        new = (t[:, b].double() + delta).half().float()
        dq = (new - t[:, b]).repeat_interleave(g, dim=0).gather(1, codes[:, b])  # (O, c): the change of Q
        he -= dq @ h[cols]
        t[:, b] = new
    t, order = t.sort(dim=-1)
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(k, device=order.device).expand_as(order))
    codes = rank.repeat_interleave(g, dim=0).gather(2, codes).view(out_f, in_f)
    return t.view(ng * nb, k).half().contiguous(), codes


def _output_error(weight: torch.Tensor, lut: torch.Tensor, codes: torch.Tensor, hessian: torch.Tensor, g: int, c: int) -> float:
    """``tr((W - Q) H (W - Q)^T)`` for the tables ``lut`` (stored order) and codes ``(O, I)``."""
    out_f, in_f = weight.shape
    k = lut.shape[1]
    rows = lut.float().view(out_f // g, in_f // c, k).repeat_interleave(g, dim=0)
    e = weight.detach().float() - rows.gather(2, codes.view(out_f, in_f // c, c)).view(out_f, in_f)
    return float((e @ hessian.to(device=e.device, dtype=torch.float32) * e).sum())


def _to_groups(w: torch.Tensor, g: int, c: int) -> torch.Tensor:
    """``(O, I) -> (O/g * I/c, g * c)``, groups in row-major ``(O/g, I/c)`` order."""
    o, i = w.shape
    return w.reshape(o // g, g, i // c, c).permute(0, 2, 1, 3).reshape(-1, g * c)


def _from_groups(x: torch.Tensor, o: int, i: int, g: int, c: int) -> torch.Tensor:
    return x.reshape(o // g, i // c, g, c).permute(0, 2, 1, 3).reshape(o, i)

"""Block-wise integer quantization: one fp16 scale (and zero point) per block of input elements.

A weight ``(O, I)`` is cut along each row into blocks of ``B = block_size`` elements (``B = I`` when
``block_size`` is None: per-channel, AFM's int8 embedding). Symmetric: ``w ~ scale * (q - 2**(bits-1))``
with ``scale = absmax / (2**(bits-1) - 1)``. Asymmetric: ``w ~ scale * (q - zero_point)`` from min/max.

Stored tensors:

- ``qdata``: uint8 ``(ceil(O * I * bits / 8),)``, codes in row-major ``(O, I)`` order, bit-packed
- ``scale``: fp16 ``(O, I / B)``
- ``zero_point`` (asymmetric only): uint8 ``(ceil(O * I / B * bits / 8),)``, bit-packed like qdata

``clip=true`` (AutoAWQ's clip search, which llm-compressor's AWQ leaves out): each block's range (absmax, or min and
max) is shrunk by the ratio in ``1, 0.975, ..., 0.5`` that gives the least output error ``dw_b^T H_bb dw_b``, where
``H_bb`` is the block's diagonal block of the layer's input Hessian ``E[x x^T]`` (the error of that block's share of the
output on the calibration inputs, cross-block terms left out, as AutoAWQ's per-group search does). Without a Hessian
(an embedding) the per-element weights ``element_sq`` or ``input_sq`` stand in, else the plain squared error. The
stored layout is unchanged: only the scales (and zero points) differ, so kernels and exporters read it as before.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import QRecoverError
from ..packing import pack, packed_nbytes, take_rows, unpack
from .base import QuantizedWeight, Quantizer, doc_field, register_quantizer


@dataclass
class BlockwiseConfig:
    block_size: int | None = doc_field(64, "input elements per scale (32/64/128); None = one scale per row")
    symmetric: bool = doc_field(True, "absmax scale around zero (True) or min/max with a zero point (False)")
    clip: bool = doc_field(False, "shrink each block's range by the ratio (1 down to 0.5) that least changes the layer's "
                                  "output in its input Hessian (AutoAWQ's clip search; needs the 'hessian' statistic)")


#: the range shrink ratios ``clip=true`` tries, 1 first (so a tie keeps the plain range)
CLIP_RATIOS = tuple(1 - i / 40 for i in range(21))


@register_quantizer
class Blockwise(Quantizer):
    name = "blockwise"
    supported_bits = (2, 3, 4, 8)
    Config = BlockwiseConfig

    @property
    def needs(self) -> frozenset[str]:  # type: ignore[override]  # depends on the config
        return frozenset({"hessian"}) if self.config.clip else frozenset()

    def _block(self, shape: tuple[int, int]) -> int:
        b = self.config.block_size or shape[1]
        if shape[1] % b:
            raise QRecoverError(
                f"blockwise cannot cut rows of weight {tuple(shape)} into block_size={b}; use a divisor of {shape[1]}"
            )
        return b

    def check(self, shape: tuple[int, int], bits: int) -> None:
        super().check(shape, bits)
        self._block(shape)

    def nbytes(self, shape: tuple[int, int], bits: int) -> int:
        n_blocks = shape[0] * (shape[1] // self._block(shape))
        zp = 0 if self.config.symmetric else packed_nbytes(n_blocks, bits)
        return packed_nbytes(shape[0] * shape[1], bits) + n_blocks * 2 + zp

    def quantize(self, weight: torch.Tensor, bits: int, stats: dict[str, torch.Tensor]) -> QuantizedWeight:
        self.check(tuple(weight.shape), bits)
        out_f, in_f = weight.shape
        b = self._block(tuple(weight.shape))
        w = weight.detach().float().reshape(out_f, in_f // b, b)
        scale, zp, codes = _round(w, bits, self.config.symmetric, CLIP_RATIOS[0])
        if self.config.clip:  # per block, keep the ratio of least error (strictly less: a tie keeps the earlier one)
            error = _block_error(stats, w.shape, w.device)
            best = error(w - _values(codes, scale, zp, bits))
            for ratio in CLIP_RATIOS[1:]:
                s, z, c = _round(w, bits, self.config.symmetric, ratio)
                err = error(w - _values(c, s, z, bits))
                better = err < best
                best = torch.where(better, err, best)
                scale, codes = torch.where(better, s, scale), torch.where(better.unsqueeze(-1), c, codes)
                zp = None if zp is None else torch.where(better, z, zp)
        tensors = {"qdata": pack(codes.to(torch.uint8), bits), "scale": scale.contiguous()}
        if zp is not None:
            tensors["zero_point"] = pack(zp.to(torch.uint8), bits)
        return self._pack(bits, (out_f, in_f), tensors)

    def dequantize(self, qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.decode(qw, unpack(qw.tensors["qdata"], qw.bits, qw.numel), dtype)

    def decode(self, qw: QuantizedWeight, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out_f, in_f = qw.shape
        b = self._block(qw.shape)
        codes = codes.reshape(out_f, in_f // b, b).to(dtype)
        scale = qw.tensors["scale"].to(dtype).unsqueeze(-1)
        return ((codes - self._zero(qw, dtype, codes.device)) * scale).reshape(out_f, in_f)

    def encode(self, qw: QuantizedWeight, weight: torch.Tensor) -> torch.Tensor:
        """``round(w / scale) + zero``, clamped to the code range (a zero scale gives the zero point's code: the value
        is 0 whatever the code)."""
        out_f, in_f = qw.shape
        b = self._block(qw.shape)
        s = qw.tensors["scale"].detach().float().unsqueeze(-1)
        s = torch.where(s != 0, s, torch.ones_like(s))
        w = weight.detach().float().reshape(out_f, in_f // b, b)
        codes = torch.round(w / s) + self._zero(qw, torch.float32, w.device)
        return codes.clamp_(0, 2**qw.bits - 1).long().reshape(out_f, in_f)

    def rows(self, qw: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """:meth:`Quantizer.rows`: the rows' codes, scales and zero points taken, then :meth:`decode` on them (the same
        operations on the same numbers as :meth:`dequantize`). None where a row's codes do not fill whole bytes."""
        in_f = qw.shape[1]
        n_blocks = in_f // self._block(qw.shape)
        codes = take_rows(qw.tensors["qdata"], qw.bits, in_f, ids)
        if codes is None:
            return None
        tensors = {"qdata": codes, "scale": qw.tensors["scale"].reshape(qw.shape[0], n_blocks).index_select(0, ids)}
        if "zero_point" in qw.tensors:  # whole bytes per row, or (a row's zero points end inside a byte) all unpacked
            zp = qw.tensors["zero_point"]
            tensors["zero_point"] = take_rows(zp, qw.bits, n_blocks, ids)
            if tensors["zero_point"] is None:
                rows_zp = unpack(zp, qw.bits, qw.shape[0] * n_blocks).view(qw.shape[0], n_blocks).index_select(0, ids)
                tensors["zero_point"] = pack(rows_zp, qw.bits)
        sub = QuantizedWeight(qw.scheme, qw.bits, (ids.numel(), in_f), qw.params, tensors)
        return self.decode(sub, unpack(codes, qw.bits, sub.numel), dtype)

    def _zero(self, qw: QuantizedWeight, dtype: torch.dtype, device) -> torch.Tensor:
        """The zero point of each block, ``(O, I/B, 1)`` (asymmetric: stored), or ``2**(bits-1)`` (symmetric)."""
        if "zero_point" in qw.tensors:
            out_f, in_f = qw.shape
            n = out_f * (in_f // self._block(qw.shape))
            return unpack(qw.tensors["zero_point"], qw.bits, n).view(out_f, -1, 1).to(device=device, dtype=dtype)
        return torch.full((), 2 ** (qw.bits - 1), dtype=dtype, device=device)


def _round(w: torch.Tensor, bits: int, symmetric: bool, ratio: float):
    """``(scale fp16 (O, G), zero point (O, G) or None, codes (O, G, B))`` of blocks ``w (O, G, B)`` whose range is
    shrunk by ``ratio`` (1 = absmax or min/max); values outside the shrunk range clamp to its ends."""
    qmax = 2**bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        scale = (w.abs().amax(-1) * ratio / max(half - 1, 1)).half()
        s = torch.where(scale > 0, scale, torch.ones_like(scale)).float().unsqueeze(-1)
        return scale, None, (torch.round(w / s) + half).clamp_(0, qmax)
    lo, hi = w.amin(-1).clamp(max=0) * ratio, w.amax(-1).clamp(min=0) * ratio
    scale = ((hi - lo) / qmax).half()
    s = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
    zp = torch.round(-lo / s).clamp_(0, qmax)
    return scale, zp, (torch.round(w / s.unsqueeze(-1)) + zp.unsqueeze(-1)).clamp_(0, qmax)


def _values(codes: torch.Tensor, scale: torch.Tensor, zp: torch.Tensor | None, bits: int) -> torch.Tensor:
    """The dequantized blocks ``(O, G, B)``, as :meth:`Blockwise.dequantize` computes them."""
    z = zp.unsqueeze(-1) if zp is not None else 2 ** (bits - 1)
    return (codes - z) * scale.float().unsqueeze(-1)


def _block_error(stats: dict[str, torch.Tensor], shape: tuple[int, int, int], device) -> Callable[[torch.Tensor], torch.Tensor]:
    """``dw (O, G, B) -> (O, G)``: each block's output error, ``dw_b^T H_bb dw_b`` with the diagonal blocks of the input
    Hessian, or the squared error weighted per element (``element_sq``) or per input channel (``input_sq``)."""
    o, g, b = shape
    if "hessian" in stats:
        h = stats["hessian"].to(device=device, dtype=torch.float32).reshape(g, b, g, b)
        hb = h.diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # (G, B, B): block k's rows and columns
        return lambda dw: torch.einsum("ogb,gbc,ogc->og", dw, hb, dw)
    if "element_sq" in stats:
        e = stats["element_sq"].to(device=device, dtype=torch.float32).reshape(o, g, b)
        return lambda dw: (dw.square() * e).sum(-1)
    d = stats["input_sq"].to(device=device, dtype=torch.float32).reshape(g, b) if "input_sq" in stats else 1.0
    return lambda dw: (dw.square() * d).sum(-1)

"""Block-wise integer quantization: one fp16 scale (and zero point) per block of input elements.

A weight ``(O, I)`` is cut along each row into blocks of ``B = block_size`` elements (``B = I`` when
``block_size`` is None: per-channel, AFM's int8 embedding). Symmetric: ``w ~ scale * (q - 2**(bits-1))``
with ``scale = absmax / (2**(bits-1) - 1)``. Asymmetric: ``w ~ scale * (q - zero_point)`` from min/max.

Stored tensors:

- ``qdata``: uint8 ``(ceil(O * I * bits / 8),)``, codes in row-major ``(O, I)`` order, bit-packed
- ``scale``: fp16 ``(O, I / B)``
- ``zero_point`` (asymmetric only): uint8 ``(ceil(O * I / B * bits / 8),)``, bit-packed like qdata
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import QRecoverError
from ..packing import pack, packed_nbytes, unpack
from .base import QuantizedWeight, Quantizer, doc_field, register_quantizer


@dataclass
class BlockwiseConfig:
    block_size: int | None = doc_field(64, "input elements per scale (32/64/128); None = one scale per row")
    symmetric: bool = doc_field(True, "absmax scale around zero (True) or min/max with a zero point (False)")


@register_quantizer
class Blockwise(Quantizer):
    name = "blockwise"
    supported_bits = (2, 3, 4, 8)
    Config = BlockwiseConfig

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
        qmax = 2**bits - 1
        tensors: dict[str, torch.Tensor] = {}
        if self.config.symmetric:
            half = 2 ** (bits - 1)
            scale = (w.abs().amax(-1) / max(half - 1, 1)).half()
            s = torch.where(scale > 0, scale, torch.ones_like(scale)).float().unsqueeze(-1)
            codes = (torch.round(w / s) + half).clamp_(0, qmax)
        else:
            lo, hi = w.amin(-1).clamp(max=0), w.amax(-1).clamp(min=0)
            scale = ((hi - lo) / qmax).half()
            s = torch.where(scale > 0, scale, torch.ones_like(scale)).float()
            zp = torch.round(-lo / s).clamp_(0, qmax)
            codes = (torch.round(w / s.unsqueeze(-1)) + zp.unsqueeze(-1)).clamp_(0, qmax)
            tensors["zero_point"] = pack(zp.to(torch.uint8), bits)
        tensors = {"qdata": pack(codes.to(torch.uint8), bits), "scale": scale.contiguous(), **tensors}
        return self._pack(bits, (out_f, in_f), tensors)

    def dequantize(self, qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out_f, in_f = qw.shape
        b = self._block(qw.shape)
        n_blocks = out_f * (in_f // b)
        codes = unpack(qw.tensors["qdata"], qw.bits, out_f * in_f).view(out_f, in_f // b, b).to(dtype)
        scale = qw.tensors["scale"].to(dtype).unsqueeze(-1)
        if "zero_point" in qw.tensors:
            zp = unpack(qw.tensors["zero_point"], qw.bits, n_blocks).view(out_f, in_f // b, 1).to(dtype)
        else:
            zp = torch.full((), 2 ** (qw.bits - 1), dtype=dtype, device=codes.device)
        return ((codes - zp) * scale).reshape(out_f, in_f)

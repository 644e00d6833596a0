"""torch's built-in int4 matmul (``aten._weight_int4pack_mm``) on qrecover's blockwise 4-bit layers, after a repack.

Blockwise 4-bit stores ``w = (code - z) * s`` per row and block of ``B`` columns (``z = 8`` when symmetric). torch's
int4 kernels compute ``w = (code - 8) * s + zero`` per group of ``B`` input columns, so the same numbers come out
with ``zero = (8 - z) * s`` (0 when symmetric): the codes are repacked once into torch's tiled layout
(``_convert_weight_to_int4pack``; CPU: ``..._for_cpu``), ``scales_and_zeros (K / B, N, 2)`` in the activation
dtype. Groups of 32/64/128/256 columns, ``K % 128 == 0`` (8 inner K tiles of 16), ``N % 16 == 0``. The scales
are rounded to the activation dtype (exact for fp16 scales and fp16/fp32 activations; bf16 rounds them, as
the reference path's ``dequantize(bf16)`` rounds the weight). CUDA builds of torch may accept only bf16 inputs:
the dispatch (:mod:`.dispatch`) tries it once per layer kind and drops it on an error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..packing import unpack
from .formats import BLOCKWISE, Format

GROUPS = (32, 64, 128, 256)
INNER_K_TILES = 8


@dataclass(frozen=True)
class Int4Weight:
    """A repacked weight: ``packed`` (torch's tiled int4 layout), ``scales_and_zeros (K / group, N, 2)``."""

    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    group: int
    out_features: int

    @property
    def nbytes(self) -> int:
        return self.packed.numel() * self.packed.element_size() + self.scales_and_zeros.numel() * self.scales_and_zeros.element_size()


def supported(fmt: Format | str) -> bool:
    """True for blockwise 4-bit layers whose geometry torch's int4 kernels take."""
    return (not isinstance(fmt, str) and fmt.scheme == BLOCKWISE and fmt.bits == 4 and fmt.cblock in GROUPS
            and fmt.in_f % (INNER_K_TILES * 16) == 0 and fmt.out_f % 16 == 0)


def repack(layer, fmt: Format, dtype: torch.dtype) -> Int4Weight:
    """The layer's codes and scales in torch's int4 layout, on the layer's device (one-time, at first use)."""
    n, k = fmt.out_f, fmt.in_f
    qdata = layer.qdata
    codes = unpack(qdata, 4, n * k).view(n, k).to(torch.int32)
    scale = layer.scale.float()  # (N, K / B)
    if fmt.has_zp:
        zp = unpack(layer.zero_point, 4, scale.numel()).view(scale.shape).float()
    else:
        zp = torch.full_like(scale, 8.0)
    sz = torch.stack([scale, (8.0 - zp) * scale], dim=-1).transpose(0, 1).contiguous().to(dtype)  # (K / B, N, 2)
    if qdata.device.type == "cpu":
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, INNER_K_TILES)
    else:
        uint8 = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)  # (N, K / 2), even column in the high nibble
        packed = torch.ops.aten._convert_weight_to_int4pack(uint8, INNER_K_TILES)
    return Int4Weight(packed, sz, fmt.cblock, n)


def linear(w: Int4Weight, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x (..., K) -> (..., N)`` through torch's int4 matmul."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.device.type == "cpu":
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w.packed, w.group, w.scales_and_zeros)
    else:
        y = torch.ops.aten._weight_int4pack_mm(x2, w.packed, w.group, w.scales_and_zeros)
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.reshape(*x.shape[:-1], w.out_features)

"""Bit packing of integer codes into bytes, pure torch.

Layout: codes are flattened in C order and written as a little-endian bit stream: code ``k`` occupies
bits ``[k*bits, (k+1)*bits)`` of the stream, bit ``b`` of the stream is bit ``b % 8`` of byte ``b // 8``.
The last byte is zero-padded. So ``packed_nbytes(n, bits) == ceil(n * bits / 8)`` exactly.

Eight codes of ``bits`` bits fill exactly ``bits`` bytes, so both directions work on groups of eight
codes held in one int64.
"""

from __future__ import annotations

import torch


def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes taken by ``numel`` codes of ``bits`` bits each."""
    return (numel * bits + 7) // 8


def _check(bits: int) -> None:
    if not 1 <= bits <= 8:
        raise ValueError(f"{bits=} must be in 1..8")


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes (any shape, values in ``[0, 2**bits)``) into a 1-D uint8 tensor."""
    _check(bits)
    flat = codes.reshape(-1).to(torch.uint8)
    n = flat.numel()
    if bits == 8:
        return flat.clone()
    pad = (-n) % 8
    groups = torch.cat([flat, flat.new_zeros(pad)]).view(-1, 8).to(torch.int64)
    word = (groups << (torch.arange(8, dtype=torch.int64, device=flat.device) * bits)).sum(dim=1)  # (n/8,)
    out = (word.unsqueeze(1) >> (torch.arange(bits, dtype=torch.int64, device=flat.device) * 8)) & 0xFF
    return out.to(torch.uint8).reshape(-1)[: packed_nbytes(n, bits)]


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of :func:`pack`: a 1-D uint8 tensor of ``numel`` codes."""
    _check(bits)
    if packed.numel() != packed_nbytes(numel, bits):
        raise ValueError(f"{packed.numel()=} bytes cannot hold {numel=} codes of {bits=}")
    if bits == 8:
        return packed.reshape(-1)[:numel]
    flat = packed.reshape(-1)
    pad = (-flat.numel()) % bits
    groups = torch.cat([flat, flat.new_zeros(pad)]).view(-1, bits).to(torch.int64)
    word = (groups << (torch.arange(bits, dtype=torch.int64, device=flat.device) * 8)).sum(dim=1)
    codes = (word.unsqueeze(1) >> (torch.arange(8, dtype=torch.int64, device=flat.device) * bits)) & ((1 << bits) - 1)
    return codes.to(torch.uint8).reshape(-1)[:numel]


def take_rows(packed: torch.Tensor, bits: int, row_len: int, rows: torch.Tensor) -> torch.Tensor | None:
    """The packed bytes of rows ``rows`` (1-D long) of a C-order ``(R, row_len)`` code array packed by :func:`pack`,
    as one packed stream of ``len(rows)`` rows; None when a row does not fill whole bytes (``row_len * bits % 8``),
    so that rows do not start on a byte."""
    if row_len * bits % 8:
        return None
    width = row_len * bits // 8
    return packed.reshape(-1, width).index_select(0, rows).reshape(-1)

"""What the fused kernels need to know about a packed weight, and one launch configuration (no triton here)."""

from __future__ import annotations

from dataclasses import dataclass

PALETTIZE, BLOCKWISE = 0, 1


@dataclass(frozen=True)
class Format:
    """What a kernel needs to know about a packed weight ``(out_f, in_f)``.

    ``group``: rows per table (palettize; 1 for blockwise). ``cblock``: input columns per table / scale
    (``C`` or ``B``; ``in_f`` for whole-row tables and per-channel scales). ``has_zp``: asymmetric blockwise.
    """

    scheme: int
    bits: int
    out_f: int
    in_f: int
    group: int
    cblock: int
    has_zp: bool


@dataclass(frozen=True)
class Config:
    """One launch configuration. ``use_dot``: tensor-core product (else broadcast multiply-and-sum). ``asm``: the
    decode kernel reads tables and 3-bit code words through inline PTX (:func:`qrecover.kernels.gemv._lut_load`;
    compiled kernels only, ignored under triton's interpreter). ``lut``: the decode kernel's palettize table layout
    (:mod:`qrecover.kernels.gemv`'s ``LUT_*``: fp16/fp32/pair tables read from memory, or register tables 3-6; -1 =
    its default for the shape). ``pipe``: the decode kernel (batch 1-4) reads the code words through triton's
    software pipeliner, ``pipe - 1`` tiles ahead through shared memory (asynchronous copies, ``cp.async``), instead of
    one tile ahead in registers (0). ``serial``: with split-K, the decode kernel's last program of each output tile
    sums the splits itself (one launch, no reduction kernel after it). ``swap``: the batch 5-64 decode-and-dot kernel
    computes the transposed product, ``(W x^T)^T``, the decoded weights as the tensor-core product's first operand:
    its ``block_n`` rows (>= 64) then fill sm_90's warpgroup MMA (``wgmma``), which needs 64 rows, where ``block_m``
    (16-32 inputs) does not, and the weights reach it without the register shuffles of the smaller MMA
    (``compile_check --isa``: 3.88 -> 2.53 thread instructions per weight, palettize-3 at 16x64x128)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    use_dot: bool
    num_warps: int = 4
    num_stages: int = 2
    asm: bool = False
    lut: int = -1
    pipe: int = 0
    serial: bool = False
    swap: bool = False

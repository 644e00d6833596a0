"""Work per decoded weight, read from a compiled kernel's SASS (or PTX): what work without a GPU can optimise.

A GEMV at batch 1 is memory-bound only when it spends few instructions per weight. On an H100 (132 SMs x 4
warp schedulers x ~1.75 GHz ~= 0.92e12 warp instructions/s, i.e. 29.6e12 thread instructions/s) against
3.35 TB/s of HBM3, 3.25-bit weights stream at ~8.2e12 weights/s: the budget is ~3.6 thread instructions per
weight (4.25-bit: ~4.7), everything included. :func:`loop_body` finds a kernel's main loop (the longest span
closed by a backward branch), :func:`categorise` counts its instructions by kind, and :func:`per_weight`
divides by the weights one iteration decodes. Pure text processing: no triton, no GPU.
"""

from __future__ import annotations

import re
from collections import Counter

#: SASS opcode (before the first dot) -> kind
SASS_KINDS = {
    "LDG": "global load", "LDS": "shared load", "LDSM": "shared load", "STS": "shared store", "STSM": "shared store",
    "SHFL": "shuffle", "HMMA": "mma", "HGMMA": "mma", "IMMA": "mma",
    "F2F": "convert", "F2FP": "convert", "I2F": "convert", "F2I": "convert", "I2FP": "convert", "I2I": "convert",
    "BAR": "barrier", "DEPBAR": "barrier",
}
for _op in ("IMAD", "IADD3", "VIADD", "LOP3", "SHF", "LEA", "ISETP", "SEL", "PRMT", "IMNMX", "VIMNMX", "P2R", "R2P",
            "IABS", "BMSK", "SGXT", "FLO", "POPC", "BREV", "PLOP3", "IADD", "ISCADD", "IMUL", "BFE", "BFI"):
    SASS_KINDS[_op] = "integer"
for _op in ("FADD", "FMUL", "FFMA", "FSEL", "FSETP", "FMNMX", "HADD2", "HMUL2", "HFMA2", "HSET2", "HSETP2", "MUFU",
            "HMNMX2", "FCHK", "FSWZADD"):
    SASS_KINDS[_op] = "float"

#: PTX opcode prefix -> kind (used where no SASS disassembler is available)
PTX_KINDS = [("ld.global", "global load"), ("ld.shared", "shared load"), ("ldmatrix", "shared load"),
             ("st.shared", "shared store"), ("stmatrix", "shared store"), ("shfl", "shuffle"), ("mma", "mma"),
             ("wgmma", "mma"), ("cvt", "convert"), ("bar", "barrier"),
             ("fma.rn.f", "float"), ("add.f", "float"), ("mul.f", "float"), ("sub.f", "float"), ("fma.rn.f16", "float"),
             ("add.rn.f", "float"), ("mul.rn.f", "float"), ("max.f", "float"), ("min.f", "float"), ("setp.", "integer"),
             ("selp", "integer"), ("and.", "integer"), ("or.", "integer"), ("xor.", "integer"), ("shl.", "integer"),
             ("shr.", "integer"), ("add.s", "integer"), ("add.u", "integer"), ("sub.s", "integer"), ("mad.", "integer"),
             ("mul.", "integer"), ("prmt", "integer"), ("lop3", "integer"), ("bfe", "integer"), ("bfi", "integer"),
             ("min.", "integer"), ("max.", "integer")]

KINDS = ("global load", "shared load", "shared store", "shuffle", "integer", "float", "convert", "mma", "barrier", "other")

_SASS_INSN = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(?:\.[A-Z0-9_.]+)?")
_SASS_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_SASS_BRA = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")
_PTX_LABEL = re.compile(r"^\s*(\$L__\w+):")
_PTX_BRA = re.compile(r"\bbra(?:\.uni)?\s+(\$L__\w+)")


def _lines(text: str, ptx: bool) -> list[tuple[str, str]]:
    """``[(kind, item)]`` with kind "label" (item: its name), "insn" (opcode) or "branch" (target label)."""
    out = []
    label_re, bra_re = (_PTX_LABEL, _PTX_BRA) if ptx else (_SASS_LABEL, _SASS_BRA)
    for line in text.splitlines():
        if m := label_re.match(line):
            out.append(("label", m.group(1)))
            continue
        if ptx:
            s = line.strip()
            if not s or s.startswith(("//", ".", "{", "}", "$")) or s.endswith(":"):
                continue
            op = s.split()[0].lstrip("@!%p0123456789").strip() if s.startswith("@") else s.split()[0]
            if s.startswith("@"):
                op = s.split()[1]
        else:
            m = _SASS_INSN.search(line)
            if not m:
                continue
            op = m.group(1)
        out.append(("insn", op.rstrip(";")))
        if b := bra_re.search(line):
            out.append(("branch", b.group(1)))
    return out


def _loop_span(items: list[tuple[str, str]]) -> tuple[int, int]:
    """Indices into ``items`` of the longest loop: a label and the last backward branch to it."""
    seen: dict[str, int] = {}
    best: tuple[int, int] | None = None
    for i, (kind, item) in enumerate(items):
        if kind == "label":
            seen[item] = i
        elif kind == "branch" and item in seen:
            span = (seen[item], i)
            if best is None or span[1] - span[0] > best[1] - best[0]:
                best = span
    if best is None:
        raise ValueError("no backward branch: the kernel has no loop")
    return best


def loop_body(text: str, ptx: bool = False) -> list[str]:
    """Opcodes of the longest loop: from a label to the last backward branch to it (the main K loop).

    Raises ValueError when the code has no backward branch (no loop)."""
    items = _lines(text, ptx)
    a, b = _loop_span(items)
    return [item for kind, item in items[a:b + 1] if kind == "insn"]


def loop_parts(text: str, ptx: bool = False) -> tuple[list[str], list[str]]:
    """:func:`loop_body` split in two: the opcodes every iteration runs, and those of the blocks that a forward branch
    inside the loop can skip (a flush every few tiles: weight them by how often they run)."""
    items = _lines(text, ptx)
    a, b = _loop_span(items)
    labels = {item: i for i, (kind, item) in enumerate(items) if kind == "label" and a <= i <= b}
    skipped = set()
    for i in range(a, b + 1):
        kind, item = items[i]
        if kind == "branch" and labels.get(item, -1) > i:  # a forward branch to a label inside the loop
            skipped.update(range(i + 1, labels[item]))
    always = [item for i, (kind, item) in enumerate(items[a:b + 1], a) if kind == "insn" and i not in skipped]
    return always, [item for i, (kind, item) in enumerate(items) if kind == "insn" and i in skipped]


def kind_of(op: str, ptx: bool = False) -> str:
    if ptx:
        return next((k for prefix, k in PTX_KINDS if op.startswith(prefix)), "other")
    if op.startswith("U") and op[1:] in SASS_KINDS:  # uniform datapath: once per warp, off the vector pipes
        return "other"
    return SASS_KINDS.get(op, "other")


def categorise(ops: list[str], ptx: bool = False) -> Counter:
    """``{kind: count}`` over :data:`KINDS` for the opcodes ``ops``."""
    c = Counter({k: 0 for k in KINDS})
    c.update(kind_of(op, ptx) for op in ops)
    return c


def per_weight(counts: Counter, num_warps: int, weights_per_iter: int) -> dict[str, float]:
    """Thread instructions per decoded weight: every thread runs the loop body once per iteration, and
    one iteration of all ``32 * num_warps`` threads decodes ``weights_per_iter`` weights."""
    threads = 32 * num_warps
    out = {k: counts[k] * threads / weights_per_iter for k in KINDS}
    out["total"] = sum(counts.values()) * threads / weights_per_iter
    return out


#: results per clock per SM on sm_90 by kind (CUDA programming guide's throughput table): issue 4 warps x 32 lanes;
#: fp32 add/mul/fma 128; integer add/logic/shift/compare 64; conversions 16; shuffles and load/store units 32
SM90_RATES = {"issue": 128, "float": 128, "integer": 64, "convert": 16, "shuffle": 32, "lsu": 32}


def weights_per_clock_sm90(pw: dict[str, float]) -> tuple[float, str]:
    """``(weights per clock per SM, limiting pipe)`` from :func:`per_weight`'s counts: the slowest of issue, fp32,
    integer, conversion, shuffle and load/store pipes. A ceiling: latency, stalls and DRAM are not modelled. An H100
    needs ~36 (3.25-bit weights) or ~27 (4.25-bit) per clock per SM to stream at 3.35 TB/s (132 SMs, 1.75 GHz)."""
    lsu = pw["global load"] + pw["shared load"] + pw["shared store"]
    cost = {"issue": pw["total"] / SM90_RATES["issue"], "float": pw["float"] / SM90_RATES["float"],
            "integer": pw["integer"] / SM90_RATES["integer"], "convert": pw["convert"] / SM90_RATES["convert"],
            "shuffle": pw["shuffle"] / SM90_RATES["shuffle"], "lsu": lsu / SM90_RATES["lsu"]}
    pipe = max(cost, key=cost.get)
    return 1.0 / cost[pipe], pipe


def occupancy_sm90(registers: int, shared_bytes: int, num_warps: int) -> float:
    """Fraction of an H100 SM's 64 warp slots a kernel can fill (65536 registers, 228 KB shared, 32 blocks;
    registers allocated per warp in units of 256, shared with 1 KB reserved per block)."""
    per_warp = -(-max(registers, 1) * 32 // 256) * 256
    warps_by_regs = 65536 // per_warp
    blocks = min(32, warps_by_regs // num_warps, (228 * 1024) // (shared_bytes + 1024) if shared_bytes else 32)
    return min(64, blocks * num_warps) / 64

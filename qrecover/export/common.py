"""What every export format shares: the checkpoint's layers as :class:`QuantizedWeight`, their integer layout
(when they have one), re-quantization with a measured cost, adapter checks and the exported base's identity.

Integer layers are recognised by their stored layout, not by the scheme's name: every scheme in
:data:`INTEGER_SCHEMES` stores ``qdata`` (packed row-major codes), ``scale`` fp16 ``(O, I / B)`` and, when
asymmetric, ``zero_point`` packed like qdata, with ``w = scale * (q - zp)`` (``zp = 2**(bits-1)`` when
symmetric) -- blockwise's layout (see :mod:`qrecover.schemes.blockwise`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..adapters.lora import check_base
from ..checkpoint import read_packed
from ..errors import QRecoverError
from ..io_utils import sha256_file
from ..packing import unpack
from ..schemes import QuantizedWeight, get_quantizer
from ..transforms.hadamard import rotation

#: schemes whose stored tensors have blockwise's layout (qdata / scale / zero_point, w = scale * (q - zp))
INTEGER_SCHEMES = frozenset({"blockwise", "gptq"})
EXPORT_META = "qrecover_export.json"
ADAPTER_BINDING = "qrecover_adapter_binding.json"


@dataclass
class IntegerLayout:
    """An integer layer as codes and per-block parameters: ``w[o, i] = scale[o, i // block] * (codes[o, i] - zp[o, i // block])``.

    codes: uint8 ``(O, I)``; scale: fp16 ``(O, I / block)``; zero_point: uint8 ``(O, I / block)`` (the
    constant ``2**(bits-1)`` when symmetric).
    """

    bits: int
    block: int
    symmetric: bool
    codes: torch.Tensor
    scale: torch.Tensor
    zero_point: torch.Tensor


@dataclass
class Checkpoint:
    """A qrecover checkpoint read for export: manifest, packed layers, the rest of the tensors (fp16)."""

    path: Path
    manifest: dict[str, Any]
    layers: dict[str, QuantizedWeight]
    remainder: dict[str, torch.Tensor]

    @property
    def tied(self) -> bool:
        return any("tied_to" in v for v in self.manifest["layers"].values())

    def kind(self, name: str) -> str:
        return self.manifest["layers"][name]["kind"]


def untied_head(ckpt: Checkpoint, offset: float, embedding: torch.Tensor | None = None
                ) -> tuple[str, torch.Tensor, torch.Tensor] | None:
    """A tied head's online final-norm rotation folded into an untied head, for formats that run nothing online.

    ``rot+`` on a tied head keeps the head as the rotated embedding ``E R1`` and runs the final norm un-rotated,
    ``norm(x R1^T) R1`` (the manifest's ``transforms.online``, side ``output``). Untied, the head reads the rotated
    stream's norm directly: ``lm_head = E R1^T diag(g) R1`` and the final norm becomes the identity. ``offset``: 1 for
    Gemma's ``x * (1 + w)`` norms, else 0; ``embedding``: ``E R1`` as the export writes it (default: the checkpoint's,
    dequantized). Returns ``(the final norm's name, lm_head float32, the norm's new weight float32)``, or None when
    there is no such rotation."""
    online = ckpt.manifest.get("transforms", {}).get("online", {})
    untie = {n: s for n, s in online.items() if s.get("side") != "input"}
    if not untie:
        return None
    if len(untie) > 1 or not ckpt.tied:
        raise QRecoverError(f"online rotations at {', '.join(untie)}: an export can fold a tied head's final-norm rotation "
                            "only; compress without rot+ in --encodings")
    if embedding is None:
        emb = next((n for n in ckpt.layers if ckpt.kind(n) == "embedding"), None)
        if emb is None:
            raise QRecoverError(f"{str(ckpt.path)!r} has a tied head's online rotation but no quantized embedding to untie it from")
        embedding = ckpt.layers[emb].dequantize(torch.float32)
    (norm, spec), = untie.items()
    g = ckpt.remainder[f"{norm}.weight"].double() + offset
    r = rotation(int(spec["size"]), spec["kind"], int(spec["seed"]))
    head = (embedding.double() @ ((r.T * g) @ r)).float()
    return norm, head, torch.full_like(g, 1.0 - offset).float()


def read_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint's layers and remaining tensors, its weights file verified against the manifest's sha256."""
    path = Path(path)
    manifest, layers, state = read_packed(path)
    return Checkpoint(path, manifest, layers, state)


def integer_layout(qw: QuantizedWeight) -> IntegerLayout | None:
    """The codes and block parameters of an integer layer (a scheme in :data:`INTEGER_SCHEMES`), else None."""
    if qw.scheme not in INTEGER_SCHEMES or "scale" not in qw.tensors or "lut" in qw.tensors:
        return None
    out_f, in_f = qw.shape
    scale = qw.tensors["scale"]
    n_blk = scale.shape[-1] if scale.dim() == 2 else scale.numel() // out_f
    block = in_f // n_blk
    codes = unpack(qw.tensors["qdata"], qw.bits, out_f * in_f).view(out_f, in_f)
    if "zero_point" in qw.tensors:
        zp = unpack(qw.tensors["zero_point"], qw.bits, out_f * n_blk).view(out_f, n_blk)
        sym = False
    else:
        zp = torch.full((out_f, n_blk), 2 ** (qw.bits - 1), dtype=torch.uint8)
        sym = True
    layout = IntegerLayout(qw.bits, block, sym, codes, scale.reshape(out_f, n_blk).half(), zp)
    # the layout must reproduce the scheme's own dequantization bit for bit, else it is not this layout
    ref = qw.dequantize(torch.float32)
    if not torch.equal(layout_dequantize(layout), ref):
        return None
    return layout


def layout_dequantize(lay: IntegerLayout) -> torch.Tensor:
    """``(O, I)`` float32 weight of an :class:`IntegerLayout` (the same arithmetic as blockwise)."""
    o, i = lay.codes.shape
    codes = lay.codes.view(o, i // lay.block, lay.block).float()
    return ((codes - lay.zero_point.float().unsqueeze(-1)) * lay.scale.float().unsqueeze(-1)).reshape(o, i)


def relative_error(approx: torch.Tensor, ref: torch.Tensor) -> float:
    """``||approx - ref||_F / ||ref||_F`` in float64."""
    ref64 = ref.double()
    return float((approx.double() - ref64).norm() / ref64.norm().clamp_min(1e-300))


_REQUANT = re.compile(r"^int(\d)/g(\d+)$")


def parse_requantize(spec: str | None) -> tuple[int, int] | None:
    """``'int4/g64'`` -> ``(4, 64)``."""
    if spec is None:
        return None
    m = _REQUANT.match(spec.strip())
    if not m or int(m.group(1)) not in (2, 3, 4, 8):
        raise QRecoverError(f"--requantize {spec!r} must look like int4/g64 (bits 2, 3, 4 or 8, a group size)")
    return int(m.group(1)), int(m.group(2))


def to_int_groups(qw: QuantizedWeight, bits: int, group: int) -> tuple[QuantizedWeight, float]:
    """Re-quantize a layer's stored weights to symmetric ``bits``-bit integers in groups of ``group`` inputs.

    Returns the new weight and the measured relative error against the stored layer (not the original
    model: the export cannot see it).
    """
    q = get_quantizer("blockwise", block_size=group, symmetric=True)
    dense = qw.dequantize(torch.float32)
    q.check(tuple(qw.shape), bits)
    new = q.quantize(dense, bits, {})
    return new, relative_error(new.dequantize(torch.float32), dense)


def check_adapter(adapter: str | Path, checkpoint: Path) -> dict[str, Any]:
    """The adapter's qrecover metadata, after checking it was trained on ``checkpoint``."""
    meta = check_base(adapter, checkpoint, allow_foreign=False)
    assert meta is not None
    return meta


def write_binding(out_dir: Path, adapter_src: Path, adapter_meta: dict[str, Any], base_file: Path,
                  source_checkpoint: Path) -> dict[str, Any]:
    """``ADAPTER_BINDING`` in ``out_dir``: the exported base this adapter belongs to (sha256 of ``base_file``)."""
    binding = {"format": "qrecover-export-adapter", "adapter": str(adapter_src.resolve()),
               "base": {"file": base_file.name, "sha256": sha256_file(base_file)},
               "trained_on": adapter_meta.get("base"), "source_checkpoint": str(source_checkpoint.resolve()),
               "rank": adapter_meta.get("rank"), "alpha": adapter_meta.get("alpha")}
    (out_dir / ADAPTER_BINDING).write_text(json.dumps(binding, indent=1) + "\n")
    return binding


def write_meta(out_dir: Path, report: dict[str, Any]) -> None:
    (out_dir / EXPORT_META).write_text(json.dumps(report, indent=1, default=str) + "\n")

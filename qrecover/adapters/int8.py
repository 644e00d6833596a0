"""8-bit adapter weights: every LoRA matrix quantized per row to int8 at save time, with an fp16 scale per row.

A LoRA matrix ``W (rows, cols)`` (``A (r, in)``, ``B (out, r)``) is stored as ``qdata (rows, cols)`` int8 and
``scale (rows,)`` fp16 with ``W ≈ qdata * scale``, ``scale = max|W_row| / 127`` (symmetric, absmax: a row's
largest entry is exact up to the fp16 scale). Bytes per matrix: ``rows * cols + 2 * rows``; a rank-16 adapter on all
210 projections of SmolLM2-135M is 5.20 MB instead of 9.77 MB (+0.309 instead of +0.581 bpw).

PEFT reads only floating-point LoRA weights, so an 8-bit adapter directory holds
``adapter_model.int8.safetensors`` (the adapter: keys ``K`` int8 and ``K + SCALE_SUFFIX`` fp16, K the PEFT key)
and, so that plain PEFT and every qrecover loader read it unchanged, ``adapter_model.safetensors`` with the same
values expanded to fp16 (exactly ``qdata * scale``: derived, not counted in the adapter's bytes;
:func:`expand_int8_file` rebuilds it from the int8 file alone).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import QRecoverError
from ..io_utils import atomic_file

INT8_FILE = "adapter_model.int8.safetensors"
SCALE_SUFFIX = "_scale"


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight (rows, cols)`` -> ``(qdata (rows, cols) int8, scale (rows,) fp16)``, symmetric absmax per row. The
    scale is rounded to fp16 first and the codes computed with it, so ``qdata * scale`` is what is stored."""
    if weight.dim() != 2:
        raise QRecoverError(f"int8 adapter weights are matrices; got shape {tuple(weight.shape)}")
    w = weight.detach().float().cpu()
    scale = (w.abs().amax(dim=1) / 127).to(torch.float16)
    scale = torch.where(scale.float() > 0, scale, torch.ones_like(scale))  # an all-zero row: codes 0, any scale
    qdata = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return qdata, scale


def dequantize_rows(qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``qdata (rows, cols) int8 * scale (rows,)`` in ``dtype``."""
    return (qdata.float() * scale.float()[:, None]).to(dtype)


def save_int8(state: dict[str, torch.Tensor], path: Path) -> tuple[int, dict[str, torch.Tensor]]:
    """Write ``state`` (PEFT key -> LoRA matrix) as int8 + fp16 scales to ``path``; returns ``(tensor bytes,
    the dequantized state in fp16)``: the values a model loaded from this file computes with."""
    packed, expanded = {}, {}
    for k, v in state.items():
        q, s = quantize_rows(v)
        packed[k], packed[k + SCALE_SUFFIX] = q, s
        expanded[k] = dequantize_rows(q, s, torch.float16)
    save_file(packed, str(path), metadata={"format": "pt", "qrecover": "int8-per-row"})
    return sum(t.numel() * t.element_size() for t in packed.values()), expanded


def load_int8(path: Path, dtype: torch.dtype = torch.float16) -> dict[str, torch.Tensor]:
    """The PEFT state dict stored in an int8 adapter file, dequantized to ``dtype``."""
    raw = load_file(str(path))
    keys = [k for k in raw if not k.endswith(SCALE_SUFFIX)]
    missing = [k for k in keys if k + SCALE_SUFFIX not in raw]
    if missing or any(raw[k].dtype != torch.int8 for k in keys):
        raise QRecoverError(f"{str(path)!r} is not a qrecover int8 adapter file (tensors {missing[:2] or keys[:2]} lack an "
                            f"int8 matrix with its {SCALE_SUFFIX}); export the adapter again with --adapter-bits 8")
    return {k: dequantize_rows(raw[k], raw[k + SCALE_SUFFIX], dtype) for k in keys}


def expand_int8_file(adapter_dir: Path) -> Path:
    """(Re)write ``adapter_model.safetensors`` of an 8-bit adapter directory from its int8 file alone."""
    state = load_int8(Path(adapter_dir) / INT8_FILE)
    out = Path(adapter_dir) / "adapter_model.safetensors"
    with atomic_file(out) as tmp:
        save_file({k: v.contiguous() for k, v in state.items()}, str(tmp), metadata={"format": "pt"})
    return out


__all__ = ["INT8_FILE", "SCALE_SUFFIX", "dequantize_rows", "expand_int8_file", "load_int8", "quantize_rows", "save_int8"]

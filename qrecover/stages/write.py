"""Stage ``write``: pack the chosen weights and the 16-bit remainder into ``model.safetensors``, measure the
bits per weight from the file, and write the checkpoint atomically (nothing half-written after a crash)."""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..checkpoint import MANIFEST, WEIGHTS
from ..io_utils import atomic_dir, sha256_file

_DTYPE_BYTES = {"U8": 1, "I8": 1, "F16": 2, "BF16": 2, "F32": 4, "I32": 4, "I64": 8}


def bpw(nbytes: int, params: int) -> float:
    return 8.0 * nbytes / params


def measure_bpw(weights: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Bits per weight from the bytes of every tensor in the weights file (nothing left out)."""
    per_tensor: dict[str, int] = {}
    with safe_open(str(weights), framework="pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            per_tensor[k] = math.prod(sl.get_shape()) * _DTYPE_BYTES[sl.get_dtype()]
    layer_bytes = {n: sum(per_tensor[f"{n}.{t}"] for t in info["tensors"]) for n, info in manifest["layers"].items()}
    total = sum(per_tensor.values())
    linear = sum(b for n, b in layer_bytes.items() if manifest["layers"][n]["kind"] == "linear")
    p = manifest["parameters"]
    return {
        "bpw": {"model": bpw(total, p["model"]), "linear": bpw(linear, p["linear"])},
        "bytes": {"total": total, "linear": linear, "file": weights.stat().st_size,
                  "embedding": sum(b for n, b in layer_bytes.items() if manifest["layers"][n]["kind"] != "linear"),
                  "remainder": total - sum(layer_bytes.values())},
    }


def write_checkpoint(out: Path, tensors: dict[str, torch.Tensor], manifest: dict[str, Any], model, tokenizer,
                     overwrite: bool, extra: dict[str, Any] | None = None, before_commit: Callable[[], None] | None = None
                     ) -> dict[str, Any]:
    """Write ``tensors``, the config, the tokenizer and the manifest (completed with the measured bpw, bytes,
    the weights' sha256, creation time and ``extra``) to ``out``; return the manifest. ``before_commit``: called
    once everything is written, before the directory is moved into place (several processes: a barrier, so that
    a failure of any of them leaves nothing)."""
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "qrecover"})
        measured = measure_bpw(tmp / WEIGHTS, manifest)
        manifest["measured_bpw"] = measured["bpw"]
        manifest["bytes"] = measured["bytes"]
        manifest["weights_file"] = {"name": WEIGHTS, "sha256": sha256_file(tmp / WEIGHTS)}
        manifest["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        manifest.update(extra or {})
        model.config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        if before_commit is not None:
            before_commit()
    return manifest

"""A qrecover checkpoint on disk: its file names, format version and manifest reader.

A leaf module (it imports nothing of qrecover's but the error type): compression writes checkpoints
(:mod:`qrecover.stages.write`), loading (:mod:`qrecover.api`), adapters (:mod:`qrecover.recovery.lora`),
evaluation and export read them, and none of those needs another to know what a checkpoint is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import QRecoverError

FORMAT_VERSION = 1
MANIFEST = "qrecover.json"  # the manifest: how to load the checkpoint, its source, budget, per-layer encodings
WEIGHTS = "model.safetensors"  # packed codes, tables, scales, zero points and the 16-bit remainder


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``path``; a QRecoverError for a missing, corrupt or newer one."""
    path = Path(path)
    mf = path / MANIFEST
    if not mf.exists():
        raise QRecoverError(f"{str(path)!r} is not a qrecover checkpoint (no {MANIFEST}); compress a model first")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise QRecoverError(f"{mf} is not valid JSON ({e}); the checkpoint is corrupted, compress again") from None
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise QRecoverError(
            f"{str(path)!r} has format_version={version!r}, newer than this qrecover reads ({FORMAT_VERSION}); "
            "upgrade qrecover"
        )
    return manifest


__all__ = ["FORMAT_VERSION", "MANIFEST", "WEIGHTS", "read_manifest"]

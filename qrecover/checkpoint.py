"""A qrecover checkpoint on disk: its file names, format version and manifest reader.

A leaf module (it imports nothing of qrecover's but the error type): compression writes checkpoints
(:mod:`qrecover.stages.write`), loading (:mod:`qrecover.api`), adapters (:mod:`qrecover.adapters.lora`),
evaluation and export read them, and none of those needs another to know what a checkpoint is.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from .errors import QRecoverError
from .io_utils import sha256_file
from .schemes.base import QuantizedWeight

FORMAT_VERSION = 1
MANIFEST = "qrecover.json"  # the manifest: how to load the checkpoint, its source, budget, per-layer encodings
WEIGHTS = "model.safetensors"  # packed codes, tables, scales, zero points and the 16-bit remainder


def source_model_spec(manifest: dict[str, Any]) -> str | None:
    """The unquantized model a checkpoint was compressed from, as a model spec (None: the built-in default)."""
    src = manifest.get("source") or {}
    return None if src.get("kind", "default") == "default" else src.get("path")


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


def read_packed(path: str | Path, verify: bool = True
                ) -> tuple[dict[str, Any], dict[str, QuantizedWeight], dict[str, torch.Tensor]]:
    """``(manifest, packed layers by name, every other tensor by name)`` of the checkpoint ``path``. ``verify``
    checks the weights file against the manifest's sha256 (a changed or corrupted file is refused)."""
    path = Path(path)
    manifest = read_manifest(path)
    weights = path / manifest["weights_file"]["name"]
    if not weights.is_file():
        raise QRecoverError(f"{weights} is missing; the checkpoint is incomplete, compress again")
    if verify:
        digest, want = sha256_file(weights), manifest["weights_file"]["sha256"]
        if digest != want:
            raise QRecoverError(f"{weights} has sha256 {digest[:16]}..., the manifest says {want[:16]}...: the weights "
                                "were changed or corrupted after compression; compress again")
    with safe_open(str(weights), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    layers = {name: QuantizedWeight(info["scheme"], info["bits"], tuple(info["shape"]), info["params"],
                                    {t: state.pop(f"{name}.{t}") for t in info["tensors"]})
              for name, info in manifest["layers"].items()}
    return manifest, layers, state


__all__ = ["FORMAT_VERSION", "MANIFEST", "WEIGHTS", "read_manifest", "read_packed"]

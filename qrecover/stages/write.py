"""Stage ``write``: pack the chosen weights and the 16-bit remainder into ``model.safetensors`` (:func:`pack`),
build the manifest that says how to load them (:func:`build_manifest`), measure the bits per weight from the
file, and write the checkpoint atomically (nothing half-written after a crash)."""

from __future__ import annotations

import json
import math
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import safetensors
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .._version import __version__
from ..checkpoint import FORMAT_VERSION, MANIFEST, WEIGHTS
from ..config import CompressConfig
from ..distributed import SINGLE, join
from ..io_utils import atomic_dir, sha256_file
from ..schemes import QuantizedWeight
from ..sensitivity import METHOD
from .candidates import Prepared
from .checks import bpw
from .specs import Encoding

_DTYPE_BYTES = {"U8": 1, "I8": 1, "F16": 2, "BF16": 2, "F32": 4, "I32": 4, "I64": 8}


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


def versions() -> dict[str, str]:
    """The library versions a checkpoint records."""
    import transformers  # lazy: qrecover.models imports it where a model loads; this module runs after that

    return {"qrecover": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "python": platform.python_version()}


def pack(p: Prepared, chosen: dict[str, int], qws: dict[str, QuantizedWeight], damage: dict[str, float | None],
         enc_of: dict[str, Encoding]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``(tensors, layers)``: the remainder in float16 and every unit's packed tensors (``{unit}.{qdata|scale|...}``)
    by their names in the weights file, and each unit's manifest entry. ``chosen``: the index into ``unit.cands``
    of its encoding; ``qws``/``damage``: its packed weight and estimated damage."""
    tensors: dict[str, torch.Tensor] = {k: v.detach().to(torch.float16).contiguous() for k, v in p.remainder.items()}
    layers: dict[str, Any] = {}
    for n, u in p.units.items():
        qw = qws[n]
        for tname, t in qw.tensors.items():
            tensors[f"{n}.{tname}"] = t.contiguous()
        layers[n] = {
            "kind": u.kind, "scheme": qw.scheme, "bits": qw.bits, "params": qw.params, "shape": list(qw.shape),
            "tensors": sorted(qw.tensors), "nbytes": qw.nbytes, "bpw": bpw(qw.nbytes, qw.numel),
            "damage": damage[n], "label": u.cands[chosen[n]].label,
            **({"transforms": list(enc_of[n].transforms)} if enc_of[n].transforms else {}),
            **({"tied_to": p.head_name} if u.tied else {}),
        }
    return tensors, layers


def build_manifest(p: Prepared, cfg: CompressConfig, layers: dict[str, Any], damage_table: dict[str, dict[str, float | None]],
                   encodings: list[Encoding], embedding_encodings: list[Encoding], unquantized: dict[str, list[int]],
                   routers: dict[str, Any], finalize: dict[str, Any]) -> dict[str, Any]:
    """The manifest (``qrecover.json``) before the file is written: source, budget, config, every layer, the
    sensitivity table, calibration, finalize and transform records, versions (:func:`write_checkpoint` adds
    the measured bits per weight, bytes, the weights' sha256 and the creation time)."""
    damages = [info["damage"] for info in layers.values()]
    return {
        "format": "qrecover",
        "format_version": FORMAT_VERSION,
        "source": {"path": p.source.path, "kind": p.source.kind, "name": p.source.name, "weights_sha256": p.source.weights_sha256},
        "architecture": type(p.model).__name__,
        "parameters": p.params,
        "budget": {"bpw": cfg.bpw, "scope": cfg.scope, "bits": cfg.bits, "allocation": cfg.allocation,
                   "embedding_bits": cfg.embedding_bits,
                   "encodings": [e.label for e in encodings], "embedding_encodings": [e.label for e in embedding_encodings]},
        "config": cfg.to_dict(),
        "layers": layers,
        "remainder": {k: {"dtype": "float16", "shape": list(v.shape)} for k, v in p.remainder.items()},
        "unquantized_matrices": unquantized,
        **({"routers": routers} if routers else {}),
        **({"moe": {"unfused": p.model.qrecover_moe}} if getattr(p.model, "qrecover_moe", None) else {}),
        "sensitivity": {"method": METHOD, "unit": "predicted increase of mean next-token loss (nats)",
                        "table": damage_table,
                        "predicted_loss_increase": None if any(d is None for d in damages) else sum(damages)},
        "calibration": p.calibration,
        "finalize": finalize,
        "transforms": p.transforms or {},
        "versions": versions(),
    }


def write_shared(out: Path, tensors: dict[str, torch.Tensor], manifest: dict[str, Any], model, tokenizer,
                 overwrite: bool, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """:func:`write_checkpoint` by rank 0 of a launch (:mod:`qrecover.distributed`); the others wait for it, and it
    for them before the checkpoint is moved into place. Every process returns rank 0's manifest."""
    group = join()
    if group.rank > 0:
        group.barrier()
        return group.broadcast(None)
    manifest = write_checkpoint(out, tensors, manifest, model, tokenizer, overwrite, extra=extra,
                                before_commit=group.barrier if group is not SINGLE else None)
    return group.broadcast(manifest)

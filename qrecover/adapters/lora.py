"""LoRA on the frozen quantized model, through PEFT: attach, export in 16 bits, load with a base check.

A qrecover checkpoint's :class:`~qrecover.qlinear.QuantLinear` is an ``nn.Linear`` to PEFT, so the
adapter is plain PEFT: ``adapter_config.json`` + ``adapter_model.safetensors``, loadable with
``PeftModel.from_pretrained(qrecover.load(CHECKPOINT), DIR)``. PEFT wraps each ``QuantLinear`` in qrecover's
:class:`~qrecover.adapters.peft_quant.QuantLoraLinear` (whose merge re-quantizes the packed weights) when the
config is registered: :func:`attach_lora`, :func:`load_adapter` and ``qrecover.load(CKPT, adapter=DIR)`` do it;
with plain PEFT pass ``config=register_quant_lora(LoraConfig.from_pretrained(DIR))``, else ``merge_and_unload``
cannot change the packed weights. Merge with ``peft_quant.merge_and_unload(peft_model, calibration_windows)``: the
palettized layers re-quantize with calibration statistics (a bare ``merge_and_unload()`` refuses). Next to them qrecover writes
``qrecover_adapter.json``: which base it was trained on (the sha256 of the checkpoint's manifest and of its
weights file), its rank and exact size, and how it was trained. :func:`load_adapter` refuses an adapter
trained on another base unless told otherwise.

Initialisation from the quantization error (``init_error_svd``) is in :mod:`.svd_init`.

Sizes: each adapted layer ``W (out, in)`` gets ``A (r, in)`` and ``B (out, r)``, stored in 16 bits:
``2 * r * (in + out)`` bytes. Its cost in bits per weight of the base model is ``bytes * 8 / parameters``.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
from peft.utils import get_peft_model_state_dict
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..checkpoint import read_manifest
from ..errors import QRecoverError
from ..io_utils import read_json, sha256_file
from ..qlinear import QuantLinear
from .head_lora import head_config, register_head_lora
from .int8 import INT8_FILE, save_int8
from .peft_quant import register_quant_lora

ADAPTER_META = "qrecover_adapter.json"
ADAPTER_FORMAT_VERSION = 1
SAVE_DTYPE = torch.float16  # adapters ship in 16 bits (AFM); training keeps fp32 master copies


def base_identity(checkpoint: str | Path) -> dict[str, str]:
    """What an adapter is bound to: the checkpoint's manifest and weights hashes (and its path, for people)."""
    checkpoint = Path(checkpoint)
    manifest = read_manifest(checkpoint)
    return {"path": str(checkpoint.resolve()), "manifest_sha256": sha256_file(checkpoint / "qrecover.json"),
            "weights_sha256": manifest["weights_file"]["sha256"]}


def quantized_targets(model: nn.Module, only: list[str] | None = None) -> list[str]:
    """Names of every :class:`QuantLinear` (attention and MLP projections), or the subset ``only``."""
    names = [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
    if not names:
        raise QRecoverError("the model has no quantized linear layers: recovery adapters train on a qrecover "
                            "checkpoint (the output of `qrecover compress`), not on an unquantized model")
    if only is not None:
        unknown = sorted(set(only) - set(names))
        if unknown:
            raise QRecoverError(f"adapter target layers {unknown[:3]} are not quantized layers of this model")
        names = [n for n in names if n in set(only)]
    return names


def attach_lora(model: nn.Module, rank: int, alpha: float | None = None, dropout: float = 0.0,
                targets: list[str] | None = None, head_rank: int = 0, ranks: dict[str, int] | None = None):
    """Wrap ``model`` in a PEFT LoRA model on its quantized projections; only the adapter trains.

    ``alpha`` defaults to ``2 * rank`` (scaling 2). B starts at zero, so the wrapped model's output equals
    the base model's at step 0. The LoRA layers are :class:`~qrecover.adapters.peft_quant.QuantLoraLinear`.
    ``head_rank > 0`` adds a rank-``head_rank`` LoRA on the tied output head (scaling 2 as well;
    :mod:`qrecover.adapters.head_lora`), a PEFT ``rank_pattern`` entry for ``lm_head``. ``ranks``: a rank per
    layer (``{name: rank > 0}``, :mod:`qrecover.adapters.rank_alloc`), the targets then being those layers; alpha
    follows each rank so that every layer keeps the scaling ``alpha / rank``.
    """
    if not (isinstance(rank, int) and rank > 0):
        raise QRecoverError(f"LoRA rank {rank!r} must be a positive integer, e.g. --rank 16")
    head, rank_pattern = head_config(model, head_rank)
    if ranks is not None:
        if not ranks or any(not isinstance(r, int) or r <= 0 for r in ranks.values()):
            raise QRecoverError(f"per-layer ranks must be positive integers on at least one layer (got {dict(list(ranks.items())[:3])})")
        targets = list(ranks)
        # PEFT matches a rank_pattern key as a regex against the end of a module's name: escape the dots
        rank_pattern = {**{re.escape(n): r for n, r in ranks.items()}, **rank_pattern}
    scaling = (alpha if alpha is not None else 2 * rank) / rank
    config = LoraConfig(r=rank, lora_alpha=float(alpha if alpha is not None else 2 * rank), lora_dropout=dropout,
                        target_modules=quantized_targets(model, targets) + head, bias="none", task_type="CAUSAL_LM",
                        rank_pattern=rank_pattern, alpha_pattern={k: float(scaling * r) for k, r in rank_pattern.items()})
    with _quiet_peft():
        return get_peft_model(model, register_head_lora(register_quant_lora(config)))


@contextlib.contextmanager
def _quiet_peft() -> Iterator[None]:
    """PEFT 0.21 reads transformers' ``is_gradient_checkpointing``, which transformers 5 deprecates with a
    FutureWarning at every adapter made or loaded: noise a user can do nothing about. Only that one is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def lora_modules(peft_model: nn.Module) -> dict[str, nn.Module]:
    """``{layer name in the base model: PEFT LoRA layer}`` for every layer with a 'default' adapter."""
    return {name.removeprefix("base_model.model."): mod for name, mod in peft_model.named_modules()
            if hasattr(mod, "lora_A") and "default" in getattr(mod, "lora_A", {})}


def adapter_layers(peft_model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """``{layer name: (rank, in_features, out_features)}`` for every adapted layer."""
    out = {}
    for name, mod in lora_modules(peft_model).items():
        a, b = mod.lora_A["default"].weight, mod.lora_B["default"].weight
        out[name] = (a.shape[0], a.shape[1], b.shape[0])
    return out


def expected_bytes(layers: dict[str, tuple[int, int, int]]) -> int:
    """16-bit bytes of the adapter tensors: ``2 * r * (in + out)`` per layer."""
    return sum(2 * r * (i + o) for r, i, o in layers.values())


def save_adapter(peft_model: nn.Module, out: Path, base: dict[str, str], parameters: int,
                 extra: dict[str, Any] | None = None, bits: int = 16) -> dict[str, Any]:
    """Write the PEFT adapter directory (16-bit tensors) and ``qrecover_adapter.json`` into ``out``.

    ``bits=8``: the adapter is ``adapter_model.int8.safetensors`` (per-row int8 + fp16 scales,
    :mod:`qrecover.adapters.int8`), its bytes the ones counted; ``adapter_model.safetensors`` then holds the
    same values expanded to fp16 for PEFT. ``out`` should be a fresh (temporary) directory; callers move it into
    place atomically.
    """
    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().to("cpu", SAVE_DTYPE).contiguous() for k, v in get_peft_model_state_dict(
        peft_model, save_embedding_layers=False).items()}  # never the base embedding (a head adapter targets lm_head)
    bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
    if bad:
        raise QRecoverError(f"adapter tensors {bad[:3]} are not finite in 16 bits; lower the learning rate")
    int8_bytes = None
    if bits == 8:
        int8_bytes, state = save_int8(state, out / INT8_FILE)
    save_file(state, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = peft_model.peft_config["default"]
    config.base_model_name_or_path = base["path"]
    config.save_pretrained(str(out))
    layers = adapter_layers(peft_model)
    tensor_bytes = sum(v.numel() * v.element_size() for v in state.values()) if int8_bytes is None else int8_bytes
    file_bytes = (out / ("adapter_model.safetensors" if int8_bytes is None else INT8_FILE)).stat().st_size
    meta = {
        "format": "qrecover-adapter", "format_version": ADAPTER_FORMAT_VERSION, "base": base,
        "rank": config.r, "alpha": config.lora_alpha,
        "dtype": str(SAVE_DTYPE).removeprefix("torch.") if int8_bytes is None else "int8 per row + float16 scales",
        "layers": len(layers), "target_modules": sorted(layers),
        "bytes": {"tensors": tensor_bytes, "expected_16bit": expected_bytes(layers), "file": file_bytes},
        "base_parameters": parameters,
        "bpw_cost": tensor_bytes * 8 / parameters,
        **(extra or {}),
    }
    (out / ADAPTER_META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def check_adapter_files(adapter: str | Path) -> None:
    """Refuse, before any model is loaded, an adapter directory PEFT could not read: ``adapter_config.json``
    missing or not a JSON object, ``adapter_model.safetensors`` missing, truncated or with a corrupt header."""
    adapter = Path(adapter)
    fix = "re-export or copy the adapter again (the --out directory of `qrecover recover` / `qrecover finetune`)"
    if not (adapter / "adapter_config.json").is_file():
        raise QRecoverError(f"{str(adapter)!r} is not a PEFT adapter directory (no adapter_config.json); "
                            "pass the --out directory of `qrecover recover`")
    config = read_json(adapter / "adapter_config.json", "adapter config", "")
    if not isinstance(config, dict) or "peft_type" not in config:
        raise QRecoverError(f"adapter config {str(adapter / 'adapter_config.json')!r} is not a PEFT adapter config (a "
                            f"JSON object with a peft_type); {fix}")
    weights = adapter / "adapter_model.safetensors"
    if not weights.is_file():
        if (adapter / "adapter_model.bin").is_file():  # a foreign PEFT adapter in the old format: PEFT reads it
            return
        raise QRecoverError(f"adapter {str(adapter)!r} has no adapter_model.safetensors; {fix}")
    try:
        with safe_open(str(weights), framework="pt") as f:
            f.keys()
    except SafetensorError as e:
        raise QRecoverError(f"adapter weights {str(weights)!r} are truncated or corrupt ({e}); {fix}") from None


def read_adapter_meta(adapter: str | Path) -> dict[str, Any]:
    adapter = Path(adapter)
    if not (adapter / "adapter_config.json").is_file():
        raise QRecoverError(f"{str(adapter)!r} is not a PEFT adapter directory (no adapter_config.json); "
                            "pass the --out directory of `qrecover recover`")
    meta_path = adapter / ADAPTER_META
    if not meta_path.is_file():
        raise QRecoverError(f"{str(adapter)!r} has no {ADAPTER_META}: it was not written by qrecover, so its base "
                            "cannot be checked; pass --allow-foreign-adapter to load it anyway")
    return read_json(meta_path, "adapter record", "")


def check_base(adapter: str | Path, checkpoint: str | Path, allow_foreign: bool = False) -> dict[str, Any] | None:
    """Refuse an adapter trained on another checkpoint (compares manifest and weights hashes), or one whose
    files PEFT could not read (:func:`check_adapter_files`)."""
    check_adapter_files(adapter)
    try:
        meta = read_adapter_meta(adapter)
    except QRecoverError:
        if allow_foreign:
            return None
        raise
    here = base_identity(checkpoint)
    trained = meta.get("base", {})
    same = (trained.get("manifest_sha256") == here["manifest_sha256"]
            and trained.get("weights_sha256") == here["weights_sha256"])
    if not same and not allow_foreign:
        raise QRecoverError(
            f"adapter {str(adapter)!r} was trained on checkpoint {trained.get('path')!r} (manifest sha256 "
            f"{str(trained.get('manifest_sha256'))[:12]}...), not on {str(checkpoint)!r} (manifest sha256 "
            f"{here['manifest_sha256'][:12]}...): its corrections do not fit these weights. Use the adapter trained "
            "for this checkpoint, or pass --allow-foreign-adapter to load it anyway")
    return meta


def peft_from_pretrained(model: nn.Module, adapter: str | Path, trainable: bool = False):
    """``PeftModel.from_pretrained(model, adapter)`` with qrecover's LoRA layer on the quantized layers
    (:func:`~qrecover.adapters.peft_quant.register_quant_lora`), so that merging changes the packed weights."""
    config = PeftConfig.from_pretrained(str(adapter))
    if isinstance(config, LoraConfig):
        register_head_lora(register_quant_lora(config))
    with _quiet_peft():
        return PeftModel.from_pretrained(model, str(adapter), is_trainable=trainable, config=config)


def load_adapter(model: nn.Module, adapter: str | Path, checkpoint: str | Path, allow_foreign: bool = False,
                 trainable: bool = False):
    """:func:`peft_from_pretrained` after checking the adapter belongs to ``checkpoint``."""
    check_base(adapter, checkpoint, allow_foreign)
    return peft_from_pretrained(model, adapter, trainable)


def adapter_summary(adapter: str | Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """``{path, rank, bpw_cost}`` of an adapter directory; the cost from the bytes of its stored tensors."""
    adapter = Path(adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    size = {"F16": 2, "BF16": 2, "F32": 4, "I8": 1}
    weights = adapter / INT8_FILE if (adapter / INT8_FILE).is_file() else adapter / "adapter_model.safetensors"
    with safe_open(str(weights), framework="pt") as f:
        nbytes = sum(math.prod(f.get_slice(k).get_shape()) * size[f.get_slice(k).get_dtype()] for k in f.keys())
    return {"path": str(adapter), "rank": int(config["r"]), "bpw_cost": nbytes * 8 / manifest["parameters"]["model"]}

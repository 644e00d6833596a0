"""Load what compress and recover wrote: a packed checkpoint, optionally with its recovery adapter.

Below both :mod:`qrecover.api` and :mod:`qrecover.recovery` (both import from here, never the reverse).
An adapter's base identity (the checkpoint's manifest and weights hashes, :func:`check_base`) is checked
once per (adapter, checkpoint) pair: :func:`load` checks it before the expensive load; a caller that has
already checked it (``finetune`` checks every input before it creates its output directory) loads the
checkpoint and calls :func:`attach_adapter`, which does not check again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .checkpoint import read_packed
from .errors import QRecoverError
from .models import load_model, resolve
from .moe import unfuse_experts
from .qlinear import QuantEmbedding, QuantLinear, QuantLMHead
from .transforms.rotate import attach_online

__all__ = ["load", "load_any", "attach_adapter", "check_base"]


def check_base(adapter: str | Path, path: str | Path, allow_foreign: bool = False) -> dict[str, Any] | None:
    """:func:`qrecover.adapters.lora.check_base` (imported when called: peft takes seconds to import, and loading a
    checkpoint without an adapter, or compressing, never needs it)."""
    from .adapters.lora import check_base as check

    return check(adapter, path, allow_foreign)


def _check_plain_linear(name: str, module: nn.Module) -> None:
    """A packed linear layer computes ``x W^T + b`` and nothing else: refuse a layer class whose forward does
    more (a scaled or capped head inside the module) rather than load a model that silently differs.
    Logit soft-capping (Gemma-2/3) is applied by the causal-LM forward, outside the head, and is kept."""
    if not isinstance(module, nn.Linear) or type(module).forward is not nn.Linear.forward:
        raise QRecoverError(f"{name} is a {type(module).__name__}, whose forward is not a plain linear layer's; "
                            "qrecover cannot load it packed yet: compress with a model whose linear layers are nn.Linear")


def load(path: str | Path, cache: bool = False, verify: bool = True, adapter: str | Path | None = None,
         allow_foreign_adapter: bool = False, trainable: bool = False) -> nn.Module:
    """Load a compressed checkpoint as a transformers model with :class:`QuantLinear` layers.

    ``verify`` checks the weights file against the manifest's sha256 (a tampered or corrupted file is
    refused). ``cache`` keeps dequantized weights after first use (faster repeated CPU evaluation).
    ``adapter``: a recovery adapter directory; the model comes back wrapped in PEFT's ``PeftModel``. An
    adapter trained on another checkpoint is refused unless ``allow_foreign_adapter``; ``trainable`` leaves the
    adapter's weights trainable (a feature adapter's step 0).
    """
    if adapter is not None:
        check_base(adapter, path, allow_foreign_adapter)  # before the expensive load
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: transformers takes seconds to import

    path = Path(path)
    manifest, packed, state = read_packed(path, verify)
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if manifest.get("moe", {}).get("unfused"):  # the experts modules compress converted (qrecover.moe)
        unfuse_experts(model, only=manifest["moe"]["unfused"])
    for name, info in manifest["layers"].items():
        qw = packed[name]
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        if info["kind"] == "embedding":  # keeps the module's own forward (e.g. Gemma's sqrt(hidden) scale)
            new = QuantEmbedding.replacing(old, qw, cache=True)
        else:
            _check_plain_linear(name, old)
            bias = state.pop(f"{name}.bias", None)
            new = QuantLinear(qw, bias=bias.float() if bias is not None else None, cache=cache)
        setattr(parent, child, new)
        if "tied_to" in info:
            hp, _, hc = info["tied_to"].rpartition(".")
            _check_plain_linear(info["tied_to"], model.get_submodule(info["tied_to"]))
            setattr(model.get_submodule(hp), hc, QuantLMHead(new))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not any(k.startswith(f"{n}.") for n in manifest["layers"])]
    if missing or unexpected:
        raise QRecoverError(f"checkpoint {str(path)!r} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    attach_online(model, manifest.get("transforms", {}).get("online"))  # e.g. rot on a tied head: the final norm
    model.eval()
    model.qrecover_manifest = manifest
    if adapter is not None:
        model = attach_adapter(model, adapter, trainable)
    return model


def attach_adapter(model: nn.Module, adapter: str | Path, trainable: bool = False) -> nn.Module:
    """``model`` (from :func:`load`) wrapped in PEFT with ``adapter``, whose base the caller has checked
    (:func:`check_base`); qrecover's LoRA layer on the packed layers, so that merging re-quantizes."""
    manifest = model.qrecover_manifest
    from .adapters.lora import peft_from_pretrained  # lazy: peft

    peft_model = peft_from_pretrained(model, adapter, trainable)
    if not trainable:
        peft_model.eval()
    peft_model.qrecover_manifest = manifest
    return peft_model


def load_any(spec: str | None, cache: bool = True, adapter: str | Path | None = None,
             allow_foreign_adapter: bool = False) -> tuple[nn.Module, Any, dict[str, Any]]:
    """An original model or a qrecover checkpoint (with an optional recovery adapter), for evaluation.

    Returns ``(model, tokenizer, info)``; ``info["adapter"]`` is ``{path, rank, bpw_cost}`` when an adapter
    is loaded, else None.
    """
    from transformers import AutoTokenizer  # lazy: transformers takes seconds to import

    path, kind = resolve(spec)
    if kind == "qrecover":
        model = load(path, cache=cache, adapter=adapter, allow_foreign_adapter=allow_foreign_adapter)
        info = {"kind": "qrecover", "path": str(path), "measured_bpw": model.qrecover_manifest.get("measured_bpw"),
                "adapter": None}
        if adapter is not None:
            from .adapters.lora import adapter_summary  # lazy: peft

            info["adapter"] = adapter_summary(adapter, model.qrecover_manifest)
        return model, AutoTokenizer.from_pretrained(path), info
    if adapter is not None:
        raise QRecoverError(f"--adapter needs a qrecover checkpoint; {spec or 'the default model'!r} is an unquantized "
                            "model. Pass the checkpoint the adapter was trained on")
    model, tok, source = load_model(spec)
    return model, tok, {"kind": source.kind, "path": source.path, "measured_bpw": {"model": 32.0, "linear": 32.0},
                        "adapter": None}



"""Serving several PEFT adapters at once on one quantized model: adapter directories read into the stacked layout
of :class:`qrecover.kernels.multi_adapter.MultiAdapterLinear` (per-token adapter choice, BGMV kernels on CUDA).

``set_index = attach_adapters(model, [dir0, dir1]); set_index(torch.tensor([0, 1, -1]))`` and then any forward (or
``generate``) runs each sequence through its own adapter (``-1``: the base model). 8-bit adapter directories
(``--adapter-bits 8``, :mod:`.int8`) are served as their stored int8 codes and row scales, half the bytes read per
token of fp16 adapters.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file
from torch import nn

from ..errors import QRecoverError
from ..kernels.multi_adapter import Int8Adapter, MultiAdapterLinear
from .int8 import INT8_FILE, SCALE_SUFFIX, quantize_rows


def read_peft_adapter(adapter_dir: str | Path) -> dict[str, tuple[torch.Tensor, torch.Tensor, float]]:
    """A PEFT LoRA adapter directory as ``{module name: (A (r, I), B (O, r), scaling)}``.

    Module names are relative to the causal-LM model (``model.layers.0.self_attn.q_proj``), as
    ``model.get_submodule`` takes them. Handles ``lora_alpha / r`` and rsLoRA's ``lora_alpha / sqrt(r)``;
    per-module rank or alpha patterns are refused.
    """
    adapter_dir = Path(adapter_dir)
    cfg_path, weights = adapter_dir / "adapter_config.json", adapter_dir / "adapter_model.safetensors"
    if not cfg_path.exists() or not weights.exists():
        raise QRecoverError(f"{str(adapter_dir)!r} is not a PEFT adapter directory (needs adapter_config.json and "
                            "adapter_model.safetensors)")
    cfg = json.loads(cfg_path.read_text())
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("rank_pattern") or cfg.get("alpha_pattern"):
        raise QRecoverError(f"{str(adapter_dir)!r}: only plain LoRA adapters (one rank and alpha) can be stacked; "
                            f"got peft_type={cfg.get('peft_type')!r}, rank/alpha patterns "
                            f"{bool(cfg.get('rank_pattern'))}/{bool(cfg.get('alpha_pattern'))}")
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    state = load_file(str(weights))
    out: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for key, a in state.items():
        if not key.endswith(".lora_A.weight"):
            continue
        name = key.removesuffix(".lora_A.weight").removeprefix("base_model.model.")
        out[name] = (a, state[key.replace(".lora_A.weight", ".lora_B.weight")], scaling)
    if not out:
        raise QRecoverError(f"{weights} holds no lora_A/lora_B weights")
    return out


def quantize_adapter(a: torch.Tensor, b: torch.Tensor, scaling: float) -> Int8Adapter:
    """A float adapter ``(A, B, scaling)`` as int8 per row, as qrecover's 8-bit adapter files store it."""
    return (*quantize_rows(a), *quantize_rows(b), scaling)


def read_int8_adapter(adapter_dir: str | Path) -> dict[str, Int8Adapter]:
    """An adapter as int8 per row: the stored codes and scales of an 8-bit adapter directory (its
    ``adapter_model.int8.safetensors``), or a float adapter quantized as that file would store it."""
    floats = read_peft_adapter(adapter_dir)
    path = Path(adapter_dir) / INT8_FILE
    if not path.exists():
        return {name: quantize_adapter(*ab) for name, ab in floats.items()}
    raw = load_file(str(path))

    def codes(name: str, which: str) -> tuple[torch.Tensor, torch.Tensor]:
        key = f"base_model.model.{name}.lora_{which}.weight"
        if key not in raw or key + SCALE_SUFFIX not in raw or raw[key].dtype != torch.int8:
            raise QRecoverError(f"{path} lacks the int8 matrix {key} with its {SCALE_SUFFIX}; export the adapter again "
                                "with --adapter-bits 8")
        return raw[key], raw[key + SCALE_SUFFIX]

    return {name: (*codes(name, "A"), *codes(name, "B"), s) for name, (_, _, s) in floats.items()}


def attach_adapters(model: nn.Module, adapter_dirs: list[str | Path], int8: bool | None = None) -> Callable[[torch.Tensor], None]:
    """Serve several PEFT adapters at once on ``model``: every linear layer any adapter targets becomes a
    :class:`MultiAdapterLinear` holding all of them stacked (index ``i`` = ``adapter_dirs[i]``; an adapter that
    does not target a layer is zeros there). Returns ``set_index(index)``: call it before each forward with one
    adapter index (or -1 for the base model) per sequence ``(B,)`` or per token ``(B * T,)``.

    ``int8``: serve the adapters as int8 per row (half the bytes read per token; 8-bit adapter directories with their
    stored codes, float ones quantized as ``--adapter-bits 8`` would store them); None: when every directory is an
    8-bit adapter directory.
    """
    if int8 is None:
        int8 = all((Path(d) / INT8_FILE).exists() for d in adapter_dirs)
    adapters = [read_int8_adapter(d) if int8 else read_peft_adapter(d) for d in adapter_dirs]
    layers: list[MultiAdapterLinear] = []
    for name in sorted(set().union(*adapters)):
        base = model.get_submodule(name)
        i, o = base.in_features, base.out_features
        none = ((torch.zeros(1, i, dtype=torch.int8), torch.ones(1), torch.zeros(o, 1, dtype=torch.int8), torch.ones(o), 0.0)
                if int8 else (torch.zeros(1, i), torch.zeros(o, 1), 0.0))
        pairs = [a.get(name, none) for a in adapters]
        layer = MultiAdapterLinear.from_int8(base, pairs) if int8 else MultiAdapterLinear.from_adapters(base, pairs)
        device = next(base.buffers(), next(base.parameters(), None))
        if device is not None:
            layer.to(device.device)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, layer)
        layers.append(layer)

    def set_index(index: torch.Tensor) -> None:
        for layer in layers:
            layer.token_index = index

    return set_index


__all__ = ["attach_adapters", "quantize_adapter", "read_int8_adapter", "read_peft_adapter"]

"""Stage ``transform`` (optional): apply the function-preserving transforms the chosen encodings name
(``awq+gptq:4/g64``, ``rot+gptq:3/g64``), before any statistics are collected: model-level ones (rotations)
first, then layer-wise ones (AWQ) layer by layer. A model-level transform's ``online`` part (a rotation
that must run at inference, e.g. a tied head's final norm) is recorded under ``online`` for ``qrecover.load``.

Transforms are model-level: the model is transformed once and every candidate, with or without the
transform in its spec, then quantizes the transformed weights (the manifest records this). The search of a
transform optimises the fake quantization of the first encoding that names it, run without calibration
statistics; a scheme that cannot quantize without them (GPTQ needs the Hessian) is searched with
round-to-nearest blocks of the same width and group size instead, as AWQ's reference does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn as nn

from ..calibrate import capture_inputs, forward_layer
from ..models import decoder_layers, resident
from ..progress import progress
from ..schemes import get_quantizer
from ..transforms import get_transform
from .specs import Encoding


def transforms_of(encodings: Sequence[Encoding]) -> list[str]:
    """Transform names in the order the specs first name them."""
    out: list[str] = []
    for e in encodings:
        out += [t for t in e.transforms if t not in out]
    return out


def search_quantize_fn(enc: Encoding):
    """``(name, weight) -> dequantized weight``: the fake quantization a transform's search optimises."""
    q = enc.quantizer

    def rtn(w: torch.Tensor) -> torch.Tensor:
        in_f = w.shape[1]
        g = enc.params.get("group_size") or enc.params.get("block_size") or 128
        block = g if in_f % g == 0 else None
        return get_quantizer("blockwise", block_size=block, symmetric=False).quantize(w, enc.bits, {}).dequantize().to(w.dtype)

    def fn(_name: str, w: torch.Tensor) -> torch.Tensor:
        if q.needs & {"hessian", "out_grad_sq"} and enc.scheme != "palettize":
            return rtn(w)
        return q.quantize(w, enc.bits, {}).dequantize().to(w.dtype)  # palettize: unweighted k-means
    return fn


@torch.no_grad()
def apply_transforms(model: nn.Module, windows: torch.Tensor, encodings: Sequence[Encoding], device,
                     show_progress: bool = True) -> dict[str, Any]:
    """Transform ``model`` in place; returns the manifest's ``transforms`` entry (empty when none is named)."""
    names = transforms_of(encodings)
    if not names:
        return {}
    tfs = {n: get_transform(n) for n in names}
    for t in tfs.values():
        t.check(model)
    # model-level transforms (rotations) first: data-free, and every layer-wise search then sees their result
    summary: dict[str, Any] = {n: t.apply_model(model, device) for n, t in tfs.items() if t.model_level}
    online = {k: v for n in summary for k, v in summary[n].get("online", {}).items()}
    tfs = {n: t for n, t in tfs.items() if not t.model_level}
    info = {"names": names, "applies_to": "every candidate (the transform is model-level: applied once, "
            "before calibration, so every encoding quantizes the transformed weights)",
            "search_quantizer": {n: next(e.label for e in encodings if n in e.transforms) for n in tfs},
            "layers": summary, **({"online": online} if online else {})}
    if not tfs:
        return info
    fns = {n: search_quantize_fn(next(e for e in encodings if n in e.transforms)) for n in tfs}
    layers = decoder_layers(model)
    hidden, kwargs = capture_inputs(model, windows, device)
    summary.update({n: [] for n in tfs})
    with progress() as bar:
        task = bar.add_task(f"transform ({'+'.join(tfs)}): decoder layers", total=len(layers), visible=show_progress)
        for layer in layers:
            with resident(model, layer, device, keep=True):  # the fold lasts (lazily: in a scratch file)
                for n, t in tfs.items():
                    with torch.enable_grad():  # a search may optimise; the fold itself is in place
                        summary[n].append(t.apply_layer(layer, hidden, kwargs, fns[n]))
                hidden = forward_layer(layer, hidden, kwargs)
            bar.advance(task)
    return info

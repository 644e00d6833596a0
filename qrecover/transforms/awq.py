"""AWQ: activation-aware per-input-channel scales, folded into the operation before the scaled linears.

For a group of linears that read the same input ``x`` (q/k/v; gate/up; o; down) the weights become
``W diag(s)`` and the input ``diag(s)^-1 x``: the product is unchanged, but input channels that carry large
activations get larger weights, hence relatively finer steps on the target grid (Lin et al. 2023, "AWQ").
``diag(s)^-1`` is folded into the previous operation's output channels: an RMSNorm/LayerNorm's weight (and
bias), or the rows of the previous linear (and its bias), so the model computes the same function.

Search (as AutoAWQ / llm-compressor do, duo scaling): ``x_mean = mean |x|`` per input channel over the
calibration tokens, ``w_mean`` = the mean over output rows of ``|W|`` normalised by its group's absmax;
for ``r`` in ``0, 1/n_grid, ..., (n_grid-1)/n_grid``: ``s = x_mean^r / (w_mean^(1-r) + 1e-4)``, clamped to
``>= 1e-4`` and normalised by ``sqrt(max(s) * min(s))``; the loss is the mean squared difference between
the output of the module that consumes the linears (self_attn for q/k/v, mlp for gate/up, the linear
itself for o and down) with the original weights and with ``quantize_fn(name, W diag(s)) diag(s)^-1``.
The best ``s`` is folded; if none beats no scaling (``s = 1``), nothing changes.

Folding goes through a declared mapping table per architecture family (:data:`FAMILIES`): (previous op,
linears it feeds, compared module, and for a fused previous linear which chunk of its rows feeds them).
A previous linear is folded only when its rows map one to one onto the consumer's input channels (with
grouped-query attention ``v_proj`` has fewer rows than ``o_proj`` has inputs: that pair is skipped, as the
references do). Gemma's norms multiply by ``1 + w``: folding sets ``w' = (1 + w) / s - 1``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from ..errors import QRecoverError
from ..models import decoder_layers
from .base import QuantizeFn, Transform, register_transform


@dataclass(frozen=True)
class Mapping:
    """``prev`` (a norm or a linear inside the decoder layer) feeds ``linears``; the search compares the
    output of ``inspect``. A linear ``prev`` whose output is split in ``chunks`` equal parts (fused
    qkv_proj: 3, gate_up_proj: 2) feeds the linears with its LAST chunk."""

    prev: str
    linears: tuple[str, ...]
    inspect: str
    chunks: int = 1


@dataclass(frozen=True)
class Family:
    """One architecture family: decoder-layer class names, mappings, and the norm's weight offset
    (Gemma's RMSNorm computes ``x_norm * (1 + w)``: offset 1)."""

    name: str
    layer_classes: tuple[str, ...]
    mappings: tuple[Mapping, ...]
    norm_offset: float = 0.0


def _llama_like(norm_mlp: str) -> tuple[Mapping, ...]:
    attn, mlp = "self_attn", "mlp"
    return (
        Mapping("input_layernorm", (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"), attn),
        Mapping(f"{attn}.v_proj", (f"{attn}.o_proj",), f"{attn}.o_proj"),
        Mapping(norm_mlp, (f"{mlp}.gate_proj", f"{mlp}.up_proj"), mlp),
        Mapping(f"{mlp}.up_proj", (f"{mlp}.down_proj",), f"{mlp}.down_proj"),
    )


FAMILIES: tuple[Family, ...] = (
    Family("llama", ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                     "SmolLM3DecoderLayer"), _llama_like("post_attention_layernorm")),
    Family("gemma", ("GemmaDecoderLayer",), _llama_like("post_attention_layernorm"), norm_offset=1.0),
    Family("gemma2", ("Gemma2DecoderLayer", "Gemma3DecoderLayer"), _llama_like("pre_feedforward_layernorm"),
           norm_offset=1.0),
    Family("phi3", ("Phi3DecoderLayer",), (
        Mapping("input_layernorm", ("self_attn.qkv_proj",), "self_attn"),
        Mapping("self_attn.qkv_proj", ("self_attn.o_proj",), "self_attn.o_proj", chunks=3),  # v: the last third
        Mapping("post_attention_layernorm", ("mlp.gate_up_proj",), "mlp"),
        Mapping("mlp.gate_up_proj", ("mlp.down_proj",), "mlp.down_proj", chunks=2),  # up: the second half
    )),
)


def supported_layers() -> list[str]:
    return sorted(c for f in FAMILIES for c in f.layer_classes)


def family_of(layer: nn.Module) -> Family:
    """The mapping family of a decoder layer, or QRecoverError naming its class and the supported ones."""
    cls = type(layer).__name__
    for fam in FAMILIES:
        if cls in fam.layer_classes:
            return fam
    raise QRecoverError(f"awq has no mapping for {cls}; supported: {supported_layers()}; use an encoding without awq")


def duo_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, ratio: float) -> torch.Tensor:
    """``(I,)`` AWQ scales for one grid ratio: ``x_mean^r / (w_mean^(1-r) + 1e-4)``, normalised."""
    s = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
    return s / (s.max() * s.min()).sqrt()


def weight_mean(weights: list[torch.Tensor], group_size: int | None) -> torch.Tensor:
    """``(I,)`` mean over the rows of every weight ``(O_k, I)`` of ``|W|`` / its group's absmax."""
    w = torch.cat([x.detach().float() for x in weights])
    g = group_size if group_size and w.shape[1] % group_size == 0 else w.shape[1]
    grouped = w.abs().view(w.shape[0], -1, g)
    return (grouped / (grouped.amax(-1, keepdim=True) + 1e-6)).view_as(w).mean(0)


def search_scales(x_mean: torch.Tensor, w_mean: torch.Tensor, loss: Callable[[torch.Tensor | None], float],
                  n_grid: int = 20, duo_scaling: bool = True) -> tuple[torch.Tensor, float | None, float, float]:
    """AWQ's grid search: ``(s (I,), best ratio or None when no scaling is best, loss(None), loss(s))``.

    ``loss(s)`` is the output error with the weights fake-quantized as ``Q(W diag(s)) diag(s)^-1``
    (``s = None``: plain ``Q(W)``); ratios ``i / n_grid`` for ``i < n_grid``; ties keep the earlier one.
    """
    before = loss(None)
    best: tuple[float, float | None, torch.Tensor] = (before, None, torch.ones_like(x_mean))
    for i in range(n_grid):
        r = i / n_grid
        s = duo_scales(x_mean, w_mean if duo_scaling else torch.zeros_like(w_mean), r)
        if not torch.all(torch.isfinite(s)):
            continue
        e = loss(s)
        if e < best[0]:
            best = (e, r, s)
    return best[2], best[1], before, best[0]


@dataclass
class _Captured:
    """One mapping's calibration data: ``mean |x|`` ``(I,)`` of the linears' input, the compared module's calls."""

    x_mean: torch.Tensor
    calls: list[tuple[tuple, dict]]


@register_transform
class AWQ(Transform):
    """See the module docstring. ``n_grid``: ratios tried; ``duo_scaling``: the weight term in ``s``;
    ``group_size``: the target grid's group, for ``w_mean`` (None or not dividing: whole rows);
    ``search_tokens``: calibration tokens (whole windows, the first ones, at least one) on which the
    search evaluates each ratio, the bulk of the cost (``x_mean`` uses every token); None = all."""

    name = "awq"

    def __init__(self, n_grid: int = 20, duo_scaling: bool = True, group_size: int | None = 128,
                 search_tokens: int | None = 4096):
        if n_grid < 1:
            raise QRecoverError(f"awq n_grid={n_grid} must be at least 1")
        self.n_grid, self.duo_scaling, self.group_size = n_grid, duo_scaling, group_size
        self.search_tokens = search_tokens

    def check(self, model: nn.Module) -> None:
        for layer in decoder_layers(model):
            family_of(layer)

    def apply_layer(self, layer: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict[str, Any]],
                    quantize_fn: QuantizeFn) -> dict[str, Any]:
        fam = family_of(layer)
        mods = dict(layer.named_modules())
        results: dict[Mapping, dict[str, Any]] = {}
        active = []
        for m in fam.mappings:
            prev, first = mods[m.prev], mods[m.linears[0]]
            if isinstance(prev, nn.Linear) and prev.out_features != m.chunks * first.in_features:
                results[m] = {"prev": m.prev, "linears": list(m.linears), "skipped":
                              f"{m.prev} has {prev.out_features} outputs for {first.in_features} inputs (grouped-query attention)"}
            else:
                active.append(m)
        with torch.no_grad():
            captured = self._capture(layer, inputs, kwargs, active, mods, self._search_calls(inputs))
            # one capture serves every mapping: a fold changes only the inputs of its own linears, which
            # no later mapping reads (each mapping's compared module follows the earlier ones' linears)
            for m, cap in zip(active, captured):
                linears = [mods[n] for n in m.linears]
                s, ratio, before, after = self._search(m, linears, mods[m.inspect], cap, quantize_fn)
                if ratio is not None:
                    self._fold(mods[m.prev], linears, s, fam.norm_offset)
                results[m] = {"prev": m.prev, "linears": list(m.linears), "ratio": ratio,
                              "error_before": before, "error_after": after}
        return {"family": fam.name, "mappings": [results[m] for m in fam.mappings]}

    # --- stages -------------------------------------------------------------------------------------------

    @staticmethod
    def _capture(layer: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict[str, Any]], mappings: list[Mapping],
                 mods: dict[str, nn.Module], n_calls: int) -> list[_Captured]:
        """One pass of the layer over every input: per mapping, ``mean |x|`` of its linears' input over all
        tokens, and the compared module's calls in the first ``n_calls`` windows."""
        sums: list[torch.Tensor | float] = [0.0] * len(mappings)
        counts = [0] * len(mappings)
        calls: list[list[tuple[tuple, dict]]] = [[] for _ in mappings]
        window = [0]

        def on_input(k: int):
            def hook(_m, args):
                x = args[0].reshape(-1, args[0].shape[-1])
                sums[k] = sums[k] + x.abs().double().sum(0)
                counts[k] += x.shape[0]
            return hook

        def on_call(k: int):
            def hook(_m, args, kw):
                if window[0] < n_calls:
                    calls[k].append((args, dict(kw)))
            return hook

        hooks = []
        try:
            for k, m in enumerate(mappings):
                hooks.append(mods[m.linears[0]].register_forward_pre_hook(on_input(k)))
                hooks.append(mods[m.inspect].register_forward_pre_hook(on_call(k), with_kwargs=True))
            for i, (x, kw) in enumerate(zip(inputs, kwargs)):
                window[0] = i
                layer(x, **kw)
        finally:
            for h in hooks:
                h.remove()
        return [_Captured((sm / max(c, 1)).float(), cl) for sm, c, cl in zip(sums, counts, calls)]

    def _search_calls(self, inputs: list[torch.Tensor]) -> int:
        """How many of the first windows the search evaluates (``search_tokens``)."""
        if self.search_tokens is None:
            return len(inputs)
        n, tokens = 0, 0
        for x in inputs:
            if n and tokens + x.shape[:-1].numel() > self.search_tokens:
                break
            n, tokens = n + 1, tokens + x.shape[:-1].numel()
        return n

    @staticmethod
    def _run(module: nn.Module, calls: list[tuple[tuple, dict]]) -> Iterator[torch.Tensor]:
        for args, kw in calls:
            y = module(*args, **kw)
            yield (y[0] if isinstance(y, tuple) else y).float()

    def _search(self, m: Mapping, linears: list[nn.Linear], inspect: nn.Module, cap: _Captured,
                quantize_fn: QuantizeFn) -> tuple[torch.Tensor, float | None, float, float]:
        ref = list(self._run(inspect, cap.calls))
        originals = [lin.weight.data.clone() for lin in linears]

        def loss(s: torch.Tensor | None) -> float:
            for name, lin, w in zip(m.linears, linears, originals):
                if s is None:
                    lin.weight.data = quantize_fn(name, w).to(w.dtype)
                else:
                    s_ = s.to(w.dtype)
                    lin.weight.data = (quantize_fn(name, w * s_) / s_).to(w.dtype)
            try:
                total, n = 0.0, 0
                for y, r in zip(self._run(inspect, cap.calls), ref):
                    total += float((y - r).double().square().sum())
                    n += r.numel()
            finally:
                for lin, w in zip(linears, originals):
                    lin.weight.data = w
            return total / max(n, 1)

        return search_scales(cap.x_mean, weight_mean(originals, self.group_size), loss, self.n_grid, self.duo_scaling)

    @staticmethod
    def _fold(prev: nn.Module, linears: list[nn.Linear], s: torch.Tensor, norm_offset: float) -> None:
        """``W <- W diag(s)`` for the linears; the previous op's output channels divided by ``s``."""
        for lin in linears:
            lin.weight.data = (lin.weight.data.float() * s).to(lin.weight.dtype)
        if isinstance(prev, nn.Linear):
            rows = slice(prev.out_features - s.numel(), prev.out_features)  # the last chunk
            prev.weight.data[rows] = (prev.weight.data[rows].float() / s.unsqueeze(1)).to(prev.weight.dtype)
            if prev.bias is not None:
                prev.bias.data[rows] = (prev.bias.data[rows].float() / s).to(prev.bias.dtype)
            return
        weight = getattr(prev, "weight", None)
        if weight is None or weight.shape != s.shape:
            raise QRecoverError(f"awq cannot fold scales into {type(prev).__name__}: no weight of shape {tuple(s.shape)}")
        weight.data = ((weight.data.float() + norm_offset) / s - norm_offset).to(weight.dtype)
        bias = getattr(prev, "bias", None)
        if bias is not None:
            bias.data = (bias.data.float() / s).to(bias.dtype)

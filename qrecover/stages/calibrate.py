"""Stage ``calibrate``: decide which statistics to compute (only those asked for), then walk the decoder
layers one at a time on the compute device, handing each layer's statistics to a callback.

What is computed: the union of the chosen quantizers' ``needs`` (read on instances:
``get_quantizer(...).needs``), plus what the damage estimate needs when there is something to allocate
(``hessian`` and the output-gradient moments, :mod:`qrecover.sensitivity`). The backward pass runs only when
some quantizer needs ``out_grad_sq``, the embedding's candidates need its Fisher (``element_sq``), or damage
must be estimated; the Hessian only when a quantizer or the damage estimate needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..calibrate import capture_inputs, gradient_stats, layer_stats
from ..distributed import SINGLE, World
from ..models import decoder_layers, linear_layers, module_name, resident
from ..progress import progress
from .specs import Encoding


@dataclass(frozen=True)
class StatsPlan:
    """``layer``: per-linear input statistics to collect (subset of {"hessian", "input_sq"});
    ``gradients``: whether the backward pass runs; ``damage``: whether damage is estimated."""

    layer: frozenset[str]
    gradients: bool
    damage: bool


def plan_stats(linear: Sequence[Encoding], embedding: Sequence[Encoding], damage: bool) -> StatsPlan:
    """What calibration must compute for these candidates. ``damage``: estimate each candidate's damage
    (needed whenever there is a choice to make)."""
    needs: set[str] = set()
    for e in linear:
        needs |= set(e.quantizer.needs)
    emb_needs = set().union(*(set(e.quantizer.needs) for e in embedding)) if embedding else set()
    layer = {s for s in needs if s in ("hessian", "input_sq")} | ({"hessian"} if damage else set())
    gradients = damage or "out_grad_sq" in needs or bool(emb_needs)
    return StatsPlan(frozenset(layer), gradients, damage)


def gradients(model: nn.Module, windows: torch.Tensor, plan: StatsPlan, device, show_progress: bool,
              group: World = SINGLE) -> dict | None:
    """The backward pass's statistics (:func:`qrecover.calibrate.gradient_stats`), or None when not planned."""
    return gradient_stats(model, windows, show_progress, device, group=group) if plan.gradients else None


def layer_pass(model: nn.Module, windows: torch.Tensor, want: frozenset[str],
               on_layer: Callable[[int, nn.Module, dict[str, dict[str, torch.Tensor]]], None],
               device, show_progress: bool, title: str = "calibrate + quantize: decoder layers", group: World = SINGLE) -> None:
    """For each decoder layer in turn: move it to ``device``, replay the calibration inputs through it
    collecting ``want``, call ``on_layer(index, layer, stats)`` (stats by the linear's full name), move it
    back to the CPU (a lazily loaded model's layer: drop its weights, :func:`qrecover.models.resident`); its
    outputs (unquantized weights) are the next layer's inputs. ``group``: each process replays its share of
    ``windows``, the statistics reduced to one process's bits (:mod:`qrecover.distributed`)."""
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    hidden, kwargs = capture_inputs(model, windows[group.span(len(windows))], device)
    with progress() as bar:
        task = bar.add_task(title, total=len(layers), visible=show_progress)
        for i, layer in enumerate(layers):
            with resident(model, layer, device):
                lins = linear_layers(layer, prefix=f"{prefix}.{i}.")
                stats, hidden = layer_stats(layer, hidden, kwargs, lins, want, group=group)
                on_layer(i, layer, stats)
                del stats
            bar.advance(task)

"""Stage ``finalize``: re-quantize every decoder linear layer with its CHOSEN encoding on inputs produced by
the already quantized layers before it (GPTQ's sequential mode), then hand the packed weights to ``write``.

Layer by layer, one decoder layer on the compute device at a time; inside a layer, linear layers are taken
in groups that share an input (q/k/v, then o, then gate/up, then down: "true sequential"), each group's
statistics collected with the earlier groups already quantized. The first layer's inputs come from the
quantized embedding. A quantizer that needs no input statistics (round-to-nearest) gives the same result on
any input (it is re-quantized without a statistics pass); its dequantized weight still feeds the layers after it. The
model's weights are restored afterwards (a :class:`~qrecover.api.Prepared` serves further budgets); a lazily
loaded model's layer is read from disk for its turn and dropped after (:func:`qrecover.models.resident`).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..calibrate import capture_inputs, forward_layer, layer_stats, linear_groups
from ..models import decoder_layers, linear_layers, module_name, resident
from ..progress import progress
from ..schemes import QuantizedWeight
from ..sensitivity import linear_damage
from .candidates import quantize_unit
from .specs import Encoding

INPUT_STATS = frozenset({"hessian", "input_sq"})
#: at most this many bytes of the last group's inputs are kept for the output correction (else a second pass)
KEEP_BYTES = 2 * 2**30


def _kept_bytes(hidden: list[torch.Tensor], group: list[str], lins: dict[str, nn.Module]) -> int:
    """Bytes of the last group's inputs over every window, if each linear reads one value per token."""
    tokens = sum(h.numel() // h.shape[-1] for h in hidden)
    return sum(tokens * lins[n].weight.shape[1] * hidden[0].element_size() for n in group)


def _corrected_outputs(layer: nn.Module, hidden: list[torch.Tensor], kwargs: list[dict], outs: list[torch.Tensor],
                       kept: dict[str, list[torch.Tensor]], deltas: dict[str, torch.Tensor]) -> list[torch.Tensor] | None:
    """The layer's outputs with its last group quantized, from the pass that collected that group's statistics
    (``outs``, the group still unquantized) plus each quantized linear's output change ``x (W_q - W)^T``: exact
    where those outputs are added to the residual stream unchanged (Llama, Qwen, Mistral, Phi-3: the down
    projection). Checked on the first window against a real forward; None (run the forward) where it does not
    hold (a norm after the projection as in Gemma, routed experts) or a linear ran other than once per window."""
    if any(len(kept.get(n, ())) != len(hidden) for n in deltas):
        return None
    fixed = []
    for j, y in enumerate(outs):
        change = [F.linear(kept[n][j], d) for n, d in deltas.items()]
        if any(c.shape != y.shape for c in change):  # the projection's output is not the layer's (e.g. routed experts)
            return None
        fixed.append(y + sum(change))
    want = forward_layer(layer, hidden[:1], kwargs[:1])[0]
    err = (fixed[0] - want).abs().max()
    change = (want - outs[0]).abs().max()  # what the correction had to account for
    eps = torch.finfo(want.dtype).eps * want.abs().max() * 64
    if not err <= 1e-3 * change + eps:
        return None
    fixed[0] = want
    return fixed


@torch.no_grad()
def finalize(model: nn.Module, windows: torch.Tensor, chosen: dict[str, Encoding], fixed: dict[str, QuantizedWeight],
             out_grad_sq: dict[str, torch.Tensor] | None, device, show_progress: bool = True, groups: str = "input"
             ) -> tuple[dict[str, QuantizedWeight], dict[str, Any]]:
    """``chosen``: decoder linear name -> its encoding; ``fixed``: already final units (the embedding, by
    module name; its chosen weight feeds the first layer). ``out_grad_sq``: the gradient pass's moments (for
    quantizers that need them, and for the finalized damage estimate), or None.

    Returns ``(packed weights by linear name, info)``; ``info["damage"]`` is each re-quantized layer's
    estimated damage under the statistics it was re-quantized with. ``groups``: 'input' (true-sequential, the
    module docstring) or 'layer' (every linear of a layer from one statistics pass on the layer's quantized
    input, then the layer quantized at once: fewer forwards, as llm-compressor's GPTQ does).
    """
    t0 = time.time()
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    emb = model.get_input_embeddings()
    emb_name = module_name(model, emb)
    saved = emb.weight.data
    if emb_name in fixed:
        emb.weight.data = fixed[emb_name].dequantize().to(saved.dtype)
    try:
        hidden, kwargs = capture_inputs(model, windows, device)
    finally:
        emb.weight.data = saved
    result: dict[str, QuantizedWeight] = {}
    damage: dict[str, float] = {}
    shortcuts = 0
    with progress() as bar:
        task = bar.add_task("finalize: decoder layers on quantized inputs", total=len(layers), visible=show_progress)
        for i, layer in enumerate(layers):
            with resident(model, layer, device):
                lins = linear_layers(layer, prefix=f"{prefix}.{i}.")
                originals = {n: m.weight.data.clone() for n, m in lins.items()}
                try:
                    order = linear_groups(layer, hidden[0], kwargs[0], lins) if groups == "input" else [list(lins)]
                    kept, outs, deltas = None, None, {}
                    for k, group in enumerate(order):
                        want = set().union(*(chosen[n].quantizer.needs for n in group)) & INPUT_STATS
                        # the last of several groups: its pass runs to the layer's end and keeps the group's inputs,
                        # so that the layer's outputs need no second pass where the correction is exact (below)
                        if want and k == len(order) - 1 > 0 and _kept_bytes(hidden, group, lins) <= KEEP_BYTES:
                            kept = {}
                        stats, outs = layer_stats(layer, hidden, kwargs, {n: lins[n] for n in group}, want, outputs=kept is not None,
                                                  hessian_dtype=torch.float32, inputs=kept) if want else ({n: {} for n in group}, None)
                        cache: dict = {}
                        for n in group:
                            st = dict(stats[n])
                            if out_grad_sq is not None:
                                st["out_grad_sq"] = out_grad_sq[n].to(device)
                            w = lins[n].weight
                            qw, _ = quantize_unit(w, [chosen[n]], st, None, cache)[0]
                            deq = qw.dequantize().to(device=w.device, dtype=w.dtype)
                            if "hessian" in st and out_grad_sq is not None:
                                damage[n] = max(linear_damage(w.detach().float() - deq.float(), st["hessian"], st["out_grad_sq"]), 0.0)
                            result[n] = qw
                            if kept is not None:
                                deltas[n] = deq - w.data
                            w.data.copy_(deq)  # the next groups and layers see the quantized layer
                        del stats
                    corrected = _corrected_outputs(layer, hidden, kwargs, outs, kept, deltas) if kept is not None else None
                    shortcuts += corrected is not None
                    hidden = corrected if corrected is not None else forward_layer(layer, hidden, kwargs)
                    del kept, outs, deltas
                finally:
                    for n, m in lins.items():
                        m.weight.data.copy_(originals[n])
            bar.advance(task)
    mode = "true-sequential (groups sharing an input, in call order)" if groups == "input" else "layer (one pass per layer)"
    return result, {"mode": mode, "damage": damage, "outputs_corrected": f"{shortcuts}/{len(layers)} layers",
                    "seconds": round(time.time() - t0, 1)}

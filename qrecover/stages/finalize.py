"""Stage ``finalize``: re-quantize every decoder linear layer with its CHOSEN encoding on inputs produced by
the already quantized layers before it (GPTQ's sequential mode), then hand the packed weights to ``write``.

Layer by layer, one decoder layer on the compute device at a time; inside a layer, linear layers are taken
in groups that share an input (q/k/v, then o, then gate/up, then down: "true sequential"), each group's
statistics collected with the earlier groups already quantized. The first layer's inputs come from the
quantized embedding. A quantizer that needs no input statistics (round-to-nearest) gives the same result on
any input (it is re-quantized without a statistics pass); its dequantized weight still feeds the layers after it. The
model's weights are restored afterwards (a :class:`~qrecover.stages.candidates.Prepared` serves further budgets); a lazily
loaded model's layer is read from disk for its turn and dropped after (:func:`qrecover.models.resident`).
"""

from __future__ import annotations

import time
import warnings
from contextlib import ExitStack, contextmanager
from typing import Any, Iterator

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..calibrate import capture_inputs, forward_layer, layer_stats, linear_groups
from ..distributed import SINGLE, World, join
from ..hardware import bf16_matmul_inputs, cpu_matmul_inputs
from ..models import decoder_layers, linear_layers, module_name, resident
from ..progress import progress
from ..schemes import QuantizedWeight
from ..sensitivity import linear_damage
from .candidates import Prepared, quantize_shared
from .checks import resolve_device
from .specs import Encoding

INPUT_STATS = frozenset({"hessian", "input_sq"})
#: at most this many bytes of a group's inputs are kept, for the output correction or a block replay (else the
#: forward runs again)
KEEP_BYTES = 2 * 2**30


def _kept_bytes(hidden: list[torch.Tensor], group: list[str], lins: dict[str, nn.Module]) -> int:
    """Bytes of a group's inputs over every window, if each linear reads one value per token."""
    tokens = sum(h.numel() // h.shape[-1] for h in hidden)
    return sum(tokens * lins[n].weight.shape[1] * hidden[0].element_size() for n in group)


def _replayable(layer: nn.Module, linear: nn.Module, parent: nn.Module, x: torch.Tensor, kw: dict) -> tuple | None:
    """The shape of ``parent``'s output if it is exactly ``linear``'s output (as the attention block's is its output
    projection's): ``(None, ...)`` for a tuple whose other elements are None, ``()`` for the bare tensor; else None.
    From one forward of one window."""
    seen: dict[str, Any] = {}
    hooks = [linear.register_forward_hook(lambda _m, _i, o: seen.setdefault("linear", o)),
             parent.register_forward_hook(lambda _m, _i, o: seen.setdefault("parent", o))]
    try:
        layer(x, **kw)
    finally:
        for h in hooks:
            h.remove()
    out = seen.get("parent")
    if isinstance(out, tuple) and out and out[0] is seen.get("linear") and all(o is None for o in out[1:]):
        return (None,) * len(out)
    return () if out is not None and out is seen.get("linear") else None


@contextmanager
def _replay(layer: nn.Module, parent: nn.Module, linear: nn.Module, inputs: list[torch.Tensor], hidden: list[torch.Tensor],
            shape: tuple) -> Iterator[None]:
    """While active, ``parent`` (whose output is ``linear``'s, :func:`_replayable`) is not run: for window ``j`` of
    ``hidden`` (told apart by the layer input it is called on) its output is ``linear(inputs[j])``, bit for bit what
    it would compute once ``linear``'s own input no longer changes, i.e. once everything before it is quantized.
    Computed once per window and handed to every later pass of the layer (``linear`` is final by then)."""
    index = {id(h): j for j, h in enumerate(hidden)}
    current: list[int | None] = [None]
    done: dict[int, Any] = {}  # window -> the block's output: later passes of the layer take it again

    def pre(_m, args, kwargs):
        x = args[0] if args else kwargs.get("hidden_states")
        current[0] = index.get(id(x))

    own = parent.__dict__.get("forward")  # an instance-level forward (e.g. an offloading hook's) to restore
    real = parent.forward

    def forward(*args, **kwargs):
        if current[0] is None:  # a window this replay has no input for
            return real(*args, **kwargs)
        j = current[0]
        if j not in done:
            y = linear(inputs[j])
            done[j] = (y, *shape[1:]) if shape else y
        return done[j]

    handle = layer.register_forward_pre_hook(pre, with_kwargs=True)
    parent.forward = forward
    try:
        yield
    finally:
        handle.remove()
        if own is None:
            del parent.forward
        else:
            parent.forward = own


def _block_replay(layer: nn.Module, layer_prefix: str, name: str, linear: nn.Module, inputs: list[torch.Tensor],
                  hidden: list[torch.Tensor], kwargs: list[dict]):
    """The :func:`_replay` of the block whose output is ``linear``'s (``name``: its full name), or None where there is
    no such block or the linear did not run once per window."""
    rel = name[len(layer_prefix):].rpartition(".")[0]
    if not rel or len(inputs) != len(hidden):
        return None
    parent = layer.get_submodule(rel)
    shape = _replayable(layer, linear, parent, hidden[0], kwargs[0])
    return None if shape is None else _replay(layer, parent, linear, inputs, hidden, shape)


def _corrected_outputs(layer: nn.Module, hidden: list[torch.Tensor], kwargs: list[dict], outs: list[torch.Tensor],
                       kept: dict[str, list[torch.Tensor]], deltas: dict[str, torch.Tensor], world: World = SINGLE
                       ) -> list[torch.Tensor] | None:
    """The layer's outputs with its last group quantized, from the pass that collected that group's statistics
    (``outs``, the group still unquantized) plus each quantized linear's output change ``x (W_q - W)^T``: exact
    where those outputs are added to the residual stream unchanged (Llama, Qwen, Mistral, Phi-3: the down
    projection). Checked on the first window against a real forward; None (run the forward) where it does not
    hold (a norm after the projection as in Gemma, routed experts) or a linear ran other than once per window.
    ``world``: the decision is every process's (the check on window 0, which rank 0 holds)."""
    fixed: list[torch.Tensor] | None = []
    if any(len(kept.get(n, ())) != len(hidden) for n in deltas):
        fixed = None
    for j, y in enumerate(outs if fixed is not None else []):
        change = [F.linear(kept[n][j], d) for n, d in deltas.items()]
        if any(c.shape != y.shape for c in change):  # the projection's output is not the layer's (e.g. routed experts)
            fixed = None
            break
        fixed.append(y + sum(change))
    if fixed is not None and world.rank == 0:
        want = forward_layer(layer, hidden[:1], kwargs[:1])[0]
        err = (fixed[0] - want).abs().max()
        change = (want - outs[0]).abs().max()  # what the correction had to account for
        eps = torch.finfo(want.dtype).eps * want.abs().max() * 64
        fixed = [want, *fixed[1:]] if err <= 1e-3 * change + eps else None
    return fixed if world.all_true(fixed is not None) else None


@torch.no_grad()
def finalize(model: nn.Module, windows: torch.Tensor, chosen: dict[str, Encoding], fixed: dict[str, QuantizedWeight],
             out_grad_sq: dict[str, torch.Tensor] | None, device, show_progress: bool = True, groups: str = "input",
             world: World = SINGLE, precision: str = "fp32") -> tuple[dict[str, QuantizedWeight], dict[str, Any]]:
    """``chosen``: decoder linear name -> its encoding; ``fixed``: already final units (the embedding, by
    module name; its chosen weight feeds the first layer). ``out_grad_sq``: the gradient pass's moments (for
    quantizers that need them, and for the finalized damage estimate), or None.

    Returns ``(packed weights by linear name, info)``; ``info["damage"]`` is each re-quantized layer's
    estimated damage under the statistics it was re-quantized with. ``groups``: 'input' (true-sequential, the
    module docstring) or 'layer' (every linear of a layer from one statistics pass on the layer's quantized
    input, then the layer quantized at once: fewer forwards, as llm-compressor's GPTQ does). ``world``: the
    processes of a launch: each runs its share of ``windows``, the statistics are reduced to one process's bits
    and a group's linears are quantized on different processes (:mod:`qrecover.distributed`). ``precision``: the
    statistics passes' CPU matmuls ('fp32', 'bf16', 'auto': :func:`matmul_inputs`); the quantization stays fp32.
    """
    t0 = time.time()
    kind = matmul_inputs(precision, device)
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    result: dict[str, QuantizedWeight] = {}
    damage: dict[str, float] = {}
    shortcuts = replayed = 0
    with progress() as bar, cpu_matmul_inputs(kind):
        hidden, kwargs = _first_inputs(model, windows, fixed, device, world)
        task = bar.add_task("finalize: decoder layers on quantized inputs", total=len(layers), visible=show_progress)
        for i, layer in enumerate(layers):
            with resident(model, layer, device):
                hidden, corrected, blocks = _finalize_layer(layer, f"{prefix}.{i}.", hidden, kwargs, chosen, out_grad_sq,
                                                            device, groups, world, result, damage)
                shortcuts += corrected
                replayed += blocks
            bar.advance(task)
    mode = "true-sequential (groups sharing an input, in call order)" if groups == "input" else "layer (one pass per layer)"
    return result, {"mode": mode, "matmul_inputs": kind, "damage": damage, "outputs_corrected": f"{shortcuts}/{len(layers)} layers",
                    "blocks_replayed": replayed,
                    "seconds": round(time.time() - t0, 1)}


def matmul_inputs(precision: str, device) -> str:
    """What finalize's statistics passes round their matmul inputs to on ``device``: 'bf16' where ``precision`` is
    'bf16', or 'auto' on a CPU that computes bf16 natively (:func:`~qrecover.hardware.native_bf16`), and the CPU's
    matmuls take it (:func:`~qrecover.hardware.cpu_rounds_bf16_inputs`; an asked-for 'bf16' they ignore warns);
    else 'fp32'. Only the CPU's matmuls take it (:func:`~qrecover.hardware.cpu_matmul_inputs`): on a GPU finalize
    stays fp32."""
    if torch.device(device).type != "cpu":
        return "fp32"
    if bf16_matmul_inputs(precision):
        return "bf16"
    if precision == "bf16":
        warnings.warn("qrecover: --finalize-precision bf16: this CPU's matrix library ignores bf16 inputs for float32 "
                      "matmuls (an Intel CPU with AMX takes them); finalize runs in fp32, as the manifest records",
                      stacklevel=2)
    return "fp32"


def _first_inputs(model: nn.Module, windows: torch.Tensor, fixed: dict[str, QuantizedWeight], device,
                  world: World) -> tuple[list[torch.Tensor], list[dict]]:
    """The first decoder layer's inputs on this process's share of ``windows``, from the embedding as chosen
    (where ``fixed`` holds it); the model's own embedding weight is put back afterwards."""
    emb = model.get_input_embeddings()
    emb_name = module_name(model, emb)
    saved = emb.weight.data
    if emb_name in fixed:
        emb.weight.data = fixed[emb_name].dequantize().to(saved.dtype)
    try:
        return capture_inputs(model, windows[world.span(len(windows))], device)
    finally:
        emb.weight.data = saved


def _finalize_layer(layer: nn.Module, layer_prefix: str, hidden: list[torch.Tensor], kwargs: list[dict],
                    chosen: dict[str, Encoding], out_grad_sq: dict[str, torch.Tensor] | None, device, groups: str,
                    world: World, result: dict[str, QuantizedWeight], damage: dict[str, float]
                    ) -> tuple[list[torch.Tensor], bool, int]:
    """Re-quantize one decoder layer's linears, group by group, on its quantized inputs ``hidden``; the packed
    weights and their damage go into ``result`` and ``damage``. Returns the layer's outputs with its linears
    quantized (the next layer's inputs), whether they came from the correction (:func:`_corrected_outputs`)
    rather than a forward, and how many blocks were replayed. The layer's own weights are restored at the end."""
    lins = linear_layers(layer, prefix=layer_prefix)
    originals = {n: m.weight.data.clone() for n, m in lins.items()}
    replays = ExitStack()  # blocks replayed from their kept inputs (_replay) until the layer is done
    replayed = 0
    try:
        # rank 0 holds window 0: every process takes its order (routed experts may differ by window)
        order = world.broadcast(linear_groups(layer, hidden[0], kwargs[0], lins) if groups == "input" else [list(lins)])
        kept, final, outs, deltas = None, None, None, {}  # final: the last group's kept inputs
        for k, group in enumerate(order):
            want = set().union(*(chosen[n].quantizer.needs for n in group)) & INPUT_STATS
            # the last of several groups: its pass runs to the layer's end and keeps the group's inputs,
            # so that the layer's outputs need no second pass where the correction is exact (below); a
            # group of one linear keeps its inputs so that later passes can replay its block (_replay)
            last = k == len(order) - 1 > 0
            keep = want and (last or len(group) == 1) and world.total(_kept_bytes(hidden, group, lins)) <= KEEP_BYTES
            kept = {} if keep else None
            stats, outs = layer_stats(layer, hidden, kwargs, {n: lins[n] for n in group}, want, outputs=last and keep,
                                      hessian_dtype=torch.float32, inputs=kept, group=world) if want else ({n: {} for n in group}, None)
            sts = {n: {**stats[n], **({"out_grad_sq": out_grad_sq[n].to(device)} if out_grad_sq is not None else {})}
                   for n in group}
            _quantize_group(group, lins, chosen, sts, out_grad_sq, world, result, damage,
                            deltas if last and kept is not None else None)
            del stats
            if last:
                final = kept
            elif kept is not None and len(group) == 1:
                n = group[0]
                block = _block_replay(layer, layer_prefix, n, lins[n], kept[n], hidden, kwargs)
                if block is not None:
                    replays.enter_context(block)
                    replayed += 1
        corrected = _corrected_outputs(layer, hidden, kwargs, outs, final, deltas, world) if final is not None else None
        hidden = corrected if corrected is not None else forward_layer(layer, hidden, kwargs)
        del kept, final, outs, deltas
    finally:
        replays.close()
        for n, m in lins.items():
            m.weight.data.copy_(originals[n])
    return hidden, corrected is not None, replayed


def _quantize_group(group: list[str], lins: dict[str, nn.Module], chosen: dict[str, Encoding], sts: dict[str, dict],
                    out_grad_sq: dict[str, torch.Tensor] | None, world: World, result: dict[str, QuantizedWeight],
                    damage: dict[str, float], deltas: dict[str, torch.Tensor] | None) -> None:
    """Quantize ``group``'s linears with their chosen encodings (shared out over the processes) and put the
    dequantized weights in place, so that the next groups and layers see them: each packed weight into ``result``,
    its damage into ``damage`` (where there are a Hessian and gradient moments), its weight change into ``deltas``
    (when given: the correction of the layer's outputs needs it)."""
    with cpu_matmul_inputs("fp32"):  # the statistics may have been collected with bf16 matmul inputs; GPTQ never is
        packed = quantize_shared({n: (lins[n].weight, [chosen[n]], sts[n], None) for n in group}, world)
    for n in group:
        st, w, (qw, _) = sts[n], lins[n].weight, packed[n][0]
        deq = qw.dequantize().to(device=w.device, dtype=w.dtype)
        if "hessian" in st and out_grad_sq is not None:
            damage[n] = max(linear_damage(w.detach().float() - deq.float(), st["hessian"], st["out_grad_sq"]), 0.0)
        result[n] = qw
        if deltas is not None:
            deltas[n] = deq - w.data
        w.data.copy_(deq)  # the next groups and layers see the quantized layer


def finalize_units(p: Prepared, enc_of: dict[str, Encoding], qws: dict[str, QuantizedWeight | None], groups: str,
                   device: str, owned: bool, show_progress: bool, precision: str = "fp32") -> dict[str, Any]:
    """Stage ``finalize`` on a prepared model: re-quantize each chosen linear (``enc_of``) on the outputs of the
    quantized layers before it; ``qws`` (unit name -> packed weight) is updated in place. ``owned``: no caller
    keeps ``p`` for another budget, so the linears' candidates are freed before finalize makes their
    replacements. Returns the manifest's ``finalize`` record (``enabled`` added by the caller)."""
    lin_names = [n for n, u in p.units.items() if u.kind == "linear"]
    if owned:  # finalize replaces every linear's packed weights: free the candidates before it makes them
        for n in lin_names:
            p.units[n].results = None
            qws[n] = None
    fixed = {n: qws[n] for n, u in p.units.items() if u.kind != "linear"}
    final, info = finalize(p.model, p.windows, {n: enc_of[n] for n in lin_names}, fixed,
                           p.grads["out_grad_sq"] if p.grads is not None else None,
                           resolve_device(device), show_progress, groups=groups, world=join(), precision=precision)
    qws.update(final)
    return info

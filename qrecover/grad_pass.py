"""Calibration's gradient pass: forward + backward of the unquantized model over the calibration windows, one
window at a time, accumulating small per-layer statistics (see :func:`gradient_stats`). :mod:`qrecover.calibrate`
runs it as the ``calibrate`` stage's first pass.

Where it runs: on the CPU the whole model runs forward once (keeping its autograd graph) and backward once per
window; a lazily loaded model (:func:`qrecover.models.load_model`, one decoder layer in memory) has all its
decoder layers read once for the pass when three times their float32 bytes fit in the available memory (so
each layer is read once, not twice per window, and runs forward once, not twice). Elsewhere (CUDA, or a model
too large for the memory) the pass is layer-wise: one decoder layer on the device at a time, forward through
every layer keeping each layer's input, then backward layer by layer, each layer's forward recomputed. Both
give the same bits (tests/test_compress_stages.py).
"""

from __future__ import annotations

from contextlib import ExitStack, nullcontext
from typing import Any

import torch
import torch.nn as nn

from .distributed import SINGLE, OrderedSum, World
from .errors import QRecoverError
from .hardware import available_memory
from .models import decoder_layers, lazy_weights, linear_layers, module_name, resident
from .moe import expert_key
from .progress import progress


class Stop(Exception):
    """Raised by a hook to end a forward early (the inputs it wanted are captured)."""


def gradient_stats(model: nn.Module, windows: torch.Tensor, show_progress: bool = True,
                   device: torch.device | str = "cpu", layerwise: bool | None = None, group: World = SINGLE,
                   bf16: bool = False) -> dict:
    """Backward passes over ``windows (n, seq_len)``; see the module docstring. Returns a dict:

    ``out_grad_sq``: ``{linear name: (out,)}`` for every linear in the decoder layers;
    ``head``: ``{"out_grad_sq": (vocab,), "hessian": (hidden, hidden)}`` of the output matrix;
    ``emb_fisher``: ``(vocab, hidden)``; ``loss``: mean next-token loss; ``tokens``: count. All on CPU.

    ``device``: where the passes run. ``layerwise``: None (the default) picks as the module docstring says; True
    forces the layer-wise pass (it needs the model's final norm, found as ``<base model>.norm``; without one the
    whole model is moved to the device for the pass); False the whole-model pass.

    ``group``: the processes of a launch (:mod:`qrecover.distributed`): each runs its share of ``windows`` (all
    of them given to every process) and the sums are reduced in window order (the same bits as one process).
    ``bf16``: the passes under bf16 autocast on ``device`` (the statistics still summed in float64).
    """
    store = lazy_weights(model)
    if layerwise is None:
        layerwise = torch.device(device).type != "cpu" or (store is not None and not _fits_whole(model))
    with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
        if layerwise and _final_norm(model) is not None:
            return _gradient_stats(model, windows, show_progress, _layerwise_step(model, torch.device(device)), group)
        with _all_resident(model, device) if store is not None else nullcontext():
            home = next(model.parameters()).device
            model.to(device)
            try:
                return _gradient_stats(model, windows.to(device), show_progress, None, group)
            finally:
                model.to(home)


def _fits_whole(model: nn.Module) -> bool:
    """Whether three times the float32 bytes of the model's parameters (its weights, plus room for one window's
    activations and their gradients) fit in the memory available now."""
    return 3 * 4 * sum(p.numel() for p in model.parameters()) <= available_memory()


def _all_resident(model: nn.Module, device) -> ExitStack:
    """Every decoder layer of a lazily loaded model read into memory (on ``device``) until the context ends."""
    stack = ExitStack()
    with ExitStack() as undo:
        undo.push(stack)
        for layer in decoder_layers(model):
            stack.enter_context(resident(model, layer, device))
        undo.pop_all()
    return stack


def to_device(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor inside (tuples, lists, dicts) moved to ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (tuple, list)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj



def _final_norm(model: nn.Module) -> nn.Module | None:
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    norm = getattr(base, "norm", None)
    return norm if isinstance(norm, nn.Module) else None


def _layerwise_step(model: nn.Module, device: torch.device):
    """One window's forward and backward with one decoder layer on ``device`` at a time; the embedding runs
    where the model is (CPU), the final norm and output matrix on ``device``. Returns the summed loss."""
    layers = decoder_layers(model)
    norm, head = _final_norm(model), model.get_output_embeddings()
    cap = getattr(model.config, "final_logit_softcapping", None)

    def step(ids: torch.Tensor) -> torch.Tensor:
        captured: dict[str, tuple] = {}

        def catch(_m, args, kwargs):
            captured["x"] = (args, kwargs)
            raise Stop

        h = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
        try:
            model(input_ids=ids, use_cache=False)  # up to the first layer: the embedding keeps its graph
        except Stop:
            pass
        finally:
            h.remove()
        args, kw = captured["x"]
        x0 = args[0] if args else kw.pop("hidden_states")
        kw = to_device(kw, device)
        inputs = []
        x = x0.detach().to(device)
        with torch.no_grad():
            for layer in layers:
                with resident(model, layer, device):
                    inputs.append(x)
                    y = layer(x, **kw)
                    x = y[0] if isinstance(y, tuple) else y
        norm.to(device)
        head.to(device)  # (a tied output matrix is the embedding's: moved back below before the next window)
        try:
            last = x.detach().requires_grad_(True)
            logits = head(norm(last))
            if cap:
                logits = torch.tanh(logits / cap) * cap
            loss = nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:].to(device), reduction="sum")
            loss.backward()
        finally:
            norm.to("cpu")
            head.to("cpu")
        g = last.grad
        for layer, x in zip(reversed(layers), reversed(inputs)):
            with resident(model, layer, device):
                xi = x.detach().requires_grad_(True)
                y = layer(xi, **kw)
                (y[0] if isinstance(y, tuple) else y).backward(g)
                g = xi.grad
        x0.backward(g.to(x0.device))
        return loss.detach()
    return step


def _fill_experts(out_grad_sq: dict[str, torch.Tensor], lin: dict[str, nn.Module]) -> dict[str, torch.Tensor]:
    """Every linear of ``lin`` in ``out_grad_sq``: an expert no calibration token was routed to (no gradient)
    gets the mean of its block's other experts of the same kind (an average expert of that layer: not zero,
    which would send it to the lowest width); any other linear without a gradient is an error."""
    missing = [n for n in lin if n not in out_grad_sq]
    for n in missing:
        key = expert_key(n)
        peers = [v for k, v in out_grad_sq.items() if key is not None and expert_key(k) == key]
        if not peers:
            raise QRecoverError(f"linear layer {n} received no gradient in calibration and has no expert peers; "
                                "use more --calib-samples")
        out_grad_sq[n] = torch.stack(peers).mean(0)
    return {n: out_grad_sq[n] for n in lin}


def _gradient_stats(model: nn.Module, windows: torch.Tensor, show_progress: bool, step, group: World) -> dict:
    layers = decoder_layers(model)
    lin = {f"{module_name(model, layers)}.{i}.{n}": m for i, l in enumerate(layers) for n, m in linear_layers(l).items()}
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    sums = OrderedSum(group)  # float64 sums in window order (one process's order on any number of processes)
    hooks = []

    def add(key: str, value: torch.Tensor) -> None:
        sums.add(key, value.detach().double())

    def grad_sq_hook(key: str):
        def fwd(_m, _inp, out):
            if out.requires_grad:  # (the layer-wise pass's first, gradient-free forward is skipped)
                out.register_hook(lambda g: add(key, g.reshape(-1, g.shape[-1]).square().sum(0)))
        return fwd

    for name, m in lin.items():
        hooks.append(m.register_forward_hook(grad_sq_hook(name)))

    def head_hook(_m, inp, out):
        x = inp[0].detach().reshape(-1, inp[0].shape[-1]).double()
        add("head.hessian", x.T @ x)
        out.register_hook(lambda g: add("head.out_grad_sq", g.reshape(-1, g.shape[-1]).square().sum(0)))

    def emb_hook(_m, inp, out):
        ids = inp[0].reshape(-1)

        def on_grad(g):  # accumulated in place: one (vocab, hidden) float64 buffer, not one per window
            sums.index_add("emb_fisher", tuple(emb.weight.shape), ids, g.reshape(-1, g.shape[-1]).double().square())
        if not out.requires_grad:  # the embedding's output is where backward must reach: it starts the graph
            out.requires_grad_(True)  # (no weight needs a gradient: a tied head's weight gradient is not computed)
        out.register_hook(on_grad)
        return out

    hooks += [head.register_forward_hook(head_hook), emb.register_forward_hook(emb_hook)]
    params = [p for p in model.parameters()]
    was = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    try:
        with progress() as bar:
            mine = windows[group.span(len(windows))]
            task = bar.add_task("calibrate: loss gradients", total=len(mine), visible=show_progress)
            for w in mine:
                ids = w.unsqueeze(0)
                if step is not None:
                    loss = step(ids)
                else:
                    logits = model(input_ids=ids, use_cache=False).logits
                    # sum, not mean: each token's own gradient is what the Fisher estimate needs
                    loss = nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
                    loss.backward()
                sums.add("loss", torch.tensor(float(loss.detach()), dtype=torch.float64))
                bar.advance(task)
    finally:
        for h in hooks:
            h.remove()
        for p, r in zip(params, was):
            p.requires_grad_(r)
            p.grad = None
    acc = sums.reduce()
    n_tok = windows.numel()  # every position's output receives a gradient
    n_pred = len(windows) * (windows.shape[1] - 1)
    return {
        "out_grad_sq": _fill_experts({k: (acc[k] / n_tok).float().cpu() for k in lin if k in acc}, lin),
        "head": {"out_grad_sq": (acc["head.out_grad_sq"] / n_tok).float().cpu(), "hessian": (acc["head.hessian"] / n_tok).float().cpu()},
        "emb_fisher": (acc["emb_fisher"] / n_tok).float().cpu(),
        "loss": float(acc["loss"]) / n_pred,
        "tokens": int(windows.numel()),
    }



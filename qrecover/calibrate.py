"""Calibration: the statistics quantizers and the sensitivity estimate need, from real text.

Two passes over the calibration windows:

1. :func:`gradient_stats`: forward + backward of the unquantized model, one window at a time,
   accumulating small per-layer vectors only: output-gradient second moments of every linear layer,
   the logit-gradient moments and final-hidden-state second moments of the output matrix, and the
   embedding's per-(token, dim) Fisher. Memory: the model, its gradients' activations for one window.
2. :func:`sequential`: layer by layer, the decoder layer's inputs are replayed through it with hooks
   that accumulate each linear layer's ``E[x x^T]``; the callback quantizes the layer's candidates,
   then the statistics are dropped and the layer's outputs become the next layer's inputs. Only one
   decoder layer's statistics exist at a time, so memory stays near the model's own size.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
from rich.progress import Progress

from .models import decoder_layers, linear_layers, module_name


class _Stop(Exception):
    pass


def progress() -> Progress:
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        TimeRemainingColumn(), transient=False, console=Console(stderr=True),  # stderr: `--json` stdout stays clean
    )


def gradient_stats(model: nn.Module, windows: torch.Tensor, show_progress: bool = True) -> dict:
    """Backward passes over ``windows (n, seq_len)``; see the module docstring. Returns a dict:

    ``out_grad_sq``: ``{linear name: (out,)}`` for every linear in the decoder layers;
    ``head``: ``{"out_grad_sq": (vocab,), "hessian": (hidden, hidden)}`` of the output matrix;
    ``emb_fisher``: ``(vocab, hidden)``; ``loss``: mean next-token loss; ``tokens``: count.
    """
    layers = decoder_layers(model)
    lin = {f"{module_name(model, layers)}.{i}.{n}": m for i, l in enumerate(layers) for n, m in linear_layers(l).items()}
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    acc: dict[str, torch.Tensor] = {}
    ids_now: list[torch.Tensor] = []
    hooks = []

    def add(key: str, value: torch.Tensor) -> None:
        value = value.detach().double()
        acc[key] = acc[key] + value if key in acc else value

    def grad_sq_hook(key: str):
        def fwd(_m, _inp, out):
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

        def on_grad(g):
            fisher = torch.zeros(emb.weight.shape, dtype=torch.float64)
            fisher.index_add_(0, ids, g.reshape(-1, g.shape[-1]).double().square())
            add("emb_fisher", fisher)
        out.register_hook(on_grad)

    hooks += [head.register_forward_hook(head_hook), emb.register_forward_hook(emb_hook)]
    total_loss, n_tok = 0.0, 0
    params = [p for p in model.parameters()]
    was = [p.requires_grad for p in params]
    for p in params:
        p.requires_grad_(False)
    emb.weight.requires_grad_(True)  # something must need grad so backward reaches every layer
    try:
        with progress() as bar:
            task = bar.add_task("calibrate: loss gradients", total=len(windows), visible=show_progress)
            for w in windows:
                ids = w.unsqueeze(0)
                logits = model(input_ids=ids, use_cache=False).logits
                # sum, not mean: each token's own gradient is what the Fisher estimate needs
                loss = nn.functional.cross_entropy(logits[0, :-1].float(), ids[0, 1:], reduction="sum")
                loss.backward()
                total_loss += float(loss.detach())
                n_tok += ids.shape[1]  # every position's output receives a gradient
                bar.advance(task)
    finally:
        for h in hooks:
            h.remove()
        for p, r in zip(params, was):
            p.requires_grad_(r)
            p.grad = None
    n_pred = len(windows) * (windows.shape[1] - 1)
    return {
        "out_grad_sq": {k: (acc[k] / n_tok).float() for k in lin},
        "head": {"out_grad_sq": (acc["head.out_grad_sq"] / n_tok).float(), "hessian": (acc["head.hessian"] / n_tok).float()},
        "emb_fisher": (acc["emb_fisher"] / n_tok).float(),
        "loss": total_loss / n_pred,
        "tokens": int(windows.numel()),
    }


def sequential(
    model: nn.Module,
    windows: torch.Tensor,
    on_layer: Callable[[int, nn.Module, dict[str, dict[str, torch.Tensor]]], None],
    show_progress: bool = True,
) -> None:
    """Replay calibration inputs layer by layer; call ``on_layer(index, layer, stats)`` for each.

    ``stats`` maps each linear layer's full name to ``{"hessian": (in, in), "input_sq": (in,)}``,
    both means over calibration tokens. Layer outputs are computed with the unquantized weights.
    """
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    captured: list[tuple[tuple, dict]] = []

    def catch(_m, args, kwargs):
        captured.append((args, kwargs))
        raise _Stop

    h = layers[0].register_forward_pre_hook(catch, with_kwargs=True)
    try:
        with torch.no_grad():
            for w in windows:
                try:
                    model(input_ids=w.unsqueeze(0), use_cache=False)
                except _Stop:
                    pass
    finally:
        h.remove()
    hidden = [a[0] if a else kw.pop("hidden_states") for a, kw in captured]
    kwargs = [kw for _, kw in captured]

    with progress() as bar, torch.no_grad():
        task = bar.add_task("calibrate + quantize: decoder layers", total=len(layers), visible=show_progress)
        for i, layer in enumerate(layers):
            lins = linear_layers(layer, prefix=f"{prefix}.{i}.")
            sums: dict[str, torch.Tensor] = {}
            counts: dict[str, int] = {}

            def hook(name: str):
                def fwd(_m, inp, _out):
                    x = inp[0].reshape(-1, inp[0].shape[-1]).double()
                    sums[name] = sums[name] + x.T @ x if name in sums else x.T @ x
                    counts[name] = counts.get(name, 0) + x.shape[0]
                return fwd

            hooks = [m.register_forward_hook(hook(n)) for n, m in lins.items()]
            outs = []
            try:
                for x, kw in zip(hidden, kwargs):
                    y = layer(x, **kw)
                    outs.append(y[0] if isinstance(y, tuple) else y)
            finally:
                for hk in hooks:
                    hk.remove()
            stats = {}
            for n in lins:
                hess = (sums[n] / counts[n]).float()
                stats[n] = {"hessian": hess, "input_sq": hess.diagonal().clone()}
            on_layer(i, layer, stats)
            del stats, sums
            hidden = outs
            bar.advance(task)

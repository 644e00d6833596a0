"""Block-wise reconstruction before ``tune``'s end-to-end pass (EfficientQAT's Block-AP, on the continuous parameters).

Decoder block by decoder block, one block's trainable tensors at a time (the fp32 masters of its tables and scales,
and its norm weights: whatever :func:`qrecover.recovery.tune.make_tunable` made trainable), AdamW minimises the mean
squared error between the quantized block's output and the unquantized block's:

- the quantized block reads the outputs of the quantized blocks before it, already reconstructed, so each block can
  also absorb the error that reaches it (the unquantized block reads the unquantized model's own hidden states);
- the windows are sequences of the tuning data (the same mix or prepared shards as the end-to-end pass);
- ``block_epochs`` passes over them, one window per step, at ``block_lr`` under the end-to-end pass's schedule
  (:func:`.schedule.lr_scheduler`: warm-up, then cosine or WSD) restarted for each block, gradient clipping as configured.

The loss is per block: a dense signal (every hidden unit of every token) where the end-to-end pass has one
distribution per token, and one block's backward at a time where the end-to-end pass needs the whole model's.
Its cost is about ``block_epochs`` + 2 forwards and ``epochs`` backwards of the model on the windows, with no output head.

Why not a library: llm-compressor and EfficientQAT reconstruct blocks for their own parameter types (weights,
integer scales); here the parameters are the packed layers' masters, whose dequantize the model already runs.

On several processes every process reconstructs the same windows in the same order (deterministic on the CPU); the
end-to-end pass's DDP wrapper then broadcasts rank 0's parameters, so the processes start it identically anyway.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..calibrate import capture_inputs, forward_layer
from ..models import decoder_layers
from ..progress import progress
from .config import TuneConfig
from .schedule import lr_scheduler


def _mse(layer: nn.Module, x: torch.Tensor, kw: dict, target: torch.Tensor) -> torch.Tensor:
    y = layer(x, **kw)
    y = y[0] if isinstance(y, tuple) else y
    return F.mse_loss(y.float(), target.float())


@torch.no_grad()
def _relative_error(outs: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    """sum ||y - t||^2 / sum ||t||^2 over every window."""
    num = sum(float((y.float() - t.float()).pow(2).sum()) for y, t in zip(outs, targets))
    den = sum(float(t.float().pow(2).sum()) for t in targets)
    return num / max(den, 1e-30)


def reconstruct_blocks(student: nn.Module, teacher: nn.Module, windows: torch.Tensor, cfg: TuneConfig,
                       device: torch.device | str, show_progress: bool = True) -> dict[str, Any]:
    """Train each decoder block of ``student`` (its parameters that require a gradient) to reproduce ``teacher``'s
    block outputs on ``windows`` (``(n, seq)`` token ids); see the module docstring. Returns the record: per block the
    relative output error ``sum ||y_q - y||^2 / sum ||y||^2`` before and after, steps and seconds."""
    t0, epochs, lr = time.time(), cfg.block_epochs, cfg.block_lr
    s_layers, t_layers = decoder_layers(student), decoder_layers(teacher)
    if len(s_layers) != len(t_layers):
        raise ValueError(f"student has {len(s_layers)} decoder layers, teacher {len(t_layers)}")
    was_training = student.training
    student.eval()
    xs, kws = capture_inputs(student, windows, device)
    xt, kwt = capture_inputs(teacher, windows, device)
    per_block, steps_total = [], 0
    try:
        with progress() as bar:
            task = bar.add_task("tune: block-wise reconstruction", total=len(s_layers) * epochs * len(windows),
                                visible=show_progress)
            for i, (ls, lt) in enumerate(zip(s_layers, t_layers)):
                yt = forward_layer(lt, xt, kwt)
                before = _relative_error(forward_layer(ls, xs, kws), yt)
                params = [p for p in ls.parameters() if p.requires_grad]
                steps = epochs * len(windows) if params else 0
                if params:
                    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
                    schedule = lr_scheduler(opt, cfg, steps)
                    order = torch.Generator().manual_seed(i)
                    for _ in range(epochs):
                        for j in torch.randperm(len(windows), generator=order).tolist():
                            _mse(ls, xs[j], kws[j], yt[j]).backward()
                            if cfg.max_grad_norm > 0:
                                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
                            opt.step()
                            schedule.step()
                            opt.zero_grad(set_to_none=True)
                            bar.advance(task)
                    del opt, schedule
                else:
                    bar.advance(task, epochs * len(windows))
                xs = forward_layer(ls, xs, kws)  # the next block's inputs: this block as reconstructed
                per_block.append({"layer": i, "before": before, "after": _relative_error(xs, yt), "steps": steps})
                xt = yt
                steps_total += steps
    finally:
        student.train(was_training)
    return {"windows": int(windows.shape[0]), "tokens": int(windows.numel()), "epochs": epochs, "lr": lr,
            "steps": steps_total, "seconds": round(time.time() - t0, 1),
            "mean_error_before": sum(b["before"] for b in per_block) / max(len(per_block), 1),
            "mean_error_after": sum(b["after"] for b in per_block) / max(len(per_block), 1),
            "per_block": per_block}

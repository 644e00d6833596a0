"""The learning-rate schedule of a recovery run: warm-up + cosine (default), or warm-up-stable-decay (WSD).

Cosine decays over the whole run, so a longer run spends most of its steps below the peak lr. WSD (Hu et al.
2024, MiniCPM; Hägele et al. 2024) holds the peak lr after warm-up and decays only over the last
``decay_fraction`` of the steps, with the ``1-sqrt`` shape Hägele et al. found best; both end at
``min_lr_ratio x lr``. Both are transformers' own schedules (``LambdaLR``, resumable through ``state_dict``).
"""

from __future__ import annotations

import torch
from transformers import get_cosine_with_min_lr_schedule_with_warmup, get_wsd_schedule

from .config import RecoverConfig


def lr_scheduler(optimizer: torch.optim.Optimizer, cfg: RecoverConfig, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """The schedule ``cfg.schedule`` over ``steps`` optimizer steps (stepped once per optimizer step)."""
    warmup = round(cfg.warmup * steps)
    if cfg.schedule == "wsd":
        decay = max(1, round(cfg.decay_fraction * steps))
        warmup = min(warmup, steps - decay)
        return get_wsd_schedule(optimizer, num_warmup_steps=warmup, num_decay_steps=decay,
                                num_stable_steps=steps - warmup - decay, decay_type="1-sqrt",
                                min_lr_ratio=cfg.min_lr_ratio)
    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, num_warmup_steps=warmup, num_training_steps=steps,
                                                       min_lr_rate=cfg.min_lr_ratio)


__all__ = ["lr_scheduler"]

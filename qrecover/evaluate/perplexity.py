"""Held-out perplexity of a model under one fixed protocol (:data:`PPL_PROTOCOL`): ``qrecover ppl``, the
``perplexity`` task of ``qrecover eval``, and the measurements of tune and export."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn

from ..data.corpus import token_windows
from ..progress import progress

PPL_PROTOCOL = ("held-out split 'eval' of the text source (documents never used for calibration or training), "
                "documents in hash order joined by EOS, the first windows*seq_len tokens cut into non-overlapping "
                "windows, each scored independently (no context carried over); ppl = exp(mean NLL of every predicted token)")


@torch.no_grad()
def perplexity(model: nn.Module, tokenizer: Any, source: str = "python-docs", windows: int = 32, seq_len: int = 512,
               show_progress: bool = True) -> dict[str, Any]:
    """Held-out perplexity under the fixed protocol :data:`PPL_PROTOCOL`."""
    data = token_windows(tokenizer, source, "eval", windows, seq_len)
    nll, count = 0.0, 0
    with progress() as bar:
        task = bar.add_task("perplexity", total=windows, visible=show_progress)
        for w in data:
            logits = model(input_ids=w.unsqueeze(0), use_cache=False).logits[0, :-1].float()
            nll += float(nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            count += seq_len - 1
            bar.advance(task)
    return {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count, "source": source, "split": "eval",
            "windows": windows, "seq_len": seq_len, "protocol": PPL_PROTOCOL}


__all__ = ["PPL_PROTOCOL", "perplexity"]

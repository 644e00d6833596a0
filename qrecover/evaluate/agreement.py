"""Agreement with the unquantized model: token-level KL divergence and multiple-choice answer flips.

Both are lower-is-better and exactly 0 for the unquantized model itself.

* **KL**: mean over every predicted token of ``KL(P_ref || P)`` in nats, where ``P_ref`` is the
  unquantized (reference) model's next-token distribution and ``P`` the evaluated model's, on the same
  held-out windows as perplexity (positions ``0 .. seq_len-2`` of each window, the ones perplexity scores).
  Its standard error is the spread of the per-window means (windows are independent text).
* **Answer flips**: the fraction of multiple-choice items whose argmax answer differs from the reference
  model's, whether or not either is correct (Dutta et al. 2024, "Accuracy is not all you need"). Standard
  error ``sqrt(p (1 - p) / (n - 1))``, as lm-eval's for a mean of 0/1 scores.

The reference model's answers are cached in ``cache_dir()/eval/answers`` under a key made of its weights
hash and every setting of the task, so each checkpoint of one model reuses them.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..errors import QRecoverError
from ..io_utils import cache_dir, write_text_atomic


def token_kl(ref_logits: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """``KL(softmax(ref_logits) || softmax(logits))`` per position, in nats.

    ref_logits, logits: ``(..., V)`` -> ``(...)``; computed in float32 (float64 if either input is).
    """
    if ref_logits.shape != logits.shape:
        raise QRecoverError(f"KL needs logits of one shape: reference {tuple(ref_logits.shape)} vs evaluated "
                            f"{tuple(logits.shape)}; the two models must share a tokenizer and vocabulary")
    dtype = torch.float64 if torch.float64 in (ref_logits.dtype, logits.dtype) else torch.float32
    lp_ref = torch.log_softmax(ref_logits.to(dtype), dim=-1)
    lp = torch.log_softmax(logits.to(dtype), dim=-1)
    return (lp_ref.exp() * (lp_ref - lp)).sum(-1)


class KLProbe(nn.Module):
    """Wraps the evaluated model: every forward also runs ``reference`` on the same input and accumulates
    per-token KL of the predicted positions (all but the last of each row).

    Pass it where a model is expected (e.g. to :func:`qrecover.evaluate.perplexity.perplexity`): perplexity and KL then
    come from one forward pass of the evaluated model, over exactly the windows perplexity scores.
    """

    def __init__(self, model: nn.Module, reference: nn.Module) -> None:
        super().__init__()
        self.model, self.reference = model, reference
        self.window_means: list[float] = []
        self.tokens = 0

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, **kwargs: Any) -> Any:
        out = self.model(input_ids=input_ids, **kwargs)
        ref = self.reference(input_ids=input_ids, **kwargs).logits
        kl = token_kl(ref[:, :-1], out.logits[:, :-1])  # (B, T-1)
        self.window_means += kl.mean(-1).tolist()
        self.tokens += kl.numel()
        return out

    def result(self) -> dict[str, Any]:
        """``{"kl", "stderr", "windows", "tokens"}``: the mean over tokens (every window has the same length,
        so also the mean of window means) and the standard error across windows."""
        return kl_summary(self.window_means, self.tokens)


def kl_summary(window_means: Sequence[float], tokens: int) -> dict[str, Any]:
    n = len(window_means)
    if n == 0:
        raise QRecoverError("KL over zero windows: pass --windows 1 or more")
    mean = sum(window_means) / n
    se = math.sqrt(sum((m - mean) ** 2 for m in window_means) / (n - 1) / n) if n > 1 else None
    return {"kl": mean, "stderr": se, "windows": n, "tokens": tokens}


def answer_flips(answers: Sequence[int], reference: Sequence[int]) -> dict[str, Any]:
    """Fraction of items answered differently from the reference: ``{"flips", "stderr", "n", "flipped"}``.

    answers, reference: one chosen option index per item, in the same item order.
    """
    if len(answers) != len(reference):
        raise QRecoverError(f"answer flips need one answer per item from both models: {len(answers)} vs "
                            f"{len(reference)} items; the reference ran with different task settings")
    n = len(answers)
    if n == 0:
        raise QRecoverError("answer flips over zero items: raise --limit")
    flipped = sum(int(a != r) for a, r in zip(answers, reference))
    p = flipped / n
    se = math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else None
    return {"flips": p, "stderr": se, "n": n, "flipped": flipped}


# --- the reference model's answers, cached -------------------------------------------------------------


def _answers_file(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_dir() / "eval" / "answers" / f"{digest[:32]}.json"


def load_answers(key: dict[str, Any]) -> list[int] | None:
    """The cached answers for ``key`` (reference weights hash + task settings), or None."""
    path = _answers_file(key)
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None  # a damaged cache entry: recompute and overwrite it
    if data.get("key") != key:
        return None
    return [int(a) for a in data["answers"]]


def store_answers(key: dict[str, Any], answers: Sequence[int]) -> Path:
    """Cache ``answers`` under ``key``, atomically (write a temporary file, then rename)."""
    path = _answers_file(key)
    write_text_atomic(path, json.dumps({"key": key, "answers": [int(a) for a in answers]}))
    return path

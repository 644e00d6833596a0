"""Training objectives for recovery: next-token cross-entropy and distillation from the unquantized model.

Both are means over the predicted positions that carry a label (``labels != -100``, shifted by one):

* ``ce``:  ``-log p_student(x_{t+1} | x_{<=t})``
* ``kd``:  ``KL(p_teacher || p_student)`` of the full next-token distributions at temperature ``T``
  (times ``T^2``, so gradients keep their scale when ``T`` changes; ``T = 1`` is plain KL)
* ``mix``: ``(1 - w) * ce + w * kd``

Shapes: ``logits (batch, seq, vocab)``, ``labels (batch, seq)`` int64 with -100 where there is no loss.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _shift(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions at t for the token at t + 1: ``(n, vocab)`` logits and ``(n,)`` targets, masked rows dropped."""
    logits, targets = logits[:, :-1], labels[:, 1:]
    keep = targets != -100
    return logits[keep], targets[keep]


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    lg, tg = _shift(logits, labels)
    return F.cross_entropy(lg.float(), tg)


def distillation(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    s, _ = _shift(student, labels)
    t, _ = _shift(teacher, labels)
    log_s = F.log_softmax(s.float() / temperature, dim=-1)
    log_t = F.log_softmax(t.float() / temperature, dim=-1)
    return F.kl_div(log_s, log_t, log_target=True, reduction="batchmean") * temperature**2


def loss_fn(objective: str, student: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None = None,
            kd_weight: float = 0.5, temperature: float = 1.0) -> torch.Tensor:
    """The training loss for ``objective`` in ``("ce", "kd", "mix")``."""
    if objective == "ce":
        return cross_entropy(student, labels)
    if teacher is None:
        raise ValueError(f"objective {objective!r} needs the teacher's logits")
    kd = distillation(student, teacher, labels, temperature)
    if objective == "kd":
        return kd
    return (1.0 - kd_weight) * cross_entropy(student, labels) + kd_weight * kd

"""qrecover's chunked distillation loss against Liger Kernel's fused-linear JSD (``beta=0``: forward KL), when installed.

qrecover keeps its own chunked loss (qrecover/recovery/objective.py: ``chunked_loss(fused=True)``), which, like
Liger's ``LigerFusedLinearJSDLoss``, computes one chunk of logits at a time and the hidden states' gradient in the
forward pass, never the full logits. Checks on float64 inputs, against :func:`loss_fn` on full logits (the
reference): that both give the same loss and gradient for ``objective="kd"`` with masked labels, so the two are
interchangeable. Skipped where liger-kernel is not installed (``pip install liger-kernel``; its chunked losses
are plain torch and run on a CPU with ``compiled=False``).
"""

from __future__ import annotations

import pytest
import torch

from qrecover.recovery import objective as O

liger = pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed")


@pytest.mark.parametrize("chunk", [4, 7, 64])
def test_chunked_kd_equals_liger_forward_kl_and_the_full_logits(chunk):
    g = torch.Generator().manual_seed(chunk)
    batch, seq, hidden, vocab = 2, 13, 8, 50
    hs = torch.randn(batch, seq, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    ht = torch.randn(batch, seq, hidden + 3, generator=g, dtype=torch.float64)
    ws = 2 * torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    wt = 2 * torch.randn(vocab, hidden + 3, generator=g, dtype=torch.float64)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :5] = -100
    labels[1, 9] = -100
    ref = O.loss_fn("kd", hs @ ws.T, labels, ht @ wt.T)
    (g_ref,) = torch.autograd.grad(ref, hs)

    ours = O.chunked_loss("kd", hs, labels, lambda h: h @ ws.T, ht, lambda h: h @ wt.T, chunk=chunk, fused=True)
    (g_ours,) = torch.autograd.grad(ours, hs)
    # Liger: beta=0 is KL(teacher || student); no hard loss; ignore_index masks the prompt; flat (B*(T-1), H) inputs
    loss = liger.LigerFusedLinearJSDLoss(weight_hard_loss=0.0, weight_soft_loss=1.0, beta=0.0, compiled=False,
                                         chunk_size=chunk)
    theirs = loss(hs[:, :-1].reshape(-1, hidden), ws, ht[:, :-1].reshape(-1, hidden + 3), wt, labels[:, 1:].reshape(-1))
    (g_theirs,) = torch.autograd.grad(theirs, hs)

    scale = float(g_ref.abs().max())
    assert abs(float(ours.detach()) - float(ref.detach())) <= 1e-12 * float(ref.detach())
    assert float((g_ours - g_ref).abs().max()) <= 1e-12 * scale
    # Liger accumulates the loss in float32 (its gradient in the inputs' dtype)
    assert abs(float(theirs.detach()) - float(ref.detach())) <= 1e-6 * float(ref.detach())
    assert float((g_theirs - g_ref).abs().max()) <= 1e-12 * scale

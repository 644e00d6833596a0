"""Estimated damage of quantizing one layer: the predicted increase of the mean next-token loss.

Second-order (Fisher) estimate, per layer, from calibration statistics. For a linear layer
``y = W x`` with weight error ``dW`` and loss gradients ``delta = dL/dy`` (per token):

    dL ~ 1/2 * E_t[ sum_i delta_ti^2 (dW x_t)_i^2 ] ~ 1/2 * sum_i g_i * (dW H dW^T)_ii

with ``g = E[delta**2]`` ``(out,)`` (output-gradient second moments, from a backward pass of the
unquantized model) and ``H = E[x x^T]`` ``(in, in)`` (input second moments, from the layer-sequential
pass). ``H`` captures which input directions carry signal (the layer's own output error); ``g`` says
how much an error in each output moves the final loss, which makes damages comparable across layers
and so usable by the allocator. Why not simply the layer's weighted output error: it ignores that
layers differ in how much their errors reach the logits, which is what the bit allocation must trade.

An embedding row ``E[v]`` perturbs the hidden state of every token ``v``:
``dL ~ 1/2 * sum_{v,j} F[v, j] * dE[v, j]^2`` with ``F[v, j]`` the mean over tokens of
``delta_tj^2 * [token_t == v]`` (``delta`` the gradient at the embedding output). The pipeline passes
``F[v, j] = E_t[delta_tj^2] / vocab``, every row alike: calibration text sees too few of the vocabulary's
tokens to estimate their frequencies, and an estimate fitted to them under-predicts held-out damage. A tied output
matrix adds the linear-layer term with ``x`` the final hidden state and ``delta`` the logit gradient.
"""

from __future__ import annotations

import torch

METHOD = "fisher-kfac-diag: 1/2 sum_i g_i (dW H dW^T)_ii, g=E[(dL/dy)^2], H=E[x x^T]"


def linear_damage(dw: torch.Tensor, hessian: torch.Tensor, out_grad_sq: torch.Tensor) -> float:
    """``dw (out, in)``, ``hessian (in, in)``, ``out_grad_sq (out,)`` -> predicted loss increase."""
    dw = dw.float()
    per_row = ((dw @ hessian.float()) * dw).sum(dim=1)  # fp32 matmul; sums below in fp64
    return float(0.5 * (out_grad_sq.double() * per_row.double()).sum())


def lookup_damage(dw: torch.Tensor, fisher: torch.Tensor) -> float:
    """``dw (vocab, dim)``, ``fisher (vocab, dim)`` -> predicted loss increase of an embedding lookup."""
    return float(0.5 * (fisher.double() * dw.double().square()).sum())

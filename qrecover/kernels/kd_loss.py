"""Triton kernel for the distillation loss's vocabulary-wide work: from the two heads' raw logits, each row's
``T^2 KL(softmax(t / T) || softmax(s / T))`` and its gradient ``T (softmax(s / T) - softmax(t / T))`` in two passes.

Why a kernel of our own: the recovery step's KD loss (:func:`qrecover.recovery.objective._loss_and_grad`) makes
about ten passes over each chunk's ``(rows, vocab)`` logits in torch (casts to fp32, two log-softmaxes, an exp, a
subtraction, a dot product, an exp and a subtraction in place, a cast back): about 100 bytes moved per logit. On an
H100 that was ~40 ms of a 199 ms step (Llama-3.2-1B geometry, 4 x 2048 tokens, 128k vocabulary; docs/training-speed.md).
Liger Kernel's KL/JSD kernels take log-probabilities, so the log-softmax passes would stay; its fused linear JSD
runs them in torch per chunk as well. This kernel reads the two logit rows twice (online max and sum of exponentials,
then the loss and the gradient) and writes the gradient once, in the logits' dtype: ~10 bytes per logit for bf16.

One program per row; fp32 arithmetic whatever the logits' dtype (as the torch path's upcast). Checked against a
float64 reference under triton's interpreter on CPU (``tests/test_kd_kernel.py``); used on CUDA when triton is
installed (:func:`usable`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: vocabulary entries per step of a row's loop: 8 per thread of 8 warps (sm_90: 64 registers under triton 3.6, 73-76 under 3.9, no spill: 3-4
#: programs per SM; 4096 took 187 registers, one program per SM)
BLOCK = 2048


@triton.jit
def _kd_rows(s_ptr, t_ptr, g_ptr, loss_ptr, n_cols, stride_s, stride_t, stride_g, inv_temp, grad_scale,
             BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    cols = tl.arange(0, BLOCK)
    m_s = tl.full((BLOCK,), float("-inf"), tl.float32)
    m_t = tl.full((BLOCK,), float("-inf"), tl.float32)
    d_s = tl.zeros((BLOCK,), tl.float32)
    d_t = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n_cols, BLOCK):  # pass 1: per-lane running max and sum of exponentials
        mask = start + cols < n_cols
        s = tl.load(s_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        t = tl.load(t_row + start + cols, mask=mask, other=float("-inf")).to(tl.float32) * inv_temp
        new_s = tl.maximum(m_s, s)
        new_t = tl.maximum(m_t, t)
        d_s = d_s * tl.exp(tl.where(new_s == float("-inf"), 0.0, m_s - new_s)) + tl.where(mask, tl.exp(s - new_s), 0.0)
        d_t = d_t * tl.exp(tl.where(new_t == float("-inf"), 0.0, m_t - new_t)) + tl.where(mask, tl.exp(t - new_t), 0.0)
        m_s = new_s
        m_t = new_t
    max_s = tl.max(m_s, axis=0)
    max_t = tl.max(m_t, axis=0)
    lse_s = max_s + tl.log(tl.sum(d_s * tl.exp(tl.where(m_s == float("-inf"), float("-inf"), m_s - max_s)), axis=0))
    lse_t = max_t + tl.log(tl.sum(d_t * tl.exp(tl.where(m_t == float("-inf"), float("-inf"), m_t - max_t)), axis=0))
    acc = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n_cols, BLOCK):  # pass 2: sum p_t (log p_t - log p_s), and the gradient
        mask = start + cols < n_cols
        s = tl.load(s_row + start + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp
        t = tl.load(t_row + start + cols, mask=mask, other=0.0).to(tl.float32) * inv_temp
        log_s = s - lse_s
        log_t = t - lse_t
        p_t = tl.exp(log_t)
        acc += tl.where(mask, p_t * (log_t - log_s), 0.0)
        g = (tl.exp(log_s) - p_t) * grad_scale
        tl.store(g_ptr + row * stride_g + start + cols, g.to(g_ptr.dtype.element_ty), mask=mask)
    tl.store(loss_ptr + row, tl.sum(acc, axis=0))


def usable(ls: torch.Tensor, lt: torch.Tensor | None) -> bool:
    """Whether :func:`kd_loss_and_grad` serves these logits: both on one CUDA device, 2-D, unit column stride
    (the interpreter's CPU run is for tests: they call the kernel directly)."""
    return (lt is not None and ls.is_cuda and lt.device == ls.device and ls.dim() == 2 and lt.shape == ls.shape
            and ls.stride(-1) == 1 and lt.stride(-1) == 1)


def kd_loss_and_grad(ls: torch.Tensor, lt: torch.Tensor, temperature: float = 1.0, weight: float = 1.0,
                     grad_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weight T^2 sum_rows KL(softmax(lt / T) || softmax(ls / T)), weight T (softmax(ls / T) - softmax(lt / T)))``
    for logits ``(rows, vocab)``: the loss a float32 scalar, the gradient in ``grad_dtype`` (default ``ls.dtype``)."""
    rows, n = ls.shape
    grad = torch.empty((rows, n), device=ls.device, dtype=grad_dtype or ls.dtype)
    per_row = torch.empty(rows, device=ls.device, dtype=torch.float32)
    if rows:
        block = min(BLOCK, triton.next_power_of_2(n))
        _kd_rows[(rows,)](ls, lt, grad, per_row, n, ls.stride(0), lt.stride(0), grad.stride(0), 1.0 / temperature,
                          weight * temperature, BLOCK=block, num_warps=max(1, min(8, block // 256)))
    return per_row.sum() * (weight * temperature**2), grad


__all__ = ["kd_loss_and_grad", "usable"]

"""The distillation loss kernel (qrecover.kernels.kd_loss) against a float64 reference and against the torch path it
replaces on CUDA (qrecover.recovery.objective._loss_and_grad); under triton's interpreter without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import CUDA, DEV, interpreted_kernels

from qrecover import kernels


@pytest.fixture(scope="module")
def kd():
    yield from interpreted_kernels(("qrecover.kernels.kd_loss",), "qrecover.kernels.kd_loss")


def _ref64(ls, lt, temperature):
    s, t = ls.double() / temperature, lt.double() / temperature
    log_s, log_t = F.log_softmax(s, -1), F.log_softmax(t, -1)
    loss = (log_t.exp() * (log_t - log_s)).sum() * temperature**2
    return loss, temperature * (log_s.exp() - log_t.exp())


@pytest.mark.parametrize("vocab,temperature", [(100, 1.0), (4096, 1.0), (5000, 2.0), (9000, 0.7)])
def test_kd_kernel_matches_float64(kd, vocab, temperature):
    """Vocabularies below, at and past one block (and not a power of two), temperatures: loss and gradient."""
    g = torch.Generator().manual_seed(vocab)
    ls = (torch.randn(5, vocab, generator=g) * 3).to(DEV)
    lt = (ls.cpu() + torch.randn(5, vocab, generator=g)).to(DEV)
    loss, grad = kd.kd_loss_and_grad(ls, lt, temperature)
    ref_loss, ref_grad = _ref64(ls.cpu(), lt.cpu(), temperature)
    assert abs(float(loss) - float(ref_loss)) <= 1e-4 * abs(float(ref_loss)) + 1e-6
    assert grad.dtype == ls.dtype and grad.shape == ls.shape
    assert float((grad.cpu().double() - ref_grad).norm() / ref_grad.norm()) < 1e-5
    assert torch.allclose(grad.cpu().double().sum(-1), torch.zeros(5, dtype=torch.float64), atol=1e-5)  # rows sum to 0


def test_kd_kernel_reads_bf16_logits_and_writes_a_bf16_gradient(kd):
    g = torch.Generator().manual_seed(0)
    ls = (torch.randn(3, 3000, generator=g) * 4).to(DEV, torch.bfloat16)
    lt = (torch.randn(3, 3000, generator=g) * 4).to(DEV, torch.bfloat16)
    loss, grad = kd.kd_loss_and_grad(ls, lt, 1.0, weight=0.5)
    ref_loss, ref_grad = _ref64(ls.cpu().float(), lt.cpu().float(), 1.0)  # the bf16 values, exactly
    assert abs(float(loss) - 0.5 * float(ref_loss)) <= 1e-4 * abs(float(ref_loss))
    assert grad.dtype == torch.bfloat16
    assert float((grad.cpu().double() - 0.5 * ref_grad).norm() / (0.5 * ref_grad).norm()) < 1e-2  # bf16 rounding


def test_kd_kernel_matches_the_torch_loss_it_replaces(kd, monkeypatch):
    """objective._loss_and_grad with the kernel (forced on CPU here) and without: the same loss and gradient."""
    from qrecover.recovery import objective

    g = torch.Generator().manual_seed(1)
    ls = torch.randn(7, 777, generator=g).to(DEV)
    lt = torch.randn(7, 777, generator=g).to(DEV)
    targets = torch.zeros(7, dtype=torch.long, device=DEV)
    monkeypatch.setattr(objective, "_kd_kernel", lambda a, b: False)
    loss_t, grad_t = objective._loss_and_grad(ls, lt, targets, "kd", 0.5, 1.5)
    monkeypatch.setattr(objective, "_kd_kernel", lambda a, b: True)
    monkeypatch.setitem(__import__("sys").modules, "qrecover.kernels.kd_loss", kd)
    loss_k, grad_k = objective._loss_and_grad(ls, lt, targets, "kd", 0.5, 1.5)
    assert abs(float(loss_k) - float(loss_t)) <= 1e-5 * abs(float(loss_t))
    assert float((grad_k.double() - grad_t.double()).norm() / grad_t.double().norm()) < 1e-5


def test_kd_kernel_is_used_only_on_cuda_with_kernels_on(monkeypatch):
    from qrecover.recovery import objective

    ls = torch.randn(2, 8)
    assert not objective._kd_kernel(ls, ls)  # CPU tensors: torch's path
    if CUDA:
        x = ls.cuda()
        assert objective._kd_kernel(x, x)
        monkeypatch.setenv("QRECOVER_KERNELS", "0")
        assert not objective._kd_kernel(x, x)


def test_a_failing_kernel_falls_back_to_torch_once_with_a_warning(kd, monkeypatch):
    """A compile or launch failure on some GPU must not stop a training run: one warning naming the error, torch's loss
    (the same numbers), and no further attempt in the process."""
    from qrecover.recovery import objective

    g = torch.Generator().manual_seed(2)
    ls, lt = torch.randn(4, 300, generator=g).to(DEV), torch.randn(4, 300, generator=g).to(DEV)
    targets = torch.zeros(4, dtype=torch.long, device=DEV)
    monkeypatch.setattr(objective, "_kd_kernel", lambda a, b: False)
    want, want_grad = objective._loss_and_grad(ls, lt, targets, "kd", 0.5, 1.0)
    monkeypatch.undo()
    calls = []

    def broken(*a, **k):
        calls.append(1)
        raise RuntimeError("PTX JIT compilation failed")

    monkeypatch.setattr(kd, "kd_loss_and_grad", broken)
    monkeypatch.setitem(__import__("sys").modules, "qrecover.kernels.kd_loss", kd)
    monkeypatch.setattr(objective, "_KD_KERNEL_FAILED", [])
    monkeypatch.setattr(kernels, "triton_available", lambda: True)
    monkeypatch.setattr(kd, "usable", lambda a, b: True)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # reach the kernel branch on the CPU
        with pytest.warns(UserWarning, match="PTX JIT compilation failed"):
            got, got_grad = objective._loss_and_grad(ls, lt, targets, "kd", 0.5, 1.0)
        assert not objective._kd_kernel(ls, lt)  # not tried again in this process
    assert float(got) == float(want) and torch.equal(got_grad, want_grad) and len(calls) == 1

"""Training objectives for recovery: next-token cross-entropy and distillation from the unquantized model.

Both are means over the predicted positions that carry a label (``labels != -100``, shifted by one):

* ``ce``:  ``-log p_student(x_{t+1} | x_{<=t})``
* ``kd``:  ``KL(p_teacher || p_student)`` of the full next-token distributions at temperature ``T``
  (times ``T^2``, so gradients keep their scale when ``T`` changes; ``T = 1`` is plain KL)
* ``mix``: ``(1 - w) * ce + w * kd``

Shapes: ``logits (batch, seq, vocab)``, ``labels (batch, seq)`` int64 with -100 where there is no loss.

Chunked (:func:`chunked_loss`, what :func:`step_loss` uses when ``cfg.loss_chunk > 0``): the same means computed
from the models' final hidden states ``(batch, seq, hidden)`` and their output heads, ``chunk`` positions at a
time, so that no more than one chunk of vocabulary-sized tensors exists at once (each chunk's gradient computed
in the forward pass for a frozen head, the adapters' case: no recomputation; else its logits recomputed in
backward): at 8 x 2048 tokens and a 128k vocabulary the full logits are 8 GB per
tensor in fp32, a chunk of 1024 positions 0.5 GB. The hidden states come from the model's own forward with
``logits_to_keep`` selecting no position (its head runs on nothing) and a hook on the decoder; the head and the
logit post-processing (Gemma-2/3's ``final_logit_softcapping``) are checked once per model against the model's
own logits on a few tokens, and a model whose logits are something else falls back to the full logits.

Losses are computed in float32, or float64 when the logits are float64 (tests compare against float64 references).
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..errors import QRecoverError
from ..models import decoder_layers
from .graphs import graphed

#: positions of the model's own forward used to check the head and post-processing (see :func:`output_head`)
CHECK_POSITIONS = 8

Head = Callable[[torch.Tensor], torch.Tensor]  # hidden (n, hidden) -> logits (n, vocab), post-processing included


def _wide(x: torch.Tensor) -> torch.Tensor:
    """``x`` in float32, or float64 if it already is (bf16/fp16 logits are upcast, as the loss always was)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def _shift(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Predictions at t for the token at t + 1: ``(n, vocab)`` logits, ``(n,)`` targets and the ``(n,)`` mask of the
    rows that carry a label. The masked rows are kept, not dropped: boolean indexing has a data-dependent shape, and
    so would read the mask back from the device (a host synchronisation) at every step."""
    logits, targets = logits[:, :-1], labels[:, 1:]
    return logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), (targets != -100).reshape(-1)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    lg, tg, _ = _shift(logits, labels)
    return F.cross_entropy(_wide(lg), tg, ignore_index=-100)  # the mean over labelled rows (NaN if none)


def distillation(student: torch.Tensor, teacher: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    s, _, keep = _shift(student, labels)
    t, _, _ = _shift(teacher, labels)
    log_s = F.log_softmax(_wide(s) / temperature, dim=-1)
    log_t = F.log_softmax(_wide(t) / temperature, dim=-1)
    kl = F.kl_div(log_s, log_t, log_target=True, reduction="none").sum(-1)
    # the mean over labelled rows (NaN if none), an unlabelled row's value not read (where, not a product: it may be nan)
    return torch.where(keep, kl, 0.0).sum() / keep.sum() * temperature**2


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


# --- chunked: one chunk of vocabulary-sized tensors at a time ------------------------------------------------

def _chunk_sum(hs: torch.Tensor, ht: torch.Tensor | None, targets: torch.Tensor, student_head: Head,
               teacher_head: Head | None, objective: str, kd_weight: float, temperature: float) -> torch.Tensor:
    """The loss of one chunk of ``n`` positions, summed (not averaged): ``hs (n, hidden)`` the student's hidden
    states, ``ht (n, hidden_t)`` the teacher's (on its own device), ``targets (n,)``."""
    ls = _wide(student_head(hs))
    total = ls.new_zeros(())
    if objective != "kd":
        ce = F.cross_entropy(ls, targets, reduction="sum")
        total = total + (ce if objective == "ce" else (1.0 - kd_weight) * ce)
    if objective != "ce":
        with torch.no_grad():
            lt = _wide(teacher_head(ht)).to(ls.device)
        log_s = F.log_softmax(ls / temperature, dim=-1)
        log_t = F.log_softmax(lt / temperature, dim=-1)
        kd = F.kl_div(log_s, log_t, log_target=True, reduction="sum") * temperature**2
        total = total + (kd if objective == "kd" else kd_weight * kd)
    return total


#: why the distillation loss kernel failed in this process, if it did (then :func:`_kd_kernel` says no from there on)
_KD_KERNEL_FAILED: list[str] = []


def _kd_kernel(ls: torch.Tensor, lt: torch.Tensor) -> bool:
    """Whether the distillation loss runs :mod:`qrecover.kernels.kd_loss`'s kernel: CUDA logits, triton installed,
    kernels not turned off (``QRECOVER_KERNELS=0``), and no earlier failure of it in this process."""
    from .. import kernels

    if _KD_KERNEL_FAILED or not (ls.is_cuda and kernels.enabled() and kernels.triton_available()):
        return False
    from ..kernels.kd_loss import usable

    return usable(ls, lt)


def _loss_and_grad(ls: torch.Tensor, lt: torch.Tensor | None, targets: torch.Tensor, objective: str, kd_weight: float,
                   temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_chunk_sum`'s loss for the student's logits ``ls (n, vocab)`` (detached; ``lt`` the teacher's, on the
    same device) and its gradient with respect to ``ls``, written out rather than taken by autograd: cross-entropy
    ``softmax(s) - onehot``, distillation ``T (softmax(s / T) - softmax(t / T))`` for ``T^2 KL(t || s)``. The same
    values in fewer passes over vocabulary-sized tensors (autograd stores and re-reads each intermediate: the
    log-softmax, the KL's terms, their gradients, the casts). Returns ``(summed loss, gradient in float32/64)``;
    plain distillation on CUDA takes :mod:`qrecover.kernels.kd_loss`'s two-pass kernel instead (the gradient then in
    the logits' dtype; ``QRECOVER_KERNELS=0`` keeps torch's)."""
    if objective == "kd" and lt is not None and _kd_kernel(ls, lt):
        from ..kernels.kd_loss import kd_loss_and_grad

        try:
            return kd_loss_and_grad(ls, lt, temperature)
        except Exception as e:  # a compile or launch failure on this GPU: torch's path for the rest of the process
            _KD_KERNEL_FAILED.append(f"{type(e).__name__}: {str(e)[:200]}")
            warnings.warn(f"qrecover: the distillation loss kernel failed ({_KD_KERNEL_FAILED[0]}); the loss runs in "
                          "torch from here on (QRECOVER_KERNELS=0 chooses that from the start)", stacklevel=2)
    s = _wide(ls)
    total = s.new_zeros(())
    grad = None
    if objective != "kd":  # cross-entropy, at temperature 1
        w = 1.0 if objective == "ce" else 1.0 - kd_weight
        rows = torch.arange(s.shape[0], device=s.device)
        grad = F.log_softmax(s, dim=-1)  # one fused kernel, then exponentiated in place
        total = total - w * grad[rows, targets].sum()
        grad.exp_()[rows, targets] -= 1.0
        if w != 1.0:
            grad.mul_(w)
    if objective != "ce":
        w = 1.0 if objective == "kd" else kd_weight
        log_s = F.log_softmax(s / temperature if temperature != 1.0 else s, dim=-1)
        tt = _wide(lt)
        log_t = F.log_softmax(tt / temperature if temperature != 1.0 else tt, dim=-1)
        p_t = log_t.exp()
        # kl_div(log_s, log_t, log_target=True, reduction="sum") = sum p_t (log_t - log_s), with no temporaries
        total = total + w * temperature**2 * torch.vdot(p_t.reshape(-1), log_t.sub_(log_s).reshape(-1))
        g = log_s.exp_().sub_(p_t)  # softmax(s / T) - softmax(t / T), in log_s's buffer
        scale = w * temperature
        if grad is None:
            grad = g.mul_(scale) if scale != 1.0 else g
        else:
            grad.add_(g, alpha=scale)
    return total, grad


class _Fused(torch.autograd.Function):
    """The chunks' summed loss, and its gradient with respect to the student's hidden states computed in the same
    pass (each chunk's logits live only inside its iteration); backward scales that stored ``(n, hidden)`` gradient.
    No recomputation, so the cost is the unchunked loss's; only for heads with no trainable parameter (their
    gradients would be lost)."""

    @staticmethod
    def forward(ctx, hs, ht, targets, chunk, args):  # noqa: D102 (torch.autograd.Function protocol)
        total = _wide(hs.new_zeros(()))
        grad = torch.zeros_like(hs) if ctx.needs_input_grad[0] else None
        student_head, teacher_head, objective, kd_weight, temperature = args
        for i in range(0, targets.numel(), chunk):
            h = hs[i:i + chunk].detach().requires_grad_(grad is not None)
            with torch.enable_grad():
                ls = student_head(h)  # autograd for the head only (a packed head, soft-capping)
            lt = None
            if objective != "ce":
                lt = teacher_head(ht[i:i + chunk]).to(ls.device)
            loss, g = _loss_and_grad(ls.detach(), lt, targets[i:i + chunk], objective, kd_weight, temperature)
            if grad is not None:
                grad[i:i + chunk] = torch.autograd.grad(ls, h, g.to(ls.dtype))[0]
            total = total + loss
        ctx.save_for_backward(grad)
        return total

    @staticmethod
    def backward(ctx, grad_out):  # noqa: D102
        (grad,) = ctx.saved_tensors
        return (None if grad is None else grad * grad_out.to(grad.dtype)), None, None, None, None


def label_positions(labels: torch.Tensor) -> torch.Tensor:
    """``(n,)`` int64: the flat indices into ``(batch * (seq - 1))`` of the predicted positions that carry a label
    (``labels[:, 1:] != -100``), row-major. A data-dependent shape: the training loop computes it on the host from
    the batch's CPU labels (no device read) and passes it to :func:`chunked_loss` as ``keep``."""
    return (labels[:, 1:] != -100).reshape(-1).nonzero().squeeze(1)


def chunked_loss(objective: str, student_hidden: torch.Tensor, labels: torch.Tensor, student_head: Head,
                 teacher_hidden: torch.Tensor | None = None, teacher_head: Head | None = None, kd_weight: float = 0.5,
                 temperature: float = 1.0, chunk: int = 1024, fused: bool = False,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`loss_fn` from hidden states, ``chunk`` predicted positions at a time.

    ``student_hidden (batch, seq, hidden)``: the student's final hidden states (after its final norm);
    ``student_head``: ``(n, hidden) -> (n, vocab)`` logits, post-processing included. ``teacher_hidden (batch, seq,
    hidden_t)`` and ``teacher_head`` likewise (``kd``/``mix``), on the teacher's device (its logits are moved to the
    student's, one chunk at a time). The peak is one chunk's vocabulary-sized tensors (logits, log-probabilities,
    their gradients), not the micro-batch's. ``fused=False``: each chunk's logits are recomputed in backward
    (``torch.utils.checkpoint``; gradients reach everything, the head's parameters included). ``fused=True``: the
    gradient with respect to ``student_hidden`` is computed chunk by chunk in the forward pass and stored
    (``(n, hidden)``), no recomputation; the heads' parameters get no gradient (for frozen heads: the adapters').
    ``keep (n,)``: :func:`label_positions` of ``labels``, on the student's device; None computes it here, which
    reads the labels back to the host on a GPU (the number of positions decides the shapes).
    """
    if objective != "ce" and (teacher_hidden is None or teacher_head is None):
        raise ValueError(f"objective {objective!r} needs the teacher's hidden states and head")
    if chunk <= 0:
        raise ValueError(f"chunk {chunk} must be a positive number of positions")
    if keep is None:
        keep = label_positions(labels)
    # (n, hidden): only the positions that carry a label, gathered by index (a shape known on the host)
    hs = student_hidden[:, :-1].reshape(-1, student_hidden.shape[-1]).index_select(0, keep)
    targets = labels[:, 1:].reshape(-1).index_select(0, keep)
    ht = None if objective == "ce" else teacher_hidden[:, :-1].reshape(-1, teacher_hidden.shape[-1]).index_select(
        0, keep.to(teacher_hidden.device))
    n = targets.numel()
    args = (student_head, teacher_head, objective, kd_weight, temperature)
    if fused:
        return _Fused.apply(hs, ht, targets, chunk, args) / n
    total = _wide(hs.sum()) * 0.0  # in the graph even when n = 0 (then the mean is NaN, as loss_fn's)
    for i in range(0, n, chunk):
        part = (hs[i:i + chunk], None if ht is None else ht[i:i + chunk], targets[i:i + chunk], *args)
        # one chunk that is the whole batch saves nothing by recomputation: computed once
        total = total + (_chunk_sum(*part) if n <= chunk else checkpoint(_chunk_sum, *part, use_reentrant=False))
    return total / n


def _unwrap(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP/FSDP-style (``.module``) and PEFT (``get_base_model``) wrappers."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def _last_hidden(output: Any) -> torch.Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def _forward(model: nn.Module, ids: torch.Tensor, logits_to_keep: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``(final hidden states (batch, seq, hidden), logits)`` of one forward of ``model`` (through its wrappers, so
    that DDP and PEFT see it); the hidden states are taken by a hook on the decoder (``model.model``)."""
    found: list[torch.Tensor] = []
    handle = _unwrap(model).model.register_forward_hook(lambda mod, args, out: found.append(_last_hidden(out)))
    try:
        kw = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
        logits = model(input_ids=ids, use_cache=False, **kw).logits
    finally:
        handle.remove()
    return found[-1], logits


def _post_candidates(base: nn.Module) -> list[tuple[str, float | None]]:
    """The logit post-processings an architecture may apply: Gemma-2/3's ``cap * tanh(logits / cap)``, or none."""
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    cap = getattr(config, "final_logit_softcapping", None)
    return ([("softcap", float(cap))] if cap else []) + [("none", None)]


def _make_head(head: nn.Module, softcap: float | None) -> Head:
    if softcap is None:
        return head

    def capped(h: torch.Tensor) -> torch.Tensor:  # the op order of transformers' Gemma-2/3 forward
        return torch.tanh(head(h) / softcap) * softcap

    return capped


_HEADS: "weakref.WeakKeyDictionary[nn.Module, tuple[str, float | None] | None]" = weakref.WeakKeyDictionary()


def output_head(model: nn.Module, ids: torch.Tensor) -> Head | None:
    """``(n, hidden) -> (n, vocab)``: ``model``'s output head with its logit post-processing, or None when the
    model's logits are not that (an architecture with post-processing this module does not know, no decoder at
    ``.model``, no ``logits_to_keep``): the caller then computes full logits.

    Checked once per model (cached): one forward of ``ids[:1, :CHECK_POSITIONS]`` with no gradient and the RNG
    state restored after, comparing the model's own logits to the head applied to its final hidden states, and that
    ``logits_to_keep`` is obeyed.
    """
    base = _unwrap(model)
    if base not in _HEADS:
        _HEADS[base] = _check_head(base, ids[:1, :CHECK_POSITIONS])
    found = _HEADS[base]
    return None if found is None else _make_head(base.get_output_embeddings(), found[1])


def _eager() -> contextlib.AbstractContextManager:
    """Compiled modules run eagerly inside (torch >= 2.6; older torch compiles as usual)."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("force_eager") if stance is not None else contextlib.nullcontext()


def _check_head(base: nn.Module, ids: torch.Tensor) -> tuple[str, float | None] | None:
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if head is None or not isinstance(getattr(base, "model", None), nn.Module):
        return None
    devices = [ids.device] if ids.device.type == "cuda" else []
    # eager even in compiled layers: a one-off check at batch 1 outside autocast would otherwise be a graph of its own
    with torch.random.fork_rng(devices=devices), torch.no_grad(), _eager():
        try:
            hidden, logits = _forward(base, ids, None)
            _, none = _forward(base, ids, torch.empty(0, dtype=torch.long, device=ids.device))
        except TypeError:  # a forward without logits_to_keep
            return None
        if none is None or none.numel() != 0 or hidden.shape[:2] != logits.shape[:2]:
            return None
        for name, cap in _post_candidates(base):
            mine = _make_head(head, cap)(hidden)
            # the same op on the same tensor as the model's forward: equal but for summation order, if at all
            if mine.shape == logits.shape and torch.allclose(mine.float(), logits.float(), rtol=1e-6,
                                                             atol=1e-6 * float(logits.abs().max()) + 1e-12):
                return name, cap
    return None


def hidden_states(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The final hidden states ``(batch, seq, hidden)`` of ``model`` on ``ids``, its head run on no position."""
    hidden, _ = _forward(model, ids, torch.empty(0, dtype=torch.long, device=ids.device))
    return hidden


# --- the teacher: placed and cast once ------------------------------------------------------------------

def teacher_target(teacher_device: str | None, device: torch.device) -> torch.device:
    """Where the teacher runs: ``teacher_device``, or ``device`` (the student's) when None. With several processes on
    a machine (torchrun's ``LOCAL_RANK`` / ``LOCAL_WORLD_SIZE``) an indexed ``cuda:N`` is per process: local process
    ``r`` uses ``cuda:(N + r)``, so ``--teacher-device cuda:4`` with 4 processes on 8 GPUs gives each process's
    teacher its own GPU (4..7) beside its student (0..3) instead of all four teachers on GPU 4."""
    target = torch.device(teacher_device) if teacher_device else torch.device(device)
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if teacher_device and target.type == "cuda" and target.index is not None and local_world > 1:
        target = torch.device("cuda", target.index + int(os.environ.get("LOCAL_RANK", "0")))
    return target


def place_teacher(teacher: nn.Module, device: torch.device, precision: str, teacher_device: str | None = None
                  ) -> torch.device:
    """Put the frozen ``teacher`` where it runs, once (later calls find it there and do nothing); returns its device.

    ``teacher_device`` (e.g. ``"cuda:1"``, per process on several: :func:`teacher_target`; None = ``device``, the
    student's). On CUDA with ``precision == "bf16"``
    its parameters are cast to bf16 (buffers such as rotary frequencies keep their dtype), parameter by parameter
    while moving, so the fp32 copy never sits on the GPU whole; elsewhere it keeps its dtype (today's CPU
    behaviour: fp32 weights, autocast). The cast is in place: the same teacher object is bf16 afterwards.
    """
    target = teacher_target(teacher_device, device)
    if target.type == "cuda":
        if not torch.cuda.is_available() or (target.index or 0) >= torch.cuda.device_count():
            found = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise QRecoverError(f"--teacher-device {str(target)!r} does not exist here ({found} CUDA devices); "
                                "pass an existing device, e.g. cuda:0, or leave it out to use the training device")
        if target.index is None:
            target = torch.device("cuda", torch.cuda.current_device())
    dtype = torch.bfloat16 if precision == "bf16" and target.type == "cuda" else None
    first = next(teacher.parameters(), None)
    if first is not None and first.device == target and (dtype is None or first.dtype == dtype):
        return target
    with torch.no_grad():
        for p in teacher.parameters():
            if p.device != target or (dtype is not None and p.is_floating_point() and p.dtype != dtype):
                p.data = p.data.to(target, dtype if dtype is not None and p.is_floating_point() else p.dtype)
    teacher.to(target).eval().requires_grad_(False)  # the buffers
    return target


# --- the decoder layers' outputs (--hidden-weight) --------------------------------------------------------

@contextlib.contextmanager
def layer_outputs(model: nn.Module) -> Iterator[list[torch.Tensor]]:
    """A list that holds the output hidden states ``(batch, seq, hidden)`` of each decoder layer of ``model``
    (through its wrappers), in order, of the last forward inside the block (a first forward, such as
    :func:`output_head`'s one-time check, is dropped when the next one starts); the hooks are gone after the block
    (so activation checkpointing's recomputation in backward adds nothing)."""
    found: list[torch.Tensor] = []
    layers = decoder_layers(_unwrap(model))

    def keep(mod: nn.Module, args: Any, out: Any) -> None:
        if mod is layers[0]:
            found.clear()
        found.append(out[0] if isinstance(out, tuple) else out)

    handles = [m.register_forward_hook(keep) for m in layers]
    try:
        yield found
    finally:
        for h in handles:
            h.remove()


def hidden_error(student: list[torch.Tensor], teacher: list[torch.Tensor], eps: float = 1e-6) -> torch.Tensor:
    """The mean over layers and tokens of ``||h_s - h_t||^2 / ||h_t||^2``, in fp32 at least (bf16 activations are
    widened): each token of each layer weighs the same, whatever its norm (a first token's outlier norm does not
    dominate)."""
    if len(student) != len(teacher) or not student:
        raise QRecoverError(f"--hidden-weight: the student ran {len(student)} decoder layers and the unquantized model "
                            f"{len(teacher)}; they must be the same model's layers")
    terms = []
    for hs, ht in zip(student, teacher):
        hs, ht = _wide(hs), _wide(ht)
        terms.append(((hs - ht).square().sum(-1) / ht.square().sum(-1).clamp_min(eps)).mean())
    return torch.stack(terms).mean()


# --- one micro-batch ------------------------------------------------------------------------------------

def step_loss(model: nn.Module, teacher: nn.Module | None, ids: torch.Tensor, labels: torch.Tensor, cfg: Any,
              autocast: Callable[[], contextlib.AbstractContextManager], precision: str = "no",
              keep: torch.Tensor | None = None) -> torch.Tensor:
    """The training loss of one micro-batch ``ids, labels (batch, seq)`` (on the student's device) under ``cfg``
    (a :class:`~qrecover.recovery.config.RecoverConfig`): the student's forward (with gradients), the teacher's
    (none) for 'kd'/'mix', and :func:`chunked_loss` with ``cfg.loss_chunk`` positions per chunk; or, with
    ``loss_chunk == 0`` or a model whose head :func:`output_head` cannot reproduce, :func:`loss_fn` on full logits.

    ``autocast()``: the training loop's mixed-precision context; ``precision``: what it resolved to ("bf16"/"no"),
    which decides whether the teacher is cast to bf16 on CUDA (:func:`place_teacher`, ``cfg.teacher_device``).
    ``keep``: :func:`label_positions` of ``labels`` computed on the host (the training loop's), so that the step
    reads nothing back from the device.
    """
    use_teacher = teacher is not None and cfg.objective != "ce"
    t_dev = place_teacher(teacher, ids.device, precision, cfg.teacher_device) if use_teacher else None
    if use_teacher and cfg.hidden_weight > 0:
        with layer_outputs(teacher) as t_layers, layer_outputs(model) as s_layers:
            loss = _output_loss(model, teacher, ids, labels, cfg, autocast, precision, keep, t_dev)
        return loss + cfg.hidden_weight * hidden_error(s_layers, [t.to(ids.device) for t in t_layers])
    return _output_loss(model, teacher, ids, labels, cfg, autocast, precision, keep, t_dev)


def _output_loss(model: nn.Module, teacher: nn.Module | None, ids: torch.Tensor, labels: torch.Tensor, cfg: Any,
                 autocast: Callable[[], contextlib.AbstractContextManager], precision: str, keep: torch.Tensor | None,
                 t_dev: torch.device | None) -> torch.Tensor:
    """:func:`step_loss` on the output: the CE/KD loss of the logits (chunked where the head allows)."""
    use_teacher = t_dev is not None
    chunk = int(cfg.loss_chunk)
    s_head = output_head(model, ids) if chunk > 0 else None
    t_head = output_head(teacher, ids.to(t_dev)) if use_teacher and s_head is not None else None
    if s_head is None or (use_teacher and t_head is None):
        teacher_logits = None
        if use_teacher:
            with torch.no_grad(), autocast():
                teacher_logits = teacher(input_ids=ids.to(t_dev), use_cache=False).logits.to(ids.device)
        with autocast():
            logits = model(input_ids=ids, use_cache=False).logits
            return loss_fn(cfg.objective, logits, labels, teacher_logits, cfg.kd_weight, cfg.temperature)
    teacher_hidden = None
    if use_teacher:
        with torch.no_grad(), autocast():
            replay = graphed(_unwrap(teacher))  # a CUDA graph of this forward while the trainer keeps one (graphs.py)
            teacher_hidden = replay(ids.to(t_dev)) if replay is not None else hidden_states(teacher, ids.to(t_dev))
    head = _unwrap(model).get_output_embeddings()
    # a tied packed head (QuantLMHead) reads its embedding's tensors, which train when the embedding is tuned
    head_trains = any(p.requires_grad for m in (head, getattr(head, "embedding", head)) for p in m.parameters())
    with autocast():
        hidden = hidden_states(model, ids)
        return chunked_loss(cfg.objective, hidden, labels, s_head, teacher_hidden, t_head, cfg.kd_weight,
                            cfg.temperature, chunk, fused=not head_trains, keep=keep)

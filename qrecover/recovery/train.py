"""The recovery training loop: one loop, top to bottom, that runs alike on this CPU and on many GPUs.

Scaling is accelerate's: ``qrecover recover ...`` runs on one process; ``accelerate launch -m qrecover.cli
recover ...`` (or ``torchrun``) runs data parallel, each process taking every ``world``-th sequence of the same
deterministic data stream. Only the LoRA weights train; the packed base weights are buffers and never change.

The launch modes and the sharded base (``cfg.shard_base``) are :mod:`.parallel`'s; checkpoints and resuming are
:mod:`.checkpoints`'.

**Global batch.** An optimizer step takes ``batch_size * grad_accum * world`` sequences (the global batch) and
its loss is the mean over every loss-carrying token of them (each micro-batch's mean weighted by its share of
the step's tokens, counted across processes), so the same global batch gives the same adapter whatever the
split into processes, micro-batches and accumulation (tested: 2 processes on CPU vs 1, to float tolerance).
Data order is world-independent: global sequence ``i`` of a step goes to process ``i % world``, and the data
position a checkpoint records is global. Hence a run may resume on another number of processes when
``batch_size * grad_accum * world`` is unchanged (e.g. 2 processes x batch 2 -> 1 process x batch 4, or
x grad_accum 2); every other setting that defines the run must be the same (:func:`check_resume`).

**RNG.** Every process seeds ``seed + rank``; a checkpoint holds the main process's RNG state, which a resumed
run's main process restores (the others reseed from ``(seed, rank, step)``). Nothing in training draws random
numbers unless ``dropout > 0`` (off by default); with dropout, masks differ between world sizes, so only
dropout-free runs are equal across them.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import resource
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn as nn
from rich.progress import TextColumn

from ..errors import QRecoverError
from ..models import decoder_layers
from ..progress import progress
from ..qlinear import QuantLinear
from . import objective
from .attention import causal_sdpa
from .checkpoints import (
    CHECKPOINTS,
    check_resume,  # noqa: F401  (re-exported, as the names below marked so: callers and tests read them here)
    checkpoint_state,
    checkpoint_world,  # noqa: F401
    latest_checkpoint,
    load_checkpoint,  # noqa: F401
    resume_from,
    save_checkpoint,
    trainable,
)
from .config import RecoverConfig
from .fused_layers import fused_lora, liger_layers
from .graphs import teacher_graph
from .parallel import (
    average_adapter_grads,
    check_distributed,
    cpu_only,
    packed_bytes_per_process,
    process_state,  # noqa: F401  (re-exported)
    requested_distributed,
    shard_base,
)
from .precision import base_dtype, frozen_base_in, mixed_precision, native_bf16  # noqa: F401  (native_bf16 re-exported)
from .schedule import lr_scheduler


class NonFiniteLoss(QRecoverError):
    """Training stopped because the loss was NaN or infinite."""


def total_steps(cfg: RecoverConfig, world: int = 1) -> int:
    """Optimizer steps that cover ``cfg.tokens`` (rounded up to whole steps)."""
    return max(1, math.ceil(cfg.tokens / (cfg.tokens_per_step * world)))


def peak_memory_bytes() -> int:
    """Peak memory of this process: GPU allocations on CUDA, else the resident set size."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _progress(show: bool):
    return progress(TextColumn("{task.completed:,.0f}/{task.total:,.0f} tok"), TextColumn("{task.fields[speed]:,.0f} tok/s"),
                    TextColumn("loss {task.fields[loss]:.4f}"), disable=not show)


class Micro(NamedTuple):
    """One micro-batch on the training device, with what the host knows of it: ``ids, labels (batch, seq)``,
    ``keep (n,)`` the flat indices of its predicted positions that carry a label
    (:func:`objective.label_positions`, computed from the CPU labels) and ``count = n``."""

    ids: torch.Tensor
    labels: torch.Tensor
    keep: torch.Tensor
    count: int


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) on ``device``: on CUDA through page-locked memory and a non-blocking copy, so that the
    copy overlaps the step already queued instead of stopping the host (a pageable copy is synchronous)."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def prepare_micro(ids: torch.Tensor, labels: torch.Tensor, device: torch.device) -> Micro:
    """A host micro-batch ``(ids, labels)`` made ready for a step that reads nothing back: its label positions
    and their count computed here, on the CPU, then everything copied to ``device`` (:func:`to_device`)."""
    keep = objective.label_positions(labels)
    return Micro(to_device(ids, device), to_device(labels, device), to_device(keep, device), int(keep.numel()))


def _loss_weights(micro: list[Micro], accelerator: Any) -> list[float] | list[torch.Tensor]:
    """Per micro-batch, the factor on its mean loss that makes the step's gradient the mean over every loss token of
    the global batch: ``n_i * world / N`` (``n_i`` its predicted positions with a label, ``N`` the step's over all
    processes; ``world`` because data parallelism averages the processes' gradients). One process: plain floats from
    the host's counts. Several: ``N`` is all-reduced on the device and the factors stay device scalars (no read)."""
    counts = [m.count for m in micro]
    if accelerator.num_processes == 1:
        total = sum(counts)
        return [n / total for n in counts] if total else [1.0 / len(micro)] * len(micro)
    # with no label anywhere N = 0: the factors are inf/NaN and so is the loss, which stops the run at its next log
    total = accelerator.reduce(torch.tensor(float(sum(counts)), dtype=torch.float32, device=accelerator.device), "sum")
    return [n * accelerator.num_processes / total for n in counts]


def compile_layers(model: nn.Module, backend: str = "inductor") -> int:
    """``torch.compile`` every decoder layer of ``model`` (transformers, unwrapped) in place (``nn.Module.compile``:
    the module keeps its parameters, names and hooks) with ``backend``; returns how many. Idempotent.

    The layers share their graphs (dynamo guards on the module's code and types, the parameters are inputs), so a run
    makes a few: per model, grad mode, autocast state and input kind. Dynamo's recompile limit (8 per code object) is
    raised to 4 per layer so that a model whose layers differ in kind (dense and packed projections) still compiles
    every one rather than falling back to eager after the 8th."""
    import torch._dynamo

    layers = decoder_layers(model)
    cfg = torch._dynamo.config
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"  # its name before torch 2.6
    setattr(cfg, name, max(getattr(cfg, name), 4 * len(layers)))
    for layer in layers:
        if getattr(layer, "_compiled_call_impl", None) is None:
            layer.compile(backend=backend)
    return len(layers)


def fill_dense_caches(model: nn.Module, dtype: torch.dtype | None) -> int:
    """Dequantize, once and before the first step, every packed layer of ``model`` that keeps a dense cache, in
    ``dtype`` (the activations' while training; None: each layer's compute dtype); returns how many. With compiled
    layers, a cache filled at a layer's first call made that call a graph of its own, traced through the layer's
    decoder (its bits and scheme): on an H100 the 1B model's 16 layers hit dynamo's recompile limit this way."""
    n = 0
    for m in model.modules():
        if isinstance(m, QuantLinear) and m.cache and not m._masters:
            m.dequantize(dtype or m.compute_dtype)
            n += 1
    return n


def _fused_adamw(params: list[torch.Tensor]) -> bool | None:
    """Whether torch's fused AdamW runs for ``params`` (floating point, all on one device type it supports)."""
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    kinds = {p.device.type for p in params}
    ok = len(kinds) == 1 and kinds <= set(_get_fused_kernels_supported_devices()) and all(p.is_floating_point() for p in params)
    return True if ok else None


def _set_grad_sync(model: nn.Module, sync: bool) -> None:
    """DDP: all-reduce gradients in this micro-batch's backward or not (what ``no_sync()`` sets, as a flag, so the
    accumulation loop needs no context manager around its forward). Other wrappers sync every micro-batch."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        model.require_backward_grad_sync = sync


def _batches(stream: Iterator[dict[str, torch.Tensor]], batch_size: int, rank: int, world: int
             ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Micro-batches ``(input_ids, labels)`` of shape ``(batch_size, seq_len)`` for this process.

    Each micro-batch step takes ``batch_size * world`` sequences from the shared stream; process ``rank``
    keeps every ``world``-th of them, so processes never see the same sequence and the global batch is the
    same whatever the number of processes.
    """
    while True:
        seqs = [next(stream) for _ in range(batch_size * world)][rank::world]
        yield torch.stack([s["input_ids"] for s in seqs]), torch.stack([s["labels"] for s in seqs])


#: the first optimizer steps of a run (compilation, allocator growth, autotuning) are read at once and reported apart
#: as its warm-up (``summary["warmup"]``), so steady-state throughput is measured after them
WARMUP_LOG_STEPS = 2


class StepContext(NamedTuple):
    """What one optimizer step needs, fixed for a run."""

    model: nn.Module
    teacher: nn.Module | None
    optimizer: Any
    scheduler: Any
    params: list[torch.Tensor]
    cfg: RecoverConfig
    accelerator: Any
    autocast: Callable[[], Any]
    precision: str
    sharded: bool


def optimizer_step(ctx: StepContext, micro: list[Micro]) -> torch.Tensor:
    """One optimizer step over ``grad_accum`` prepared micro-batches; returns the step's loss (the global batch's
    token mean on this process) as a device scalar. Reads nothing back from the device: no ``.item()``, no
    data-dependent shape, no finiteness test (the loss is checked where it is read, :func:`_read_losses`), so a GPU
    runs ahead of Python (tested with :class:`~qrecover.recovery.host_sync.HostSyncCounter`)."""
    weights = _loss_weights(micro, ctx.accelerator)
    step_loss = torch.zeros((), device=ctx.accelerator.device)
    for i, m in enumerate(micro):
        _set_grad_sync(ctx.model, i == len(micro) - 1)  # gradients all-reduced once per step
        loss = objective.step_loss(ctx.model, ctx.teacher, m.ids, m.labels, ctx.cfg, ctx.autocast, ctx.precision, keep=m.keep)
        # each backward() sums gradients: weighted, the step's gradient is the global batch's token mean
        ctx.accelerator.backward(loss * weights[i])
        step_loss = step_loss + loss.detach().float() * weights[i]
    if ctx.sharded:
        average_adapter_grads(ctx.params, ctx.accelerator.num_processes)
    if ctx.cfg.max_grad_norm > 0:
        ctx.accelerator.clip_grad_norm_(ctx.params, ctx.cfg.max_grad_norm)
    ctx.optimizer.step()
    ctx.scheduler.step()
    ctx.optimizer.zero_grad(set_to_none=True)
    return step_loss


def _read_losses(pending: list[tuple[int, int, float, torch.Tensor]], accelerator: Any, run_dir: Path
                 ) -> list[dict[str, Any]]:
    """The history entries of the ``pending`` steps ``(step, tokens, lr, loss on the device)``: their losses averaged
    over the processes and read in one transfer (the only device read between logging steps). A non-finite loss
    stops the run, naming its step; no checkpoint was written after it (checkpoints are written at reads)."""
    losses = torch.stack([loss for *_, loss in pending])
    if accelerator.num_processes > 1:
        losses = accelerator.reduce(losses, "mean")
    values = losses.tolist()
    for (step, *_), value in zip(pending, values):
        if not math.isfinite(value):
            last = latest_checkpoint(run_dir)
            where = f"the last good checkpoint is {last}" if last else "no checkpoint was written yet"
            raise NonFiniteLoss(f"training loss became {value} at step {step}; stopped. {where}. "
                                "Lower --lr (or raise --grad-accum) and rerun with --resume")
    return [{"step": step, "tokens": tokens, "loss": value, "lr": lr} for (step, tokens, lr, _), value in zip(pending, values)]


def is_checkpoint_step(step: int, steps: int, cfg: RecoverConfig) -> bool:
    """Whether the main process writes a checkpoint after optimizer step ``step`` of ``steps``."""
    return bool(cfg.checkpoint_every) and (step % cfg.checkpoint_every == 0 or step == steps)


def is_log_step(step: int, step0: int, steps: int, cfg: RecoverConfig, has_callback: bool) -> bool:
    """Whether the losses are read after optimizer step ``step`` (the run started after ``step0``): the warm-up
    steps, every ``cfg.log_every``-th, the last, checkpoint steps and, with a callback, every step. The same on
    every process (the read is a collective), so it depends on nothing process-specific."""
    return (step - step0 <= WARMUP_LOG_STEPS or step == steps or step % cfg.log_every == 0
            or is_checkpoint_step(step, steps, cfg) or has_callback)


def _loop(ctx: StepContext, stream: Iterator[tuple[torch.Tensor, torch.Tensor]], loader: Any, run_dir: Path,
          history: list[dict[str, Any]], step: int, tokens: int, steps: int, callback: Callable | None,
          show_progress: bool, description: str) -> tuple[int, int, float, dict[str, Any] | None]:
    """Optimizer steps ``step + 1 .. steps``; returns ``(step, tokens, training seconds, warm-up record)``. The
    losses stay on the device and are read at logging steps only (:func:`_read_losses`): the first
    :data:`WARMUP_LOG_STEPS`, every ``cfg.log_every``-th, the last, checkpoint steps, and every step with a callback."""
    cfg, accelerator, model, optimizer, scheduler = ctx.cfg, ctx.accelerator, ctx.model, ctx.optimizer, ctx.scheduler
    world = accelerator.num_processes
    pending: list[tuple[int, int, float, torch.Tensor]] = []  # (step, tokens, lr, loss on the device) not yet read
    step0, tokens0, train_seconds, warmup = step, tokens, 0.0, None
    with _progress(show_progress and accelerator.is_main_process) as bar:
        task = bar.add_task(description, total=steps * cfg.tokens_per_step * world, completed=tokens,
                            speed=0.0, loss=float("nan"))
        while step < steps:
            # --- one optimizer step: grad_accum micro-batches, prepared on the host, run without a device read --
            t_step = time.perf_counter()
            micro = [prepare_micro(*next(stream), accelerator.device) for _ in range(cfg.grad_accum)]
            loss = optimizer_step(ctx, micro)
            step += 1
            tokens += cfg.tokens_per_step * world
            pending.append((step, tokens, scheduler.get_last_lr()[0], loss))
            checkpointing = accelerator.is_main_process and is_checkpoint_step(step, steps, cfg)
            logging = is_log_step(step, step0, steps, cfg, callback is not None)
            if logging:  # the one device read of these steps: their losses (a checkpoint or the hook needs them)
                history.extend(_read_losses(pending, accelerator, run_dir))
                pending.clear()
            train_seconds += time.perf_counter() - t_step  # checkpoints and the caller's hook are not training
            speed = (tokens - tokens0) / train_seconds
            if logging:
                history[-1].update(tok_per_s=speed, seconds=train_seconds)
            if step - step0 == WARMUP_LOG_STEPS:  # compilation, allocator and autotuning happen here: timed apart
                warmup = {"steps": WARMUP_LOG_STEPS, "seconds": train_seconds, "tokens": tokens - tokens0}
            bar.update(task, completed=tokens, speed=speed, loss=history[-1]["loss"] if history else float("nan"))

            # --- checkpoint, then the caller's hook (both only at logging steps: the losses are read) ------
            if checkpointing:
                save_checkpoint(run_dir / CHECKPOINTS / f"step-{step:07d}.pt", checkpoint_state(
                    cfg, world, step, tokens, history, accelerator.unwrap_model(model), optimizer, scheduler, loader))
            if logging:
                accelerator.wait_for_everyone()
            if callback is not None and accelerator.is_main_process:
                callback({"step": step, "tokens": tokens, "loss": history[-1]["loss"], "model": accelerator.unwrap_model(model)})
    return step, tokens, train_seconds, warmup


def train(model: nn.Module, cfg: RecoverConfig, loader: Any, run_dir: Path, teacher: nn.Module | None = None,
          resume: bool = False, show_progress: bool = True,
          callback: Callable[[dict[str, Any]], None] | None = None, description: str = "recover") -> dict[str, Any]:
    """Train the trainable (LoRA) parameters of ``model`` on ``loader``; returns a summary of the run.

    ``loader``: iterable of ``{"input_ids", "labels"}`` sequences with ``state_dict()``/``load_state_dict()``, its
    state the global position; one with ``batches(batch_size, rank, world)`` gives this process's micro-batches
    itself (global sequence ``i`` of each ``batch_size * world`` to process ``i % world``, as :func:`_batches` does).
    ``teacher``: the unquantized model, needed by the 'kd' and 'mix' objectives.
    ``callback(info)``: called on the main process once before the first step of a fresh run (``step`` 0, ``loss``
    NaN: the model as initialised) and after every optimizer step (and checkpoint), with
    ``info = {"step", "tokens", "loss", "model"}``: the benchmark measures held-out perplexity there.
    ``cfg.shard_base`` on several processes shards ``model``'s base in place (:func:`shard_base`): afterwards its
    adapter is whole on every process (what saving reads) but a forward needs every process; a callback is refused.
    """
    from accelerate import Accelerator
    if cfg.objective != "ce" and teacher is None:
        raise QRecoverError(f"objective {cfg.objective!r} distils from the unquantized model, but none was given")
    check_distributed(requested_distributed())
    from accelerate import DistributedDataParallelKwargs

    # Autocast is ours rather than accelerate's: accelerate's mixed-precision setting is process-global and cannot
    # change between two runs in one process (the benchmark trains several); torch.autocast is the same thing.
    # DDP: the packed base weights are buffers, frozen and the same on every process (read from one checkpoint):
    # not broadcast before every forward, which would send the whole base each micro-batch.
    accelerator = Accelerator(mixed_precision="no", cpu=cpu_only(), kwargs_handlers=[DistributedDataParallelKwargs(broadcast_buffers=False)])
    check_distributed(accelerator.distributed_type)
    precision = mixed_precision(cfg)

    def autocast():
        return torch.autocast(accelerator.device.type, dtype=torch.bfloat16, enabled=precision == "bf16")

    rank, world = accelerator.process_index, accelerator.num_processes
    steps = total_steps(cfg, world)
    sharded = _sharding(cfg, world, callback)
    model, optimizer, scheduler, params = _prepare_training(model, teacher, cfg, accelerator, sharded, steps)
    packed_bytes = packed_bytes_per_process(model, accelerator)
    if teacher is not None:
        objective.place_teacher(teacher, accelerator.device, precision, cfg.teacher_device)
        teacher.eval().requires_grad_(False)

    # --- resume: adapter, optimizer, scheduler, data position and RNG exactly as they were ----------------
    step, tokens, history = 0, 0, []
    torch.manual_seed(cfg.seed + rank)
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        step, tokens, history = resume_from(ckpt, cfg, world, rank, run_dir, accelerator.unwrap_model(model),
                                            optimizer, scheduler, loader)

    stream = _stream(loader, cfg.batch_size, rank, world)
    model.train()
    stream, setup_seconds = _ready_data(stream, step < steps)
    tokens0 = tokens
    if callback is not None and accelerator.is_main_process and step == 0:
        callback({"step": 0, "tokens": 0, "loss": float("nan"), "model": accelerator.unwrap_model(model)})
        model.train()
    ctx = StepContext(model, teacher, optimizer, scheduler, params, cfg, accelerator, autocast, precision, sharded)
    step0 = step
    with contextlib.ExitStack() as scope:
        # SDPA with is_causal and no mask built (the mask builder reads the device at every forward; attention.py);
        # not with a callback, which reads every step anyway and may evaluate padded batches that need masks
        attention = scope.enter_context(causal_sdpa(objective._unwrap(model), cfg.seq_len, callback is None))
        # the frozen base's norms (and an unquantized embedding/head) in bf16 with bf16 autocast on CUDA: no casts
        # around every projection and adapter (precision.py); put back as loaded when training ends
        dtype = base_dtype(cfg, precision, accelerator.device, sharded, callback is not None)
        scope.enter_context(frozen_base_in(objective._unwrap(model), dtype))
        if cfg.compile_layers:  # every dense cache before the first compiled call: one graph for all packed layers
            fill_dense_caches(objective._unwrap(model), dtype)
        if teacher is not None and callback is None:
            scope.enter_context(causal_sdpa(objective._unwrap(teacher), cfg.seq_len))
        # LoRA's scale and add in one GEMM; Liger's fused RMSNorm, SwiGLU and rotary embedding on CUDA (fused_layers.py)
        fused = {"lora_addmm": scope.enter_context(fused_lora(objective._unwrap(model))) if cfg.fused_layers else 0,
                 "liger": scope.enter_context(liger_layers(objective._unwrap(model), objective._unwrap(teacher)))
                 if cfg.fused_layers and not cfg.compile_layers else 0}  # 0 off CUDA (liger_layers checks the devices)
        # the teacher's forward as a CUDA graph on CUDA (graphs.py); hooks (--hidden-weight) and compiled layers stay eager
        replay = scope.enter_context(teacher_graph(
            objective._unwrap(teacher) if teacher is not None else None, objective.hidden_states,
            enable=cfg.teacher_graph and cfg.objective != "ce" and cfg.hidden_weight == 0 and not cfg.compile_layers))
        step, tokens, train_seconds, warmup = _loop(ctx, stream, loader, run_dir, history, step, tokens, steps,
                                                    callback, show_progress, description)
    model.eval()
    return {"steps": step, "tokens": tokens, "final_loss": history[-1]["loss"] if history else None,
            "warmup": warmup if step - step0 > WARMUP_LOG_STEPS else None, "attention": attention, "fused_layers": fused,
            "teacher_graph": None if replay is None else {"replays": replay.replays, "failed": replay.failed},
            "tok_per_s": (tokens - tokens0) / train_seconds if train_seconds > 0 else None,
            "seconds": train_seconds, "data_setup_seconds": setup_seconds,
            "peak_memory_bytes": peak_memory_bytes(), "history": history, "world_size": world,
            "mixed_precision": precision, "shard_base": sharded, "packed_bytes_per_process": packed_bytes,
            "model": accelerator.unwrap_model(model), "is_main_process": accelerator.is_main_process}


def _sharding(cfg: RecoverConfig, world: int, callback: Callable | None) -> bool:
    """Whether this run shards the base (``cfg.shard_base`` on several processes); warns that one process has
    nothing to shard, and refuses a callback, which could not run a forward of a sharded model alone."""
    sharded = cfg.shard_base and world > 1
    if cfg.shard_base and world == 1:
        warnings.warn("qrecover: --shard-base on one process changes nothing (there is nothing to shard across); "
                      "launch several with torchrun to shard the base", stacklevel=3)  # 3: train's caller
    if sharded and callback is not None:
        raise QRecoverError("a training callback runs on the main process alone, and with --shard-base a forward of the "
                            "model needs every process; train without the callback, or without --shard-base")
    return sharded


def _prepare_training(model: nn.Module, teacher: nn.Module | None, cfg: RecoverConfig, accelerator: Any,
                      sharded: bool, steps: int) -> tuple[nn.Module, Any, Any, list[torch.Tensor]]:
    """The model ready to train: base frozen (its packed weights are buffers), adapter weights trainable, layers
    compiled and base sharded where ``cfg`` asks; with its AdamW and learning-rate schedule, both passed through
    accelerate. Returns ``(model, optimizer, scheduler, params)`` (``model`` as accelerate wrapped it)."""
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.cache = cfg.cache_dequantized
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not trainable(model):
        raise QRecoverError("the model has no trainable parameters; attach an adapter first")
    if cfg.compile_layers:  # each decoder layer its own graph, compiled at its first call (the warm-up steps)
        for net in (model, teacher) if teacher is not None else (model,):
            compile_layers(objective._unwrap(net))
    if sharded:  # before the optimizer: it holds the adapter parameters FSDP leaves in place (moved to the device)
        shard_base(model, accelerator.device, accelerator.num_processes)
    params = list(trainable(model).values())
    # fused AdamW (one kernel per step on CUDA and CPU): the for-each one reads each step count back with .item()
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=_fused_adamw(params))
    # stepped by us once per optimizer step (accelerate would step a prepared scheduler once per process)
    scheduler = lr_scheduler(optimizer, cfg, steps)  # warm-up + cosine, or WSD (cfg.schedule; schedule.py)
    if sharded:  # FSDP is the model's parallelism: accelerate must not wrap it in DDP as well
        optimizer = accelerator.prepare(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, scheduler, params


def _stream(loader: Any, batch_size: int, rank: int, world: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """This process's micro-batches. A loader with ``batches(batch_size, rank, world)`` (sharded tokens) slices the
    global order itself; the mix stream is read whole by every process, each keeping its sequences (its state is
    then the global position)."""
    return (loader.batches(batch_size, rank, world) if hasattr(loader, "batches")
            else _batches(iter(loader), batch_size, rank, world))


def _ready_data(stream: Iterator[tuple[torch.Tensor, torch.Tensor]], training: bool
                ) -> tuple[Iterator[tuple[torch.Tensor, torch.Tensor]], float]:
    """``(stream, seconds)``: the first micro-batch readies the data (scans, decontamination, self-generated chats;
    cached after one run), so it is taken here (when ``training``: steps remain) and timed apart, and tokens/s
    measures training alone. Taking it early does not move the data stream."""
    t_setup = time.perf_counter()
    if training:
        stream = itertools.chain([next(stream)], stream)
    return stream, time.perf_counter() - t_setup

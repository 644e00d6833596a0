"""The recovery training loop: one loop, top to bottom, that runs alike on this CPU and on many GPUs.

Scaling is accelerate's: ``qrecover recover ...`` runs on one process; ``accelerate launch -m qrecover.cli
recover ...`` (or ``torchrun``) runs data parallel, each process taking every ``world``-th sequence of the same
deterministic data stream. Only the LoRA weights train; the packed base weights are buffers and never change.

**Sharded base** (``cfg.shard_base`` on several processes): the packed tensors become frozen parameters and torch's
FSDP2 (``fully_shard``) shards them, each decoder layer one group gathered as it runs and the rest of the model
(embedding, final norm, head) the root group, so a process holds ``1/world`` of the base at rest (tested: 2 CPU
processes hold half the tiny model's packed bytes each). The adapter is left out of FSDP (``ignored_params``): it
stays whole on every process, as under DDP, its gradients averaged by one all-reduce per optimizer step
(:func:`_average_adapter_grads`), so checkpoints and the exported adapter are the unsharded run's, and a sharded
run resumes unsharded and the reverse (tested). accelerate's own FSDP plugin (``--use_fsdp``) stays refused.

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

Resumability: every ``checkpoint_every`` optimizer steps the main process writes ``checkpoints/step-N.pt``
(adapter weights in fp32, optimizer, scheduler, step, tokens, the data loader's exact position and every RNG
state) atomically. ``resume=True`` continues from the newest one, and the run ends where an uninterrupted run
would (tested: same weights).

A checkpoint holds tensors and plain values only (dicts, lists, numbers, strings: the RNG states as tensors and
lists), and is read with ``torch.load(weights_only=True)``: a checkpoint directory from someone else cannot run
code (a file with any other pickled object is refused).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import pickle
import random
import resource
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn as nn
from rich.progress import TextColumn

from ..errors import QRecoverError
from ..io_utils import atomic_file
from ..models import decoder_layers
from ..progress import progress
from ..qlinear import QuantLinear, local_packed_bytes, packed_as_parameters
from . import objective
from .attention import causal_sdpa
from .config import RecoverConfig
from .schedule import lr_scheduler

CHECKPOINTS = "checkpoints"
CHECKPOINT_FORMAT = 2  # 2: plain values only (weights_only loading); 1 pickled numpy and Python RNG objects


class NonFiniteLoss(QRecoverError):
    """Training stopped because the loss was NaN or infinite."""


def total_steps(cfg: RecoverConfig, world: int = 1) -> int:
    """Optimizer steps that cover ``cfg.tokens`` (rounded up to whole steps)."""
    return max(1, math.ceil(cfg.tokens / (cfg.tokens_per_step * world)))


def native_bf16() -> bool:
    """Whether this process's device computes bf16 matmuls natively: a CUDA GPU with bf16, or a CPU with
    AVX512-BF16 or AMX (oneDNN's check). There bf16 autocast is about 2x faster than fp32 (measured on this
    repo's 2-core AMD EPYC: a 4 x 512 forward of the default model in 2.4 s instead of 5.4 s)."""
    if torch.cuda.is_available():
        return torch.cuda.is_bf16_supported()
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(torch.backends.mkldnn.is_available() and check is not None and check())


def mixed_precision(cfg: RecoverConfig) -> str:
    """What ``cfg.precision`` means on this device: "bf16" (autocast) or "no" (fp32)."""
    if cfg.precision == "auto":
        return "bf16" if native_bf16() else "no"
    return "bf16" if cfg.precision == "bf16" else "no"


def cpu_only() -> bool:
    """No accelerator device (GPU, XPU, MPS...) in this process. accelerate then needs ``cpu=True`` to join the
    process group of ``torchrun`` or ``accelerate launch`` (gloo): without it every process of a CPU launch
    would train alone, on all the data (measured: accelerate 1.15 reports 1 process of 1 under torchrun)."""
    has = getattr(torch, "accelerator", None)
    return not (has.is_available() if has is not None else torch.cuda.is_available())


def process_state() -> Any:
    """accelerate's view of this launch (rank, world, barriers), joining its process group if it has one."""
    from accelerate import PartialState

    return PartialState(cpu=cpu_only())


def check_distributed(kind: Any) -> None:
    """Refuse a launch mode the loop does not support: only one process or data parallel (DDP, on GPUs or CPUs),
    the base optionally sharded by the loop itself (``--shard-base``, :func:`shard_base`).

    ``kind``: accelerate's ``DistributedType`` (or its value). accelerate's FSDP plugin is refused: it would shard
    the parameters it finds, the small adapter (the frozen base is buffers), which checkpoints and the exported
    adapter read whole on the main process; on CPU it does not start at all. DeepSpeed and Megatron-LM likewise
    wrap the optimizer and parameters in ways this loop does not handle."""
    name = str(getattr(kind, "value", kind)).upper()
    if name == "FSDP":
        raise QRecoverError(
            "FSDP through accelerate (accelerate launch --use_fsdp, or an accelerate config with distributed_type FSDP) "
            "is not supported: its plugin would shard the small adapter, not the quantized base (held in buffers). "
            "To shard the base, launch with torchrun (or accelerate launch without --use_fsdp) and pass --shard-base "
            "(with --gradient-checkpointing): torch's FSDP2 then shards the packed base weights across the processes, "
            "each decoder layer gathered as it runs")
    if name in ("DEEPSPEED", "MEGATRON_LM"):
        raise QRecoverError(f"accelerate's {name} mode is not supported by the recovery loop; launch data parallel "
                            "(accelerate launch without --use_deepspeed/--use_megatron_lm, or torchrun)")


def requested_distributed() -> str:
    """The launch mode ``accelerate launch`` asked for through the environment ("FSDP", "DEEPSPEED", "MEGATRON_LM"),
    or "NO": read before accelerate builds a plugin (its FSDP plugin raises a RuntimeError on a machine without
    GPUs before our message could say why)."""
    for kind in ("FSDP", "DEEPSPEED", "MEGATRON_LM"):
        if os.environ.get(f"ACCELERATE_USE_{kind}", "false").lower() in ("1", "true", "yes"):
            return kind
    return "NO"


def _trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def _rng_state() -> dict[str, Any]:
    """Every RNG state as tensors and plain values (what ``weights_only`` loading accepts)."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss},
             "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_checkpoint(path: Path) -> dict[str, Any]:
    """A training checkpoint, read with ``weights_only=True``: tensors and plain values, never code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        reason = next((ln for ln in lines if "global" in ln.lower()), lines[0] if lines else type(e).__name__)
        raise QRecoverError(f"checkpoint {str(path)!r} holds more than tensors and plain values (pickled objects "
                            f"that could run code: {reason[:200]}); refusing to load it. If it is not yours, delete it; "
                            "else it comes from an older qrecover: train again with --overwrite") from None
    except (RuntimeError, EOFError, OSError) as e:
        raise QRecoverError(f"checkpoint {str(path)!r} cannot be read ({type(e).__name__}: {str(e)[:200]}); it is "
                            "truncated or not a qrecover checkpoint: delete it to resume from the one before, or "
                            "train again with --overwrite") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        found = state.get("format") if isinstance(state, dict) else type(state).__name__
        raise QRecoverError(f"checkpoint {str(path)!r} has format {found!r}, not {CHECKPOINT_FORMAT}; it comes from "
                            "another qrecover version: train again with --overwrite")
    return state


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted((run_dir / CHECKPOINTS).glob("step-*.pt"))
    return found[-1] if found else None


def _save_checkpoint(path: Path, state: dict[str, Any], keep: int = 2) -> None:
    """Write atomically (temp file + rename), then drop all but the newest ``keep`` checkpoints."""
    with atomic_file(path) as tmp:
        torch.save(state, tmp)
    for old in sorted(path.parent.glob("step-*.pt"))[:-keep]:
        old.unlink()


def peak_memory_bytes() -> int:
    """Peak memory of this process: GPU allocations on CUDA, else the resident set size."""
    if torch.cuda.is_available():
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _progress(show: bool):
    return progress(TextColumn("{task.completed:,.0f}/{task.total:,.0f} tok"), TextColumn("{task.fields[speed]:,.0f} tok/s"),
                    TextColumn("loss {task.fields[loss]:.4f}"), disable=not show)


# Settings that only say how a step is executed (not what it computes): a resumed run may change them, the split of the
# global batch into (processes, batch_size, grad_accum) included as long as its product is unchanged.
EXECUTION_FIELDS = ("batch_size", "grad_accum", "checkpoint_every", "log_every", "compile_layers", "gradient_checkpointing",
                    "cache_dequantized", "loss_chunk",
                    "teacher_device", "shard_base")


def checkpoint_world(state: dict[str, Any]) -> int:
    """The number of processes that wrote a checkpoint (recorded since world-size resume; older ones: derived
    from their token count, ``tokens = step * batch_size * grad_accum * seq_len * world``)."""
    if "world" in state:
        return int(state["world"])
    c = state["config"]
    per_step = c["batch_size"] * c["grad_accum"] * c["seq_len"]
    return max(1, state["tokens"] // max(1, state["step"] * per_step))


def check_resume(saved: dict[str, Any], saved_world: int, cfg: RecoverConfig, world: int, where: Any) -> None:
    """Refuse to resume a run whose defining settings changed. ``batch_size``, ``grad_accum`` and the number of
    processes may differ when the global batch ``batch_size * grad_accum * world`` is the same."""
    now = cfg.to_dict()
    diff = {k: (saved.get(k), v) for k, v in now.items() if k not in EXECUTION_FIELDS and saved.get(k) != v}
    if diff:
        raise QRecoverError(f"cannot resume {where}: it was started with different settings {diff} "
                            "(checkpoint value, new value); rerun with the original settings or --overwrite")
    was = saved["batch_size"] * saved["grad_accum"] * saved_world
    if was != cfg.batch_size * cfg.grad_accum * world:
        raise QRecoverError(
            f"cannot resume {where}: its global batch was {was} sequences per step (batch_size {saved['batch_size']} x "
            f"grad_accum {saved['grad_accum']} x {saved_world} processes), now it would be "
            f"{cfg.batch_size * cfg.grad_accum * world} (batch_size {cfg.batch_size} x grad_accum {cfg.grad_accum} x "
            f"{world} processes); choose --batch-size and --grad-accum with batch_size x grad_accum x processes = {was}, "
            "or --overwrite")


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


def shard_base(model: nn.Module, device: torch.device, world: int) -> None:
    """Shard the frozen packed base of ``model`` (PEFT-wrapped) across the ``world`` processes with FSDP2, in place.

    The packed tensors become frozen parameters (FSDP shards parameters, not buffers); each decoder layer is one
    FSDP group (all-gathered before it runs, freed after, again in backward), the rest of the transformers model
    (embedding, final norm, head: the tied head reads the embedding's packed tensors) the root group, gathered for
    each micro-batch. FSDP is applied to the transformers model inside PEFT, so the loss code that calls it directly
    (the chunked head check, :func:`objective.output_head`) still goes through its hooks. The adapter is ignored
    by FSDP: whole on every process (moved to ``device`` here), plain tensors, its gradients averaged by
    :func:`_average_adapter_grads`; FSDP itself reduces no gradient (the base has none). The parameters FSDP
    shards become DTensors.
    """
    import inspect

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        fully_shard = None
    if fully_shard is None or "ignored_params" not in inspect.signature(fully_shard).parameters:
        raise QRecoverError(f"--shard-base needs torch's FSDP2 with ignored_params (torch 2.7 or later); this is torch "
                            f"{torch.__version__}: upgrade torch, or train without --shard-base (data parallel)")
    adapter = set(_trainable(model).values())
    packed_as_parameters(model)
    base = objective._unwrap(model)
    mesh = init_device_mesh(device.type, (world,))
    for layer in decoder_layers(base):
        fully_shard(layer, mesh=mesh, ignored_params=adapter)
    fully_shard(base, mesh=mesh, ignored_params=adapter)
    for t in itertools.chain(model.parameters(), model.buffers()):  # what FSDP did not move: the adapter
        if not isinstance(t, DTensor) and t.device != device:
            t.data = t.data.to(device)


def _average_adapter_grads(params: list[torch.Tensor], world: int) -> None:
    """With the base sharded, FSDP leaves the adapter's gradients alone: average them over the processes here, as
    DDP would (so :func:`_loss_weights` holds unchanged), in one all-reduce per dtype, once per optimizer step. A
    parameter without a gradient gets zeros on every process, so all send the same layout."""
    import torch.distributed as dist

    for dtype in dict.fromkeys(p.dtype for p in params):  # insertion order: the same on every process
        group = [p for p in params if p.dtype == dtype]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group])
        dist.all_reduce(flat)
        flat /= world
        for p, g in zip(group, flat.split([p.numel() for p in group])):
            p.grad = g.view_as(p)


def _packed_bytes_per_process(model: nn.Module, accelerator: Any) -> list[int]:
    """The packed base bytes each process holds (its shards when the base is sharded), gathered: the record that
    sharding split the base (with DDP every process holds all of it)."""
    mine = torch.tensor([local_packed_bytes(model)], dtype=torch.int64, device=accelerator.device)
    return [int(b) for b in (accelerator.gather(mine) if accelerator.num_processes > 1 else mine).tolist()]


def compile_layers(model: nn.Module, backend: str = "inductor") -> int:
    """``torch.compile`` every decoder layer of ``model`` (transformers, unwrapped) in place (``nn.Module.compile``:
    the module keeps its parameters, names and hooks) with ``backend``; returns how many. Idempotent."""
    layers = decoder_layers(model)
    for layer in layers:
        if getattr(layer, "_compiled_call_impl", None) is None:
            layer.compile(backend=backend)
    return len(layers)


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
        _average_adapter_grads(ctx.params, ctx.accelerator.num_processes)
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
                _save_checkpoint(run_dir / CHECKPOINTS / f"step-{step:07d}.pt", {
                    "format": CHECKPOINT_FORMAT, "config": cfg.to_dict(), "world": world, "step": step, "tokens": tokens,
                    "history": history,
                    "adapter": {n: p.detach().cpu().clone() for n, p in _trainable(accelerator.unwrap_model(model)).items()},
                    "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
                    "loader": loader.state_dict(), "rng": _rng_state()})
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
    sharded = cfg.shard_base and world > 1
    if cfg.shard_base and world == 1:
        warnings.warn("qrecover: --shard-base on one process changes nothing (there is nothing to shard across); "
                      "launch several with torchrun to shard the base", stacklevel=2)
    if sharded and callback is not None:
        raise QRecoverError("a training callback runs on the main process alone, and with --shard-base a forward of the "
                            "model needs every process; train without the callback, or without --shard-base")

    # --- the model: base frozen (its packed weights are buffers), adapter weights trainable ---------------
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.cache = cfg.cache_dequantized
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if not _trainable(model):
        raise QRecoverError("the model has no trainable parameters; attach an adapter first")
    if cfg.compile_layers:  # each decoder layer its own graph, compiled at its first call (the warm-up steps)
        for net in (model, teacher) if teacher is not None else (model,):
            compile_layers(objective._unwrap(net))
    if sharded:  # before the optimizer: it holds the adapter parameters FSDP leaves in place (moved to the device)
        shard_base(model, accelerator.device, world)
    params = list(_trainable(model).values())
    # fused AdamW (one kernel per step on CUDA and CPU): the for-each one reads each step count back with .item()
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=_fused_adamw(params))
    # stepped by us once per optimizer step (accelerate would step a prepared scheduler once per process)
    scheduler = lr_scheduler(optimizer, cfg, steps)  # warm-up + cosine, or WSD (cfg.schedule; schedule.py)
    if sharded:  # FSDP is the model's parallelism: accelerate must not wrap it in DDP as well
        optimizer = accelerator.prepare(optimizer)
    else:
        model, optimizer = accelerator.prepare(model, optimizer)
    packed_bytes = _packed_bytes_per_process(model, accelerator)
    if teacher is not None:
        objective.place_teacher(teacher, accelerator.device, precision, cfg.teacher_device)
        teacher.eval().requires_grad_(False)

    # --- resume: adapter, optimizer, scheduler, data position and RNG exactly as they were ----------------
    step, tokens, history = 0, 0, []
    torch.manual_seed(cfg.seed + rank)
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        state = load_checkpoint(ckpt)
        check_resume(state["config"], checkpoint_world(state), cfg, world, run_dir)
        unwrapped = accelerator.unwrap_model(model)
        missing = set(_trainable(unwrapped)) - set(state["adapter"])
        if missing:
            raise QRecoverError(f"checkpoint {ckpt} lacks adapter weights {sorted(missing)[:3]}; it belongs to another run")
        with torch.no_grad():
            for n, p in _trainable(unwrapped).items():
                p.copy_(state["adapter"][n])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        loader.load_state_dict(state["loader"])
        step, tokens, history = state["step"], state["tokens"], state["history"]
        _set_rng_state(state["rng"])
        if rank > 0:
            torch.manual_seed(hash((cfg.seed, rank, step)) % 2**63)

    # a loader with batches(batch_size, rank, world) (sharded tokens) slices the global order itself; the mix
    # stream is read whole by every process, each keeping its sequences (its state is then the global position)
    stream = (loader.batches(cfg.batch_size, rank, world) if hasattr(loader, "batches")
              else _batches(iter(loader), cfg.batch_size, rank, world))
    model.train()
    # The first micro-batch readies the data (scans, decontamination, self-generated chats; cached after one
    # run): timed apart, so tokens/s measures training alone. Taking it early does not move the data stream.
    t_setup = time.perf_counter()
    if step < steps:
        stream = itertools.chain([next(stream)], stream)
    setup_seconds = time.perf_counter() - t_setup
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
        if teacher is not None and callback is None:
            scope.enter_context(causal_sdpa(objective._unwrap(teacher), cfg.seq_len))
        step, tokens, train_seconds, warmup = _loop(ctx, stream, loader, run_dir, history, step, tokens, steps,
                                                    callback, show_progress, description)
    model.eval()
    return {"steps": step, "tokens": tokens, "final_loss": history[-1]["loss"] if history else None,
            "warmup": warmup if step - step0 > WARMUP_LOG_STEPS else None, "attention": attention,
            "tok_per_s": (tokens - tokens0) / train_seconds if train_seconds > 0 else None,
            "seconds": train_seconds, "data_setup_seconds": setup_seconds,
            "peak_memory_bytes": peak_memory_bytes(), "history": history, "world_size": world,
            "mixed_precision": precision, "shard_base": sharded, "packed_bytes_per_process": packed_bytes,
            "model": accelerator.unwrap_model(model), "is_main_process": accelerator.is_main_process}

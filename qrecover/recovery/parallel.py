"""How the recovery loop runs on several processes: the launch modes it accepts, and the sharded base.

Scaling is accelerate's: ``qrecover recover ...`` runs on one process; ``accelerate launch -m qrecover.cli
recover ...`` (or ``torchrun``) runs data parallel (DDP), each process taking every ``world``-th sequence of the
same deterministic data stream.

**Sharded base** (``cfg.shard_base`` on several processes): the packed tensors become frozen parameters and torch's
FSDP2 (``fully_shard``) shards them, each decoder layer one group gathered as it runs and the rest of the model
(embedding, final norm, head) the root group, so a process holds ``1/world`` of the base at rest (tested: 2 CPU
processes hold half the tiny model's packed bytes each). The adapter is left out of FSDP (``ignored_params``): it
stays whole on every process, as under DDP, its gradients averaged by one all-reduce per optimizer step
(:func:`average_adapter_grads`), so checkpoints and the exported adapter are the unsharded run's, and a sharded
run resumes unsharded and the reverse (tested). accelerate's own FSDP plugin (``--use_fsdp``) stays refused.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import torch
import torch.nn as nn

from ..errors import QRecoverError
from ..models import decoder_layers
from ..qlinear import local_packed_bytes, packed_as_parameters
from . import objective
from .checkpoints import trainable


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


def shard_base(model: nn.Module, device: torch.device, world: int) -> None:
    """Shard the frozen packed base of ``model`` (PEFT-wrapped) across the ``world`` processes with FSDP2, in place.

    The packed tensors become frozen parameters (FSDP shards parameters, not buffers); each decoder layer is one
    FSDP group (all-gathered before it runs, freed after, again in backward), the rest of the transformers model
    (embedding, final norm, head: the tied head reads the embedding's packed tensors) the root group, gathered for
    each micro-batch. FSDP is applied to the transformers model inside PEFT, so the loss code that calls it directly
    (the chunked head check, :func:`objective.output_head`) still goes through its hooks. The adapter is ignored
    by FSDP: whole on every process (moved to ``device`` here), plain tensors, its gradients averaged by
    :func:`average_adapter_grads`; FSDP itself reduces no gradient (the base has none). The parameters FSDP
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
    adapter = set(trainable(model).values())
    packed_as_parameters(model)
    base = objective._unwrap(model)
    mesh = init_device_mesh(device.type, (world,))
    for layer in decoder_layers(base):
        fully_shard(layer, mesh=mesh, ignored_params=adapter)
    fully_shard(base, mesh=mesh, ignored_params=adapter)
    for t in itertools.chain(model.parameters(), model.buffers()):  # what FSDP did not move: the adapter
        if not isinstance(t, DTensor) and t.device != device:
            t.data = t.data.to(device)


def average_adapter_grads(params: list[torch.Tensor], world: int) -> None:
    """With the base sharded, FSDP leaves the adapter's gradients alone: average them over the processes here, as
    DDP would (so the loop's loss weights hold unchanged), in one all-reduce per dtype, once per optimizer step. A
    parameter without a gradient gets zeros on every process, so all send the same layout."""
    import torch.distributed as dist

    for dtype in dict.fromkeys(p.dtype for p in params):  # insertion order: the same on every process
        group = [p for p in params if p.dtype == dtype]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in group])
        dist.all_reduce(flat)
        flat /= world
        for p, g in zip(group, flat.split([p.numel() for p in group])):
            p.grad = g.view_as(p)


def packed_bytes_per_process(model: nn.Module, accelerator: Any) -> list[int]:
    """The packed base bytes each process holds (its shards when the base is sharded), gathered: the record that
    sharding split the base (with DDP every process holds all of it)."""
    mine = torch.tensor([local_packed_bytes(model)], dtype=torch.int64, device=accelerator.device)
    return [int(b) for b in (accelerator.gather(mine) if accelerator.num_processes > 1 else mine).tolist()]

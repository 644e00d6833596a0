"""A training run's checkpoints: what they hold, how they are written and read, and resuming from one.

Every ``checkpoint_every`` optimizer steps the main process writes ``checkpoints/step-N.pt`` (adapter weights in
fp32, optimizer, scheduler, step, tokens, the data loader's exact position and every RNG state) atomically.
``resume=True`` continues from the newest one, and the run ends where an uninterrupted run would (tested: same
weights).

A checkpoint holds tensors and plain values only (dicts, lists, numbers, strings: the RNG states as tensors and
lists), and is read with ``torch.load(weights_only=True)``: a checkpoint directory from someone else cannot run
code (a file with any other pickled object is refused).
"""

from __future__ import annotations

import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ..errors import QRecoverError
from ..io_utils import atomic_file
from .config import RecoverConfig

CHECKPOINTS = "checkpoints"
CHECKPOINT_FORMAT = 2  # 2: plain values only (weights_only loading); 1 pickled numpy and Python RNG objects


def trainable(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters that train (the adapter's), by name: what a checkpoint saves and restores."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def rng_state(device: torch.device | str = "cpu") -> dict[str, Any]:
    """Every RNG state this process trains with, as tensors and plain values (what ``weights_only`` loading accepts):
    Python's, numpy's, torch's CPU generator and, when ``device`` (the adapter's) is a GPU, that GPU's generator only:
    not every visible GPU's, which a resume with fewer visible GPUs (``CUDA_VISIBLE_DEVICES`` per process) could not
    restore."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss},
             "numpy": {"kind": str(kind), "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
             "torch": torch.get_rng_state()}
    device = torch.device(device)
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device | str = "cpu") -> None:
    """Restore the RNG states :func:`rng_state` recorded; the GPU generator's onto ``device`` (the adapter's, where this
    process trains now). Checkpoints written before 2026-11-29 hold every visible GPU's state as a list: the entry of
    ``device``'s index is restored, when it has one."""
    py, npy = state["python"], state["numpy"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    device = torch.device(device)
    if "cuda" not in state or device.type != "cuda":
        return
    saved = state["cuda"]
    if isinstance(saved, (list, tuple)):
        index = torch.cuda.current_device() if device.index is None else device.index
        saved = saved[index] if index < len(saved) else None
    if saved is not None:
        torch.cuda.set_rng_state(saved, device)


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
    """The newest checkpoint of the run in ``run_dir``, or None."""
    found = sorted((run_dir / CHECKPOINTS).glob("step-*.pt"))
    return found[-1] if found else None


def save_checkpoint(path: Path, state: dict[str, Any], keep: int = 2) -> None:
    """Write atomically (temp file + rename), then drop all but the newest ``keep`` checkpoints."""
    with atomic_file(path) as tmp:
        torch.save(state, tmp)
    for old in sorted(path.parent.glob("step-*.pt"))[:-keep]:
        old.unlink()


# Settings that only say how a step is executed (not what it computes): a resumed run may change them, the split of the
# global batch into (processes, batch_size, grad_accum) included as long as its product is unchanged.
EXECUTION_FIELDS = ("batch_size", "grad_accum", "checkpoint_every", "log_every", "compile_layers", "fused_layers", "gradient_checkpointing",
                    "cache_dequantized", "loss_chunk",
                    "teacher_device", "shard_base", "teacher_graph")


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


def _device(model: nn.Module) -> torch.device:
    """Where the adapter trains (its first trainable parameter's device; the CPU without one)."""
    return next((p.device for p in trainable(model).values()), torch.device("cpu"))


def checkpoint_state(cfg: RecoverConfig, world: int, step: int, tokens: int, history: list[dict[str, Any]],
                     model: nn.Module, optimizer: Any, scheduler: Any, loader: Any) -> dict[str, Any]:
    """What a checkpoint after optimizer step ``step`` holds (``model`` unwrapped: its adapter weights on the CPU)."""
    return {
        "format": CHECKPOINT_FORMAT, "config": cfg.to_dict(), "world": world, "step": step, "tokens": tokens,
        "history": history,
        "adapter": {n: p.detach().cpu().clone() for n, p in trainable(model).items()},
        "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
        "loader": loader.state_dict(), "rng": rng_state(_device(model))}


def resume_from(ckpt: Path, cfg: RecoverConfig, world: int, rank: int, run_dir: Path, model: nn.Module,
                optimizer: Any, scheduler: Any, loader: Any) -> tuple[int, int, list[dict[str, Any]]]:
    """Restore adapter, optimizer, scheduler, data position and RNG exactly as checkpoint ``ckpt`` holds them
    (``model`` unwrapped); returns its ``(step, tokens, history)``. Refuses a checkpoint of another run
    (:func:`check_resume`, or adapter weights missing)."""
    state = load_checkpoint(ckpt)
    check_resume(state["config"], checkpoint_world(state), cfg, world, run_dir)
    missing = set(trainable(model)) - set(state["adapter"])
    if missing:
        raise QRecoverError(f"checkpoint {ckpt} lacks adapter weights {sorted(missing)[:3]}; it belongs to another run")
    with torch.no_grad():
        for n, p in trainable(model).items():
            p.copy_(state["adapter"][n])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    loader.load_state_dict(state["loader"])
    step, tokens, history = state["step"], state["tokens"], state["history"]
    set_rng_state(state["rng"], _device(model))
    if rank > 0:  # the main process's RNG state is the checkpoint's; the others reseed from (seed, rank, step)
        torch.manual_seed(hash((cfg.seed, rank, step)) % 2**63)
    return step, tokens, history

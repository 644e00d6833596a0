"""``tune``: train a checkpoint's continuous quantization parameters end to end, codes frozen, zero extra bytes.

What trains (``TuneConfig.params``, any of):

- ``tables``: the palettized layers' look-up tables ``lut (O/G * I/C, 2**bits)``;
- ``scales``: the blockwise/GPTQ layers' scales ``scale (O, I/B)`` (zero points are integer codes: frozen);
- ``embedding``: the packed embedding's tables or scales (the tied output head reads the same tensors);
- ``norms``: the RMSNorm/LayerNorm weights of the 16-bit remainder;
- ``codes``: the linear layers' integer codes (PV-tuning's discrete step, as straight-through QAT): an fp32 master
  weight per layer, starting at the dequantized weight; every forward re-assigns each code to the table entry (or
  grid point) nearest the master, and the gradient passes straight through to the master. At ``--codes-lr`` (row
  units, larger than the tables' ``--lr``) a master crosses to its neighbour's entry after a run of consistent steps.

Each packed tensor that trains gets an fp32 master Parameter (:meth:`qrecover.qlinear._Packed.set_masters`): the
layer's dense weight is then the scheme's own ``dequantize`` of the frozen codes and the masters, differentiable in
them (EfficientQAT's E2E-QP for scales, PV-tuning's continuous step for tables). Training is the recovery loop
unchanged (:func:`qrecover.recovery.train.train`: data mix or prepared shards, distillation objective, chunked loss,
resume, DDP, progress); the masters and norms are its trainable parameters.

On save every master is rounded to its stored dtype (fp16) and the checkpoint is written again with the same
tensors, names, dtypes and shapes: the weights file has the source's exact byte count, so every kernel and exporter
reads it as before. The manifest keeps everything of the source's but the weights hash and adds ``tuning``: the
source checkpoint (path, manifest and weights sha256), what was tuned, on which data, tokens, the training summary,
and what rounding the masters to fp16 cost (held-out perplexity with the fp32 masters and after rounding).

Layout of OUT while training: ``run.json`` and ``checkpoints/`` (resumable); at the end the checkpoint files, then
``qrecover.json`` last (its presence means complete), ``train_log.jsonl`` and ``data_report.json`` beside them.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
from safetensors.torch import load_file, save_file

from ..adapters.svd_init import init_device
from ..checkpoint import MANIFEST, read_manifest, source_model_spec
from ..data.mix_recipe import Mix
from ..errors import QRecoverError
from ..evaluate.perplexity import perplexity
from ..io_utils import atomic_file, sha256_file, write_text_atomic
from ..loading import load
from ..qlinear import _Packed
from ..stages.write import measure_bpw
from .api import (
    CHECKPOINTS,
    RUN_FILE,
    _is_main_process,
    _make_loader,
    _require_checkpoint,
    _run_dir,
    check_training_inputs,
    in_checkpoint_basis,
    load_teacher,
    train_on_data,
)
from .blocks import reconstruct_blocks
from .config import PARAM_KINDS, TuneConfig
from .objective import place_teacher
from .train import latest_checkpoint

#: the continuous stored tensor of each scheme and the --params kind it belongs to in a linear layer
CONTINUOUS = {"palettize": ("lut", "tables"), "blockwise": ("scale", "scales"), "gptq": ("scale", "scales")}
EXPORT = ".export"  # the checkpoint files while they are written, moved into OUT at the end
BLOCKS_FILE = "blocks.pt"  # the block-wise pass's result (trainable tensors + record), so that --resume skips it


# --- what trains: from the manifest alone (no model) ---------------------------------------------------------

def plan(manifest: dict[str, Any], kinds: tuple[str, ...]) -> tuple[dict[str, tuple[str, ...]], list[str]]:
    """``(packed layer name -> stored tensor names to train, remainder norm weights to train)`` for ``kinds``."""
    layers = {}
    for name, info in manifest["layers"].items():
        tensor, kind = CONTINUOUS.get(info["scheme"], (None, None))
        if tensor is None or tensor not in info["tensors"]:
            continue
        linear = info["kind"] == "linear"
        tensors = (tensor,) if (kind in kinds if linear else "embedding" in kinds) else ()
        if linear and "codes" in kinds:
            tensors += ("qdata",)
        if tensors:
            layers[name] = tensors
    norms = [n for n, v in manifest.get("remainder", {}).items()
             if "norms" in kinds and n.endswith(".weight") and "norm" in n.rsplit(".", 2)[-2] and len(v["shape"]) == 1]
    return layers, norms


def check_tunable(checkpoint: str | Path, cfg: TuneConfig) -> tuple[Path, dict[str, Any], dict[str, tuple[str, ...]], list[str]]:
    """The checkpoint path, its manifest and :func:`plan`, or a QRecoverError naming why nothing would train."""
    path = Path(checkpoint)
    if (path / "adapter_config.json").is_file() and not (path / MANIFEST).is_file():
        raise QRecoverError(f"{str(checkpoint)!r} is an adapter directory, not a checkpoint; pass the checkpoint it was "
                            "trained on (its qrecover_adapter.json names it) to tune, then train adapters on the tuned one")
    path = _require_checkpoint(checkpoint)
    manifest = read_manifest(path)
    layers, norms = plan(manifest, cfg.kinds)
    if not layers and not norms:
        schemes = sorted({f"{v['scheme']} ({v['kind']})" for v in manifest["layers"].values()})
        raise QRecoverError(f"--params {cfg.params!r} selects nothing to tune in {str(checkpoint)!r}, whose layers are "
                            f"{', '.join(schemes)}; palettize has tables, blockwise/gptq scales: pick --params accordingly, "
                            "e.g. --params tables,scales,norms")
    return path, manifest, layers, norms


def make_tunable(model: nn.Module, layers: dict[str, tuple[str, ...]], norms: list[str], code_step: float = 1.0) -> int:
    """Freeze ``model``, then make the planned tensors trainable (fp32 masters, norm weights); returns how many
    values train. ``code_step``: the codes' master weights move ``code_step`` times as far per step as the tables'."""
    model.requires_grad_(False)
    for name, tensors in layers.items():
        module = model.get_submodule(name)
        if not isinstance(module, _Packed):
            raise QRecoverError(f"{name} is a {type(module).__name__}, not a packed layer; the checkpoint does not match its model")
        module.set_masters(tensors, code_step)
    for n in norms:
        model.get_parameter(n).requires_grad_(True)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def tuned_tensors(model: nn.Module, layers: dict[str, tuple[str, ...]], norms: list[str],
                  manifest: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Round the masters (and norms) to their stored dtypes; returns them by their names in the weights file."""
    out = {}
    for name in layers:
        for t, v in model.get_submodule(name).commit_masters().items():
            out[f"{name}.{t}"] = v.cpu()
    for n in norms:
        dtype = getattr(torch, manifest["remainder"][n]["dtype"])
        out[n] = model.get_parameter(n).detach().to("cpu", dtype).contiguous()
    return out


def block_phase(model: nn.Module, teacher: nn.Module, tokenizer: Any, cfg: TuneConfig, mix: Any, manifest: dict[str, Any],
                out: Path, resume: bool, show_progress: bool) -> tuple[dict[str, Any], Any]:
    """``(record, loader)``: the block-wise reconstruction (:mod:`.blocks`) of ``model``'s trainable tensors on
    ``cfg.block_tokens`` tokens of the tuning data, saved to ``OUT/blocks.pt``; with ``resume`` a saved result is loaded
    instead (``loader`` None then)."""
    path = out / BLOCKS_FILE
    if resume and path.is_file():
        saved = torch.load(path, map_location="cpu", weights_only=True)
        params = dict(model.named_parameters())
        with torch.no_grad():
            for k, v in saved["params"].items():
                params[k].copy_(v)
        return saved["record"], None
    loader = _make_loader(cfg, tokenizer, cfg.block_tokens, mix if isinstance(mix, Mix) else None,
                          generator=teacher if teacher is not None else source_model_spec(manifest), show_progress=show_progress)
    n = cfg.block_tokens // cfg.seq_len
    windows = torch.stack([seq["input_ids"] for _, seq in zip(range(n), loader)])
    device = init_device()
    place_teacher(teacher, device, "no")
    model.to(device)
    record = reconstruct_blocks(model, teacher, windows, cfg, device, show_progress)
    record["data"] = cfg.mix or "the shipped default mix"
    if _is_main_process():
        state = {k: p.detach().cpu() for k, p in model.named_parameters() if p.requires_grad}
        with atomic_file(path) as tmp:
            torch.save({"params": state, "record": record}, tmp)
    return record, loader


# --- writing the tuned checkpoint ------------------------------------------------------------------------

def write_tuned(source: Path, out: Path, tensors: dict[str, torch.Tensor], record: dict[str, Any]) -> dict[str, Any]:
    """Write into ``out`` the checkpoint ``source`` with ``tensors`` replaced (same names, dtypes and shapes, so the
    same byte count) and ``record`` as the manifest's ``tuning``; every other file is copied; the manifest last."""
    manifest = read_manifest(source)
    weights_name = manifest["weights_file"]["name"]
    state = load_file(str(source / weights_name))
    for k, v in tensors.items():
        old = state.get(k)
        if old is None or old.dtype != v.dtype or old.shape != v.shape:
            raise QRecoverError(f"tuned tensor {k} {tuple(v.shape)} {v.dtype} does not replace the checkpoint's "
                                f"{None if old is None else (tuple(old.shape), old.dtype)}; the checkpoint changed while tuning")
        state[k] = v
    tmp = out / EXPORT
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in source.iterdir():  # config, generation config, tokenizer
        if f.is_file() and f.name not in (weights_name, MANIFEST):
            shutil.copy2(f, tmp / f.name)
    save_file(state, str(tmp / weights_name), metadata={"format": "qrecover"})
    measured = measure_bpw(tmp / weights_name, manifest)
    if measured["bytes"]["file"] != (source / weights_name).stat().st_size or measured["bpw"] != manifest["measured_bpw"]:
        raise QRecoverError(f"the tuned weights file has {measured['bytes']['file']} bytes, the source "
                            f"{(source / weights_name).stat().st_size}: tuning must not change the size (a bug)")
    record["source"] = {"path": str(source.resolve()), "manifest_sha256": sha256_file(source / MANIFEST),
                        "weights_sha256": manifest["weights_file"]["sha256"]}
    if manifest.get("tuning"):
        record["previous"] = manifest["tuning"]
    manifest["weights_file"] = {"name": weights_name, "sha256": sha256_file(tmp / weights_name)}
    manifest["tuning"] = record
    names = sorted(f.name for f in tmp.iterdir())
    for name in names:
        os.replace(tmp / name, out / name)
    write_text_atomic(out / MANIFEST, json.dumps(manifest, indent=1))  # last: its presence means "complete"
    shutil.rmtree(tmp, ignore_errors=True)
    return manifest


def _check_out(out: Path, overwrite: bool, resume: bool) -> None:
    if out.exists() and not out.is_dir():
        raise QRecoverError(f"--out {str(out)!r} is a file; pass another --out")
    if out.exists() and not (overwrite or resume):
        state = "a tuned checkpoint" if (out / MANIFEST).is_file() else "an unfinished run (resume it with --resume)"
        raise QRecoverError(f"--out {str(out)!r} already exists and holds {state}; pass --overwrite to tune again from "
                            "scratch, or --resume to continue its last checkpoint")


def _rounding_cost(model: nn.Module, tokenizer: Any, cfg: TuneConfig, commit: Callable[[], dict[str, torch.Tensor]]
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """``commit()`` (rounds the masters), with held-out perplexity measured before and after it."""
    if cfg.rounding_windows == 0:
        return commit(), None
    before = perplexity(model, tokenizer, "python-docs", cfg.rounding_windows, cfg.seq_len, show_progress=False)["ppl"]
    tensors = commit()
    after = perplexity(model, tokenizer, "python-docs", cfg.rounding_windows, cfg.seq_len, show_progress=False)["ppl"]
    return tensors, {"text": "python-docs eval", "windows": cfg.rounding_windows, "seq_len": cfg.seq_len,
                     "ppl_fp32_masters": before, "ppl_rounded": after}


def tune(checkpoint: str | Path, out: str | Path, cfg: TuneConfig | None = None, overwrite: bool = False,
         resume: bool = False, show_progress: bool = True, keep_checkpoints: bool = False,
         callback: Callable[[dict[str, Any]], None] | None = None, teacher: nn.Module | None = None) -> dict[str, Any]:
    """Tune ``checkpoint``'s continuous parameters (``cfg.params``) and write the tuned checkpoint to ``out``; returns
    its manifest. ``teacher``/``callback``: as :func:`qrecover.recovery.api.recover`'s."""
    from transformers import AutoTokenizer

    cfg = cfg or TuneConfig()
    out = Path(out)
    if resume and (out / MANIFEST).is_file():  # finished (the main process reports it)
        return read_manifest(out) if _is_main_process() else {}
    # --- every input checked before any model loads -----------------------------------------------------
    source, manifest, layers, norms = check_tunable(checkpoint, cfg)
    if out.resolve() == source.resolve():
        raise QRecoverError(f"--out {str(out)!r} is the checkpoint being tuned; pass another directory")
    mix = check_training_inputs(cfg, source, manifest, teacher is None and (cfg.objective != "ce" or cfg.block_tokens > 0),
                                f"--objective {cfg.objective} --block-tokens {cfg.block_tokens}", teacher is None)
    with _run_dir(out, overwrite, resume, check=_check_out,
                  resumable=lambda d: latest_checkpoint(d) is not None or (d / BLOCKS_FILE).is_file()):
        if _is_main_process():
            write_text_atomic(out / RUN_FILE, json.dumps({"status": "tuning", "checkpoint": str(source), "config": cfg.to_dict(),
                                                          "started": time.strftime("%Y-%m-%dT%H:%M:%S")}, indent=1))
        model = load(source, cache=cfg.cache_dequantized)
        tokenizer = AutoTokenizer.from_pretrained(source)
        if (cfg.objective != "ce" or cfg.block_tokens) and teacher is None:
            teacher = load_teacher(manifest)
        elif teacher is not None:
            teacher = in_checkpoint_basis(teacher, manifest)
        trainable = make_tunable(model, layers, norms, cfg.code_step)
        blocks, loader = block_phase(model, teacher, tokenizer, cfg, mix, manifest, out, resume, show_progress) \
            if cfg.block_tokens else (None, None)
        if cfg.tokens:
            summary, loader = train_on_data(model, cfg, tokenizer, mix, manifest, out, teacher, resume, show_progress,
                                            callback, f"tune {cfg.params}")
        else:  # block-wise only
            summary = {"steps": 0, "tokens": 0, "final_loss": None, "seconds": 0.0, "tok_per_s": None, "history": [],
                       "is_main_process": _is_main_process()}
        if not summary["is_main_process"]:
            return {}
        tensors, rounding = _rounding_cost(model, tokenizer, cfg, lambda: tuned_tensors(model, layers, norms, manifest))
        training = {k: v for k, v in summary.items() if k not in ("history", "model", "is_main_process")}
        record = {"params": list(cfg.kinds), "layers": len(layers), "norms": len(norms), "trainable_values": trainable,
                  "tensors": sorted(tensors), "data": cfg.mix or "the shipped default mix", "tokens": summary["tokens"],
                  "objective": cfg.objective, "config": cfg.to_dict(), "training": training, "blocks": blocks,
                  "rounding": rounding,
                  "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
        with open(out / "train_log.jsonl", "w") as f:
            for row in summary["history"]:
                f.write(json.dumps(row) + "\n")
        if loader is not None:
            write_text_atomic(out / "data_report.json", json.dumps(loader.report(), indent=1, default=str) + "\n")
        result = write_tuned(source, out, tensors, record)
        if not keep_checkpoints:
            shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
            (out / BLOCKS_FILE).unlink(missing_ok=True)
        (out / RUN_FILE).unlink(missing_ok=True)
        return result


__all__ = ["TuneConfig", "PARAM_KINDS", "plan", "check_tunable", "make_tunable", "tuned_tensors", "write_tuned", "tune"]

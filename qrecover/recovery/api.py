"""``recover`` and ``finetune``: the entry points the CLI and the pipeline call.

``recover(CHECKPOINT, OUT, cfg)`` trains one LoRA recovery adapter on the frozen quantized checkpoint and
writes a PEFT adapter directory::

    OUT/adapter_config.json          PEFT: PeftModel.from_pretrained(qrecover.load(CHECKPOINT), OUT)
    OUT/adapter_model.safetensors    LoRA A/B of every adapted projection, float16
    OUT/qrecover_adapter.json        the base it belongs to (hashes), rank, bytes, bpw cost, training summary
    OUT/data_report.json             tokens per source, epochs, decontamination (what was dropped and why)
    OUT/train_log.jsonl              one line per optimizer step: tokens, loss, lr, tokens/s

Every input (the checkpoint, the data mix: TOML, keys, values and the files it names; the unquantized model
distillation needs; a finetune's init adapter and data) is checked before any model loads, so bad input costs
no time and writes nothing. While training, OUT holds ``run.json`` and ``checkpoints/``; the adapter files
appear only when training has finished (``qrecover_adapter.json`` last), so a crash never leaves a loadable
half-trained adapter. A run that fails or is interrupted before its first checkpoint removes the OUT it
created; after one, OUT keeps ``run.json`` and ``checkpoints/`` (nothing else) for ``--resume``.
"""

from __future__ import annotations

import contextlib
import copy as copy_module
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..adapters.int8 import INT8_FILE
from ..adapters.lora import ADAPTER_META, attach_lora, base_identity, check_base, quantized_targets, save_adapter
from ..adapters.rank_alloc import damage_ranks
from ..adapters.svd_init import init_device, init_error_svd
from ..checkpoint import MANIFEST, read_manifest, source_model_spec
from ..data.mix import MixLoader, calibration_windows
from ..data.mix_recipe import Mix, load_mix, single_source_mix
from ..data.shards import ShardLoader, check_tokenizer, is_prepared, read_data_manifest
from ..data.sources import GeneratedSource
from ..errors import QRecoverError
from ..io_utils import cache_dir, sha256_file, write_text_atomic
from ..loading import attach_adapter, load
from ..models import DEFAULT_MODEL, default_gguf_path, load_model, resolve
from ..recipes import DEFAULT_MIX, shipped_path
from ..transforms import get_transform, model_level_names
from .config import RecoverConfig
from .objective import place_teacher
from .train import CHECKPOINTS, latest_checkpoint, process_state, total_steps, train

INIT_WINDOWS = 8  # calibration windows (of 512 tokens) whose inputs weight the 'svd' initialisation
RUN_FILE = "run.json"
EXPORT = ".export"  # the adapter files while they are written, moved into OUT at the end


def default_mix_path() -> Path:
    """The shipped recovery data mix (package data: ``qrecover/recipes/default-mix.toml``)."""
    return shipped_path(DEFAULT_MIX)


def read_mix(mix: str | Path | None) -> Mix:
    """The data mix ``--mix`` names (None: the shipped default), validated whole: TOML, keys, value types and
    ranges, and that every file and directory it names exists. Cheap: no model, no tokenizer."""
    if mix is not None and not Path(mix).expanduser().is_file():
        raise QRecoverError(f"--mix {str(mix)!r} does not exist; pass a data-mix TOML with [[source]] tables, or leave "
                            "--mix out for the shipped default mix")
    path = default_mix_path() if mix is None else Path(mix)
    try:
        return load_mix(path)
    except QRecoverError as e:
        raise (e if str(path) in str(e) else QRecoverError(f"mix {str(path)!r}: {e}")) from None


def read_mix_or_data(mix: str | Path | None) -> Mix | dict[str, Any]:
    """:func:`read_mix`, or the manifest of a directory prepared by ``qrecover data prepare`` (format checked)."""
    if is_prepared(mix):
        return read_data_manifest(mix)
    if mix is not None and Path(mix).expanduser().is_dir():
        raise QRecoverError(f"--mix {str(mix)!r} is a directory without a manifest.json: not prepared data; prepare it with "
                            f"`qrecover data prepare MIX.toml --out {mix}`, or pass a data-mix TOML")
    return read_mix(mix)


def _require_checkpoint(checkpoint: str | Path) -> Path:
    if not Path(checkpoint).expanduser().exists():
        raise QRecoverError(f"checkpoint {str(checkpoint)!r} does not exist; pass the directory that "
                            "`qrecover compress --out DIR` wrote")
    given = Path(checkpoint).expanduser()
    if given.is_dir() and not (given / MANIFEST).is_file() and not (given / "config.json").is_file():
        raise QRecoverError(f"{str(checkpoint)!r} is not a qrecover checkpoint (no {MANIFEST}); pass the directory that "
                            "`qrecover compress --out DIR` wrote")
    path, kind = resolve(str(checkpoint))
    if kind != "qrecover":
        raise QRecoverError(f"{str(checkpoint)!r} is an unquantized model ({kind}); recovery trains adapters on a "
                            "compressed checkpoint: run `qrecover compress` first and pass its output directory")
    return path


def is_complete(out: Path) -> bool:
    return (out / ADAPTER_META).is_file() and (out / "adapter_config.json").is_file()


def _check_out(out: Path, overwrite: bool, resume: bool) -> None:
    if out.exists() and not out.is_dir():
        raise QRecoverError(f"adapter directory {str(out)!r} is a file; pass another --out")
    if out.exists() and not (overwrite or resume):
        state = "a finished adapter" if is_complete(out) else "an unfinished run (resume it with --resume)"
        raise QRecoverError(f"adapter directory {str(out)!r} already exists and holds {state}; pass --overwrite "
                            "to train again from scratch, or --resume to continue its last checkpoint")


@contextlib.contextmanager
def _run_dir(out: Path, overwrite: bool, resume: bool, check: Callable[[Path, bool, bool], None] = _check_out,
             resumable: Callable[[Path], bool] = lambda out: latest_checkpoint(out) is not None) -> Iterator[None]:
    """``out`` ready for a run; on any failure (Ctrl-C included) the half-written export goes, and so does
    ``out`` itself when this call created it and nothing ``resumable`` (a checkpoint) was written.

    Under ``accelerate launch``/``torchrun`` every process checks ``out`` before the main one (rank 0, on the
    shared filesystem) changes anything; only the main process creates, clears or writes there."""
    procs = process_state()  # joins the process group of a distributed launch; one process otherwise
    check(out, overwrite, resume)
    created = overwrite or not out.exists()
    procs.wait_for_everyone()
    if procs.is_main_process:
        if out.exists() and overwrite:
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
    procs.wait_for_everyone()
    try:
        yield
    except BaseException:
        if procs.is_main_process:
            shutil.rmtree(out / EXPORT, ignore_errors=True)
            if created and not resumable(out):
                shutil.rmtree(out, ignore_errors=True)
        raise


def check_training_inputs(cfg: RecoverConfig, checkpoint: Path, manifest: dict[str, Any], needs_teacher: bool, why: str,
                          may_load_teacher: bool = True) -> Mix | dict[str, Any]:
    """The training data ``cfg.mix`` read and checked (a mix, or prepared data made with this checkpoint's tokenizer),
    and the unquantized model found where the manifest says when ``needs_teacher`` (``why``: the options that need
    it) or when the mix's self-generated sources need it (and ``may_load_teacher``). Loads no model."""
    from transformers import AutoTokenizer

    mix = read_mix_or_data(cfg.mix)
    if isinstance(mix, dict):  # prepared data: tokenized by this checkpoint's tokenizer, decontaminated if asked
        check_tokenizer(mix, AutoTokenizer.from_pretrained(checkpoint), cfg.mix)
        if cfg.decontaminate and mix["decontamination"] is None:
            raise QRecoverError(f"prepared data {cfg.mix!r} was made with --no-decontaminate; prepare it again without it, "
                                "or train with --no-decontaminate")
    if needs_teacher:
        _check_teacher_source(manifest, why)
    elif may_load_teacher and isinstance(mix, Mix) and any(isinstance(s, GeneratedSource) and not s.model for s in mix.sources):
        _check_teacher_source(manifest, "the mix's self-generated sources (selfgen or selftext without a model)")
    return mix


def _is_main_process() -> bool:
    return process_state().is_main_process


def _check_teacher_source(manifest: dict[str, Any], why: str) -> None:
    """The unquantized model the checkpoint was compressed from is where the manifest says (not loaded)."""
    src = manifest["source"]
    if src["kind"] == "default":
        if not (cache_dir() / "models" / DEFAULT_MODEL / "model.safetensors").exists():  # not converted yet
            default_gguf_path()  # raises, naming the package to install, when the GGUF is missing
        return
    try:
        resolve(src["path"])
    except QRecoverError as e:
        raise QRecoverError(f"{why} needs the unquantized model the checkpoint was compressed from, "
                            f"{src['path']!r}: {e}. Restore it, or pass --objective ce --init zero") from None


def _select_targets(model: torch.nn.Module, cfg: RecoverConfig) -> list[str] | None:
    """``None`` (every quantized projection) or the ``top:N`` layers by quantization damage in the manifest."""
    if cfg.targets == "all":
        return None
    n = int(cfg.targets.removeprefix("top:"))
    layers = model.qrecover_manifest["layers"]
    linear = [(info.get("damage") or 0.0, name) for name, info in layers.items() if info["kind"] == "linear"]
    return [name for _, name in sorted(linear, reverse=True)[:n]]


def load_teacher(manifest: dict[str, Any]) -> torch.nn.Module:
    """The unquantized model the checkpoint was compressed from, checked against the manifest's hash."""
    src = manifest["source"]
    spec = None if src["kind"] == "default" else src["path"]
    model, _, source = load_model(spec)
    if source.weights_sha256 != src["weights_sha256"]:
        raise QRecoverError(f"the unquantized model at {src['path']!r} has changed since compression (weights sha256 "
                            f"{source.weights_sha256[:12]}... vs {src['weights_sha256'][:12]}... in the manifest); "
                            "distillation needs the original: restore it, or use --objective ce")
    return in_checkpoint_basis(model, manifest, copy=False)


def in_checkpoint_basis(teacher: torch.nn.Module, manifest: dict[str, Any], copy: bool = True) -> torch.nn.Module:
    """The teacher with the checkpoint's model-level transforms replayed (``rot+``, ``r4+``: seeded and data-free), so
    that layer by layer its weights and inputs are the ones the checkpoint's layers quantized: the 'svd'
    initialisation (``W - Q``), the damage rank allocation and the block-wise pass compare them. Its function, hence
    distillation, is unchanged. ``copy``: transform a copy (a caller's teacher is left as it was). AWQ's scales are
    fitted to data and not stored, so an ``awq+`` checkpoint's teacher stays as it is (its 'svd' initialisation does
    not match the scaled layers: a known limitation, ``--init zero`` avoids it)."""
    names = model_level_names(manifest)
    done = getattr(teacher, "qrecover_transforms", [])
    if done == names:
        return teacher
    if done:
        raise QRecoverError(f"the teacher given was already transformed ({'+'.join(done)}) for another checkpoint; pass the "
                            "unquantized model as loaded")
    teacher = copy_module.deepcopy(teacher) if copy else teacher
    device = next(teacher.parameters()).device
    for name in names:
        get_transform(name).apply_model(teacher, device)
    teacher.qrecover_transforms = names
    return teacher


def _calibration_windows(tokenizer: Any, manifest: dict[str, Any]) -> tuple[dict[str, Any], torch.Tensor]:
    """``(record, windows)``: ``INIT_WINDOWS`` x 512 tokens of the checkpoint's own calibration text (split
    ``calib``), whose teacher inputs weight the 'svd' initialisation and the rank allocation."""
    calib = manifest.get("calibration") or {}
    source, split = calib.get("source", "python-docs"), calib.get("split", "calib")
    windows = calibration_windows(tokenizer, source, INIT_WINDOWS, 512, model=source_model_spec(manifest))
    return {"source": source, "split": split, "tokens": int(windows.numel())}, windows


def _status(text: str, show: bool):
    """A spinner on stderr while ``text`` runs (nothing when ``show`` is False)."""
    from rich.console import Console

    return Console(stderr=True).status(text, spinner="dots") if show else contextlib.nullcontext()


def _init_from_error(peft_model, teacher: torch.nn.Module, calibration: tuple[dict[str, Any], torch.Tensor],
                     show_progress: bool) -> dict[str, Any]:
    """``init='svd'``: every adapter starts as the input-weighted rank-r approximation of its layer's quantization
    error, the inputs being the teacher's on ``calibration`` (:func:`_calibration_windows`)."""
    record, windows = calibration
    t0 = time.time()
    with _status("initialising adapters from the quantization error", show_progress):
        # the teacher's forward over the windows on the training device too (kept in its dtype; training casts it)
        place_teacher(teacher, init_device(), "no")
        captured = init_error_svd(peft_model, teacher, windows)
    return {"method": "svd", "calibration": record, "output_error_removed": captured.pop("_total"),
            "seconds": round(time.time() - t0, 1), "per_layer": captured}


def _allocate_ranks(model: torch.nn.Module, teacher: torch.nn.Module, windows: torch.Tensor, rank: int,
                    targets: list[str] | None, show_progress: bool) -> dict[str, Any]:
    """``--rank-allocation damage``: ranks per layer for the adapter size of rank ``rank`` everywhere, from the
    layers' damage and error spectra on the calibration ``windows`` (:mod:`.rank_alloc`)."""
    t0 = time.time()
    with _status("allocating adapter ranks by damage", show_progress):
        place_teacher(teacher, init_device(), "no")  # its forward over the windows on the training device
        out = damage_ranks(model, teacher, windows, quantized_targets(model, targets), rank, device=init_device())
    return {"method": "damage", **out, "seconds": round(time.time() - t0, 1)}


def _make_loader(cfg: RecoverConfig, tokenizer: Any, total_tokens: int, mix_path: str | Path | Mix | None,
                 data: str | None = None, generator: Any = None, show_progress: bool = True) -> Any:
    """The packed data stream; ``generator`` is the unquantized instruct model (or its spec) for self-generated
    chat sources. A directory prepared by ``qrecover data prepare`` (``cfg.mix``) is read by :class:`.shards.ShardLoader`."""
    if mix_path is None and data is None and is_prepared(cfg.mix):
        return ShardLoader(cfg.mix, tokenizer, seq_len=cfg.seq_len, total_tokens=total_tokens, seed=cfg.seed)
    mix = single_source_mix(data) if data is not None else load_mix(mix_path or read_mix(cfg.mix))
    return MixLoader(mix, tokenizer, seq_len=cfg.seq_len, total_tokens=total_tokens, seed=cfg.seed,
                     decontaminate=cfg.decontaminate, model=generator, show_progress=show_progress)


def train_on_data(model: torch.nn.Module, cfg: RecoverConfig, tokenizer: Any, mix: Mix | dict[str, Any], manifest: dict[str, Any],
                  out: Path, teacher: torch.nn.Module | None, resume: bool, show_progress: bool,
                  callback: Callable[[dict[str, Any]], None] | None, description: str) -> tuple[dict[str, Any], Any]:
    """``(summary, loader)``: :func:`.train.train` of ``model``'s trainable parameters on ``mix`` (from
    :func:`check_training_inputs`), the data stream sized for ``cfg.tokens`` on this launch's processes."""
    world = process_state().num_processes
    generator = teacher if teacher is not None else source_model_spec(manifest)
    loader = _make_loader(cfg, tokenizer, total_steps(cfg, world) * cfg.tokens_per_step * world,
                          mix if isinstance(mix, Mix) else None, generator=generator, show_progress=show_progress)
    summary = train(model, cfg, loader, out, teacher=teacher, resume=resume, show_progress=show_progress,
                    callback=callback, description=description)
    return summary, loader


def _write_json(path: Path, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=1, default=str) + "\n")


def _finish(peft_model, out: Path, cfg: RecoverConfig, checkpoint: Path, summary: dict[str, Any], loader: Any,
            keep_checkpoints: bool, extra: dict[str, Any]) -> dict[str, Any]:
    """Export the adapter (files moved into ``out``, the metadata last), logs and the data report."""
    manifest = peft_model.qrecover_manifest if hasattr(peft_model, "qrecover_manifest") else None
    tmp = out / EXPORT
    shutil.rmtree(tmp, ignore_errors=True)
    training = {k: v for k, v in summary.items() if k not in ("history", "model", "is_main_process")}
    meta = save_adapter(peft_model, tmp, base_identity(checkpoint), manifest["parameters"]["model"],
                        extra={"config": cfg.to_dict(), "training": training, **extra}, bits=cfg.adapter_bits)
    with open(tmp / "train_log.jsonl", "w") as f:
        for row in summary["history"]:
            f.write(json.dumps(row) + "\n")
    _write_json(tmp / "data_report.json", loader.report())
    for name in ("adapter_model.safetensors", INT8_FILE, "adapter_config.json", "train_log.jsonl", "data_report.json", ADAPTER_META):
        if name != INT8_FILE or (tmp / name).exists():  # the int8 file exists for --adapter-bits 8 only
            os.replace(tmp / name, out / name)  # qrecover_adapter.json last: its presence means "complete"
    shutil.rmtree(tmp, ignore_errors=True)
    if not keep_checkpoints:
        shutil.rmtree(out / CHECKPOINTS, ignore_errors=True)
    (out / RUN_FILE).unlink(missing_ok=True)
    return meta


def recover(checkpoint: str | Path, out: str | Path, cfg: RecoverConfig | None = None, overwrite: bool = False,
            resume: bool = False, show_progress: bool = True, keep_checkpoints: bool = False,
            callback: Callable[[dict[str, Any]], None] | None = None, teacher: torch.nn.Module | None = None,
            ) -> dict[str, Any]:
    """Train one recovery adapter of ``cfg.rank`` on ``checkpoint``; returns its ``qrecover_adapter.json``.

    ``teacher``: the unquantized model, if the caller already holds it (else loaded when the objective
    needs it). ``callback``: see :func:`qrecover.recovery.train.train`.
    """
    from transformers import AutoTokenizer

    cfg = cfg or RecoverConfig()
    checkpoint, out = _require_checkpoint(checkpoint), Path(out)
    if resume and is_complete(out):  # (the main process reports it)
        return json.loads((out / ADAPTER_META).read_text()) if _is_main_process() else {}
    # --- every input checked before any model loads -----------------------------------------------------
    manifest = read_manifest(checkpoint)
    mix = check_training_inputs(cfg, checkpoint, manifest, teacher is None and (
        cfg.objective != "ce" or cfg.init == "svd" or cfg.rank_allocation == "damage"),
        f"--objective {cfg.objective} --init {cfg.init} --rank-allocation {cfg.rank_allocation}", teacher is None)
    with _run_dir(out, overwrite, resume):
        if _is_main_process():
            _write_json(out / RUN_FILE, {"status": "training", "checkpoint": str(checkpoint), "config": cfg.to_dict(),
                                         "started": time.strftime("%Y-%m-%dT%H:%M:%S")})
        model = load(checkpoint, cache=cfg.cache_dequantized)
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        manifest = model.qrecover_manifest
        if (cfg.objective != "ce" or cfg.init == "svd" or cfg.rank_allocation == "damage") and teacher is None:
            teacher = load_teacher(manifest)
        elif teacher is not None:
            teacher = in_checkpoint_basis(teacher, manifest)
        targets = _select_targets(model, cfg)
        calibration = (_calibration_windows(tokenizer, manifest)  # tokenized once for the allocation and the init
                       if cfg.init == "svd" or cfg.rank_allocation == "damage" else None)
        allocation = (_allocate_ranks(model, teacher, calibration[1], cfg.rank, targets, show_progress)
                      if cfg.rank_allocation == "damage" else None)
        torch.manual_seed(cfg.seed)  # the LoRA A initialisation
        peft_model = attach_lora(model, cfg.rank, cfg.alpha, cfg.dropout, targets, cfg.head_rank,
                                 ranks=None if allocation is None else allocation["ranks"])
        peft_model.qrecover_manifest = manifest
        # (on --resume too: deterministic, and the checkpoint's weights then replace it; keeps the record complete)
        init = _init_from_error(peft_model, teacher, calibration, show_progress) if cfg.init == "svd" else {"method": "zero"}
        summary, loader = train_on_data(peft_model, cfg, tokenizer, mix, manifest, out, teacher, resume, show_progress,
                                        callback, f"recover r{cfg.rank}")
        if not summary["is_main_process"]:
            return {}
        return _finish(peft_model, out, cfg, checkpoint, summary, loader, keep_checkpoints,
                       {"checkpoint_sha256": sha256_file(checkpoint / "qrecover.json"), "init": init,
                        **({"rank_allocation": allocation} if allocation is not None else {})})


def init_feature_model(checkpoint: str | Path, init_adapter: str | Path, allow_foreign_adapter: bool = False,
                       cache: bool = True):
    """The quantized base (frozen) with the recovery adapter loaded as trainable weights: a feature adapter's
    step 0. The same as ``PeftModel.from_pretrained(qrecover.load(CKPT), RECOVERY_DIR, is_trainable=True)``."""
    checkpoint = _require_checkpoint(checkpoint)  # the adapter's base: checked once, by load, before it loads
    return load(checkpoint, cache=cache, adapter=init_adapter, allow_foreign_adapter=allow_foreign_adapter, trainable=True)


def finetune(checkpoint: str | Path, init_adapter: str | Path, data: str, out: str | Path,
             cfg: RecoverConfig | None = None, overwrite: bool = False, resume: bool = False,
             show_progress: bool = True, allow_foreign_adapter: bool = False) -> dict[str, Any]:
    """Train a feature adapter that starts from a recovery adapter (its weights at step 0), base frozen.

    ``data``: the feature's training data, a jsonl of ``{"text": ...}`` or ``{"messages": [...]}`` rows (or any
    single source the mix loader reads). The rank is the recovery adapter's; ``cfg.objective`` must be 'ce'
    (a feature team teaches new behaviour, it does not imitate the unquantized model).
    """
    from transformers import AutoTokenizer

    cfg = cfg or RecoverConfig(objective="ce")
    if cfg.objective != "ce":
        raise QRecoverError(f"finetune trains on the feature's data with cross-entropy; --objective {cfg.objective!r} "
                            "is for recovery")
    checkpoint, out = _require_checkpoint(checkpoint), Path(out)
    if resume and is_complete(out):  # (the main process reports it)
        return json.loads((out / ADAPTER_META).read_text()) if _is_main_process() else {}
    # --- every input checked before any model loads -----------------------------------------------------
    if not (Path(init_adapter) / "adapter_config.json").is_file():
        raise QRecoverError(f"--init-adapter {str(init_adapter)!r} is not an adapter directory (no adapter_config.json); "
                            "pass the output directory of `qrecover recover`")
    check_base(init_adapter, checkpoint, allow_foreign_adapter)  # the one base check of this pair (attach_adapter below does not repeat it)
    try:
        mix = single_source_mix(data)
    except QRecoverError as e:
        raise QRecoverError(f"--data {data!r}: {e}") from None
    with _run_dir(out, overwrite, resume):
        peft_model = attach_adapter(load(checkpoint, cache=cfg.cache_dequantized), init_adapter, trainable=True)
        cfg = RecoverConfig.from_dict({**cfg.to_dict(), "rank": peft_model.peft_config["default"].r})
        if _is_main_process():
            _write_json(out / RUN_FILE, {"status": "training", "checkpoint": str(checkpoint),
                                         "init_adapter": str(init_adapter), "config": cfg.to_dict()})
        tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        world = process_state().num_processes
        loader = _make_loader(cfg, tokenizer, total_steps(cfg, world) * cfg.tokens_per_step * world, mix,
                              show_progress=show_progress)
        summary = train(peft_model, cfg, loader, out, resume=resume, show_progress=show_progress, description="finetune")
        if not summary["is_main_process"]:
            return {}
        return _finish(peft_model, out, cfg, checkpoint, summary, loader, False,
                       {"init_adapter": str(Path(init_adapter).resolve()), "data": data})


__all__ = ["recover", "finetune", "init_feature_model", "default_mix_path", "read_mix", "read_mix_or_data",
           "load_teacher", "in_checkpoint_basis", "latest_checkpoint", "is_complete"]

"""The pipeline's plan: its stages, each keyed by content hash, and which of them must run (see
:mod:`qrecover.pipeline`)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._version import __version__
from ..data.corpus import source_files
from ..data.shards import MANIFEST as PREPARED_MANIFEST
from ..data.shards import is_prepared
from ..errors import QRecoverError
from ..evaluate.config import EvalConfig
from ..evaluate.harness import check_tasks
from ..io_utils import sha256_file, sha256_files
from ..models import resolve, weights_sha256
from ..recipes import DEFAULT_MIX, shipped_path
from ..stages.specs import embedding_encodings, linear_encodings
from .recipe import (
    _PATH_OPTIONS,
    STAGE_FILE,
    EvalSection,
    Recipe,
    _bpw_name,
)

# --- plan -----------------------------------------------------------------------------------------------


@dataclass
class Stage:
    """One step of the pipeline. ``config`` and ``inputs`` make the key; ``params`` only tell it how to run."""

    name: str  # e.g. "compress-3.7bpw"
    kind: str  # eval | compress | recover | report
    config: dict[str, Any]  # its own settings, as keyed (paths replaced by content hashes)
    inputs: dict[str, str]  # name -> key of every stage it consumes
    key: str
    dir: Path  # work_dir / f"{name}-{key[:12]}"
    params: dict[str, Any]  # runtime arguments: resolved paths, bpw, rank, ...
    status: str = "run"  # cached | run | resume; "ran" once execute() has run it
    reason: str = ""  # why it runs: new, unfinished, forced, input <name> runs
    seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "key": self.key, "dir": str(self.dir), "status": self.status,
                "reason": self.reason, "inputs": dict(self.inputs), "config": self.config, "seconds": self.seconds}


@dataclass
class Plan:
    recipe: Recipe
    model_sha256: str
    stages: list[Stage]

    @property
    def work_dir(self) -> Path:
        return self.recipe.path(self.recipe.work_dir)

    @property
    def report_dir(self) -> Path:
        return self.recipe.path(self.recipe.report_dir)

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe.source, "model": self.recipe.model_spec or "default", "model_sha256": self.model_sha256,
                "work_dir": str(self.work_dir), "report_dir": str(self.report_dir), "qrecover": __version__,
                "stages": [s.to_dict() for s in self.stages]}


def stage_key(kind: str, config: dict[str, Any], inputs: dict[str, str]) -> str:
    """sha256 of the stage kind, its config, the keys of its inputs and the qrecover version."""
    blob = json.dumps({"stage": kind, "config": config, "inputs": inputs, "qrecover": __version__},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


def _candidates(cfg: Any) -> dict[str, list[list[Any]]]:
    """The compress config's candidate encodings, presets expanded and every parameter resolved: a menu whose
    meaning changes (a preset's specs, a scheme's default) changes the key, though its name does not."""
    def rows(encs: list[Any]) -> list[list[Any]]:
        return [[e.scheme, e.bits, list(e.transforms), e.params_json] for e in encs]

    return {"linear": rows(linear_encodings(cfg.scheme, cfg.bits, cfg.scheme_params, cfg.encodings)),
            "embedding": rows(embedding_encodings(cfg.embedding_bits, cfg.embedding_encodings,
                                                  cfg.scope == "model" and cfg.bpw is not None))}


def model_sha256(spec: str | None) -> str:
    """The weights hash of an unquantized model, as :func:`qrecover.models.load_model` records it."""

    path, kind = resolve(spec)
    if kind == "qrecover":
        raise QRecoverError(f"model {spec!r} is a qrecover checkpoint; the recipe's model is the unquantized model "
                            "the pipeline compresses (an HF directory, a .gguf, or \"\" for the default)")
    return weights_sha256(path, kind)


def _keyed_options(recipe: Recipe, section: str, options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(options as keyed, options to run with)``: path options resolved; keyed by content, not by name."""

    keyed, run = dict(options), dict(options)
    if (section, "mix") in _PATH_OPTIONS and "mix" not in options:  # the shipped default mix, keyed by content too
        keyed["mix"] = {"sha256": sha256_file(shipped_path(DEFAULT_MIX))}
    for (sec, name), what in _PATH_OPTIONS.items():
        if sec != section or name not in options or (what == "data" and options[name] == "python-docs"):
            continue
        value = options[name]
        resolved = str(recipe.path(value))
        run[name] = resolved
        if what == "file" and (section, name) == ("recover", "mix") and is_prepared(resolved):
            # a directory of `qrecover data prepare`: its manifest holds every shard's sha256
            keyed[name] = {"prepared_manifest_sha256": sha256_file(Path(resolved) / PREPARED_MANIFEST)}
        elif what == "file":
            if not Path(resolved).is_file():
                raise QRecoverError(f"[{section}] {name} = {value!r} does not exist (looked for {resolved}); paths are relative to the recipe")
            keyed[name] = {"sha256": sha256_file(resolved)}
        elif what == "data":

            try:
                keyed[name] = {"sha256": sha256_files(source_files(resolved)[1])}
            except QRecoverError as e:
                raise QRecoverError(f"[{section}] {name} = {value!r}: {e} (paths are relative to the recipe)") from None
        else:
            keyed[name] = {"weights_sha256": model_sha256(resolved)}
    return keyed, run


def make_plan(recipe: Recipe, force: Sequence[str] = ()) -> Plan:
    """Every stage with its key, and whether it is cached or runs (and why). Reads the model's weights to
    hash them; writes nothing."""

    spec = recipe.model_spec
    weights = model_sha256(spec)
    work = recipe.path(recipe.work_dir)
    stages: list[Stage] = []

    def add(name: str, kind: str, config: dict[str, Any], inputs: list[Stage], **params: Any) -> Stage:
        ins = {s.name: s.key for s in inputs}
        key = stage_key(kind, config, ins)
        s = Stage(name, kind, config, ins, key, work / f"{name}-{key[:12]}", params)
        stages.append(s)
        return s

    ev_keyed, ev_run = _keyed_options(recipe, "eval", recipe.eval.options)
    _check_tasks(recipe.eval, ev_run)
    ev_config = {"tasks": list(recipe.eval.tasks), "limit": recipe.eval.limit, **ev_keyed}
    c_keyed, c_run = _keyed_options(recipe, "compress", recipe.compress.options)
    r_keyed, r_run = _keyed_options(recipe, "recover", recipe.recover.options)

    original = add("eval-original", "eval", {**ev_config, "model_sha256": weights}, [], model=spec, adapter=None, options=ev_run)
    compressed: dict[float, Stage] = {}
    for b in recipe.compress.bpw:
        cfg = recipe.compress.config(spec, b, c_run)
        keyed = {**cfg.to_dict(), **c_keyed, "model_sha256": weights, "candidates": _candidates(cfg)}
        del keyed["model"]
        compressed[b] = add(f"compress-{_bpw_name(b)}", "compress", keyed, [], bpw=b, options=c_run)
    tuned: dict[float, Stage] = {}
    if recipe.tune is not None:
        t_keyed, t_run = _keyed_options(recipe, "tune", recipe.tune.options)
        t_cfg = {**recipe.tune.config(t_run).to_dict(), **t_keyed}
        for b in recipe.compress.bpw:
            tuned[b] = add(f"tune-{_bpw_name(b)}", "tune", t_cfg, [compressed[b]], options=t_run)
    recovered: dict[tuple[float, int], Stage] = {}
    for b in recipe.compress.bpw:
        for r in recipe.recover.ranks:
            cfg = recipe.recover.config(r, r_run)
            recovered[b, r] = add(f"recover-{_bpw_name(b)}-r{r}", "recover", {**cfg.to_dict(), **r_keyed},
                                  [compressed[b]], rank=r, options=r_run)
    evals = [original]
    for b in recipe.compress.bpw:
        evals.append(add(f"eval-{_bpw_name(b)}", "eval", ev_config, [compressed[b]], options=ev_run))
    for b, t in tuned.items():
        evals.append(add(f"eval-{_bpw_name(b)}-tuned", "eval", ev_config, [t], options=ev_run))
    for b in recipe.compress.bpw:
        for r in recipe.recover.ranks:
            evals.append(add(f"eval-{_bpw_name(b)}-r{r}", "eval", ev_config, [compressed[b], recovered[b, r]], options=ev_run))
    add("report", "report", {}, evals)

    names = [s.name for s in stages]
    if bad := [f for f in force if f not in names]:
        raise QRecoverError(f"--force {', '.join(bad)}: no such stage; the stages are {', '.join(names)}")
    _decide(stages, set(force))
    return Plan(recipe, weights, stages)


def _check_tasks(ev: EvalSection, options: dict[str, Any]) -> None:
    """Unknown task names fail now, not after an hour of compression and training."""

    check_tasks(EvalConfig(tasks=list(ev.tasks), limit=ev.limit, **options))


def read_marker(stage_dir: Path) -> dict[str, Any] | None:
    """The stage's ``stage.json``, or None if absent or unreadable (an unfinished stage)."""
    try:
        return json.loads((Path(stage_dir) / STAGE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        return None


_RESUMABLE = {"recover": "adapter", "tune": "checkpoint"}  # a training stage's output dir: it resumes its checkpoints


def _decide(stages: list[Stage], force: set[str]) -> None:
    runs: set[str] = set()
    for s in stages:
        marker = read_marker(s.dir)
        upstream = [n for n in s.inputs if n in runs]
        done = marker is not None and marker.get("key") == s.key
        if s.name in force:
            s.status, s.reason = "run", "forced"
        elif not s.dir.exists():
            s.status, s.reason = "run", "new"
        elif not done:
            # resume only on the same inputs: an input that runs again makes a new checkpoint
            resumable = (s.dir / _RESUMABLE.get(s.kind, "-")).is_dir() and not upstream
            s.status, s.reason = ("resume" if resumable else "run"), "unfinished"
        elif upstream:
            s.status, s.reason = "run", f"input {upstream[0]} runs"
        else:
            s.status, s.reason = "cached", ""
        if s.status != "cached":
            runs.add(s.name)



"""``qrecover pipeline RECIPE``: the whole experiment in one command, every stage cached by content hash.

**Recipe** (TOML, :class:`Recipe`)::

    model = ""                          # "" = the built-in default model; or an HF directory / .gguf
    work_dir = "runs/table10"           # stage outputs
    report_dir = "reports/table10"      # report.md/json/html, the results files, pipeline.json
    [eval]                              # tasks, limit + any other EvalConfig field (windows, seq_len, ...)
    tasks = ["ifeval", "gsm8k", "mmlu", "ppl", "kl"]
    limit = 20
    [compress]                          # bpw list + any other CompressConfig field (bits, scheme, ...)
    bpw = [3.5, 3.7]
    [recover]                           # ranks list + any other RecoverConfig field (tokens, objective, ...)
    ranks = [16]
    tokens = 65536

Relative paths (``model``, ``work_dir``, ``report_dir``, ``[compress] calib_data``, ``[recover] mix``,
``[eval] ppl_data`` and ``reference``) are relative to the recipe file, as in mix recipes, so a recipe
gives the same result from any working directory. RECIPE is a TOML path or the name of a recipe shipped with
qrecover (:mod:`qrecover.recipes`, e.g. ``table10``); a shipped recipe's relative paths are relative to the
working directory instead (its own directory is inside the installed package).

**Stages**, in order: ``eval-original``; ``compress-<bpw>bpw`` per budget; ``recover-<bpw>bpw-r<rank>`` per
(budget, rank); ``eval-<bpw>bpw`` per checkpoint; ``eval-<bpw>bpw-r<rank>`` per adapter; ``report``. A
stage's key is the sha256 of its kind, its own config, the keys of the stages it consumes, the qrecover
version and, for the stages that read the original model, its weights hash; data named by path is keyed
by content (the mix recipe file, or the manifest of a ``qrecover data prepare`` directory named as ``mix``,
the calibration and perplexity text). Its output lives in
``work_dir/<name>-<key[:12]>/`` and is complete when ``stage.json`` (written last, atomically) holds the
key. So a rerun skips every completed stage, a changed config reruns that stage and what consumes it,
and after a crash only unfinished stages run (an unfinished recover stage resumes its last checkpoint).
A stage that runs makes every stage consuming it run too: its output is new (a checkpoint's manifest
records when it was made, and adapters are bound to that manifest).

After the report stage, its files are copied into ``report_dir`` (only those whose bytes changed), with
the results files under ``results/`` and ``pipeline.json`` (every stage's key and config: the eval limit,
the budgets, the training tokens, ...).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from ._version import __version__
from .api import compress, prepare
from .config import CompressConfig
from .data.corpus import source_files
from .data.shards import MANIFEST as PREPARED_MANIFEST
from .data.shards import is_prepared
from .errors import QRecoverError
from .evaluate.config import EvalConfig
from .evaluate.harness import check_tasks
from .evaluate.runner import evaluate, save_results
from .fields import doc_field
from .io_utils import read_toml, sha256_file, sha256_files, toml_value, write_bytes_atomic, write_text_atomic
from .models import DEFAULT_MODEL, resolve, weights_sha256
from .recipes import DEFAULT_MIX, is_shipped, shipped_names, shipped_path
from .recovery.api import recover
from .recovery.config import RecoverConfig
from .reports.render import write_report
from .reports.results import load_results
from .reports.table import normalise

STAGE_FILE = "stage.json"
REPORT_FILES = ("report.md", "report.json", "report.html")
KINDS = ("eval", "compress", "recover", "report")
DEFAULT_TASKS = ["ifeval", "gsm8k", "mmlu", "ppl", "kl"]

# options that name a path: resolved against the recipe's directory; keyed by content ("data": text files,
# "file": one file) or by the weights hash ("model")
_PATH_OPTIONS = {("compress", "calib_data"): "data", ("recover", "mix"): "file", ("eval", "ppl_data"): "data",
                 ("eval", "reference"): "model"}


# --- recipe ---------------------------------------------------------------------------------------------


def _compress_fields() -> list[str]:

    return [f.name for f in dataclasses.fields(CompressConfig) if f.name not in ("model", "bpw")]


def _recover_fields() -> list[str]:

    return [f.name for f in dataclasses.fields(RecoverConfig) if f.name != "rank"]


def _eval_fields() -> list[str]:

    return [f.name for f in dataclasses.fields(EvalConfig) if f.name not in ("model", "adapter", "tasks", "limit")]


def _check_options(section: str, options: dict[str, Any], own: Sequence[str], allowed: Sequence[str]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise QRecoverError(f"[{section}]: unknown key(s) {unknown}; allowed keys: {', '.join([*own, *allowed])}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class EvalSection:
    """``[eval]``: what every model (original, quantized, recovered) is scored on, identically."""

    tasks: list[str] = doc_field(None, f"tasks of `qrecover eval` (default {DEFAULT_TASKS}): gsm8k, ifeval, mmlu, ppl, kl, alpacaeval or lm-eval "
                                       "task names")
    limit: int | None = doc_field(None, "items per benchmark task (MMLU: questions round-robin over subjects); left out = every item")
    options: dict[str, Any] = doc_field(None, "any other EvalConfig field (batch_size, max_gen_toks, ppl_data, windows, seq_len, reference, "
                                              "judge_url, judge_model), written as a key of [eval] itself")

    def __post_init__(self) -> None:
        if self.tasks is None:
            self.tasks = list(DEFAULT_TASKS)
        self.options = {k: v for k, v in (self.options or {}).items() if v is not None}
        if not isinstance(self.tasks, list) or not self.tasks or not all(isinstance(t, str) and t.strip() for t in self.tasks):
            raise QRecoverError(f"[eval] tasks = {self.tasks!r} must be a non-empty list of task names, e.g. tasks = {json.dumps(DEFAULT_TASKS)}")
        if len(set(self.tasks)) != len(self.tasks):
            raise QRecoverError(f"[eval] tasks = {self.tasks!r} names a task twice; list each once")
        if self.limit is not None and (not _is_int(self.limit) or self.limit <= 0):
            raise QRecoverError(f"[eval] limit = {self.limit!r} must be a positive integer (items per task), or left out for every item")
        _check_options("eval", self.options, ("tasks", "limit"), _eval_fields())
        for k in ("batch_size", "windows", "seq_len", "max_gen_toks"):
            if k in self.options and (not _is_int(self.options[k]) or self.options[k] <= (1 if k == "seq_len" else 0)):
                raise QRecoverError(f"[eval] {k} = {self.options[k]!r} must be a positive integer" + (" of at least 2" if k == "seq_len" else ""))
        for k in ("ppl_data", "reference", "judge_url", "judge_model"):
            if k in self.options and not isinstance(self.options[k], str):
                raise QRecoverError(f"[eval] {k} = {self.options[k]!r} must be a string")

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"tasks": list(self.tasks)}
        if self.limit is not None:
            d["limit"] = self.limit
        return {**d, **self.options}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "EvalSection":
        d = dict(d)
        return cls(tasks=d.pop("tasks", None), limit=d.pop("limit", None), options=d)


@dataclass
class CompressSection:
    """``[compress]``: one checkpoint per budget; every other CompressConfig field applies to all of them."""

    bpw: list[float] = doc_field(None, "bits-per-weight budgets, one checkpoint each (measured from packed bytes), e.g. [3.5, 3.7]")
    options: dict[str, Any] = doc_field(None, "any other CompressConfig field (bits, scheme, scheme_params, scope, embedding_bits, allocation, "
                                              "calib_data, calib_samples, seq_len, seed), written as a key of [compress] itself")

    def __post_init__(self) -> None:
        if self.bpw is None:
            self.bpw = [3.7]
        self.options = {k: v for k, v in (self.options or {}).items() if v is not None}
        if not isinstance(self.bpw, list) or not self.bpw:
            raise QRecoverError(f"[compress] bpw = {self.bpw!r} must be a non-empty list of budgets, e.g. bpw = [3.5, 3.7]")
        for b in self.bpw:
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or b <= 0:
                raise QRecoverError(f"[compress] bpw = {self.bpw!r}: {b!r} is not a positive number of bits per weight, e.g. bpw = [3.5, 3.7]")
        self.bpw = [float(b) for b in self.bpw]
        if len({_bpw_name(b) for b in self.bpw}) != len(self.bpw):
            raise QRecoverError(f"[compress] bpw = {self.bpw!r} lists a budget twice; list each once")
        _check_options("compress", self.options, ("bpw",), _compress_fields())
        for b in self.bpw:  # every value checked now, not after the first stages ran
            self.config(None, b)

    def config(self, model: str | None, bpw: float, options: dict[str, Any] | None = None):

        try:
            return CompressConfig(model=model, bpw=bpw, **(self.options if options is None else options))
        except QRecoverError as e:
            raise QRecoverError(f"[compress] (bpw = {bpw}): {e}") from None
        except (TypeError, ValueError) as e:
            raise QRecoverError(f"[compress] has a value of the wrong type ({e}); see `qrecover compress --help`") from None

    def to_dict(self) -> dict[str, Any]:
        return {"bpw": list(self.bpw), **self.options}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CompressSection":
        d = dict(d)
        return cls(bpw=d.pop("bpw", None), options=d)


@dataclass
class RecoverSection:
    """``[recover]``: one adapter per (budget, rank); every other RecoverConfig field applies to all of them."""

    ranks: list[int] = doc_field(None, "LoRA ranks, one adapter per checkpoint each (AFM: 8, 16, 32); [] = no recovery, quantized rows only")
    options: dict[str, Any] = doc_field(None, "any other RecoverConfig field (tokens, objective, mix, seq_len, batch_size, lr, ...), "
                                              "written as a key of [recover] itself")

    def __post_init__(self) -> None:
        if self.ranks is None:
            self.ranks = [16]
        self.options = {k: v for k, v in (self.options or {}).items() if v is not None}
        if not isinstance(self.ranks, list) or not all(_is_int(r) and r > 0 for r in self.ranks):
            raise QRecoverError(f"[recover] ranks = {self.ranks!r}: every rank must be a positive integer, e.g. ranks = [16]")
        if len(set(self.ranks)) != len(self.ranks):
            raise QRecoverError(f"[recover] ranks = {self.ranks!r} lists a rank twice; list each once")
        _check_options("recover", self.options, ("ranks",), _recover_fields())
        for r in self.ranks:
            self.config(r)

    def config(self, rank: int, options: dict[str, Any] | None = None):

        try:
            return RecoverConfig(rank=rank, **(self.options if options is None else options))
        except QRecoverError as e:
            raise QRecoverError(f"[recover] (rank = {rank}): {e}") from None
        except (TypeError, ValueError) as e:
            raise QRecoverError(f"[recover] has a value of the wrong type ({e}); see `qrecover recover --help`") from None

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks), **self.options}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RecoverSection":
        d = dict(d)
        return cls(ranks=d.pop("ranks", None), options=d)


_SECTIONS = {"eval": EvalSection, "compress": CompressSection, "recover": RecoverSection}


@dataclass
class Recipe:
    """A whole experiment: the model, where outputs go, and the three stage sections."""

    model: str = doc_field("", "the unquantized model: '' = the built-in default model, or an HF directory / .gguf (relative to the recipe)")
    work_dir: str = doc_field("runs", "directory of the stage outputs, one subdirectory per stage and key (relative to the recipe)")
    report_dir: str = doc_field("report", "where report.md/json/html, results/*.json and pipeline.json land (relative to the recipe)")
    eval: EvalSection = doc_field(None, "[eval]: tasks, limit and other evaluation settings")
    compress: CompressSection = doc_field(None, "[compress]: bpw budgets and other compression settings")
    recover: RecoverSection = doc_field(None, "[recover]: ranks and other recovery-training settings")
    base_dir: Path = dataclasses.field(default=None, repr=False, compare=False,
                                       metadata={"help": "directory relative paths resolve against: the recipe file's (not saved)"})
    source: str | None = dataclasses.field(default=None, repr=False, compare=False,
                                           metadata={"help": "the file the recipe was read from (not saved)"})

    def __post_init__(self) -> None:
        self.eval = self.eval if self.eval is not None else EvalSection()
        self.compress = self.compress if self.compress is not None else CompressSection()
        self.recover = self.recover if self.recover is not None else RecoverSection()
        self.base_dir = Path(self.base_dir) if self.base_dir is not None else Path.cwd()
        for k in ("model", "work_dir", "report_dir"):
            if not isinstance(getattr(self, k), str):
                raise QRecoverError(f"{k} = {getattr(self, k)!r} must be a string (a path; model may be \"\" for the default model)")
        for k in ("work_dir", "report_dir"):
            if not getattr(self, k).strip():
                raise QRecoverError(f"{k} must name a directory, e.g. {k} = \"{'runs' if k == 'work_dir' else 'report'}\"")

    def path(self, p: str) -> Path:
        """``p`` resolved against the recipe's directory (absolute paths and ``~`` as they are)."""
        q = Path(p).expanduser()
        return q if q.is_absolute() else (self.base_dir / q).resolve()

    @property
    def model_spec(self) -> str | None:
        """What :func:`qrecover.models.resolve` takes: None for the default model."""

        return None if self.model.strip() in ("", "default", DEFAULT_MODEL) else str(self.path(self.model))

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model, "work_dir": self.work_dir, "report_dir": self.report_dir,
                "eval": self.eval.to_dict(), "compress": self.compress.to_dict(), "recover": self.recover.to_dict()}

    @classmethod
    def from_dict(cls, d: Any, base_dir: str | os.PathLike | None = None, source: str | None = None) -> "Recipe":
        if not isinstance(d, dict):
            raise QRecoverError(f"a recipe is a TOML table, got {type(d).__name__}")
        allowed = ["model", "work_dir", "report_dir", *_SECTIONS]
        unknown = sorted(set(d) - set(allowed))
        if unknown:
            raise QRecoverError(f"unknown key(s) {unknown} at the top of the recipe; allowed keys: {', '.join(allowed)}")
        sections = {}
        for name, cls_ in _SECTIONS.items():
            s = d.get(name, {})
            if not isinstance(s, dict):
                raise QRecoverError(f"{name} = {s!r:.60} must be a table: write a [{name}] section")
            sections[name] = cls_.from_dict(s)
        return cls(**{k: d[k] for k in ("model", "work_dir", "report_dir") if k in d}, **sections,
                   base_dir=Path(base_dir) if base_dir is not None else None, source=source)

    def to_toml(self) -> str:
        d = self.to_dict()
        lines = [f"{k} = {toml_value(d[k])}" for k in ("model", "work_dir", "report_dir")]
        for name in _SECTIONS:
            lines += ["", f"[{name}]"] + [f"{k} = {toml_value(v)}" for k, v in d[name].items()]
        return "\n".join(lines) + "\n"

    def save(self, path: str | os.PathLike) -> Path:
        return write_text_atomic(path, self.to_toml())


def find_recipe(spec: str | os.PathLike) -> tuple[Path, bool]:
    """``(file, shipped)``: ``spec`` as a path if that file exists, else the shipped recipe of that name."""
    path = Path(spec).expanduser()
    if path.is_file():
        return path, is_shipped(path)
    recipes = [n for n in shipped_names() if not n.endswith("-mix")]  # the other shipped files are data mixes
    if str(spec).removesuffix(".toml") in recipes:
        return shipped_path(str(spec)), True
    raise QRecoverError(f"recipe {str(spec)!r} does not exist and is not a shipped recipe (shipped: {', '.join(recipes)}); "
                        "pass a TOML file or a shipped recipe's name, e.g. `qrecover pipeline table10`")


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Read and validate a recipe (a TOML path or a shipped recipe's name, see :func:`find_recipe`); every
    problem is a QRecoverError naming the file, the key and the fix."""
    name = str(path)
    path, shipped = find_recipe(path)
    d = read_toml(path, "recipe", "; pass a TOML file or a shipped recipe's name such as table10")
    try:
        return Recipe.from_dict(d, base_dir=Path.cwd() if shipped else path.resolve().parent,
                                source=name if shipped else str(path))
    except QRecoverError as e:
        raise QRecoverError(f"recipe {str(path)!r}: {e}") from None


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


def _bpw_name(b: float) -> str:
    return f"{b:g}bpw"


def stage_key(kind: str, config: dict[str, Any], inputs: dict[str, str]) -> str:
    """sha256 of the stage kind, its config, the keys of its inputs and the qrecover version."""
    blob = json.dumps({"stage": kind, "config": config, "inputs": inputs, "qrecover": __version__},
                      sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


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
    if recipe.recover.ranks and "mix" not in recipe.recover.options:  # the shipped default mix, keyed by content too
        r_keyed["mix"] = {"sha256": sha256_file(shipped_path(DEFAULT_MIX))}

    original = add("eval-original", "eval", {**ev_config, "model_sha256": weights}, [], model=spec, adapter=None, options=ev_run)
    compressed: dict[float, Stage] = {}
    for b in recipe.compress.bpw:
        cfg = recipe.compress.config(spec, b, c_run)
        keyed = {**cfg.to_dict(), **c_keyed, "model_sha256": weights}
        del keyed["model"]
        compressed[b] = add(f"compress-{_bpw_name(b)}", "compress", keyed, [], bpw=b, options=c_run)
    recovered: dict[tuple[float, int], Stage] = {}
    for b in recipe.compress.bpw:
        for r in recipe.recover.ranks:
            cfg = recipe.recover.config(r, r_run)
            recovered[b, r] = add(f"recover-{_bpw_name(b)}-r{r}", "recover", {**cfg.to_dict(), **r_keyed},
                                  [compressed[b]], rank=r, options=r_run)
    evals = [original]
    for b in recipe.compress.bpw:
        evals.append(add(f"eval-{_bpw_name(b)}", "eval", ev_config, [compressed[b]], options=ev_run))
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
            resumable = s.kind == "recover" and (s.dir / "adapter").is_dir() and not upstream
            s.status, s.reason = ("resume" if resumable else "run"), "unfinished"
        elif upstream:
            s.status, s.reason = "run", f"input {upstream[0]} runs"
        else:
            s.status, s.reason = "cached", ""
        if s.status != "cached":
            runs.add(s.name)


# --- stages ---------------------------------------------------------------------------------------------


@dataclass
class _Context:
    plan: Plan
    show_progress: bool
    recover_callback: Callable[[dict[str, Any]], None] | None
    prepared: Any = None  # (CompressConfig minus bpw, Prepared, stage name): one calibration serves every budget
    todo: list[Stage] = dataclasses.field(default_factory=list)

    def dir_of(self, name: str) -> Path:
        return self.plan.stage(name).dir


def evaluate_model(model: str | None, adapter: str | None, tasks: list[str], limit: int | None, out: Path,
                   options: dict[str, Any], show_progress: bool) -> Any:
    """The one call into :mod:`qrecover.evaluate`: score ``model`` (+ ``adapter``), write ``out``."""

    cfg = EvalConfig(model=model, adapter=adapter, tasks=list(tasks), limit=limit, **options)
    results = evaluate(cfg, show_progress=show_progress)
    save_results(results, out, overwrite=True)
    return results


def _run_eval(s: Stage, ctx: _Context) -> dict[str, Any]:
    ev = ctx.plan.recipe.eval
    model, adapter = s.params.get("model"), None
    for name in s.inputs:
        kind = ctx.plan.stage(name).kind
        if kind == "compress":
            model = str(ctx.dir_of(name) / "checkpoint")
        elif kind == "recover":
            adapter = str(ctx.dir_of(name) / "adapter")
    res = evaluate_model(model, adapter, ev.tasks, ev.limit, s.dir / "results.json", s.params["options"], ctx.show_progress)
    return {"results": "results.json", "metrics": {n: m.value for n, m in res.metrics.items()}}


def _run_compress(s: Stage, ctx: _Context) -> dict[str, Any]:

    cfg = ctx.plan.recipe.compress.config(ctx.plan.recipe.model_spec, s.params["bpw"], s.params["options"])
    same = {k: v for k, v in cfg.to_dict().items() if k != "bpw"}
    if ctx.prepared is None or ctx.prepared[0] != same:
        ctx.prepared = None  # free the previous one first
        ctx.prepared = (same, prepare(cfg, ctx.show_progress), s.name)
    manifest = compress(cfg, out=s.dir / "checkpoint", overwrite=True, show_progress=ctx.show_progress,
                        prepared=ctx.prepared[1])
    calibrated_by = ctx.prepared[2]
    if not any(t.kind == "compress" for t in ctx.todo):
        ctx.prepared = None  # the model and every candidate encoding: not kept through training and evaluation
    return {"checkpoint": "checkpoint", "measured_bpw": manifest["measured_bpw"],
            "calibration": "own" if calibrated_by == s.name else f"shared with {calibrated_by} (same settings but bpw)"}


def _run_recover(s: Stage, ctx: _Context) -> dict[str, Any]:

    (dep,) = s.inputs
    cfg = ctx.plan.recipe.recover.config(s.params["rank"], s.params["options"])
    resume = s.status == "resume"
    meta = recover(ctx.dir_of(dep) / "checkpoint", s.dir / "adapter", cfg, overwrite=not resume, resume=resume,
                   show_progress=ctx.show_progress, callback=ctx.recover_callback)
    return {"adapter": "adapter", "resumed": resume, "bpw_cost": meta.get("bpw_cost"),
            "final_loss": meta.get("training", {}).get("final_loss")}


def _run_report(s: Stage, ctx: _Context) -> dict[str, Any]:

    (s.dir / "results").mkdir(parents=True, exist_ok=True)
    runs = {}
    for name in s.inputs:
        target = s.dir / "results" / f"{name}.json"
        shutil.copyfile(ctx.dir_of(name) / "results.json", target)
        r = load_results(target)
        r.source = f"results/{name}.json"  # as the report directory holds it
        runs[name] = r
    base = runs.pop("eval-original")
    rows = normalise(list(runs.values()), base)
    write_report(rows, base, s.dir / "report", overwrite=True)
    info = {k: v for k, v in ctx.plan.to_dict().items() if k not in ("recipe", "work_dir", "report_dir")}
    info["stages"] = [{k: v for k, v in t.to_dict().items() if k in ("name", "kind", "key", "inputs", "config")}
                      for t in ctx.plan.stages]
    (s.dir / "pipeline.json").write_text(json.dumps(info, indent=1) + "\n")
    return {"report": "report", "rows": [r.label for r in rows]}


_RUNNERS: dict[str, Callable[[Stage, _Context], dict[str, Any]]] = {
    "eval": _run_eval, "compress": _run_compress, "recover": _run_recover, "report": _run_report}


def _write_marker(s: Stage, plan: Plan, started: float, output: dict[str, Any]) -> None:
    now = time.time()
    s.seconds = round(now - started, 1)
    marker = {"stage": s.name, "kind": s.kind, "key": s.key,
              "inputs": {n: {"key": k, "dir": plan.stage(n).dir.name} for n, k in s.inputs.items()},
              "config": s.config, "qrecover": __version__, "seconds": s.seconds,
              "started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
              "finished": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"), "output": output}
    write_text_atomic(s.dir / STAGE_FILE, json.dumps(marker, indent=1, default=str) + "\n")  # complete from here on


def publish(plan: Plan) -> list[str]:
    """Copy the report stage's files into ``report_dir`` (only those whose bytes differ); return what changed.

    Writes report.md/json/html, results/<stage>.json and pipeline.json, each atomically; removes results
    files of stages no longer in the recipe. Other files in ``report_dir`` are left alone.
    """
    src = plan.stage("report").dir
    dst = plan.report_dir
    files = {f"report/{n}": n for n in REPORT_FILES} | {"pipeline.json": "pipeline.json"}
    files |= {f"results/{p.name}": f"results/{p.name}" for p in sorted((src / "results").glob("*.json"))}
    changed = []
    for rel_src, rel_dst in files.items():
        data = (src / rel_src).read_bytes()
        target = dst / rel_dst
        if target.is_file() and target.read_bytes() == data:
            continue
        write_bytes_atomic(target, data)
        changed.append(rel_dst)
    keep = {Path(r).name for r in files.values() if r.startswith("results/")}
    for old in sorted((dst / "results").glob("*.json")) if (dst / "results").is_dir() else []:
        if old.name not in keep:
            old.unlink()
            changed.append(f"results/{old.name} (removed)")
    return changed


def execute(plan: Plan, show_progress: bool = True, hook: Callable[[str, Stage], None] | None = None,
            recover_callback: Callable[[dict[str, Any]], None] | None = None,
            only: Sequence[str] = ()) -> dict[str, Any]:
    """Run every stage of ``plan`` that is not cached, in order, then publish the report.

    ``only``: run just these stages (their inputs must be done already), e.g. to run two independent
    evaluations in two processes; the report is published only once every stage is done.

    ``hook(event, stage)`` is called with ``"skip"`` for a cached stage, and ``"start"``, ``"ran"`` (output
    written, ``stage.json`` not yet) and ``"done"`` for one that runs; an exception it raises stops the
    pipeline there, as a crash would. ``recover_callback``: passed to every recover stage's training loop.
    Returns the plan's dict with each stage's status ``ran`` or ``cached`` and its seconds, plus the report.
    """
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=True)
    say = (lambda m: console.print(m, highlight=False)) if show_progress else (lambda m: None)  # noqa: E731
    if only:
        names = {s.name: s for s in plan.stages}
        unknown = [n for n in only if n not in names]
        if unknown:
            raise QRecoverError(f"--only {unknown[0]!r} is not a stage of this recipe; stages: {', '.join(names)}")
        for n in only:
            pending = [i for i in names[n].inputs if names[i].status != "cached"]
            if pending:
                raise QRecoverError(f"--only {n!r} needs {pending[0]!r}, which is not done yet; run it first "
                                    f"(qrecover pipeline RECIPE --only {pending[0]}) or run the whole pipeline")
    todo = [s for s in plan.stages if s.status != "cached" and (not only or s.name in only)]
    ctx = _Context(plan, show_progress, recover_callback, todo=list(todo))
    t0 = time.time()
    for s in plan.stages:
        if s.status == "cached" or s not in todo:
            if hook and s.status == "cached":
                hook("skip", s)
            continue
        ctx.todo.remove(s)
        i = todo.index(s) + 1
        say(f"[bold]\\[{i}/{len(todo)}] {escape(s.name)}[/] ({escape(s.reason)}) in {escape(s.dir.name)}")
        if hook:
            hook("start", s)
        started = time.time()
        if s.status != "resume":  # a fresh start: nothing of an earlier attempt or an earlier key survives
            shutil.rmtree(s.dir, ignore_errors=True)
        s.dir.mkdir(parents=True, exist_ok=True)
        (s.dir / STAGE_FILE).unlink(missing_ok=True)
        try:
            output = _RUNNERS[s.kind](s, ctx)
            if hook:
                hook("ran", s)
        except BaseException:
            say(f"[bold red]{escape(s.name)} failed[/] after {time.time() - started:.0f} s; completed stages are kept, "
                "run the pipeline again to continue from here")
            raise
        _write_marker(s, plan, started, output)
        s.status = "ran"
        say(f"    done in {s.seconds:.1f} s")
        if hook:
            hook("done", s)
    complete = all(s.status in ("cached", "ran") for s in plan.stages)
    changed = publish(plan) if complete else []
    summary = plan.to_dict()
    summary["report"] = str(plan.report_dir / "report.md") if complete else None
    summary["published"] = changed
    summary["seconds"] = round(time.time() - t0, 1)
    return summary


def run_pipeline(recipe: Recipe | str | os.PathLike, dry_run: bool = False, force: Sequence[str] = (),
                 show_progress: bool = True, hook: Callable[[str, Stage], None] | None = None,
                 recover_callback: Callable[[dict[str, Any]], None] | None = None,
                 only: Sequence[str] = ()) -> dict[str, Any]:
    """Plan, and unless ``dry_run`` execute, a recipe (a :class:`Recipe`, a TOML path or a shipped recipe's name);
    see :func:`execute`."""
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe)
    plan = make_plan(recipe, force)
    if dry_run:
        return plan.to_dict()
    return execute(plan, show_progress=show_progress, hook=hook, recover_callback=recover_callback, only=only)


__all__ = ["Recipe", "EvalSection", "CompressSection", "RecoverSection", "Stage", "Plan", "load_recipe", "make_plan",
           "execute", "publish", "run_pipeline", "find_recipe", "stage_key", "model_sha256", "evaluate_model", "read_marker"]

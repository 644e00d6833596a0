"""Pipeline recipes: the TOML file, its ``[eval]``, ``[compress]`` and ``[recover]`` sections, and where a recipe is
found (see :mod:`qrecover.pipeline`)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import CompressConfig
from ..errors import QRecoverError
from ..evaluate.config import EvalConfig
from ..fields import OptionsConfig, doc_field
from ..io_utils import read_toml, toml_value, write_text_atomic
from ..models import DEFAULT_MODEL
from ..recipes import is_shipped, shipped_names, shipped_path
from ..recovery.config import RecoverConfig, TuneConfig

STAGE_FILE = "stage.json"
REPORT_FILES = ("report.md", "report.json", "report.html")
KINDS = ("eval", "compress", "tune", "recover", "report")
DEFAULT_TASKS = ["ifeval", "gsm8k", "mmlu", "ppl", "kl"]

# options that name a path: resolved against the recipe's directory; keyed by content ("data": text files,
# "file": one file) or by the weights hash ("model")
_PATH_OPTIONS = {("compress", "calib_data"): "data", ("recover", "mix"): "file", ("tune", "mix"): "file",
                 ("eval", "ppl_data"): "data", ("eval", "reference"): "model"}



def _bpw_name(b: float) -> str:
    return f"{b:g}bpw"


# --- recipe ---------------------------------------------------------------------------------------------


def _compress_fields() -> list[str]:

    return [f.name for f in dataclasses.fields(CompressConfig) if f.name not in ("model", "bpw")]


def _recover_fields() -> list[str]:

    return [f.name for f in dataclasses.fields(RecoverConfig) if f.name != "rank"]


_LORA_FIELDS = ("rank", "alpha", "init", "rank_allocation", "targets", "head_rank", "adapter_bits", "dropout")


def _tune_fields() -> list[str]:

    return [f.name for f in dataclasses.fields(TuneConfig) if f.name not in _LORA_FIELDS]


def _eval_fields() -> list[str]:

    return [f.name for f in dataclasses.fields(EvalConfig) if f.name not in ("model", "adapter", "tasks", "limit")]


def _check_options(section: str, options: dict[str, Any], own: Sequence[str], allowed: Sequence[str]) -> None:
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        raise QRecoverError(f"[{section}]: unknown key(s) {unknown}; allowed keys: {', '.join([*own, *allowed])}")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


@dataclass
class EvalSection(OptionsConfig):
    """``[eval]``: what every model (original, quantized, recovered) is scored on, identically."""

    tasks: list[str] = doc_field(None, f"tasks of `qrecover eval` (default {DEFAULT_TASKS}): gsm8k, ifeval, mmlu, ppl, kl, alpacaeval or lm-eval "
                                       "task names")
    limit: int | None = doc_field(None, "items per benchmark task (MMLU: questions round-robin over subjects); left out = every item")
    options: dict[str, Any] = doc_field(None, "any other EvalConfig field (batch_size, max_gen_toks, ppl_data, windows, seq_len, reference, "
                                              "judge_url, judge_model), written as a key of [eval] itself")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Defaults filled in, values normalised and checked (QRecoverError naming the key and the fix)."""
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



@dataclass
class CompressSection(OptionsConfig):
    """``[compress]``: one checkpoint per budget; every other CompressConfig field applies to all of them."""

    bpw: list[float] = doc_field(None, "bits-per-weight budgets, one checkpoint each (measured from packed bytes), e.g. [3.5, 3.7]")
    options: dict[str, Any] = doc_field(None, "any other CompressConfig field (bits, scheme, scheme_params, scope, embedding_bits, allocation, "
                                              "calib_data, calib_samples, seq_len, seed), written as a key of [compress] itself")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Defaults filled in, values normalised and checked (QRecoverError naming the key and the fix)."""
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



@dataclass
class RecoverSection(OptionsConfig):
    """``[recover]``: one adapter per (budget, rank); every other RecoverConfig field applies to all of them."""

    ranks: list[int] = doc_field(None, "LoRA ranks, one adapter per checkpoint each (AFM: 8, 16, 32); [] = no recovery, quantized rows only")
    options: dict[str, Any] = doc_field(None, "any other RecoverConfig field (tokens, objective, mix, seq_len, batch_size, lr, ...), "
                                              "written as a key of [recover] itself")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Defaults filled in, values normalised and checked (QRecoverError naming the key and the fix)."""
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



@dataclass
class TuneSection(OptionsConfig):
    """``[tune]`` (optional): one tuned checkpoint per budget (`qrecover tune`: the checkpoint's tables, scales and
    norms trained end to end, codes frozen, zero extra bytes), evaluated as its own row. The adapters of
    ``[recover]`` still train on the compressed checkpoint, so adding ``[tune]`` reruns none of them."""

    options: dict[str, Any] = doc_field(None, "any TuneConfig field (tokens, params, lr, mix, objective, block_tokens, ...), "
                                              "written as a key of [tune] itself")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Values checked now (QRecoverError naming the key and the fix), not after compression ran."""
        self.options = {k: v for k, v in (self.options or {}).items() if v is not None}
        _check_options("tune", self.options, (), _tune_fields())
        self.config()

    def config(self, options: dict[str, Any] | None = None):

        try:
            return TuneConfig(**(self.options if options is None else options))
        except QRecoverError as e:
            raise QRecoverError(f"[tune]: {e}") from None
        except (TypeError, ValueError) as e:
            raise QRecoverError(f"[tune] has a value of the wrong type ({e}); see `qrecover tune --help`") from None



_SECTIONS = {"eval": EvalSection, "compress": CompressSection, "tune": TuneSection, "recover": RecoverSection}
OPTIONAL_SECTIONS = ("tune",)  # absent from the TOML = no such stages


@dataclass
class Recipe:
    """A whole experiment: the model, where outputs go, and the three stage sections."""

    model: str = doc_field("", "the unquantized model: '' = the built-in default model, or an HF directory / .gguf (relative to the recipe)")
    work_dir: str = doc_field("runs", "directory of the stage outputs, one subdirectory per stage and key (relative to the recipe)")
    report_dir: str = doc_field("report", "where report.md/json/html, results/*.json and pipeline.json land (relative to the recipe)")
    eval: EvalSection = doc_field(None, "[eval]: tasks, limit and other evaluation settings")
    compress: CompressSection = doc_field(None, "[compress]: bpw budgets and other compression settings")
    recover: RecoverSection = doc_field(None, "[recover]: ranks and other recovery-training settings")
    tune: TuneSection | None = doc_field(None, "[tune] (optional): tune each checkpoint's quantization parameters, zero extra "
                                               "bytes, as a row of its own; absent = no tuned rows")
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
        d = {"model": self.model, "work_dir": self.work_dir, "report_dir": self.report_dir,
             "eval": self.eval.to_dict(), "compress": self.compress.to_dict(), "recover": self.recover.to_dict()}
        if self.tune is not None:
            d["tune"] = self.tune.to_dict()
        return d

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
            if name in OPTIONAL_SECTIONS and name not in d:
                continue
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
            if name in d:
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



"""A data-mix recipe (TOML): a list of ``[[source]]`` tables, each a name, a kind and a token weight.

Weights are normalised to fractions of the run's token budget (phi-4 §3.2: "fraction of training" per
source). Each kind is a registered class of :mod:`.sources` (its keys, checks and ``open()``); ``path`` is
relative to the recipe. :class:`Mix` validates the whole recipe (keys, value types and ranges, the files
it names) without reading any document; :class:`.mix.MixLoader` streams it.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import QRecoverError
from ..fields import doc_field
from ..io_utils import read_toml, toml_value, write_text_atomic
from .source import SOURCES, Source, source_from_dict
from .sources import BuiltinSource


@dataclass
class Mix:
    """A data-mix recipe: weighted sources. ``base_dir`` (not saved) resolves relative paths."""

    sources: list[Source] = doc_field(None, "the sources, in recipe order (ties in scheduling go to the earlier one)")
    description: str = doc_field("", "free text: what this mix is for")
    base_dir: str | None = dataclasses.field(default=None, repr=False, compare=False,
                                              metadata={"help": "directory that relative paths are resolved against (the recipe's)"})

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, check_paths: bool = True) -> None:
        """Raise QRecoverError on duplicate names, weights that do not sum to a positive value, missing files."""
        if not self.sources:
            raise QRecoverError("the mix has no sources; add at least one [[source]] table with name, kind and weight")
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise QRecoverError(f"source names must be unique; {dup} appear more than once")
        total = sum(s.weight for s in self.sources)
        if not total > 0:
            raise QRecoverError(f"the source weights {dict(zip(names, [s.weight for s in self.sources]))} sum to {total}; "
                                "give at least one source a positive weight")
        if check_paths:
            for s in self.sources:
                s.check(self.base_dir)

    def fractions(self) -> dict[str, float]:
        """Each source's share of the training tokens: weight / sum of weights."""
        total = sum(s.weight for s in self.sources)
        return {s.name: s.weight / total for s in self.sources}

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"description": self.description} if self.description else {}
        return {**d, "source": [s.to_dict() for s in self.sources]}

    @classmethod
    def from_dict(cls, d: dict[str, Any], base_dir: str | os.PathLike | None = None) -> Mix:
        if not isinstance(d, dict):
            raise QRecoverError(f"a mix is a table with [[source]] entries, got {type(d).__name__}")
        unknown = sorted(set(d) - {"description", "source"})
        if unknown:
            raise QRecoverError(f"unknown top-level key(s) {unknown} in the mix; allowed keys: description, source")
        sources = d.get("source")
        if not isinstance(sources, list) or not sources:
            raise QRecoverError("the mix has no sources; add at least one [[source]] table with name, kind and weight")
        if not isinstance(d.get("description", ""), str):
            raise QRecoverError(f"description = {d['description']!r} must be a string")
        return cls([source_from_dict(s, i) for i, s in enumerate(sources)], d.get("description", ""),
                   str(base_dir) if base_dir is not None else None)

    def to_toml(self) -> str:
        lines = [f"description = {toml_value(self.description)}", ""] if self.description else []
        for s in self.sources:
            lines.append("[[source]]")
            lines += [f"{k} = {toml_value(v)}" for k, v in s.to_dict().items()]
            lines.append("")
        return "\n".join(lines)

    def save(self, path: str | os.PathLike) -> Path:
        return write_text_atomic(path, self.to_toml())

    @classmethod
    def from_toml(cls, path: str | os.PathLike) -> Mix:
        path = Path(path).expanduser()
        d = read_toml(path, "mix recipe", "; pass a TOML file with [[source]] tables")
        return cls.from_dict(d, base_dir=path.resolve().parent)


def load_mix(recipe: str | os.PathLike | Mix) -> Mix:
    """A :class:`Mix` from a TOML path (or a Mix, returned as is)."""
    return recipe if isinstance(recipe, Mix) else Mix.from_toml(recipe)


def single_source_mix(data: str, name: str = "data") -> Mix:
    """A one-source mix for ``data``: 'python-docs' (built in), a .jsonl/.parquet file (or a directory or glob
    of them), or text files. Relative paths are relative to the working directory."""
    if data == "python-docs":
        return Mix([BuiltinSource(name=name, weight=1.0)])
    p = Path(data).expanduser()
    suffixes = {f.suffix for f in p.rglob("*") if f.is_file()} if p.is_dir() else {Path(data).suffix}
    kind = "jsonl" if suffixes == {".jsonl"} else "parquet" if suffixes == {".parquet"} else "text"
    return Mix([SOURCES[kind](name=name, weight=1.0, path=data)], base_dir=os.getcwd())


__all__ = ["Mix", "load_mix", "single_source_mix"]

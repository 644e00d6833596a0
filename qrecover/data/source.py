"""A data source of a mix: the base class every source kind extends, and the registry of kinds.

The lowest module of the mix: :mod:`.documents`, :mod:`.sources` and :mod:`.mix` import it, it imports none
of them. A kind is one registered class (:mod:`.sources`): a dataclass of its TOML keys (``name``, ``kind``,
``weight`` first, then the kind's own), :meth:`Source.validate` (values, no I/O), :meth:`Source.check` (the
files it names exist; cheap) and :meth:`Source.open` (its documents, read one at a time). A new kind is a
subclass with ``kind`` defaulting to its name, registered with :func:`register_source`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from ..errors import QRecoverError
from ..fields import DictConfig, doc_field
from ..registry import Registry

SOURCES = Registry("source kind", "source kind", key="kind")
COMMON_KEYS = ("name", "kind", "weight")
POSITIVE = ("max_documents", "shuffle_buffer", "samples", "max_new_tokens", "batch_size")
_ACCEPTS = {"str": (str,), "int": (int,), "float": (int, float)}  # a TOML value's Python types per annotation


@dataclass
class OpenContext:
    """What opening a source may need besides its own keys: ``base_dir`` resolves relative paths (the
    recipe's directory); ``tokenizer`` and ``model`` (a spec or an ``nn.Module``) are the loader's, for
    kinds that generate their data (``selfgen``, ``selftext``)."""

    base_dir: str | None = None
    tokenizer: Any = None
    model: Any = None
    show_progress: bool = True


@dataclass
class Source(DictConfig):
    """One data source of a mix; subclasses add their kind's keys (see :func:`source_from_dict`)."""

    what = "source"

    name: str = doc_field(None, "unique name; it labels the source's sequences and report rows")
    kind: str = doc_field(None, "text | jsonl | parquet | hf | builtin | selfgen | selftext (a registered source kind)")
    weight: float = doc_field(None, "share of the training tokens (normalised over the sources; >= 0)")

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The TOML keys of this kind, in declaration order (``name``, ``kind``, ``weight`` first)."""
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def accepts(cls, key: str) -> tuple[type, ...]:
        """The Python types a TOML value of ``key`` may have (from the field's annotation; floats take ints)."""
        ann = next(f.type for f in dataclasses.fields(cls) if f.name == key)
        return _ACCEPTS[str(ann).split("|")[0].strip()]

    def to_dict(self) -> dict[str, Any]:
        """The keys of this kind, None values left out."""
        return {k: getattr(self, k) for k in self.keys() if getattr(self, k) is not None}

    @classmethod
    def from_dict(cls, d: Any, i: int = 0) -> Source:  # type: ignore[override]
        return source_from_dict(d, i)

    def validate(self, where: str, given: dict[str, Any]) -> None:
        """Raise QRecoverError on a value this kind cannot use (``given``: the keys the recipe set)."""
        for k in POSITIVE:
            if k in given and given[k] <= 0:
                raise QRecoverError(f"{where}: {k} = {given[k]} must be a positive integer")

    def check(self, base_dir: str | None) -> None:
        """Raise QRecoverError when a file or directory this source names does not exist (no reading)."""

    def open(self, ctx: OpenContext) -> Any:
        """The source's documents (``documents.Docs`` or ``documents.StreamDocs``), read one at a time."""
        raise NotImplementedError(f"source kind {self.kind!r} has no open()")

    def plan_key(self) -> dict[str, Any]:
        """The settings a plan (unique tokens, decontamination verdicts) depends on, for its cache key. Kinds
        without a key count as its default value, so plans cached before kinds were classes stay valid."""
        return {"kind": self.kind, "field": getattr(self, "field", "text"), "messages_field": getattr(self, "messages_field", "messages"),
                "split": getattr(self, "split", None), "max_documents": getattr(self, "max_documents", None)}


def register_source(cls: type[Source]) -> type[Source]:
    """Class decorator: make a :class:`Source` subclass the kind named by its ``kind`` default."""
    return SOURCES.register(cls)


def source_from_dict(d: Any, i: int = 0) -> Source:
    """The ``i``-th ``[[source]]`` table of a recipe as its kind's class, with every key and value checked."""
    where = f"source #{i + 1}"
    if not isinstance(d, dict):
        raise QRecoverError(f"{where} must be a table ([[source]] with name, kind, weight), got {d!r:.80}")
    for k in COMMON_KEYS:
        if k not in d:
            raise QRecoverError(f"{where} ({d.get('name', 'unnamed')!r}) lacks the key {k!r}; every source needs name, kind and weight")
    where = f"source {d['name']!r}"
    if not isinstance(d["kind"], str) or d["kind"] not in SOURCES:
        raise QRecoverError(f"{where}: unknown kind {d['kind']!r}; choose from {list(SOURCES)}")
    cls = SOURCES[d["kind"]]
    allowed = cls.keys()
    for k, v in d.items():
        if k not in allowed:
            raise QRecoverError(f"{where} (kind {d['kind']!r}): unknown key {k!r}; allowed keys: {', '.join(allowed)}")
        if isinstance(v, bool) or not isinstance(v, cls.accepts(k)):
            want = " or ".join(t.__name__ for t in cls.accepts(k))
            raise QRecoverError(f"{where}: {k} = {v!r} must be a {want}")
    src = cls(**d)
    src.weight = float(src.weight)
    if not math.isfinite(src.weight) or src.weight < 0:
        raise QRecoverError(f"{where}: weight = {d['weight']!r} must be a finite number >= 0")
    if not src.name.strip():
        raise QRecoverError(f"source #{i + 1}: name must not be empty")
    src.validate(where, d)
    return src


__all__ = ["SOURCES", "COMMON_KEYS", "OpenContext", "Source", "register_source", "source_from_dict"]

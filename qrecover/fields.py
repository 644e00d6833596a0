"""Config dataclasses: every field declared with its help text, and one round trip to plain dicts and JSON.

``doc_field`` puts the help text on the field (as peft declares its config fields); :class:`DictConfig` gives a
dataclass ``to_dict``/``to_json``/``from_dict``, where ``from_dict`` refuses keys the dataclass does not have,
naming them and the known ones. Compress, recover and evaluation configs and the pipeline's sections use it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import field
from typing import Any, ClassVar

from .errors import QRecoverError


def doc_field(default: Any, help: str, **kw: Any) -> Any:  # noqa: A002 - mirrors peft's field(metadata={"help"})
    """A dataclass field with its help text."""
    return field(default=default, metadata={"help": help}, **kw)


class DictConfig:
    """Mixin for config dataclasses; ``what`` names the config in errors ("compress config")."""

    what: ClassVar[str] = "config"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)  # type: ignore[call-overload]

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        unknown = set(d) - known
        if unknown:
            raise QRecoverError(f"unknown {cls.what} key(s) {sorted(unknown)}; known: {sorted(known)}")
        return cls(**d)


__all__ = ["DictConfig", "doc_field"]

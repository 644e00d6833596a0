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


def doc_field(default: Any, help: str, *, flag: str | None = None, short: str | None = None, negate: bool = False,  # noqa: A002
              cli: bool = True, **kw: Any) -> Any:
    """A dataclass field with its help text (as peft's ``field(metadata={"help": ...})``) and, for the command-line
    options derived from it (:mod:`qrecover.cli.config_options`): ``flag`` when it is not ``--field-name``,
    ``short`` (``-r``), ``negate`` (a bool defaulting to True that the flag turns off), ``cli=False`` (not an option)."""
    meta: dict[str, Any] = {"help": help}
    meta.update({k: v for k, v in (("flag", flag), ("short", short)) if v})
    meta.update({k: v for k, v in (("negate", negate), ("cli", cli)) if v is not (k == "cli")})
    return field(default=default, metadata=meta, **kw)


class DictConfig:
    """Mixin for config dataclasses; ``what`` names the config in errors ("compress config"). ``validate()`` checks
    every field (a QRecoverError naming the value and the fix); a subclass defines it and calls it from
    ``__post_init__``."""

    what: ClassVar[str] = "config"

    def validate(self) -> None:
        """Nothing to check unless a subclass says so."""

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




class OptionsConfig(DictConfig):
    """A config with a few fields of its own and ``options``: any other keys, kept flat beside them in its dict
    (a pipeline recipe's ``[compress]`` holds ``bpw`` and any CompressConfig field). ``to_dict`` leaves out own
    fields that are None; ``from_dict`` takes the own fields and puts every other key in ``options``."""

    def to_dict(self) -> dict[str, Any]:
        own = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "options"}  # type: ignore[arg-type]
        return {**{k: list(v) if isinstance(v, list) else v for k, v in own.items() if v is not None}, **self.options}  # type: ignore[attr-defined]

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        d = dict(d)
        own = {f.name: d.pop(f.name, None) for f in dataclasses.fields(cls) if f.name != "options"}  # type: ignore[arg-type]
        return cls(**own, options=d)


__all__ = ["DictConfig", "OptionsConfig", "doc_field"]

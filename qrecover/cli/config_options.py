"""Command-line options derived from a config dataclass: each field declared once, with its help text and flag.

A field's metadata (:func:`qrecover.fields.doc_field`) holds its ``help`` and, where the flag is not the field's
name in kebab case, ``flag`` (e.g. ``"--no-cache-dequantized"`` for ``cache_dequantized``: a bool field whose
default is True is turned off by a flag, ``negate``), ``short`` (``"-r"``) and ``cli=False`` (a field the command
takes otherwise). :func:`config_command` adds every other field of the class to a typer command as an option, so a
new field needs no CLI edit; the command receives them as one ``config`` dict of field values.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any

import typer


def _option(f: dataclasses.Field, annotation: Any) -> tuple[Any, Any]:
    """``(annotation, typer.Option)`` of one field: its default, flag and help text."""
    meta = f.metadata
    flag = meta.get("flag") or "--" + f.name.replace("_", "-")
    names = [flag, *([meta["short"]] if meta.get("short") else [])]
    text = meta.get("help", "")
    help_text = text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")
    if meta.get("negate"):  # a bool that defaults to True: the flag turns it off
        return bool, typer.Option(False, *names, help=f"Turn off: {text}" + ("" if text.endswith(".") else "."))
    return annotation, typer.Option(f.default, *names, help=help_text)


def config_options(cls: type, skip: Sequence[str] = ()) -> list[inspect.Parameter]:
    """One keyword-only parameter per field of ``cls`` (not in ``skip``, not ``cli=False``), named as the field."""
    hints = typing.get_type_hints(cls)
    params = []
    for f in dataclasses.fields(cls):
        if f.name in skip or f.metadata.get("cli") is False:
            continue
        annotation, option = _option(f, hints[f.name])
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=option, annotation=annotation))
    return params


def config_values(cls: type, given: dict[str, Any]) -> dict[str, Any]:
    """The parsed options as field values (a ``negate`` flag given means False)."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            out[f.name] = not given[f.name] if f.metadata.get("negate") else given[f.name]
    return out


def config_command(cls: type, skip: Sequence[str] = ()) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command ``fn(..., config: dict)``: typer sees ``fn``'s own parameters (``config`` removed) and one
    option per field of ``cls``; ``fn`` gets the fields' values in ``config``."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        own = [p for p in inspect.signature(fn, eval_str=True).parameters.values() if p.name != "config"]
        fields = config_options(cls, skip)
        names = {p.name for p in fields}

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            config = config_values(cls, {k: v for k, v in kwargs.items() if k in names})
            return fn(**{k: v for k, v in kwargs.items() if k not in names}, config=config)

        command.__signature__ = inspect.Signature([*own, *fields])  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in [*own, *fields]}
        del command.__wrapped__  # typer must read __signature__, not fn's own
        return command

    return wrap


__all__ = ["config_command", "config_options", "config_values"]

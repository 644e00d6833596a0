"""Command-line options derived from a config dataclass: each field declared once, with its help text and flag.

A field's metadata (:func:`qrecover.fields.doc_field`) holds its ``help`` and, where the flag is not the field's
name in kebab case, ``flag`` (e.g. ``"--no-cache-dequantized"`` for ``cache_dequantized``: a bool field whose
default is True is turned off by a flag, ``negate``), ``short`` (``"-r"``) and ``cli=False`` (a field the command
takes otherwise). :func:`config_command` adds every other field of the class to a typer command as an option, so a
new field needs no CLI edit; the command receives them as one ``config`` dict of field values. A command that takes
only some fields names them, in the order its ``--help`` lists them (``only``: ``qrecover tune`` trains no LoRA, so it
has no ``--rank``). The options stand where the command's ``config`` parameter stands among its own.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Any

import typer
from rich.markup import escape


def _option(f: dataclasses.Field, annotation: Any) -> tuple[Any, Any]:
    """``(annotation, typer.Option)`` of one field: its default, flag and help text."""
    meta = f.metadata
    flag = meta.get("flag") or "--" + f.name.replace("_", "-")
    names = [flag, *([meta["short"]] if meta.get("short") else [])]
    text = escape(meta.get("help", ""))  # typer renders help as rich markup: "qrecover[train-gpu]" must stay as written
    help_text = text[:1].upper() + text[1:] + ("" if text.endswith(".") else ".")
    if meta.get("negate"):  # a bool that defaults to True: the flag turns it off
        return bool, typer.Option(False, *names, help=f"Turn off: {text}" + ("" if text.endswith(".") else "."))
    return annotation, typer.Option(f.default, *names, help=help_text)


def _fields(cls: type, skip: Sequence[str], only: Sequence[str] | None) -> list[dataclasses.Field]:
    """The fields that are options: ``only`` (in its order), or every field not in ``skip`` nor ``cli=False``."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    if only is None:
        return [f for f in fields.values() if f.name not in skip and f.metadata.get("cli") is not False]
    unknown = [name for name in only if name not in fields]
    if unknown:
        raise TypeError(f"{cls.__name__} has no field(s) {unknown}")
    return [fields[name] for name in only]


def config_options(cls: type, skip: Sequence[str] = (), only: Sequence[str] | None = None) -> list[inspect.Parameter]:
    """One keyword-only parameter per field of ``cls`` (not in ``skip``, not ``cli=False``; or the fields named in
    ``only``, in its order), named as the field."""
    hints = typing.get_type_hints(cls)
    params = []
    for f in _fields(cls, skip, only):
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


def config_command(cls: type, skip: Sequence[str] = (), only: Sequence[str] | None = None
                   ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a command ``fn(..., config: dict, ...)``: typer sees ``fn``'s own parameters with one option per field
    of ``cls`` (see :func:`config_options`) in place of ``config``; ``fn`` gets the fields' values in ``config``."""

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        params = list(inspect.signature(fn, eval_str=True).parameters.values())
        at = [p.name for p in params].index("config")
        fields = config_options(cls, skip, only)
        names = {p.name for p in fields}

        @functools.wraps(fn)
        def command(**kwargs: Any) -> Any:
            config = config_values(cls, {k: v for k, v in kwargs.items() if k in names})
            return fn(**{k: v for k, v in kwargs.items() if k not in names}, config=config)

        # keyword-only, all of them: typer passes every value by name, and own parameters may follow the fields
        listed = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in [*params[:at], *fields, *params[at + 1:]]]
        command.__signature__ = inspect.Signature(listed)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in listed}
        del command.__wrapped__  # typer must read __signature__, not fn's own
        return command

    return wrap


__all__ = ["config_command", "config_options", "config_values"]

"""Option types shared by several commands, and output helpers."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.console import Console

from ..errors import QRecoverError

console = Console(stderr=True)

JsonOpt = typer.Option(False, "--json", help="Print machine-readable JSON on stdout instead of a table.")
ModelArg = typer.Option(None, "--model", "-m", help="Hugging Face causal-LM directory or .gguf file (default: the built-in SmolLM2-135M-Instruct)")
AdapterOpt = typer.Option(None, "--adapter", help="A recovery/feature adapter directory (PEFT) trained on this checkpoint; another base's adapter is "
                                                  "refused.")
AllowForeignOpt = typer.Option(False, "--allow-foreign-adapter", help="Load --adapter even though it was trained on another checkpoint.")
CalibDataOpt = typer.Option("python-docs", "--calib-data", help="Text: 'python-docs' (built in), or a directory, file or glob of text files; "
                            "or a data-mix recipe: 'calib-mix' (shipped: the docs' calib split + the model's own general chats) or a .toml file.")


#: the arguments ``qrecover.cli.main`` was called with (``compress --procs`` relaunches them); empty when a command
#: is invoked otherwise (typer's test runner, say)
INVOKED: list[str] = []


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, indent=1, default=str))


def parse_ints(value: str, what: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise QRecoverError(f"{what} {value!r} must be comma-separated integers, e.g. 2,4") from None


def training_data(mix: Any, data: Any, overwrite: bool, resume: bool) -> Any:
    """The training data of a training command: ``--data`` or ``--mix`` (at most one), with ``--overwrite`` and
    ``--resume`` not both given."""
    if overwrite and resume:
        raise QRecoverError("--overwrite and --resume contradict each other; pick one")
    if data is not None and mix is not None:
        raise QRecoverError("--data and --mix both name the training data; pass one")
    return data if data is not None else mix

"""The ``qrecover`` command: one file per command, all of them thin wrappers over :mod:`qrecover.api`."""

from __future__ import annotations

import os
import sys

import typer

from ..errors import QRecoverError
from . import compress as _compress
from . import data as _data
from . import eval as _eval
from . import export as _export
from . import finetune as _finetune
from . import gate as _gate
from . import info as _info
from . import pipeline as _pipeline
from . import ppl as _ppl
from . import recover as _recover
from . import report as _report
from . import tune as _tune
from .common import INVOKED
from .launch import LAUNCHED, restart_with_tcmalloc

app = typer.Typer(
    name="qrecover",
    help="Compress language models below 4 bits per weight, recover accuracy, gate releases.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
app.command("compress", epilog=_compress.EXAMPLES)(_compress.compress)
app.command("recover", epilog=_recover.EXAMPLES)(_recover.recover)
app.command("finetune", epilog=_finetune.EXAMPLES)(_finetune.finetune)
app.command("tune", epilog=_tune.EXAMPLES)(_tune.tune)
app.command("info", epilog=_info.EXAMPLES)(_info.info)
app.command("ppl", epilog=_ppl.EXAMPLES)(_ppl.ppl)
app.command("eval", epilog=_eval.EXAMPLES)(_eval.eval_)
app.command("report", epilog=_report.EXAMPLES)(_report.report)
app.command("gate", epilog=_gate.EXAMPLES)(_gate.gate)
app.command("pipeline", epilog=_pipeline.EXAMPLES)(_pipeline.pipeline)
app.command("export", epilog=_export.EXAMPLES)(_export.export)
app.add_typer(_data.app, name="data")


def main(argv: list[str] | None = None) -> None:
    """Console entry point: bad input ends with its message and exit code 2, never a traceback (printed by rank 0
    alone under a launch of several processes)."""
    if argv is None:  # the console: the commands that run a model restart under tcmalloc where it is installed
        restart_with_tcmalloc(sys.argv[1:])
    INVOKED[:] = sys.argv[1:] if argv is None else argv  # what --procs relaunches (qrecover.cli.launch)
    try:
        app(args=argv, prog_name="qrecover", standalone_mode=True)
    except QRecoverError as e:
        from rich.console import Console
        from rich.markup import escape

        if os.environ.get("RANK", "0") == "0":
            # soft_wrap: no newlines inserted into the message (the terminal wraps it), so a long path stays one word
            Console(stderr=True).print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(2)
    except KeyboardInterrupt:
        if os.environ.get("RANK", "0") == "0" and os.environ.get(LAUNCHED) != "1":  # else the launching process says so
            print("interrupted: nothing was written", file=sys.stderr)
        sys.exit(130)

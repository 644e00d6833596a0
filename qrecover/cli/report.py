"""``qrecover report``: results files normalised to the unquantized model, as Markdown, JSON and HTML."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from ..reports.render import cell_text, uninformative_metrics, uninformative_note, write_report
from ..reports.results import load_results
from ..reports.table import RATIO_NOTE, metric_names, normalise
from .common import JsonOpt, console, emit_json

EXAMPLES = """Examples:

  qrecover report results/3.7bpw.json results/3.7bpw-r16.json --baseline results/original.json --out reports

  qrecover report results/*.json --baseline results/original.json --out reports --overwrite --json | jq '.rows[].label'
"""


def report(
    results: list[Path] = typer.Argument(..., help="Results files of the quantized and recovered models (from `qrecover eval`)."),
    baseline: Path = typer.Option(..., "--baseline", help="Results file of the unquantized model: every score is a percentage of it."),
    out: Path = typer.Option(..., "--out", help="Directory to write report.md, report.json and report.html into."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --out if it exists."),
    json_out: bool = JsonOpt,
) -> None:
    """Table-10 style report: per bpw, quantized and recovered scores as a percentage of the unquantized model."""
    base = load_results(baseline)
    rows = normalise([load_results(p) for p in results], base)
    rep = write_report(rows, base, out, overwrite=overwrite)
    if json_out:
        emit_json(rep)
        return
    names = metric_names(rows)
    t = Table(title=escape(f"% of unquantized {base.run.model}"))
    for h in ["model", "bpw", "bpw with adapter"] + names:
        t.add_column(escape(h), justify="left" if h == "model" else "right")
    for r in rows:
        fmt = lambda x: "—" if x is None else f"{x:.2f}"  # noqa: E731
        t.add_row(escape(r.label), fmt(r.bpw), fmt(r.bpw_with_adapter), *(escape(cell_text(r, n)) for n in names))
    console.print(t)
    console.print(escape(RATIO_NOTE), highlight=False)
    if noisy := uninformative_metrics(rows):
        console.print(escape(uninformative_note(noisy)), highlight=False)
    console.print(escape(f"wrote {out}/report.md, report.json, report.html"), highlight=False)

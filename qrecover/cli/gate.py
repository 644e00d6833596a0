"""``qrecover gate``: exit 0 when every checked cell of a report keeps enough of the baseline, 1 when not."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from ..errors import QRecoverError
from ..io_utils import read_json
from ..reports.gate import gate as run_gate
from .common import JsonOpt, console, emit_json

EXAMPLES = """Examples:

  qrecover gate reports/report.json --min-ratio 0.97

  qrecover gate reports/report.json --min-ratio 0.97 --metric gsm8k=0.95 --metric ifeval=0.98 --noise-aware

  qrecover gate reports/report.json --min-ratio 0.9 --rows quantized --json | jq .passed

  qrecover gate reports/report.json --min-ratio 0.97 --include-uninformative

Metrics the report marks uninformative (the unquantized model scores within noise of chance, e.g. MMLU
at 25%) are skipped unless --include-uninformative is given or --metric names them.

Exit codes: 0 every checked cell passed, 1 some cell failed, 2 unusable input.
"""


def parse_metric(spec: str) -> tuple[str, float]:
    name, sep, value = spec.partition("=")
    try:
        if not sep or not name.strip():
            raise ValueError
        return name.strip(), float(value)
    except ValueError:
        raise QRecoverError(f"--metric {spec!r} must be NAME=FRACTION, e.g. --metric gsm8k=0.95") from None


def gate(
    report: Path = typer.Argument(..., help="report.json written by `qrecover report`."),
    min_ratio: float = typer.Option(..., "--min-ratio",
                                    help="Least fraction of the unquantized score every checked cell must keep, e.g. 0.97 = 97%."),
    metric: list[str] = typer.Option([], "--metric", help="Per-metric threshold NAME=FRACTION, overriding --min-ratio (repeatable)."),
    rows: str = typer.Option("auto", "--rows", help="Rows to check: auto (recovered rows, or all if none), all, quantized, tuned (checkpoints of "
                                                       "`qrecover tune`), recovered."),
    noise_aware: bool = typer.Option(False, "--noise-aware", help="Fail a cell only when ratio + one standard error is below its threshold."),
    include_uninformative: bool = typer.Option(False, "--include-uninformative", help="Also check metrics the report marks uninformative "
                                                                                      "(unquantized score within noise of chance); skipped by "
                                                                                      "default."),
    json_out: bool = JsonOpt,
) -> None:
    """Gate a release on a report: every checked cell's ratio to the unquantized model must reach its threshold."""
    per_metric: dict[str, float] = {}
    for spec in metric:
        name, value = parse_metric(spec)
        if name in per_metric:
            raise QRecoverError(f"--metric {name} given twice")
        per_metric[name] = value
    data = read_json(report, "report", " (write it with `qrecover report`)")
    try:
        result = run_gate(data, min_ratio, per_metric, rows=rows, noise_aware=noise_aware,
                          include_uninformative=include_uninformative)
    except QRecoverError as e:
        raise QRecoverError(f"{report}: {e}") from None

    t = Table(title=escape(f"gate {report} ({result.rows} rows{', noise-aware' if noise_aware else ''})"))
    for h in ("row", "metric", "ratio", "± stderr", "threshold", "result"):
        t.add_column(h, justify="left" if h in ("row", "metric", "result") else "right")
    for c in result.cells:
        verdict = ("[yellow]skipped, uninformative[/]" if c.uninformative else "[yellow]skipped[/]" if c.skipped
                   else "[green]pass[/]" if c.passed else "[bold red]FAIL[/]")
        t.add_row(escape(c.row), escape(c.metric), "—" if c.ratio is None else f"{100 * c.ratio:.1f}%",
                  "—" if c.ratio_stderr is None else f"{100 * c.ratio_stderr:.1f}", f"{100 * c.threshold:.1f}%",
                  verdict + (f" ({escape(c.note)})" if c.note else ""))
    console.print(t)
    n_fail, n_skip = len(result.failed), len(result.skipped)
    n_noise = sum(c.uninformative for c in result.cells)
    checked = len(result.cells) - n_skip
    skips = [f"{n_skip - n_noise} skipped (not run)"] * (n_skip > n_noise) + [
        f"{n_noise} skipped (uninformative; --include-uninformative checks them)"] * (n_noise > 0)
    console.print(f"{checked - n_fail}/{checked} cells passed" + "".join(f", {s}" for s in skips) + ": " +
                  ("[green]PASS[/]" if result.passed else "[bold red]FAIL[/]"))
    if json_out:
        emit_json(result.to_dict())
    if not result.passed:
        raise typer.Exit(1)

"""``report.md``, ``report.json`` and ``report.html`` from normalised rows, written atomically.

``report.json`` (what ``qrecover gate`` reads)::

    {"report_version": 1, "note": "...", "baseline": {"model", "source", "metrics": {name: {value, stderr,
     higher_is_better, settings}}}, "metrics": [names...], "rows": [Row.to_dict(), ...]}

where each row's ``cells[name]`` holds ``value, stderr, baseline, baseline_stderr, ratio, ratio_stderr,
higher_is_better``, ``ratio`` being a fraction of the baseline (1.0 = 100%), and its ``skipped[name]`` the
text shown for a metric that was not run (``"not run: no judge configured"``); such a metric has no cell,
and the baseline's own skipped metrics are under ``baseline.skipped``.
"""

from __future__ import annotations

import base64
import html
import io
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..io_utils import atomic_dir
from .results import Results
from .table import RATIO_NOTE, Row, metric_names

REPORT_VERSION = 1
FILES = ("report.md", "report.json", "report.html")


def report_dict(rows: Sequence[Row], baseline: Results) -> dict[str, Any]:
    """The content of ``report.json``."""
    b = baseline.to_dict()
    return {
        "report_version": REPORT_VERSION,
        "note": RATIO_NOTE,
        "baseline": {"model": baseline.run.model, "source": baseline.source, "metrics": b["metrics"],
                     "skipped": dict(baseline.skipped)},
        "metrics": metric_names(rows),
        "rows": [r.to_dict() for r in rows],
    }


def _fmt_bpw(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _num(x: float) -> str:
    """Scores in their own unit: 3 significant decimals for 0-1 accuracies, 1 decimal otherwise."""
    return f"{x:.3g}" if abs(x) < 1 else f"{x:.1f}"


def cell_text(row: Row, name: str) -> str:
    """``97.9% (61.2 ± 1.3)``: percent of the baseline, then the raw score ± its stderr; ``—`` if not measured;
    ``not run: <reason>`` if skipped (e.g. AlpacaEval without a judge).

    The ratio's own stderr is in ``report.json`` (``ratio_stderr``).
    """
    if name in row.skipped:
        return row.skipped[name]
    c = row.cells.get(name)
    if c is None:
        return "—"
    raw = _num(c.value) + ("" if c.stderr is None else f" ± {_num(c.stderr)}")
    return f"{c.percent:.1f}% ({raw})"


def _table(rows: Sequence[Row]) -> tuple[list[str], list[list[str]]]:
    names = metric_names(rows)
    header = ["bpw", "bpw with adapter", "model"] + names
    body = []
    for r in rows:
        kind = r.label.split(" bpw ", 1)[-1] if r.bpw is not None else r.label
        body.append([_fmt_bpw(r.bpw), _fmt_bpw(r.bpw_with_adapter), kind] + [cell_text(r, n) for n in names])
    return header, body


def _arrows(rows: Sequence[Row]) -> str:
    names = metric_names(rows)
    hib = {}
    for r in rows:
        for n, c in r.cells.items():
            hib.setdefault(n, c.higher_is_better)
    def what(n: str) -> str:
        if n in hib:
            return f"{n} ({'higher' if hib[n] else 'lower'} is better)"
        notes = {r.skipped[n] for r in rows if n in r.skipped}
        return f"{n} (no ratio)" if notes and all(t.startswith("no ratio") for t in notes) else f"{n} (not run)"

    return ", ".join(what(n) for n in names)


def render_markdown(rows: Sequence[Row], baseline: Results) -> str:
    header, body = _table(rows)
    esc = lambda s: s.replace("|", "\\|")  # noqa: E731
    lines = ["# qrecover evaluation report", "",
             f"Baseline (100%): unquantized model `{baseline.run.model}`" + (f" ({baseline.source})" if baseline.source else "") + ".",
             "", RATIO_NOTE, "", f"Metrics: {_arrows(rows)}. Cells: percent of baseline (raw score ± stderr).", "",
             "| " + " | ".join(map(esc, header)) + " |",
             "|" + "|".join(["---:", "---:", "---"] + [":---:"] * (len(header) - 3)) + "|"]
    lines += ["| " + " | ".join(map(esc, r)) + " |" for r in body]
    parts = [f"{n} {_num(m.value)}" + ("" if m.stderr is None else f" ± {_num(m.stderr)}")
             for n, m in baseline.metrics.items() if n in metric_names(rows)]
    parts += [f"{n} not run ({why})" for n, why in baseline.skipped.items() if n in metric_names(rows)]
    lines += ["", f"Baseline scores: {', '.join(parts)}.", ""]
    return "\n".join(lines)


def plot_png(rows: Sequence[Row]) -> bytes | None:
    """Normalised score (%) vs measured bpw, one line per metric x (quantized | recovered rank r); None without matplotlib."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        return None
    fig = Figure(figsize=(7, 4.2), dpi=100)
    ax = fig.add_subplot()
    names = metric_names(rows)
    colors = [f"C{i % 10}" for i in range(len(names))]
    series = sorted({(r.kind, r.adapter_rank or 0) for r in rows if r.kind != "original" and r.bpw is not None})
    markers = "o^sDv<>p*h"
    for name, color in zip(names, colors):
        for i, (kind, rank) in enumerate(series):  # one line per metric x (quantized | recovered at rank r)
            pts = sorted(((r.bpw, r.cells[name]) for r in rows if (r.kind, r.adapter_rank or 0) == (kind, rank)
                          and r.bpw is not None and name in r.cells), key=lambda p: p[0])
            if not pts:
                continue
            xs = [x for x, _ in pts]
            ys = [c.percent for _, c in pts]
            err = [0.0 if c.ratio_stderr is None else 100 * c.ratio_stderr for _, c in pts]
            label = f"{name} {kind}" + (f" r{rank}" if kind == "recovered" else "")
            ax.errorbar(xs, ys, yerr=err, linestyle="--" if kind == "quantized" else "-", marker=markers[i % len(markers)],
                        color=color, capsize=3, label=label)
    ax.axhline(100.0, color="gray", linewidth=1, linestyle=":", label="unquantized")
    ax.set_xlabel("measured bits per weight (adapter not counted)")
    ax.set_ylabel("% of unquantized (below 100% = worse)")
    ax.invert_xaxis()  # as in the table: high bpw first
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def render_html(rows: Sequence[Row], baseline: Results, png: bytes | None) -> str:
    header, body = _table(rows)
    e = html.escape
    th = "".join(f"<th>{e(h)}</th>" for h in header)
    trs = "\n".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r) + "</tr>" for r in body)
    if png is None:
        fig = "<p><em>Plot not drawn: matplotlib is not installed (pip install matplotlib).</em></p>"
    else:
        fig = f'<img alt="normalised score vs bits per weight" src="data:image/png;base64,{base64.b64encode(png).decode()}">'
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>qrecover evaluation report</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
</style>
</head>
<body>
<h1>qrecover evaluation report</h1>
<p>Baseline (100%): unquantized model <code>{e(baseline.run.model)}</code>.</p>
<p>{e(RATIO_NOTE)}</p>
<p>Metrics: {e(_arrows(rows))}. Cells: percent of baseline (raw score ± stderr).</p>
<table>
<thead><tr>{th}</tr></thead>
<tbody>
{trs}
</tbody>
</table>
{fig}
</body>
</html>
"""


def write_report(rows: Sequence[Row], baseline: Results, out: str | Path, overwrite: bool = False) -> dict[str, Any]:
    """Write ``report.md``, ``report.json``, ``report.html`` into ``out`` (all three or none); return the JSON."""
    report = report_dict(rows, baseline)
    md = render_markdown(rows, baseline)
    page = render_html(rows, baseline, plot_png(rows))
    with atomic_dir(Path(out), overwrite=overwrite) as tmp:
        (tmp / "report.md").write_text(md)
        (tmp / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        (tmp / "report.html").write_text(page)
    return report

"""``report.md``, ``report.json`` and ``report.html`` from normalised rows, written atomically.

``report.json`` (what ``qrecover gate`` reads)::

    {"report_version": 1, "note": "...", "baseline": {"model", "source", "metrics": {name: {value, stderr,
     higher_is_better, settings}}}, "metrics": [names...], "uninformative": {name: reason},
     "uninformative_rule": "...", "rows": [Row.to_dict(), ...]}

where each row's ``cells[name]`` holds ``value, stderr, baseline, baseline_stderr, ratio, ratio_stderr,
higher_is_better``, ``ratio`` being a fraction of the baseline (1.0 = 100%), and its ``skipped[name]`` the
text shown for a metric that was not run (``"not run: no judge configured"``); such a metric has no cell,
and the baseline's own skipped metrics are under ``baseline.skipped``. A metric whose unquantized score is
within noise of chance (:func:`~qrecover.reports.table.uninformative`) is named in the report's and every
row's ``uninformative`` with the reason; the Markdown and HTML tables mark its column and cells with †
and state the rule under the table.

``report.html`` holds the table and the plot, an inline SVG (:func:`plot_svg`): one panel per metric.
"""

from __future__ import annotations

import html
import io
import json
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..io_utils import atomic_dir
from .results import Results
from .table import KIND_ORDER, RATIO_NOTE, UNINFORMATIVE_RULE, Row, metric_names

REPORT_VERSION = 1
MARK = "†"  # flags an uninformative metric in the tables


def report_dict(rows: Sequence[Row], baseline: Results) -> dict[str, Any]:
    """The content of ``report.json``."""
    b = baseline.to_dict()
    return {
        "report_version": REPORT_VERSION,
        "note": RATIO_NOTE,
        "baseline": {"model": baseline.run.model, "source": baseline.source, "metrics": b["metrics"],
                     "skipped": dict(baseline.skipped)},
        "metrics": metric_names(rows),
        "uninformative": uninformative_metrics(rows),
        "uninformative_rule": UNINFORMATIVE_RULE,
        "rows": [r.to_dict() for r in rows],
    }


def _fmt_bpw(x: float | None) -> str:
    return "—" if x is None else f"{x:.2f}"


def _num(x: float) -> str:
    """Scores in their own unit: 3 significant decimals for 0-1 accuracies, 1 decimal otherwise."""
    return f"{x:.3g}" if abs(x) < 1 else f"{x:.1f}"


def cell_text(row: Row, name: str) -> str:
    """``97.9% (61.2 ± 1.3)``: percent of the baseline, then the raw score ± its stderr; ``—`` if not measured;
    ``not run: <reason>`` if skipped (e.g. AlpacaEval without a judge); `` †`` appended when the metric is
    uninformative (its baseline within noise of chance, :func:`~qrecover.reports.table.uninformative`).

    The ratio's own stderr is in ``report.json`` (``ratio_stderr``).
    """
    mark = f" {MARK}" if name in row.uninformative else ""
    if name in row.skipped:
        return row.skipped[name] + mark
    c = row.cells.get(name)
    if c is None:
        return "—"
    raw = _num(c.value) + ("" if c.stderr is None else f" ± {_num(c.stderr)}")
    return f"{c.percent:.1f}% ({raw}){mark}"


def uninformative_metrics(rows: Sequence[Row]) -> dict[str, str]:
    """``{metric: reason}`` of the uninformative metrics of any row, in column order."""
    reasons = {n: why for r in rows for n, why in r.uninformative.items()}
    return {n: reasons[n] for n in metric_names(rows) if n in reasons}


def uninformative_note(noisy: dict[str, str]) -> str:
    return (f"{MARK} Uninformative: " + "; ".join(f"{n}: {why.removeprefix('uninformative: ')}" for n, why in noisy.items())
            + f". {UNINFORMATIVE_RULE}")


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
    noisy = uninformative_metrics(rows)
    header = header[:3] + [f"{n} {MARK}" if n in noisy else n for n in header[3:]]
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
    if noisy:
        lines += [uninformative_note(noisy), ""]
    return "\n".join(lines)


PANEL_COLUMNS = 4  # panels per row of the figure
PANEL_SIZE = (3.1, 2.45)  # inches per panel (at 96 px/inch: ~300 x 235 px)
QUANTIZED_STYLE = {"color": "#1f77b4", "linestyle": "--", "marker": "o"}
TUNED_STYLE = {"color": "#6a3d9a", "linestyle": "-.", "marker": "s"}  # tuned checkpoints: zero extra bytes
RECOVERED_COLORS = ("#d95f02", "#1b9e77", "#7570b3", "#e7298a", "#66a61e")  # one per adapter rank
PANEL_MEASURE = {"nats": "as exp(-KL)", "fraction": "as 1 - rate"}  # what 100% means where the baseline is 0


def panel_id(name: str) -> str:
    """The SVG id of metric ``name``'s panel: ``panel-`` and the name with anything but [A-Za-z0-9_-] as ``_``."""
    return "panel-" + re.sub(r"[^A-Za-z0-9_-]", "_", name)


def plotted_metrics(rows: Sequence[Row]) -> list[str]:
    """The metrics drawn as panels: those with a ratio in some quantized or recovered row; informative ones first."""
    names = [n for n in metric_names(rows) if any(n in r.cells for r in rows if r.kind != "original" and r.bpw is not None)]
    noisy = {n for r in rows for n in r.uninformative}
    return [n for n in names if n not in noisy] + [n for n in names if n in noisy]


def _series(rows: Sequence[Row]) -> list[tuple[str, int]]:
    """``(kind, rank)`` of every line: quantized (rank 0), tuned (rank 0), then recovered per adapter rank."""
    return sorted({(r.kind, r.adapter_rank or 0) for r in rows if r.kind != "original" and r.bpw is not None},
                  key=lambda kr: (KIND_ORDER[kr[0]], kr[1]))


def plot_svg(rows: Sequence[Row]) -> str | None:
    """One small panel per metric (:func:`plotted_metrics`): % of the unquantized model vs measured bpw, the
    quantized rows and the recovered rows (one line per adapter rank) as series, error bars of one standard
    error of the ratio where the results carry one, and the unquantized model as the 100% line. One legend
    above the panels; an uninformative metric's panel is grey and says so. Returns an ``<svg>`` element with
    text kept as text and ``id`` :func:`panel_id` on each panel (deterministic bytes); None without matplotlib
    or without anything to draw.
    """
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError:
        return None
    names = plotted_metrics(rows)
    if not names:
        return None
    series = _series(rows)
    n_plain = sum(k != "recovered" for k, _ in series)  # the quantized and tuned lines come first
    noisy = {n: why for r in rows for n, why in r.uninformative.items()}
    bpws = sorted({r.bpw for r in rows if r.bpw is not None and r.kind != "original"})
    span = (bpws[-1] - bpws[0]) or 0.5
    dodge = 0.04 * span  # series side by side at one bpw, so their error bars do not hide each other
    ncols = min(PANEL_COLUMNS, len(names))
    nrows = math.ceil(len(names) / ncols)
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "qrecover-report", "font.size": 8}):
        fig = Figure(figsize=(PANEL_SIZE[0] * ncols, PANEL_SIZE[1] * nrows + 0.45), dpi=96, layout="constrained")
        axes = fig.subplots(nrows, ncols, squeeze=False)
        handles: dict[str, Any] = {}
        for k, name in enumerate(names):
            ax = axes[k // ncols][k % ncols]
            ax.set_gid(panel_id(name))
            handles["unquantized (100%)"] = ax.axhline(100.0, color="#555555", linewidth=1.2, linestyle=":", zorder=1)
            first = next(r.cells[name] for r in rows if name in r.cells)
            for i, (kind, rank) in enumerate(series):
                pts = sorted((r.bpw, r.cells[name]) for r in rows
                             if (r.kind, r.adapter_rank or 0) == (kind, rank) and r.bpw is not None and name in r.cells)
                if not pts:
                    continue
                offset = (i - (len(series) - 1) / 2) * dodge
                style = ({"quantized": QUANTIZED_STYLE, "tuned": TUNED_STYLE}.get(kind) or
                         {"color": RECOVERED_COLORS[(i - n_plain) % len(RECOVERED_COLORS)], "linestyle": "-", "marker": "^"})
                label = kind if kind != "recovered" else f"recovered (rank {rank})"
                err = [math.nan if c.ratio_stderr is None else 100 * c.ratio_stderr for _, c in pts]
                handles[label] = ax.errorbar([x + offset for x, _ in pts], [c.percent for _, c in pts],
                                             yerr=None if all(math.isnan(e) for e in err) else err,
                                             capsize=2.5, markersize=5, linewidth=1.5, elinewidth=1, zorder=3, **style)
            title = f"{name}  ({PANEL_MEASURE.get(first.scale) or f'unquantized {_num(first.baseline)}'})"
            if name in noisy:
                ax.set_facecolor("#eeeeee")
                ax.set_title(f"{name}: uninformative\n(unquantized at chance)", fontsize=9, color="#777777")
            else:
                ax.set_title(title, fontsize=9)
            ax.set_xticks(bpws, [f"{b:.2f}" for b in bpws])
            ax.set_xlim(bpws[0] - 0.25 * span, bpws[-1] + 0.25 * span)
            ax.yaxis.set_major_formatter("{x:.0f}%")
            ax.grid(alpha=0.3, linewidth=0.6)
            if k // ncols == nrows - 1 or k + ncols >= len(names):
                ax.set_xlabel("measured bpw")
            if k % ncols == 0:
                ax.set_ylabel("% of unquantized")
        for k in range(len(names), nrows * ncols):
            axes[k // ncols][k % ncols].set_visible(False)
        order = [lbl for lbl in handles if lbl != "unquantized (100%)"] + ["unquantized (100%)"]
        legend = fig.legend([handles[lbl] for lbl in order], order, loc="outside upper center", ncols=len(order),
                            frameon=False, fontsize=9)
        legend.set_gid("legend")
        buf = io.StringIO()
        fig.savefig(buf, format="svg", metadata={"Date": None})
    svg = buf.getvalue()
    return svg[svg.index("<svg"):]  # inline: without the XML declaration and doctype


def _figure_html(rows: Sequence[Row], svg: str | None) -> str:
    e = html.escape
    if svg is None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return "<p><em>Plot not drawn: matplotlib is not installed (pip install matplotlib).</em></p>"
        return "<p><em>No plot: no quantized or recovered row has a ratio.</em></p>"
    left_out = [n for n in metric_names(rows) if n not in plotted_metrics(rows)]
    why = {n: next((r.skipped[n] for r in rows if n in r.skipped), "") for n in left_out}
    note = ("" if not left_out else " Not plotted (no ratio in any row): "
            + "; ".join(f"{e(n)} ({e(why[n])})" if why[n] else e(n) for n in left_out) + ".")
    return (f'<figure id="plot">\n{svg}\n<figcaption>One panel per metric: percent of the unquantized model '
            f"(dotted line, 100%) against measured bits per weight (adapter not counted), quantized and recovered "
            f"side by side at each bpw; bars are one standard error of the ratio where the results carry one. "
            f"Below 100% is worse, for every metric.{note}</figcaption>\n</figure>")


def render_html(rows: Sequence[Row], baseline: Results, svg: str | None) -> str:
    header, body = _table(rows)
    names = metric_names(rows)
    noisy = uninformative_metrics(rows)
    e = html.escape
    th = "".join(f"<th>{e(h)}</th>" for h in header[:3]) + "".join(
        f'<th class="uninformative" title="{e(noisy[n])}">{e(n)} {MARK}</th>' if n in noisy else f"<th>{e(n)}</th>"
        for n in names)
    trs = "\n".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in r[:3]) + "".join(
        f'<td class="uninformative" title="{e(noisy[n])}">{e(c)}</td>' if n in noisy else f"<td>{e(c)}</td>"
        for n, c in zip(names, r[3:])) + "</tr>" for r, row in zip(body, rows))
    foot = "" if not noisy else f'<p class="uninformative-note">{e(uninformative_note(noisy))}</p>'
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>qrecover evaluation report</title>
<style>
body {{ font-family: sans-serif; margin: 2em; }}
table {{ border-collapse: collapse; }}
th, td {{ border: 1px solid #ccc; padding: 4px 8px; text-align: right; }}
.uninformative {{ color: #888; background: #f3f3f3; }}
.uninformative-note {{ color: #555; }}
figure {{ margin: 1.5em 0; }}
figure svg {{ max-width: 100%; height: auto; }}
figcaption {{ color: #444; max-width: 60em; }}
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
{foot}
{_figure_html(rows, svg)}
</body>
</html>
"""


def write_report(rows: Sequence[Row], baseline: Results, out: str | Path, overwrite: bool = False) -> dict[str, Any]:
    """Write ``report.md``, ``report.json``, ``report.html`` into ``out`` (all three or none); return the JSON."""
    report = report_dict(rows, baseline)
    md = render_markdown(rows, baseline)
    page = render_html(rows, baseline, plot_svg(rows))
    with atomic_dir(Path(out), overwrite=overwrite) as tmp:
        (tmp / "report.md").write_text(md)
        (tmp / "report.json").write_text(json.dumps(report, indent=1) + "\n")
        (tmp / "report.html").write_text(page)
    return report

"""Release gate: does every checked cell of a ``report.json`` keep at least a given fraction of the baseline?

Pure: :func:`gate` takes the report as a dict and returns a :class:`GateResult` listing every checked cell.
Thresholds are fractions of the unquantized model's score (0.97 = 97%), compared with each cell's
``ratio`` (oriented so below 1 is worse, for lower-is-better metrics too).

A metric a row skipped (the report row's ``skipped``, e.g. AlpacaEval without a judge) is neither a pass
nor a failure: its cell is listed with ``skipped`` true, ``passed`` false and the reason as its note, and
the overall verdict is decided by the other cells. Naming it in ``per_metric`` asks for a score, so
there a skipped cell fails.

A metric the report marks uninformative (the row's ``uninformative``: the unquantized model scores within
noise of chance, see :func:`qrecover.reports.table.uninformative`) is skipped the same way, its reason as
the note, unless ``include_uninformative`` is set or ``per_metric`` names it: a ratio of noise to noise
would pass or fail a release by chance.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import QRecoverError
from .results import KINDS

ROW_CHOICES = ("auto", "all", "quantized", "tuned", "recovered")
EPS = 1e-9  # a ratio equal to its threshold passes even when float division lands a hair below it


@dataclass
class GateCell:
    row: str  # the row's label, e.g. "3.70 bpw recovered (rank 16)"
    kind: str
    metric: str
    ratio: float | None  # None: the metric was not measured for this row (a failure)
    ratio_stderr: float | None
    threshold: float
    passed: bool
    note: str = ""  # "", "within 1 stderr", "not measured", or why a skipped metric was not run
    skipped: bool = False  # not run, or uninformative (see the module doc): counted neither as a pass nor as a failure
    uninformative: bool = False  # the unquantized model scores within noise of chance on this metric


@dataclass
class GateResult:
    passed: bool
    rows: str  # which rows were checked: "recovered", "all", "quantized", "tuned"
    noise_aware: bool
    cells: list[GateCell] = field(default_factory=list)
    include_uninformative: bool = False

    @property
    def failed(self) -> list[GateCell]:
        return [c for c in self.cells if not c.passed and not c.skipped]

    @property
    def skipped(self) -> list[GateCell]:
        return [c for c in self.cells if c.skipped]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_threshold(value: float, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value <= 2) or math.isnan(value):
        raise QRecoverError(f"{what} {value!r} must be a fraction of the baseline in (0, 2], e.g. 0.97 for 97%")
    return float(value)


def _rows(report: Any) -> tuple[list[dict], list[str]]:
    """The report's rows and metric names, checked just enough to gate on."""
    if not isinstance(report, Mapping) or not isinstance(report.get("rows"), list) or not isinstance(report.get("metrics"), list):
        raise QRecoverError("not a qrecover report: expected a JSON object with 'rows' and 'metrics' lists (write one with `qrecover report`)")
    rows = report["rows"]
    if not rows:
        raise QRecoverError("the report has no rows; there is nothing to gate")
    for i, r in enumerate(rows):
        if not isinstance(r, Mapping) or not isinstance(r.get("cells"), Mapping) or r.get("kind") not in KINDS:
            raise QRecoverError(f"report row {i} is malformed: expected 'label', 'kind' and 'cells'")
        for key in ("skipped", "uninformative"):
            if not isinstance(r.get(key, {}), Mapping):
                raise QRecoverError(f"report row {i} ({r.get('label')}) is malformed: '{key}' must be an object")
        for name, c in r["cells"].items():
            ok = isinstance(c, Mapping) and isinstance(c.get("ratio"), (int, float)) and not isinstance(c.get("ratio"), bool)
            se = c.get("ratio_stderr") if isinstance(c, Mapping) else None
            if not ok or not (se is None or isinstance(se, (int, float))):
                raise QRecoverError(f"report row {i} ({r.get('label')}) cell {name!r} is malformed: expected numeric 'ratio' and 'ratio_stderr' (or "
                                    "null)")
    return rows, list(report["metrics"])


def gate(report: Mapping[str, Any], min_ratio: float, per_metric: Mapping[str, float] | None = None,
         rows: str = "auto", noise_aware: bool = False, include_uninformative: bool = False) -> GateResult:
    """Check the report's cells against ``min_ratio`` (or ``per_metric[name]`` where given).

    ``rows``: 'auto' = the recovered rows, or every row when the report has none; 'all'; 'quantized'; 'tuned'
    (checkpoints of `qrecover tune`); 'recovered'. A cell passes when ``ratio >= threshold``; with ``noise_aware`` it fails only when
    ``ratio + ratio_stderr < threshold`` (one standard error of slack; a cell without a stderr is compared
    plainly). A metric the report lists but a checked row did not measure fails ("not measured"); one the row
    skipped is listed as skipped and left out of the verdict, unless ``per_metric`` names it (then it fails).

    Raises QRecoverError on a malformed report, an unknown ``rows`` choice, a choice that selects no row or
    only skipped cells, a ``per_metric`` name the report does not have, or a threshold outside (0, 2].
    """
    per_metric = dict(per_metric or {})
    check_threshold(min_ratio, "--min-ratio")
    for name, t in per_metric.items():
        check_threshold(t, f"--metric {name}=")
    if rows not in ROW_CHOICES:
        raise QRecoverError(f"--rows {rows!r} must be one of {', '.join(ROW_CHOICES)}")
    all_rows, names = _rows(report)
    unknown = sorted(set(per_metric) - set(names))
    if unknown:
        raise QRecoverError(f"--metric {', '.join(unknown)}: not in the report (it has {', '.join(names)})")

    if rows == "auto":
        chosen = "recovered" if any(r["kind"] == "recovered" for r in all_rows) else "all"
    else:
        chosen = rows
    checked = [r for r in all_rows if chosen == "all" or r["kind"] == chosen]
    if not checked:
        raise QRecoverError(f"--rows {rows}: the report has no {chosen} rows "
                            f"(it has {', '.join(sorted({r['kind'] for r in all_rows}))})")

    cells = []
    for r in checked:
        for name in names:
            t = per_metric.get(name, min_ratio)
            label = str(r.get("label", r.get("model", "?")))
            c = r["cells"].get(name)
            noise = r.get("uninformative", {}).get(name)
            if noise is not None and not include_uninformative and name not in per_metric:
                cells.append(GateCell(label, r["kind"], name, None if c is None else float(c["ratio"]),
                                      None if c is None else c.get("ratio_stderr"), t, False, str(noise),
                                      skipped=True, uninformative=True))
                continue
            why = r.get("skipped", {}).get(name)
            if c is None and why is not None:
                if name in per_metric:  # a threshold was asked for explicitly: a missing score fails it
                    cells.append(GateCell(label, r["kind"], name, None, None, t, False, f"{why}; --metric {name} asks for a score"))
                else:
                    cells.append(GateCell(label, r["kind"], name, None, None, t, False, str(why), skipped=True))
                continue
            if c is None:
                cells.append(GateCell(label, r["kind"], name, None, None, t, False, "not measured"))
                continue
            ratio, se = float(c["ratio"]), c.get("ratio_stderr")
            if ratio >= t - EPS:
                cells.append(GateCell(label, r["kind"], name, ratio, se, t, True))
            elif noise_aware and se is not None and ratio + se >= t - EPS:
                cells.append(GateCell(label, r["kind"], name, ratio, se, t, True, "within 1 stderr"))
            else:
                cells.append(GateCell(label, r["kind"], name, ratio, se, t, False))
    if all(c.skipped for c in cells):
        hint = ("; --include-uninformative checks the uninformative ones" if any(c.uninformative for c in cells) else "")
        raise QRecoverError(f"every checked cell ({len(cells)}) was skipped (not run or uninformative); there is "
                            f"nothing to gate{hint}")
    return GateResult(passed=all(c.passed or c.skipped for c in cells), rows=chosen, noise_aware=noise_aware, cells=cells,
                      include_uninformative=include_uninformative)

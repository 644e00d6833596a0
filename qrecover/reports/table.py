"""Scores normalised to the unquantized model, in the layout of AFM's Table 10 (appendix F).

Pure functions of :class:`~qrecover.reports.results.Results`: one :class:`Row` per evaluated model
(label "3.7 bpw quantized" or "3.7 bpw recovered (rank 16)"), one :class:`Cell` per metric.

The ratio is oriented so that **below 1 (100%) always means worse than the unquantized model**:

* higher-is-better metrics (accuracy, win rate): ``ratio = v / b``
* lower-is-better metrics (perplexity): ``ratio = b / v``
* divergences in nats whose baseline is 0 (KL to the unquantized model, ``scale="nats"``):
  ``ratio = exp(b - v)``, the same rule as perplexity applied to log-likelihoods (ppl ratio = exp(nll_b - nll_v))
* rates whose baseline is 0 (answer flips against the unquantized model, ``scale="fraction"``):
  ``ratio = 1 - (v - b)``, i.e. the agreement

where ``v`` is the run's value and ``b`` the baseline's. Its standard error is propagated to first order,
treating the two measurements as independent (the relative errors add in quadrature, for either
orientation)::

    ratio_stderr = ratio * sqrt((s_v / v)**2 + (s_b / b)**2)

and is ``None`` when either stderr is missing. A metric is compared only under identical ``settings``
(num_fewshot, limit, seq_len, ...): a difference is an error, never a silent comparison, and so is a
run metric the baseline lacks.

A metric the run skipped (``Results.skipped``, e.g. AlpacaEval without a judge) has no cell: the row's
``skipped[name]`` holds the text its column shows instead, ``"not run: <reason>"``. A metric the run
measured but the baseline skipped cannot be normalised and shows ``"baseline not run: <reason>"``; one whose
ratio does not exist (a higher-is-better baseline of 0, a lower-is-better value of 0) shows ``"no ratio: ..."``
with both values. The gate counts such cells as neither pass nor fail.

A metric is **uninformative** (:func:`uninformative`, rule :data:`UNINFORMATIVE_RULE`) when the
unquantized model's own score is within noise of the task's chance level: ``|b - chance| <= 2 s_b``,
``s_b`` being the baseline's standard error and chance the score of guessing (:data:`CHANCE`: 0.25 for
4-choice MMLU, 0 for GSM8K's exact match). MMLU at 25% on a 135M model, or GSM8K at 0, say nothing about
what quantization cost: ratios of noise. Every row marks such a metric in ``uninformative[name]`` (the
reason); the table flags its cells and ``qrecover gate`` skips them unless asked for.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import QRecoverError
from .results import Metric, Results

RATIO_NOTE = ("Each cell is a percentage of the unquantized model's score: value / baseline for "
              "higher-is-better metrics, baseline / value for lower-is-better ones (perplexity); "
              "exp(-KL) for the KL divergence to the unquantized model (nats) and 1 - flip rate for answer flips, "
              "whose unquantized value is 0; so below 100% always means worse. ± is one standard error of the raw score; the ratio's own "
              "standard error (first-order propagation) is in report.json as ratio_stderr.")

KIND_ORDER = {"original": 0, "quantized": 1, "tuned": 2, "recovered": 3}

# the score of guessing, per metric; a metric not listed has no known chance level and is never uninformative
CHANCE = {
    "mmlu": 0.25,  # four answer choices, one right
    "gsm8k": 0.0,  # exact match of a free-form number (flexible-extract)
    "gsm8k_strict": 0.0,  # the same, strict-match
}
NOISE_STDERRS = 2.0  # "within noise": within this many of the baseline's standard errors (~95% for a normal)
UNINFORMATIVE_RULE = (f"A metric is uninformative when the unquantized model's score b is within noise of the task's chance "
                      f"level: |b - chance| <= {NOISE_STDERRS:g} x its standard error (chance: "
                      + ", ".join(f"{n} {c:g}" for n, c in CHANCE.items())
                      + "; a metric without a known chance level or a standard error is never marked). Its percentages "
                      "compare noise with noise, so they are flagged and `qrecover gate` skips them unless asked "
                      "(--include-uninformative, or --metric NAME=...).")


def uninformative(baseline: Results) -> dict[str, str]:
    """``{metric: reason}`` for the baseline's metrics whose score is within noise of chance (see the module doc).

    ``mmlu`` 0.25 ± 0.099 -> uninformative (0 stderrs from chance 0.25); ``gsm8k`` 0 ± 0 -> uninformative;
    ``mmlu`` 0.45 ± 0.05 -> not (4 stderrs); ``ppl`` -> never (no chance level).
    """
    out = {}
    for name, m in baseline.metrics.items():
        chance = CHANCE.get(name)
        if chance is None or m.stderr is None or not math.isfinite(m.stderr):
            continue
        if abs(m.value - chance) <= NOISE_STDERRS * m.stderr:
            out[name] = (f"uninformative: the unquantized model scores {m.value:.3g} ± {m.stderr:.3g}, within "
                         f"{NOISE_STDERRS:g} standard errors of chance ({chance:g})")
    return out


@dataclass
class Cell:
    """One metric of one run, against the baseline. ``ratio`` is a fraction (1.0 = the baseline)."""

    value: float
    stderr: float | None
    baseline: float
    baseline_stderr: float | None
    ratio: float
    ratio_stderr: float | None
    higher_is_better: bool
    scale: str = "ratio"  # the metric's scale (Metric.scale): how ``ratio`` was formed (see the module doc)

    @property
    def percent(self) -> float:
        return 100.0 * self.ratio


@dataclass
class Row:
    """One evaluated model: bpw without and with its adapter counted, and its normalised cells."""

    label: str
    kind: str
    model: str
    source: str | None
    bpw: float | None  # measured_bpw.model; None for an original without a measured bpw
    bpw_linear: float | None
    adapter_rank: int | None
    adapter_bpw_cost: float | None
    bpw_with_adapter: float | None  # bpw + adapter_bpw_cost (= bpw without an adapter)
    cells: dict[str, Cell]
    skipped: dict[str, str] = field(default_factory=dict)  # metric -> what its cell says instead of a number
    uninformative: dict[str, str] = field(default_factory=dict)  # metric -> why its baseline is within noise of chance

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def ratio_of(m: Metric, base: Metric, name: str = "metric") -> tuple[float, float | None]:
    """``(ratio, ratio_stderr)`` of ``m`` against ``base``, oriented so below 1 is worse (see module doc)."""
    v, b = m.value, base.value
    if m.scale != base.scale:
        raise QRecoverError(f"metric {name!r}: scale {m.scale!r} in the run but {base.scale!r} in the baseline")
    if m.scale in ("nats", "fraction"):  # divergences and flip rates: the unquantized model scores 0
        ratio = math.exp(b - v) if m.scale == "nats" else 1.0 - (v - b)
        if m.stderr is None or base.stderr is None:
            return ratio, None
        spread = math.hypot(m.stderr, base.stderr)
        return ratio, (ratio * spread if m.scale == "nats" else spread)
    if m.higher_is_better:
        if b == 0:
            raise QRecoverError(f"metric {name!r}: baseline value is 0, the ratio value/baseline is undefined")
        ratio = v / b
    else:
        if v == 0:
            raise QRecoverError(f"metric {name!r}: value is 0, the ratio baseline/value of a lower-is-better metric is undefined")
        ratio = b / v
    if m.stderr is None or base.stderr is None:
        return ratio, None
    # ratio * sqrt((s_v/v)^2 + (s_b/b)^2), written with the nonzero denominator only so a zero score works
    num, den, s_num, s_den = (v, b, m.stderr, base.stderr) if m.higher_is_better else (b, v, base.stderr, m.stderr)
    return ratio, math.hypot(s_num / den, num * s_den / den**2)


def check_comparable(name: str, m: Metric, base: Metric, run: str, baseline: str) -> None:
    """Raise unless ``m`` and ``base`` were measured the same way (direction and settings)."""
    if m.higher_is_better != base.higher_is_better:
        raise QRecoverError(f"metric {name!r}: higher_is_better is {m.higher_is_better} in {run} "
                            f"but {base.higher_is_better} in baseline {baseline}")
    if m.settings != base.settings:
        diffs = []
        for k in sorted(set(m.settings) | set(base.settings)):
            a, c = m.settings.get(k, "<missing>"), base.settings.get(k, "<missing>")
            if a != c:
                diffs.append(f"{k}: {a!r} vs {c!r}")
        raise QRecoverError(f"metric {name!r}: settings differ between {run} and baseline {baseline} "
                            f"({'; '.join(diffs)}); re-run the evaluation with the same settings")


def row_label(run: Results) -> str:
    """Table-10 style label: ``3.7 bpw quantized``, ``3.7 bpw tuned``, ``3.7 bpw recovered (rank 16)``, ``unquantized``."""
    r = run.run
    if r.measured_bpw is None:
        head = "unquantized" if r.kind == "original" else r.kind
        return head
    bpw = f"{r.measured_bpw.model:.2f} bpw"
    if r.kind == "recovered":
        return f"{bpw} recovered (rank {r.adapter.rank})"
    if r.kind == "original":
        return f"{bpw} unquantized"
    return f"{bpw} {r.kind}"


def _row(run: Results, baseline: Results, noise: dict[str, str]) -> Row:
    cells, skipped = {}, {}
    for name, m in run.metrics.items():
        if name in baseline.skipped:
            skipped[name] = f"baseline not run: {baseline.skipped[name]}"
            continue
        if name not in baseline.metrics:
            raise QRecoverError(f"metric {name!r} of {run.name} is absent from baseline {baseline.name} "
                                f"(it has {', '.join(sorted(baseline.metrics))}); evaluate the unquantized model on it too")
        base = baseline.metrics[name]
        check_comparable(name, m, base, run.name, baseline.name)
        zero = m.scale not in ("nats", "fraction") and (base.value if m.higher_is_better else m.value) == 0
        if zero:  # e.g. a small model that solves no GSM8K problem: no ratio exists; the column says why
            who = "the unquantized model" if m.higher_is_better else "this run"
            skipped[name] = f"no ratio: {who} scores 0 (value {m.value:.4g}, unquantized {base.value:.4g})"
            continue
        ratio, ratio_se = ratio_of(m, base, name)
        cells[name] = Cell(value=m.value, stderr=m.stderr, baseline=base.value, baseline_stderr=base.stderr,
                           ratio=ratio, ratio_stderr=ratio_se, higher_is_better=m.higher_is_better, scale=m.scale)
    r = run.run
    bpw = None if r.measured_bpw is None else r.measured_bpw.model
    cost = None if r.adapter is None else r.adapter.bpw_cost
    return Row(label=row_label(run), kind=r.kind, model=r.model, source=run.source, bpw=bpw,
               bpw_linear=None if r.measured_bpw is None else r.measured_bpw.linear,
               adapter_rank=None if r.adapter is None else r.adapter.rank, adapter_bpw_cost=cost,
               bpw_with_adapter=None if bpw is None else bpw + (cost or 0.0), cells=cells,
               skipped=skipped | {name: f"not run: {why}" for name, why in run.skipped.items()},
               uninformative={name: why for name, why in noise.items() if name in run.metrics})


def sort_key(row: Row) -> tuple:
    """bpw descending (an unmeasured original first), then original, quantized, tuned, recovered, then rank."""
    return (-(row.bpw if row.bpw is not None else math.inf), KIND_ORDER[row.kind], row.adapter_rank or 0, row.model)


def normalise(runs: Results | Sequence[Results], baseline: Results) -> list[Row]:
    """Rows of ``runs`` normalised to ``baseline`` (the unquantized model), sorted as in Table 10.

    Each cell's ratio is ``v / b`` for higher-is-better metrics and ``b / v`` for lower-is-better ones
    (perplexity, KL), so a ratio below 1 (100%) always means worse than the baseline; its stderr is
    ``ratio * sqrt((s_v/v)^2 + (s_b/b)^2)`` (None if either stderr is missing). Rows are sorted by
    measured bpw descending, quantized before recovered at equal bpw. Metrics whose baseline is within
    noise of chance are named in each row's ``uninformative`` (:func:`uninformative`).

    Raises QRecoverError when a run's metric is absent from the baseline, when its settings or its
    direction differ from the baseline's, or when the baseline is not an unquantized model.
    """
    if isinstance(runs, Results):
        runs = [runs]
    if baseline.run.kind != "original":
        raise QRecoverError(f"baseline {baseline.name} is kind {baseline.run.kind!r}; scores are normalised to the "
                            "unquantized model, pass its results file (kind 'original') as --baseline")
    if not runs:
        raise QRecoverError("no results to report; pass at least one results file")
    noise = uninformative(baseline)
    return sorted((_row(r, baseline, noise) for r in runs), key=sort_key)


def metric_names(rows: Sequence[Row]) -> list[str]:
    """The report's columns: every metric of any row, measured or skipped, in first-seen order."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row.cells))
        names.update(dict.fromkeys(row.skipped))
    return list(names)

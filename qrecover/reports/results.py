"""The results file (schema version 1): what one evaluated model scored, and which model it was.

One JSON file per evaluated model, written by ``qrecover eval`` (to come) and read by ``qrecover report``::

    {
      "schema_version": 1,
      "run": {
        "model": "out/smollm2-3.7bpw",
        "kind": "recovered",                          # original | quantized | recovered
        "measured_bpw": {"model": 3.71, "linear": 3.52},  # null for the original
        "adapter": {"path": "out/lora-r16", "rank": 16, "bpw_cost": 0.21},  # null unless recovered
        "manifest_sha256": "9f2c...",                 # sha256 of the checkpoint's qrecover.json, or null
        "versions": {"qrecover": "0.1.0", "lm_eval": "0.4.8"}
      },
      "metrics": {
        "gsm8k": {"value": 0.412, "stderr": 0.013, "higher_is_better": true,
                  "settings": {"num_fewshot": 5, "limit": null}},
        "ppl":   {"value": 11.9, "stderr": null, "higher_is_better": false,
                  "settings": {"data": "python-docs", "windows": 32, "seq_len": 512}}
      },
      "skipped": {"alpacaeval": "no judge configured"}  # optional: metrics not run, and why
    }

``skipped`` (optional, absent when empty) names the metrics that were deliberately not run, with the
reason; the report shows "not run: <reason>" in their column instead of a number, and the gate lists
them as skipped. A name is either in ``metrics`` or in ``skipped``, never both.

Every dataclass round-trips: ``Results.from_dict(r.to_dict()) == r``. :func:`load_results` validates a
file and raises :class:`~qrecover.errors.QRecoverError` naming the file and the offending key.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import QRecoverError
from ..fields import doc_field
from ..io_utils import read_json, write_text_atomic

SCHEMA_VERSION = 1
KINDS = ("original", "quantized", "tuned", "recovered")
SCALES = ("ratio", "nats", "fraction")


@dataclass
class MeasuredBpw:
    model: float = doc_field(0.0, "bits per weight over every weight (embedding included), from packed bytes")
    linear: float = doc_field(0.0, "bits per weight over the decoder linear layers only")


@dataclass
class Adapter:
    path: str = doc_field("", "the LoRA adapter directory (PEFT layout)")
    rank: int = doc_field(0, "LoRA rank r")
    bpw_cost: float = doc_field(0.0, "bits per model weight the adapter adds when shipped (its bytes x 8 / model parameters)")


IMPLIED_SCALES = {"kl": "nats", "mmlu_flips": "fraction"}  # qrecover eval's agreement metrics (see Metric.scale)


@dataclass
class Metric:
    value: float = doc_field(0.0, "the score, in the benchmark's own unit (accuracy 0-1, perplexity, ...)")
    stderr: float | None = doc_field(None, "standard error of `value` (lm-eval's bootstrap/analytic stderr), or null if unknown")
    higher_is_better: bool = doc_field(True, "False for perplexity, KL divergence and other losses")
    settings: dict[str, Any] = doc_field(None, "the protocol: num_fewshot, limit, seq_len, ...; compared only with identical settings")
    scale: str = doc_field("ratio", "how the report normalises it: 'ratio' (value/baseline, or baseline/value when lower is "
                      "better), 'nats' (a divergence in nats, baseline 0: exp(baseline - value)), 'fraction' (a rate "
                      "whose baseline is 0, e.g. answer flips: 1 - (value - baseline))")

    def __post_init__(self) -> None:
        if self.settings is None:
            self.settings = {}


@dataclass
class RunInfo:
    model: str = doc_field("", "the evaluated model: checkpoint directory, HF directory or .gguf")
    kind: str = doc_field("original", "'original' (unquantized), 'quantized', 'tuned' (a checkpoint of `qrecover tune`), or "
                                          "'recovered' (quantized + LoRA adapter)")
    measured_bpw: MeasuredBpw | None = doc_field(None, "measured bits per weight of the checkpoint; null for the original")
    adapter: Adapter | None = doc_field(None, "the accuracy-recovery adapter; required for 'recovered', null otherwise")
    manifest_sha256: str | None = doc_field(None, "sha256 of the checkpoint's qrecover.json, or null")
    versions: dict[str, str] = doc_field(None, "package versions the evaluation ran with")

    def __post_init__(self) -> None:
        if self.versions is None:
            self.versions = {}


@dataclass
class Results:
    run: RunInfo = doc_field(None, "which model was evaluated")
    metrics: dict[str, Metric] = doc_field(None, "metric name -> score")
    schema_version: int = doc_field(SCHEMA_VERSION, "version of this file layout")
    skipped: dict[str, str] = doc_field(None, "metric name -> why it was not run (e.g. 'no judge configured'); saved only when non-empty")
    source: str | None = field(default=None, compare=False, repr=False, metadata={"help": "the file it was read from (not saved)"})

    def __post_init__(self) -> None:
        if self.metrics is None:
            self.metrics = {}
        if self.skipped is None:
            self.skipped = {}

    @property
    def name(self) -> str:
        """How error messages refer to this run: its file, else its model."""
        return self.source or self.run.model

    def to_dict(self) -> dict[str, Any]:
        r = self.run
        d = {
            "schema_version": self.schema_version,
            "run": {
                "model": r.model,
                "kind": r.kind,
                "measured_bpw": None if r.measured_bpw is None else {"model": r.measured_bpw.model, "linear": r.measured_bpw.linear},
                "adapter": None if r.adapter is None else {"path": r.adapter.path, "rank": r.adapter.rank, "bpw_cost": r.adapter.bpw_cost},
                "manifest_sha256": r.manifest_sha256,
                "versions": dict(r.versions),
            },
            "metrics": {n: {"value": m.value, "stderr": m.stderr, "higher_is_better": m.higher_is_better,
                            **({} if m.scale == "ratio" else {"scale": m.scale}),
                            "settings": dict(m.settings)} for n, m in self.metrics.items()},
        }
        if self.skipped:  # optional key: files without skipped metrics stay as they were
            d["skipped"] = dict(self.skipped)
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.to_json() + "\n")  # all or nothing: a reader never sees half a file

    @classmethod
    def from_dict(cls, d: Any, source: str | None = None) -> "Results":
        """Validate ``d`` and build the dataclasses; errors name ``source`` and the key path."""
        v = _Validator(source or "<results>")
        v.obj(d, "")
        v.keys(d, "", required=("schema_version", "run", "metrics"))
        version = d["schema_version"]
        if isinstance(version, bool) or not isinstance(version, int):
            v.fail("schema_version", f"must be an integer, got {version!r}")
        if version != SCHEMA_VERSION:
            v.fail("schema_version", f"is {version}, this qrecover reads version {SCHEMA_VERSION}; upgrade qrecover or re-run the evaluation")

        run = _run_info(v, d["run"])
        skipped = _skipped(v, d.get("skipped", {}))
        metrics = _metrics(v, d["metrics"], skipped)
        return cls(run=run, metrics=metrics, skipped=dict(skipped), schema_version=version, source=source)


def _run_info(v: _Validator, r: Any) -> RunInfo:
    """The ``run`` section: which model was evaluated, its kind, and the bpw and adapter its kind needs."""
    v.obj(r, "run")
    v.keys(r, "run", required=("model", "kind", "measured_bpw", "adapter", "manifest_sha256", "versions"))
    model = v.str_(r["model"], "run.model")
    kind = v.str_(r["kind"], "run.kind")
    if kind not in KINDS:
        v.fail("run.kind", f"is {kind!r}, must be one of {', '.join(KINDS)}")
    bpw = None
    if r["measured_bpw"] is not None:
        b = r["measured_bpw"]
        v.obj(b, "run.measured_bpw")
        v.keys(b, "run.measured_bpw", required=("model", "linear"))
        bpw = MeasuredBpw(model=v.pos(b["model"], "run.measured_bpw.model"), linear=v.pos(b["linear"], "run.measured_bpw.linear"))
    elif kind != "original":
        v.fail("run.measured_bpw", f"is null, but a {kind} model must record its measured bits per weight")
    adapter = _adapter(v, r["adapter"])
    if kind == "recovered" and adapter is None:
        v.fail("run.adapter", "is null, but a recovered model must name its adapter (path, rank, bpw_cost)")
    if kind != "recovered" and adapter is not None:
        v.fail("run.adapter", f"is set, but kind is {kind!r}; a model evaluated with an adapter is kind 'recovered'")
    sha = r["manifest_sha256"]
    if sha is not None:
        v.str_(sha, "run.manifest_sha256")
    versions = r["versions"]
    v.obj(versions, "run.versions")
    for k, val in versions.items():
        v.str_(val, f"run.versions.{k}")
    return RunInfo(model=model, kind=kind, measured_bpw=bpw, adapter=adapter, manifest_sha256=sha, versions=dict(versions))


def _adapter(v: _Validator, a: Any) -> Adapter | None:
    """``run.adapter``: null, or the adapter's path, a positive rank and a non-negative bpw cost."""
    if a is None:
        return None
    v.obj(a, "run.adapter")
    v.keys(a, "run.adapter", required=("path", "rank", "bpw_cost"))
    rank = a["rank"]
    if isinstance(rank, bool) or not isinstance(rank, int) or rank <= 0:
        v.fail("run.adapter.rank", f"must be a positive integer, got {rank!r}")
    cost = v.num(a["bpw_cost"], "run.adapter.bpw_cost")
    if cost < 0:
        v.fail("run.adapter.bpw_cost", f"must be >= 0, got {cost!r}")
    return Adapter(path=v.str_(a["path"], "run.adapter.path"), rank=rank, bpw_cost=cost)


def _skipped(v: _Validator, skipped: Any) -> Any:
    """The optional ``skipped`` section: metric name -> a non-empty reason."""
    v.obj(skipped, "skipped")
    for name, why in skipped.items():
        if not v.str_(why, f"skipped.{name}").strip():
            v.fail(f"skipped.{name}", "is empty; say why the metric was not run, e.g. 'no judge configured'")
    return skipped


def _metrics(v: _Validator, ms: Any, skipped: Any) -> dict[str, Metric]:
    """The ``metrics`` section: at least one metric or skipped one, none both, each a :class:`Metric`."""
    v.obj(ms, "metrics")
    if not ms and not skipped:
        v.fail("metrics", "is empty; a results file must hold at least one metric")
    both = sorted(set(ms) & set(skipped))
    if both:
        v.fail(f"skipped.{both[0]}", "is also in metrics; a metric is either scored or skipped")
    return {name: _metric(v, name, m) for name, m in ms.items()}


def _metric(v: _Validator, name: str, m: Any) -> Metric:
    """One metric: value, stderr (>= 0 or null), direction, settings and the scale the report normalises it by."""
    key = f"metrics.{name}"
    v.obj(m, key)
    v.keys(m, key, required=("value", "stderr", "higher_is_better", "settings"))
    value = v.num(m["value"], f"{key}.value")
    stderr = None if m["stderr"] is None else v.num(m["stderr"], f"{key}.stderr")
    if stderr is not None and stderr < 0:
        v.fail(f"{key}.stderr", f"must be >= 0 or null, got {stderr!r}")
    if not isinstance(m["higher_is_better"], bool):
        v.fail(f"{key}.higher_is_better", f"must be true or false, got {m['higher_is_better']!r}")
    v.obj(m["settings"], f"{key}.settings")
    # qrecover eval's agreement metrics were written without their scale before it was recorded
    scale = m.get("scale", IMPLIED_SCALES.get(name, "ratio") if not m["higher_is_better"] else "ratio")
    if scale not in SCALES:
        v.fail(f"{key}.scale", f"is {scale!r}, must be one of {', '.join(SCALES)}")
    if scale != "ratio" and m["higher_is_better"]:
        v.fail(f"{key}.scale", f"{scale!r} is for lower-is-better metrics (divergences, flip rates)")
    return Metric(value=value, stderr=stderr, higher_is_better=m["higher_is_better"],
                  settings=dict(m["settings"]), scale=scale)


def load_results(path: str | Path) -> Results:
    """Read and validate one results file; every problem is a QRecoverError naming the file and the key."""
    d = read_json(path, "results file", " (write one with `qrecover eval`)")
    return Results.from_dict(d, source=str(path))


class _Validator:
    """Type checks that raise ``QRecoverError("<file>: key 'run.kind' ...")``."""

    def __init__(self, source: str) -> None:
        self.source = source

    def fail(self, key: str, msg: str) -> None:
        where = f"key {key!r}" if key else "top level"
        raise QRecoverError(f"{self.source}: {where} {msg}")

    def obj(self, x: Any, key: str) -> None:
        if not isinstance(x, dict):
            self.fail(key, f"must be a JSON object, got {type(x).__name__}")

    def keys(self, x: dict, key: str, required: tuple[str, ...]) -> None:
        missing = [k for k in required if k not in x]
        if missing:
            full = ", ".join(f"{key}.{k}" if key else k for k in missing)
            raise QRecoverError(f"{self.source}: missing key(s) {full}")

    def str_(self, x: Any, key: str) -> str:
        if not isinstance(x, str):
            self.fail(key, f"must be a string, got {x!r}")
        return x

    def num(self, x: Any, key: str) -> float:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            self.fail(key, f"must be a finite number, got {x!r}")
        return float(x)

    def pos(self, x: Any, key: str) -> float:
        f = self.num(x, key)
        if f <= 0:
            self.fail(key, f"must be positive, got {x!r}")
        return f

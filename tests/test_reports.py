"""Tests for :mod:`qrecover.reports` and the ``report`` / ``gate`` commands, on hand-made results files (no model).

Checks: the results schema round-trips (dataclasses <-> dict <-> file) and ``load_results`` names the file
and the key for a missing key, a wrong type, an unknown schema version, bad JSON and kind/adapter
mismatches; normalisation against hand-computed numbers, for a higher-is-better metric (v/b) and a
lower-is-better one (b/v), stderr propagated to first order and null when a stderr is missing; differing
settings and a metric absent from the baseline are errors naming the metric; rows sorted by bpw
descending, quantized before recovered, with bpw with and without the adapter; report.md holds the
table, report.json round-trips, report.html parses and holds the table and (with matplotlib) an inline
SVG with one titled panel per metric (the browser's view of it: tests/test_report_browser.py); the gate's
exit codes 0/1/2 through ``qrecover.cli.main``, per-metric thresholds, row selection, missing cells, and
``--noise-aware`` passing a cell that plain mode fails. Skipped metrics (AlpacaEval without a judge):
``Results.skipped`` round-trips and is validated, files without it still load and save unchanged, the
report's column reads "not run: no judge configured" in md/json/html (and "baseline not run: ..." when only
the baseline skipped it), and the gate lists such a cell as skipped, neither pass nor failure.
"""

from __future__ import annotations

import json
import math
from html.parser import HTMLParser
from pathlib import Path

import pytest
from cli_helpers import run as run_cli

from qrecover.errors import QRecoverError
from qrecover.reports.gate import gate
from qrecover.reports.render import write_report
from qrecover.reports.results import Adapter, MeasuredBpw, Metric, Results, RunInfo, load_results
from qrecover.reports.table import normalise, ratio_of

FEWSHOT = {"ifeval": {"num_fewshot": 0, "limit": None}, "gsm8k": {"num_fewshot": 5, "limit": None},
           "ppl": {"data": "python-docs", "windows": 32, "seq_len": 512}, "alpacaeval": {"limit": None, "judge_model": "gpt-4o"}}
HIB = {"ifeval": True, "gsm8k": True, "ppl": False, "alpacaeval": True, "kl": False, "mmlu_flips": False}
FEWSHOT |= {"kl": {"windows": 32}, "mmlu_flips": {"limit": 20}}


def results(kind: str, scores: dict, bpw: float | None = None, rank: int | None = None, cost: float = 0.0) -> dict:
    """A results dict; ``scores`` maps metric -> (value, stderr)."""
    return {
        "schema_version": 1,
        "run": {"model": f"out/{kind}-{bpw}-{rank}", "kind": kind,
                "measured_bpw": None if bpw is None else {"model": bpw, "linear": bpw - 0.2},
                "adapter": None if rank is None else {"path": f"out/lora-r{rank}", "rank": rank, "bpw_cost": cost},
                "manifest_sha256": None if bpw is None else "ab" * 32, "versions": {"qrecover": "0.1.0"}},
        "metrics": {n: {"value": v, "stderr": s, "higher_is_better": HIB[n], "settings": dict(FEWSHOT[n])}
                    for n, (v, s) in scores.items()},
    }


BASE = results("original", {"ifeval": (0.80, 0.02), "gsm8k": (0.50, 0.01), "ppl": (10.0, 0.5)})
Q37 = results("quantized", {"ifeval": (0.72, 0.03), "gsm8k": (0.45, 0.01), "ppl": (12.5, 0.5)}, bpw=3.7)
R37 = results("recovered", {"ifeval": (0.78, 0.02), "gsm8k": (0.49, None), "ppl": (10.5, 0.5)}, bpw=3.7, rank=16, cost=0.25)
Q30 = results("quantized", {"ifeval": (0.60, 0.03), "gsm8k": (0.30, 0.01), "ppl": (20.0, 1.0)}, bpw=3.0)
R30 = results("recovered", {"ifeval": (0.74, 0.03), "gsm8k": (0.44, 0.01), "ppl": (11.0, 0.5)}, bpw=3.0, rank=16, cost=0.25)


def write(tmp_path: Path, name: str, d: dict) -> Path:
    p = tmp_path / name
    p.write_text(json.dumps(d))
    return p


def run(argv, capsys):
    """The shared CLI runner, with stderr's whitespace collapsed (the console wraps long lines)."""
    code, out, err = run_cli(argv, capsys)
    return code, out, " ".join(err.split())


def test_schema_round_trip(tmp_path):
    r = Results(run=RunInfo(model="out/m", kind="recovered", measured_bpw=MeasuredBpw(3.7, 3.5),
                            adapter=Adapter("out/lora", 16, 0.25), manifest_sha256="00" * 32, versions={"qrecover": "0.1.0"}),
                metrics={"gsm8k": Metric(0.41, 0.013, True, {"num_fewshot": 5}), "ppl": Metric(11.9, None, False, {"seq_len": 512})})
    assert Results.from_dict(json.loads(r.to_json())) == r
    r.save(tmp_path / "r.json")
    back = load_results(tmp_path / "r.json")
    assert back == r and back.source == str(tmp_path / "r.json")
    for d in (BASE, Q37, R37):
        assert Results.from_dict(d).to_dict() == json.loads(json.dumps(d))


def _broken(mutate) -> dict:
    d = json.loads(json.dumps(R37))
    mutate(d)
    return d


@pytest.mark.parametrize("mutate, needles", [
    (lambda d: d["run"].pop("kind"), ["missing key", "run.kind"]),
    (lambda d: d.pop("metrics"), ["missing key", "metrics"]),
    (lambda d: d["metrics"]["gsm8k"].pop("settings"), ["missing key", "metrics.gsm8k.settings"]),
    (lambda d: d.update(schema_version=2), ["schema_version", "is 2", "version 1"]),
    (lambda d: d["metrics"]["gsm8k"].update(value="0.4"), ["metrics.gsm8k.value", "finite number"]),
    (lambda d: d["metrics"]["gsm8k"].update(stderr=-1), ["metrics.gsm8k.stderr"]),
    (lambda d: d["metrics"]["ppl"].update(higher_is_better="no"), ["metrics.ppl.higher_is_better"]),
    (lambda d: d["run"].update(kind="distilled"), ["run.kind", "distilled"]),
    (lambda d: d["run"].update(adapter=None), ["run.adapter", "recovered"]),
    (lambda d: d["run"].update(kind="quantized"), ["run.adapter", "quantized"]),
    (lambda d: d["run"].update(measured_bpw=None), ["run.measured_bpw", "null"]),
    (lambda d: d["run"]["adapter"].update(rank=0), ["run.adapter.rank"]),
    (lambda d: d["run"]["measured_bpw"].update(model=True), ["run.measured_bpw.model"]),
    (lambda d: d.update(metrics={}), ["metrics", "empty"]),
    (lambda d: d.update(run=[]), ["'run'", "JSON object"]),
])
def test_load_results_errors_name_file_and_key(tmp_path, mutate, needles):
    p = write(tmp_path, "bad.json", _broken(mutate))
    with pytest.raises(QRecoverError) as e:
        load_results(p)
    msg = str(e.value)
    assert str(p) in msg
    for n in needles:
        assert n in msg, (n, msg)


def test_load_results_bad_files(tmp_path):
    with pytest.raises(QRecoverError, match="does not exist"):
        load_results(tmp_path / "nope.json")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(QRecoverError, match="not valid JSON"):
        load_results(tmp_path / "x.json")


# --- normalisation -----------------------------------------------------------------------------------


def test_normalise_arithmetic():
    (row,) = normalise(Results.from_dict(Q37), Results.from_dict(BASE))
    ife, ppl = row.cells["ifeval"], row.cells["ppl"]
    # higher is better: 0.72 / 0.80; stderr 0.9 * sqrt((0.03/0.72)^2 + (0.02/0.80)^2)
    assert ife.ratio == pytest.approx(0.9) and ife.percent == pytest.approx(90.0)
    assert ife.ratio_stderr == pytest.approx(0.043732139211339754)
    # lower is better: 10.0 / 12.5 (below 100% = worse); stderr 0.8 * sqrt((0.5/12.5)^2 + (0.5/10)^2)
    assert ppl.ratio == pytest.approx(0.8)
    assert ppl.ratio_stderr == pytest.approx(0.05122499389946279)
    assert (ppl.value, ppl.baseline, ppl.baseline_stderr) == (12.5, 10.0, 0.5)
    # a lower-is-better metric that improved is above 100%
    better = results("quantized", {"ppl": (8.0, None)}, bpw=3.7)
    (row,) = normalise(Results.from_dict(better), Results.from_dict(BASE))
    assert row.cells["ppl"].ratio == pytest.approx(1.25) and row.cells["ppl"].ratio_stderr is None


def test_normalise_missing_stderr_and_zero_score():
    (row,) = normalise(Results.from_dict(R37), Results.from_dict(BASE))
    assert row.cells["gsm8k"].ratio == pytest.approx(0.98) and row.cells["gsm8k"].ratio_stderr is None
    zero = results("quantized", {"gsm8k": (0.0, 0.01)}, bpw=2.0)
    (row,) = normalise(Results.from_dict(zero), Results.from_dict(BASE))
    # d(v/b)/dv = 1/b at v = 0: stderr 0.01 / 0.5
    assert row.cells["gsm8k"].ratio == 0.0 and row.cells["gsm8k"].ratio_stderr == pytest.approx(0.02)
    zero_base = results("original", {"gsm8k": (0.0, 0.01)})
    with pytest.raises(QRecoverError, match="gsm8k.*baseline value is 0"):
        ratio_of(Results.from_dict(zero).metrics["gsm8k"], Results.from_dict(zero_base).metrics["gsm8k"], "gsm8k")
    # in a report, a ratio that does not exist is a column note, not a failed report (nor a gate failure)
    (row,) = normalise(Results.from_dict(zero), Results.from_dict(zero_base))
    assert "gsm8k" not in row.cells
    assert row.skipped["gsm8k"] == "no ratio: the unquantized model scores 0 (value 0, unquantized 0)"


def test_settings_mismatch_is_an_error():
    d = json.loads(json.dumps(Q37))
    d["metrics"]["gsm8k"]["settings"].update(num_fewshot=8, limit=100)
    with pytest.raises(QRecoverError) as e:
        normalise(Results.from_dict(d, source="q.json"), Results.from_dict(BASE, source="base.json"))
    msg = str(e.value)
    for n in ("'gsm8k'", "q.json", "base.json", "num_fewshot: 8 vs 5", "limit: 100 vs None"):
        assert n in msg, (n, msg)
    d = json.loads(json.dumps(Q37))
    d["metrics"]["ppl"]["settings"].pop("seq_len")
    with pytest.raises(QRecoverError, match="seq_len: '<missing>' vs 512"):
        normalise(Results.from_dict(d), Results.from_dict(BASE))
    d = json.loads(json.dumps(Q37))
    d["metrics"]["ppl"]["higher_is_better"] = True
    with pytest.raises(QRecoverError, match="'ppl': higher_is_better"):
        normalise(Results.from_dict(d), Results.from_dict(BASE))


def test_metric_missing_from_baseline_and_bad_baseline():
    d = json.loads(json.dumps(Q37))
    d["metrics"]["alpacaeval"] = {"value": 0.3, "stderr": None, "higher_is_better": True, "settings": {}}
    with pytest.raises(QRecoverError, match="'alpacaeval'.*absent from baseline"):
        normalise(Results.from_dict(d), Results.from_dict(BASE))
    with pytest.raises(QRecoverError, match="kind 'quantized'"):
        normalise(Results.from_dict(Q37), Results.from_dict(Q37))


def test_row_order_labels_and_adapter_bpw():
    runs = [Results.from_dict(d) for d in (R30, Q37, R37, Q30)]
    rows = normalise(runs, Results.from_dict(BASE))
    assert [r.label for r in rows] == ["3.70 bpw quantized", "3.70 bpw recovered (rank 16)",
                                       "3.00 bpw quantized", "3.00 bpw recovered (rank 16)"]
    assert [(r.bpw, r.bpw_with_adapter) for r in rows] == [(3.7, 3.7), (3.7, pytest.approx(3.95)),
                                                          (3.0, 3.0), (3.0, pytest.approx(3.25))]
    assert rows[1].adapter_rank == 16 and rows[1].adapter_bpw_cost == 0.25 and rows[0].adapter_rank is None
    assert rows[0].bpw_linear == pytest.approx(3.5)


# --- rendering ---------------------------------------------------------------------------------------


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.cells, self.imgs, self._in_cell = [], [], [], False

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag in ("td", "th"):
            self._in_cell, self._buf = True, ""
        if tag == "img":
            self.imgs.append(dict(attrs).get("src", ""))

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self._in_cell = False
            self.cells.append(self._buf)

    def handle_data(self, data):
        if self._in_cell:
            self._buf += data


SVG = "{http://www.w3.org/2000/svg}"


def svg_panels(page: str) -> dict[str, list[str]]:
    """``{metric: texts of its panel}`` of the inline SVG of report.html (parsed as XML: it must be well formed)."""
    import xml.etree.ElementTree as ET

    from qrecover.reports.render import panel_id

    assert page.count("<svg") == 1 and "<img" not in page
    root = ET.fromstring(page[page.index("<svg"):page.index("</svg>") + len("</svg>")])
    groups = {g.get("id"): g for g in root.iter(f"{SVG}g") if (g.get("id") or "").startswith("panel-")}
    assert root.find(f".//{SVG}g[@id='legend']") is not None
    out = {}
    for gid, g in groups.items():
        texts = ["".join(t.itertext()).strip() for t in g.iter(f"{SVG}text")]
        title = next(t for t in texts if not t.endswith("%") and not t.replace(".", "").isdigit() and "bpw" not in t
                     and t != "% of unquantized")
        name = title.split()[0].rstrip(":")
        assert panel_id(name) == gid
        out[name] = [title] + texts
    return out


@pytest.fixture
def report_dir(tmp_path):
    rows = normalise([Results.from_dict(d) for d in (Q37, R37, Q30, R30)], Results.from_dict(BASE, source="base.json"))
    out = tmp_path / "rep"
    rep = write_report(rows, Results.from_dict(BASE, source="base.json"), out)
    return out, rep


def test_report_files(report_dir):
    out, rep = report_dir
    assert sorted(p.name for p in out.iterdir()) == ["report.html", "report.json", "report.md"]
    md = (out / "report.md").read_text()
    assert "| bpw | bpw with adapter | model | ifeval | gsm8k | ppl |" in md
    assert "| 3.70 | 3.70 | quantized | 90.0% (0.72 ± 0.03) | 90.0% (0.45 ± 0.01) | 80.0% (12.5 ± 0.5) |" in md
    assert "| 3.70 | 3.95 | recovered (rank 16) | 97.5% (0.78 ± 0.02) | 98.0% (0.49) |" in md
    assert "below 100% always means worse" in md
    back = json.loads((out / "report.json").read_text())
    assert back == json.loads(json.dumps(rep))
    assert back["metrics"] == ["ifeval", "gsm8k", "ppl"]
    c = back["rows"][0]["cells"]["ppl"]
    assert c["ratio"] == pytest.approx(0.8) and c["ratio_stderr"] == pytest.approx(0.05122499389946279)
    assert (c["value"], c["baseline"]) == (12.5, 10.0)


def test_report_html(report_dir):
    out, _ = report_dir
    page = _Page()
    page.feed((out / "report.html").read_text())
    page.close()
    assert "table" in page.tags
    assert "97.5% (0.78 ± 0.02)" in page.cells and "recovered (rank 16)" in page.cells
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert not page.imgs and "matplotlib is not installed" in (out / "report.html").read_text()
        return
    panels = svg_panels((out / "report.html").read_text())
    assert list(panels) == ["ifeval", "gsm8k", "ppl"]  # one panel per metric, titled with its name
    for name, texts in panels.items():
        assert texts[0].startswith(name), texts


def test_report_overwrite_is_refused(report_dir):
    out, _ = report_dir
    rows = normalise(Results.from_dict(Q37), Results.from_dict(BASE))
    with pytest.raises(QRecoverError, match="already exists"):
        write_report(rows, Results.from_dict(BASE), out)


# --- gate (pure) -------------------------------------------------------------------------------------


def cell(ratio, se):
    return {"ratio": ratio, "ratio_stderr": se}


REPORT = {
    "metrics": ["ifeval", "gsm8k"],
    "rows": [
        {"label": "3.70 bpw quantized", "kind": "quantized", "cells": {"ifeval": cell(0.90, 0.02), "gsm8k": cell(0.95, None)}},
        {"label": "3.70 bpw recovered (rank 16)", "kind": "recovered", "cells": {"ifeval": cell(0.975, 0.01), "gsm8k": cell(0.99, None)}},
    ],
}


def test_gate_pure():
    r = gate(REPORT, 0.97)
    assert r.passed and r.rows == "recovered" and len(r.cells) == 2
    assert {c.row for c in r.cells} == {"3.70 bpw recovered (rank 16)"}
    r = gate(REPORT, 0.98)
    assert not r.passed and [(c.metric, c.passed) for c in r.cells] == [("ifeval", False), ("gsm8k", True)]
    r = gate(REPORT, 0.98, noise_aware=True)  # 0.975 + 0.01 >= 0.98
    assert r.passed and r.cells[0].note == "within 1 stderr"
    assert not gate(REPORT, 0.995, noise_aware=True).passed  # gsm8k has no stderr: compared plainly
    assert gate(REPORT, 0.98, {"ifeval": 0.97}).passed
    assert not gate(REPORT, 0.97, rows="all").passed and len(gate(REPORT, 0.97, rows="all").cells) == 4
    assert gate(REPORT, 0.89, rows="quantized").passed
    quantized_only = {"metrics": REPORT["metrics"], "rows": REPORT["rows"][:1]}
    assert gate(quantized_only, 0.90).rows == "all"
    with pytest.raises(QRecoverError, match="no recovered rows"):
        gate(quantized_only, 0.9, rows="recovered")
    missing = {"metrics": ["ifeval", "gsm8k"], "rows": [{"label": "x", "kind": "recovered", "cells": {"ifeval": cell(1.0, None)}}]}
    r = gate(missing, 0.9)
    assert not r.passed and r.failed[0].metric == "gsm8k" and r.failed[0].note == "not measured"
    edge = {"metrics": ["gsm8k"], "rows": [{"label": "x", "kind": "recovered", "cells": {"gsm8k": cell(0.485 / 0.5, None)}}]}
    assert gate(edge, 0.97).passed  # a ratio equal to its threshold passes, float rounding aside


# --- CLI ---------------------------------------------------------------------------------------------


def test_cli_report_then_gate(tmp_path, capsys):
    files = [write(tmp_path, f"{n}.json", d) for n, d in (("q37", Q37), ("r37", R37), ("q30", Q30), ("r30", R30))]
    base = write(tmp_path, "base.json", BASE)
    out = tmp_path / "reports"
    code, stdout, err = run(["report", *files, "--baseline", base, "--out", out, "--json"], capsys)
    assert code == 0, err
    assert json.loads(stdout) == json.loads((out / "report.json").read_text())
    code, _, err = run(["report", *files, "--baseline", base, "--out", out], capsys)
    assert code == 2 and "already exists" in err
    code, _, err = run(["report", *files, "--baseline", base, "--out", out, "--overwrite"], capsys)
    assert code == 0 and "wrote" in err and "report.html" in err
    # recovered rows: ifeval 97.5% / 92.5%, gsm8k 98% / 88%, ppl 95.2% / 90.9%
    code, stdout, err = run(["gate", out / "report.json", "--min-ratio", "0.85", "--json"], capsys)
    assert code == 0, err
    g = json.loads(stdout)
    assert g["passed"] and len(g["cells"]) == 6 and "6/6 cells passed" in err
    code, stdout, err = run(["gate", out / "report.json", "--min-ratio", "0.9", "--json"], capsys)
    assert code == 1 and "FAIL" in err and not json.loads(stdout)["passed"]
    code, _, err = run(["gate", out / "report.json", "--min-ratio", "0.85", "--rows", "all"], capsys)
    assert code == 1  # the 3.0 bpw quantized model keeps 60% of gsm8k


def test_cli_report_errors(tmp_path, capsys):
    d = json.loads(json.dumps(Q37))
    d["metrics"]["gsm8k"]["settings"]["num_fewshot"] = 8
    q, base = write(tmp_path, "q.json", d), write(tmp_path, "base.json", BASE)
    code, _, err = run(["report", q, "--baseline", base, "--out", tmp_path / "o"], capsys)
    assert code == 2 and "settings differ" in err and "gsm8k" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    code, _, err = run(["report", tmp_path / "nope.json", "--baseline", base, "--out", tmp_path / "o"], capsys)
    assert code == 2 and "does not exist" in err


@pytest.fixture
def report_file(tmp_path):
    return write(tmp_path, "report.json", REPORT)


@pytest.mark.parametrize("args, code", [
    (["--min-ratio", "0.97"], 0),
    (["--min-ratio", "0.98"], 1),
    (["--min-ratio", "0.98", "--noise-aware"], 0),
    (["--min-ratio", "0.98", "--metric", "ifeval=0.97"], 0),
    (["--min-ratio", "0.97", "--metric", "gsm8k=0.995"], 1),
    (["--min-ratio", "0.97", "--rows", "all"], 1),
    (["--min-ratio", "0.89", "--rows", "quantized"], 0),
])
def test_cli_gate_exit_codes(report_file, capsys, args, code):
    got, _, err = run(["gate", report_file, *args], capsys)
    assert got == code, err
    assert "ifeval" in err and ("FAIL" in err) == (code == 1)


@pytest.mark.parametrize("args, needle", [
    (["--min-ratio", "0"], "(0, 2]"),
    (["--min-ratio", "2.5"], "(0, 2]"),
    (["--min-ratio", "0.9", "--metric", "ifeval=3"], "(0, 2]"),
    (["--min-ratio", "0.9", "--metric", "ifeval:0.9"], "NAME=FRACTION"),
    (["--min-ratio", "0.9", "--metric", "ifeval=high"], "NAME=FRACTION"),
    (["--min-ratio", "0.9", "--metric", "mmlu=0.9"], "mmlu"),
    (["--min-ratio", "0.9", "--rows", "some"], "--rows"),
    ([], "--min-ratio"),  # typer's own usage error
])
def test_cli_gate_unusable_input(report_file, capsys, args, needle):
    code, out, err = run(["gate", report_file, *args], capsys)
    assert code == 2 and needle in err and "Traceback" not in err + out


def test_cli_gate_bad_files(tmp_path, capsys):
    code, _, err = run(["gate", tmp_path / "missing.json", "--min-ratio", "0.9"], capsys)
    assert code == 2 and "does not exist" in err
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    code, _, err = run(["gate", bad, "--min-ratio", "0.9"], capsys)
    assert code == 2 and "not valid JSON" in err
    code, _, err = run(["gate", write(tmp_path, "r.json", {"rows": "x"}), "--min-ratio", "0.9"], capsys)
    assert code == 2 and "not a qrecover report" in err


def test_help_lists_options(capsys):
    for cmd, opts in (("report", ["--baseline", "--out", "--overwrite", "--json"]),
                      ("gate", ["--min-ratio", "--metric", "--rows", "--noise-aware", "--json"])):
        code, out, _ = run([cmd, "--help"], capsys)
        assert code == 0 and "Examples" in out and all(o in out for o in opts), cmd


# --- skipped metrics (AlpacaEval without a judge) ------------------------------------------------------

def skipping(d: dict, reason: str = "no judge configured") -> dict:
    d = json.loads(json.dumps(d))
    d["skipped"] = {"alpacaeval": reason}
    return d


def test_skipped_round_trip_and_validation(tmp_path):
    r = Results.from_dict(skipping(Q37))
    assert r.skipped == {"alpacaeval": "no judge configured"}
    assert r.to_dict()["skipped"] == {"alpacaeval": "no judge configured"}
    assert Results.from_dict(json.loads(r.to_json())) == r
    r.save(tmp_path / "s.json")
    assert load_results(tmp_path / "s.json") == r
    assert "skipped" not in Results.from_dict(Q37).to_dict()  # absent when empty: old files unchanged
    only = results("quantized", {}, bpw=3.7)
    only["skipped"] = {"alpacaeval": "no judge configured"}
    assert Results.from_dict(only).metrics == {}  # a file may hold only a skipped metric
    for bad, needles in ((lambda d: d.update(skipped=["alpacaeval"]), ["'skipped'", "JSON object"]),
                         (lambda d: d["skipped"].update(alpacaeval=None), ["skipped.alpacaeval", "string"]),
                         (lambda d: d["skipped"].update(alpacaeval=" "), ["skipped.alpacaeval", "empty"]),
                         (lambda d: d["skipped"].update(gsm8k="oops"), ["skipped.gsm8k", "also in metrics"])):
        d = skipping(Q37)
        bad(d)
        with pytest.raises(QRecoverError) as e:
            load_results(write(tmp_path, "bad.json", d))
        assert all(n in str(e.value) for n in needles), (needles, str(e.value))


def test_skipped_column_in_report(tmp_path):
    base = results("original", {"ifeval": (0.80, 0.02), "alpacaeval": (0.20, 0.02), "gsm8k": (0.50, 0.01)})
    q = skipping(results("quantized", {"ifeval": (0.72, 0.03), "gsm8k": (0.45, 0.01)}, bpw=3.7))
    r = results("recovered", {"ifeval": (0.78, 0.02), "alpacaeval": (0.19, 0.02), "gsm8k": (0.49, None)}, bpw=3.7, rank=16)
    rows = normalise([Results.from_dict(q), Results.from_dict(r)], Results.from_dict(base))
    assert "alpacaeval" not in rows[0].cells and rows[0].skipped == {"alpacaeval": "not run: no judge configured"}
    assert rows[1].cells["alpacaeval"].ratio == pytest.approx(0.95) and rows[1].skipped == {}
    out = tmp_path / "rep"
    rep = write_report(rows, Results.from_dict(base), out)
    md = (out / "report.md").read_text()
    assert "| bpw | bpw with adapter | model | ifeval | gsm8k | alpacaeval |" in md
    assert "| 3.70 | 3.70 | quantized | 90.0% (0.72 ± 0.03) | 90.0% (0.45 ± 0.01) | not run: no judge configured |" in md
    assert "| 95.0% (0.19 ± 0.02) |" in md
    back = json.loads((out / "report.json").read_text())
    assert back == json.loads(json.dumps(rep)) and "alpacaeval" in back["metrics"]
    assert back["rows"][0]["skipped"] == {"alpacaeval": "not run: no judge configured"}
    assert "alpacaeval" not in back["rows"][0]["cells"]
    page = _Page()
    page.feed((out / "report.html").read_text())
    assert "not run: no judge configured" in page.cells


def test_skipped_everywhere_and_on_the_baseline(tmp_path):
    # no row and not the baseline ran it: a column that says so, no number anywhere
    rows = normalise(Results.from_dict(skipping(Q37)), Results.from_dict(skipping(BASE)))
    out = tmp_path / "rep"
    write_report(rows, Results.from_dict(skipping(BASE)), out)
    md = (out / "report.md").read_text()
    assert "alpacaeval (not run)" in md and "| not run: no judge configured |" in md
    assert "alpacaeval not run (no judge configured)" in md  # the baseline scores line
    # the run has a score but the baseline has none: not normalised, and the cell says why
    r = json.loads(json.dumps(Q37))
    r["metrics"]["alpacaeval"] = {"value": 0.2, "stderr": 0.02, "higher_is_better": True, "settings": dict(FEWSHOT["alpacaeval"])}
    (row,) = normalise(Results.from_dict(r), Results.from_dict(skipping(BASE)))
    assert row.skipped == {"alpacaeval": "baseline not run: no judge configured"} and "alpacaeval" not in row.cells


SKIP_REPORT = {
    "metrics": ["ifeval", "alpacaeval"],
    "rows": [{"label": "3.70 bpw recovered (rank 16)", "kind": "recovered", "cells": {"ifeval": cell(0.98, 0.01)},
              "skipped": {"alpacaeval": "not run: no judge configured"}}],
}


def test_gate_skipped_is_neither_pass_nor_fail():
    r = gate(SKIP_REPORT, 0.97)
    assert r.passed and [(c.metric, c.passed, c.skipped) for c in r.cells] == [("ifeval", True, False), ("alpacaeval", False, True)]
    assert r.cells[1].note == "not run: no judge configured" and r.cells[1].ratio is None
    assert r.failed == [] and [c.metric for c in r.skipped] == ["alpacaeval"]
    assert not gate(SKIP_REPORT, 0.99).passed  # the measured cell still decides
    r = gate(SKIP_REPORT, 0.97, {"alpacaeval": 0.9})  # a threshold asked for explicitly: a missing score fails
    assert not r.passed and r.failed[0].metric == "alpacaeval" and "asks for a score" in r.failed[0].note
    only = {"metrics": ["alpacaeval"], "rows": [dict(SKIP_REPORT["rows"][0], cells={})]}
    with pytest.raises(QRecoverError, match="skipped.*nothing to gate"):
        gate(only, 0.97)
    with pytest.raises(QRecoverError, match="'skipped' must be an object"):
        gate({"metrics": ["ifeval"], "rows": [dict(SKIP_REPORT["rows"][0], skipped=["alpacaeval"])]}, 0.97)


def test_cli_report_and_gate_with_skipped(tmp_path, capsys):
    q, r = write(tmp_path, "q.json", skipping(Q37)), write(tmp_path, "r.json", skipping(R37))
    base = write(tmp_path, "base.json", skipping(BASE))
    out = tmp_path / "reports"
    code, _, err = run(["report", q, r, "--baseline", base, "--out", out], capsys)
    assert code == 0, err
    assert "| not run: no judge configured |" in (out / "report.md").read_text()
    code, stdout, err = run(["gate", out / "report.json", "--min-ratio", "0.9", "--json"], capsys)
    assert code == 0, err
    assert "skipped" in err and "3/3 cells passed, 1 skipped (not run)" in err
    g = json.loads(stdout)
    assert g["passed"] and [c["metric"] for c in g["cells"] if c["skipped"]] == ["alpacaeval"]
    code, _, err = run(["gate", out / "report.json", "--min-ratio", "0.9", "--metric", "alpacaeval=0.9"], capsys)
    assert code == 1 and "FAIL" in err


def test_divergence_and_flip_scales_normalise_against_a_zero_baseline():
    """KL (nats) and flip rates are 0 for the unquantized model: exp(b - v) and 1 - (v - b), below 1 = worse."""
    import math

    from qrecover.reports.table import ratio_of

    kl = Metric(value=0.05, stderr=0.01, higher_is_better=False, scale="nats")
    base = Metric(value=0.0, stderr=0.0, higher_is_better=False, scale="nats")
    r, se = ratio_of(kl, base, "kl")
    assert r == pytest.approx(math.exp(-0.05)) and se == pytest.approx(math.exp(-0.05) * 0.01)
    flips = Metric(value=0.12, stderr=0.02, higher_is_better=False, scale="fraction")
    r, se = ratio_of(flips, Metric(value=0.0, stderr=None, higher_is_better=False, scale="fraction"), "flips")
    assert r == pytest.approx(0.88) and se is None
    with pytest.raises(QRecoverError, match="scale 'nats' in the run but 'ratio'"):
        ratio_of(kl, Metric(value=0.0, stderr=0.0, higher_is_better=False), "kl")
    # the scale round-trips, and a file without it reads as 'ratio'
    res = Results(run=RunInfo(model="m", kind="original"), metrics={"kl": base, "ppl": Metric(11.0, None, False)})
    back = Results.from_dict(json.loads(res.to_json()))
    assert back == res and back.metrics["ppl"].scale == "ratio" and "scale" not in res.to_dict()["metrics"]["ppl"]
    bad = res.to_dict()
    bad["metrics"]["kl"]["scale"] = "log"
    with pytest.raises(QRecoverError, match="metrics.kl.scale.*must be one of ratio, nats, fraction"):
        Results.from_dict(bad)


def test_agreement_metrics_without_a_recorded_scale_get_theirs():
    """Results files written before the scale was recorded: kl and mmlu_flips are still exp(-KL) and 1 - flips."""
    base = results("original", {"kl": (0.0, 0.0), "mmlu_flips": (0.0, 0.0), "ppl": (10.0, None)})
    run = results("quantized", {"kl": (0.5, 0.01), "mmlu_flips": (0.25, 0.05), "ppl": (12.5, None)}, bpw=3.5)
    assert all("scale" not in m for d in (base, run) for m in d["metrics"].values())
    (row,) = normalise(Results.from_dict(run), Results.from_dict(base))
    assert row.cells["kl"].ratio == pytest.approx(math.exp(-0.5))
    assert row.cells["mmlu_flips"].ratio == pytest.approx(0.75)
    assert row.cells["ppl"].ratio == pytest.approx(0.8)


# --- uninformative metrics: the unquantized model within noise of chance ------------------------------------

HIB |= {"mmlu": True}
FEWSHOT |= {"mmlu": {"num_fewshot": 0, "limit": 20}}
NOISY_BASE = results("original", {"ifeval": (0.80, 0.02), "mmlu": (0.25, 0.0993), "gsm8k": (0.0, 0.0), "ppl": (10.0, None)})
NOISY_Q = results("quantized", {"ifeval": (0.72, 0.03), "mmlu": (0.35, 0.109), "gsm8k": (0.05, 0.05), "ppl": (12.5, None)}, bpw=3.7)
NOISY_R = results("recovered", {"ifeval": (0.78, 0.02), "mmlu": (0.20, 0.09), "gsm8k": (0.0, 0.0), "ppl": (10.5, None)},
                  bpw=3.7, rank=16, cost=0.25)


def test_uninformative_rule():
    from qrecover.reports.table import NOISE_STDERRS, uninformative

    def verdict(name, value, se):
        base = results("original", {name: (value, se)})
        return name in uninformative(Results.from_dict(base))

    assert NOISE_STDERRS == 2.0
    assert verdict("mmlu", 0.25, 0.0993) and verdict("mmlu", 0.40, 0.08)  # 0.15 <= 2 x 0.08
    assert not verdict("mmlu", 0.42, 0.08) and not verdict("mmlu", 0.45, 0.05)  # 0.17 > 0.16; 4 stderrs
    assert verdict("mmlu", 0.10, 0.08) and not verdict("mmlu", 0.25, None)  # below chance is noise too; no stderr: unknown
    assert verdict("gsm8k", 0.0, 0.0) and verdict("gsm8k", 0.05, 0.05) and not verdict("gsm8k", 0.30, 0.02)
    assert not verdict("ifeval", 0.0, 0.0) and not verdict("ppl", 10.0, None)  # no known chance level
    why = uninformative(Results.from_dict(NOISY_BASE))
    assert list(why) == ["mmlu", "gsm8k"] and "0.25 ± 0.0993" in why["mmlu"] and "chance (0.25)" in why["mmlu"]


def test_uninformative_marked_in_every_table(tmp_path):
    base = Results.from_dict(NOISY_BASE, source="base.json")
    rows = normalise([Results.from_dict(NOISY_Q), Results.from_dict(NOISY_R)], base)
    assert all(set(r.uninformative) == {"mmlu", "gsm8k"} for r in rows)
    assert "mmlu" in rows[0].cells and "gsm8k" in rows[0].skipped  # still normalised where a ratio exists
    out = tmp_path / "rep"
    rep = write_report(rows, base, out)
    md = (out / "report.md").read_text()
    assert "| bpw | bpw with adapter | model | ifeval | mmlu † | ppl | gsm8k † |" in md
    assert "| 3.70 | 3.70 | quantized | 90.0% (0.72 ± 0.03) | 140.0% (0.35 ± 0.109) † | 80.0% (12.5) | no ratio: " in md
    assert "(value 0.05, unquantized 0) † |" in md
    assert "† Uninformative: mmlu: the unquantized model scores 0.25 ± 0.0993, within 2 standard errors of chance" in md
    assert "|b - chance| <= 2 x its standard error" in md  # the rule, stated
    back = json.loads((out / "report.json").read_text())
    assert back == json.loads(json.dumps(rep)) and list(back["uninformative"]) == ["mmlu", "gsm8k"]
    assert "|b - chance|" in back["uninformative_rule"]
    assert back["rows"][0]["uninformative"] == back["uninformative"]
    page_text = (out / "report.html").read_text()
    page = _Page()
    page.feed(page_text)
    assert "mmlu †" in page.cells and "140.0% (0.35 ± 0.109) †" in page.cells and "90.0% (0.72 ± 0.03)" in page.cells
    assert page_text.count('<td class="uninformative"') == 4 and "|b - chance| &lt;= 2" in page_text
    # the plot: informative panels first, the uninformative one last and grey, gsm8k (no ratio anywhere) not drawn
    panels = svg_panels(page_text)
    assert list(panels) == ["ifeval", "ppl", "mmlu"]
    assert "uninformative" in panels["mmlu"][0] and "uninformative" not in panels["ifeval"][0]
    assert "Not plotted (no ratio in any row): gsm8k" in page_text


def test_report_html_is_deterministic(tmp_path):
    """Same rows, same bytes (the pipeline copies only report files whose bytes changed)."""
    base = Results.from_dict(NOISY_BASE)
    rows = normalise([Results.from_dict(NOISY_Q), Results.from_dict(NOISY_R)], base)
    write_report(rows, base, tmp_path / "a")
    write_report(rows, base, tmp_path / "b")
    assert (tmp_path / "a" / "report.html").read_bytes() == (tmp_path / "b" / "report.html").read_bytes()


NOISY_REPORT = {
    "metrics": ["ifeval", "mmlu", "gsm8k"],
    "rows": [{"label": "3.70 bpw recovered (rank 16)", "kind": "recovered",
              "cells": {"ifeval": cell(0.98, 0.01), "mmlu": cell(0.80, 0.4)},
              "skipped": {"gsm8k": "no ratio: the unquantized model scores 0"},
              "uninformative": {"mmlu": "uninformative: at chance", "gsm8k": "uninformative: at chance"}}],
}


def test_gate_skips_uninformative_unless_asked():
    r = gate(NOISY_REPORT, 0.97)
    assert r.passed and [(c.metric, c.passed, c.skipped, c.uninformative) for c in r.cells] == [
        ("ifeval", True, False, False), ("mmlu", False, True, True), ("gsm8k", False, True, True)]
    assert r.cells[1].note == "uninformative: at chance" and r.cells[1].ratio == pytest.approx(0.80)
    r = gate(NOISY_REPORT, 0.97, include_uninformative=True)  # mmlu 80% fails; gsm8k has no ratio: skipped, not run
    assert not r.passed and [c.metric for c in r.failed] == ["mmlu"] and [c.metric for c in r.skipped] == ["gsm8k"]
    assert r.include_uninformative and not any(c.uninformative for c in r.cells)
    r = gate(NOISY_REPORT, 0.97, {"mmlu": 0.75})  # naming it asks for it
    assert r.passed and [(c.metric, c.skipped) for c in r.cells][:2] == [("ifeval", False), ("mmlu", False)]
    only = {"metrics": ["mmlu"], "rows": [dict(NOISY_REPORT["rows"][0], cells={"mmlu": cell(0.8, 0.4)})]}
    with pytest.raises(QRecoverError, match="--include-uninformative"):
        gate(only, 0.97)
    with pytest.raises(QRecoverError, match="'uninformative' must be an object"):
        gate(dict(NOISY_REPORT, rows=[dict(NOISY_REPORT["rows"][0], uninformative=["mmlu"])]), 0.97)
    assert gate(REPORT, 0.97).passed  # a report written before the mark gates as before


def test_cli_gate_include_uninformative(tmp_path, capsys):
    files = [write(tmp_path, f"{n}.json", d) for n, d in (("q", NOISY_Q), ("r", NOISY_R))]
    out = tmp_path / "reports"
    code, _, err = run(["report", *files, "--baseline", write(tmp_path, "base.json", NOISY_BASE), "--out", out], capsys)
    assert code == 0 and "Uninformative: mmlu" in err, err
    # recovered: ifeval 97.5%, ppl 95.2%; mmlu 80% (uninformative), gsm8k no ratio (uninformative)
    code, stdout, err = run(["gate", out / "report.json", "--min-ratio", "0.95", "--json"], capsys)
    assert code == 0, err
    assert "2/2 cells passed, 2 skipped (uninformative; --include-uninformative checks them)" in err
    assert sorted(c["metric"] for c in json.loads(stdout)["cells"] if c["uninformative"]) == ["gsm8k", "mmlu"]
    code, _, err = run(["gate", out / "report.json", "--min-ratio", "0.95", "--include-uninformative"], capsys)
    assert code == 1 and "2/3 cells passed, 1 skipped (not run)" in err


def test_reference_report_is_current(tmp_path):
    """reports/table10 is what this renderer makes of its committed results (as the pipeline's report stage
    does: sources named ``results/<stage>.json``). The HTML's SVG depends on the matplotlib version, so
    report.md and report.json are compared byte for byte and the HTML by its table and panels."""
    ref = Path(__file__).resolve().parents[1] / "reports" / "table10"
    runs = {}
    for p in sorted((ref / "results").glob("eval-*.json")):
        runs[p.stem] = load_results(p)
        runs[p.stem].source = f"results/{p.name}"
    base = runs.pop("eval-original")
    write_report(normalise(list(runs.values()), base), base, tmp_path / "rep")
    for name in ("report.md", "report.json"):
        assert (tmp_path / "rep" / name).read_text() == (ref / name).read_text(), f"regenerate {ref / name}"
    new, old = _Page(), _Page()
    new.feed((tmp_path / "rep" / "report.html").read_text())
    old.feed((ref / "report.html").read_text())
    assert new.cells == old.cells
    panels = svg_panels((ref / "report.html").read_text())
    assert list(panels) == ["ifeval", "ifeval_prompt_strict", "ifeval_inst_loose", "ifeval_prompt_loose", "ppl", "kl",
                            "mmlu_flips", "mmlu"]
    assert json.loads((ref / "report.json").read_text())["uninformative"].keys() == {"mmlu", "gsm8k", "gsm8k_strict"}


def test_plot_series_per_adapter_rank(tmp_path):
    """Several adapter ranks: one recovered series each, in the one legend; a single bpw still draws."""
    import xml.etree.ElementTree as ET

    pytest.importorskip("matplotlib")
    from qrecover.reports.render import plot_svg

    r8 = results("recovered", {"ifeval": (0.76, 0.02), "gsm8k": (0.47, 0.01), "ppl": (11.0, 0.5)}, bpw=3.7, rank=8, cost=0.12)
    rows = normalise([Results.from_dict(d) for d in (Q37, R37, r8)], Results.from_dict(BASE))
    root = ET.fromstring(plot_svg(rows))
    legend = root.find(f".//{SVG}g[@id='legend']")
    texts = ["".join(t.itertext()).strip() for t in legend.iter(f"{SVG}text")]
    assert texts == ["quantized", "recovered (rank 8)", "recovered (rank 16)", "unquantized (100%)"]
    assert len([g for g in root.iter(f"{SVG}g") if (g.get("id") or "").startswith("panel-")]) == 3


T37 = results("tuned", {"ifeval": (0.75, 0.02), "gsm8k": (0.47, 0.01), "ppl": (11.5, 0.5)}, bpw=3.7)


def test_tuned_rows_sort_label_plot_and_gate(tmp_path):
    """A checkpoint of `qrecover tune` is its own kind: between quantized and recovered at its bpw, zero extra bytes,
    its own line in the plot, gated with --rows tuned and left out of --rows auto when recovered rows exist."""
    import xml.etree.ElementTree as ET

    rows = normalise([Results.from_dict(d) for d in (R37, T37, Q37)], Results.from_dict(BASE))
    assert [r.label for r in rows] == ["3.70 bpw quantized", "3.70 bpw tuned", "3.70 bpw recovered (rank 16)"]
    assert rows[1].bpw_with_adapter == rows[1].bpw == 3.7 and rows[1].adapter_rank is None
    assert rows[1].cells["ppl"].ratio == pytest.approx(10.0 / 11.5)
    with pytest.raises(QRecoverError, match="run.adapter"):  # a tuned run carries no adapter
        Results.from_dict({**T37, "run": {**T37["run"], "adapter": {"path": "a", "rank": 4, "bpw_cost": 0.1}}})
    report = {"metrics": ["ifeval", "ppl"], "rows": [r.to_dict() for r in rows]}
    assert {c.row for c in gate(report, 0.9).cells} == {"3.70 bpw recovered (rank 16)"}
    r = gate(report, 0.9, rows="tuned")
    assert r.rows == "tuned" and {c.row for c in r.cells} == {"3.70 bpw tuned"} and not r.passed  # ppl 0.87 < 0.9
    pytest.importorskip("matplotlib")
    from qrecover.reports.render import plot_svg

    legend = ET.fromstring(plot_svg(rows)).find(f".//{SVG}g[@id='legend']")
    assert ["".join(t.itertext()).strip() for t in legend.iter(f"{SVG}text")] == [
        "quantized", "tuned", "recovered (rank 16)", "unquantized (100%)"]

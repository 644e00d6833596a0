"""``qrecover pipeline``: recipes, stage keys and caching, on the tiny model with real stages (nothing mocked).

Checks: a recipe round-trips (dataclasses <-> TOML) and every bad recipe is a QRecoverError naming the key and
the fix, exit code 2 through the CLI (missing file, bad TOML, unknown keys with the allowed ones named, empty
bpw, non-positive ranks and limit, wrong types, an unknown --force stage); the first run executes every stage
(original eval, compress per bpw, recover per (bpw, rank), evals, report) and writes report.md/json/html in the
Table-10 layout; a second run executes nothing and touches no file; changing ``recover.tokens`` reruns exactly
the recover stages, their evals and the report; a stage interrupted after its work leaves no marker and is
redone, with only what consumes it; an interrupted recover stage resumes its training checkpoint; --dry-run
runs nothing and --force reruns the stage and its consumers.

Each test after the first works on a copy of the first run's directory (recipe, data, stage outputs): paths in
a recipe are relative to it, so the copy is a self-contained experiment.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import tomllib
from cli_helpers import run as cli

from qrecover.errors import QRecoverError
from qrecover.io_utils import sha256_file
from qrecover.pipeline import Recipe, load_recipe, make_plan, read_marker, run_pipeline

BPW = [4.6, 5.0]  # the tiny model's embedding dominates: ~4.2 bpw is its floor
STAGES = ["eval-original", "compress-4.6bpw", "compress-5bpw", "recover-4.6bpw-r4", "recover-5bpw-r4",
          "eval-4.6bpw", "eval-5bpw", "eval-4.6bpw-r4", "eval-5bpw-r4", "report"]


def recipe_text(model: Path, tokens: int = 128) -> str:
    return f"""
model = "{model}"
work_dir = "work"
report_dir = "report"

[eval]
tasks = ["ppl", "kl"]
windows = 2
seq_len = 64

[compress]
bpw = {BPW}
calib_samples = 2
seq_len = 64

[recover]
ranks = [4]
tokens = {tokens}
seq_len = 64
batch_size = 2
objective = "ce"
decontaminate = false
checkpoint_every = 0
mix = "mix.toml"
"""


def set_recipe(d: Path, model: Path, **kw) -> Path:
    (d / "recipe.toml").write_text(recipe_text(model, **kw))
    return d / "recipe.toml"


@pytest.fixture(scope="module")
def first(tiny_model_dir, tmp_path_factory):
    """One complete run: ``(experiment dir, summary, hook events)``."""
    from qrecover.data.corpus import documents

    d = tmp_path_factory.mktemp("pipe") / "exp"
    (d / "texts").mkdir(parents=True)
    for i, t in enumerate(documents("python-docs", "train")[:6]):
        (d / "texts" / f"doc{i}.txt").write_text(t)
    (d / "mix.toml").write_text('[[source]]\nname = "docs"\nkind = "text"\npath = "texts/*.txt"\nweight = 1.0\n')
    set_recipe(d, tiny_model_dir)
    events = []
    summary = run_pipeline(d / "recipe.toml", show_progress=False, hook=lambda e, s: events.append((e, s.name)))
    return d, summary, events


@pytest.fixture
def exp(first, tmp_path) -> Path:
    """A copy of the first run's experiment directory (mtimes kept)."""
    return Path(shutil.copytree(first[0], tmp_path / "exp"))


def ran(summary) -> list[str]:
    return [s["name"] for s in summary["stages"] if s["status"] == "ran"]


def flat(text: str) -> str:
    """Console output with rich's line wrapping undone."""
    return " ".join(text.split())


class Crash(Exception):
    pass


def crash_at_step_2(info):
    """A training callback: Ctrl-C (or any crash) after the second step's checkpoint."""
    if info["step"] == 2:
        raise Crash


def snapshot(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in sorted(d.rglob("*")) if p.is_file()}


# --- recipes --------------------------------------------------------------------------------------------


def test_recipe_round_trips(tmp_path):
    r = Recipe.from_dict({"model": "m", "work_dir": "w", "report_dir": "r",
                          "eval": {"tasks": ["ppl"], "limit": 3, "windows": 4},
                          "compress": {"bpw": [3.5, 4], "bits": [2, 4], "scheme_params": {"group_size": 16}},
                          "recover": {"ranks": [8, 16], "tokens": 1024, "objective": "ce", "decontaminate": False}},
                         base_dir=tmp_path)
    assert r.compress.bpw == [3.5, 4.0] and r.compress.options["scheme_params"] == {"group_size": 16}
    path = r.save(tmp_path / "r.toml")
    again = load_recipe(path)
    assert again == r and again.to_dict() == r.to_dict()
    assert tomllib.loads(r.to_toml()) == r.to_dict()
    assert again.path("w") == (tmp_path / "w").resolve()  # relative to the recipe file
    d = Recipe()  # every section has its documented default
    assert d.eval.tasks == ["ifeval", "gsm8k", "mmlu", "ppl", "kl"] and d.eval.limit is None
    assert d.compress.bpw == [3.7] and d.recover.ranks == [16] and d.model_spec is None
    assert d.tune is None and "tune" not in d.to_dict() and "[tune]" not in d.to_toml()  # optional: absent = no tune stages
    t = Recipe.from_dict({**r.to_dict(), "tune": {"tokens": 512, "params": "tables,norms", "lr": 1e-3}}, base_dir=tmp_path)
    assert t.tune.options == {"tokens": 512, "params": "tables,norms", "lr": 1e-3}
    again = load_recipe(t.save(tmp_path / "t.toml"))
    assert again == t and tomllib.loads(t.to_toml())["tune"] == {"tokens": 512, "params": "tables,norms", "lr": 1e-3}


BAD = [
    ('bogus = 1\n', r"unknown key\(s\) \['bogus'\] at the top of the recipe; allowed keys: model, work_dir, report_dir, eval, "
                   r"compress, tune, recover"),
    ('[compress]\nbpw = [3.7]\nbpww = 3\n', r"\[compress\]: unknown key\(s\) \['bpww'\]; allowed keys: bpw, scope, bits, scheme"),
    ('[recover]\nrank = 16\n', r"\[recover\]: unknown key\(s\) \['rank'\]; allowed keys: ranks, alpha"),
    ('[eval]\nlimt = 5\n', r"\[eval\]: unknown key\(s\) \['limt'\]; allowed keys: tasks, limit, batch_size"),
    ('[compress]\nbpw = []\n', r"bpw = \[\] must be a non-empty list of budgets"),
    ('[compress]\nbpw = [0]\n', r"0 is not a positive number of bits per weight"),
    ('[compress]\nbpw = [3.7, 3.70]\n', r"lists a budget twice"),
    ('[compress]\nscope = "all"\n', r"\[compress\] \(bpw = 3.7\): --scope 'all' must be 'model' or 'linear'"),
    ('[recover]\nranks = [0]\n', r"ranks = \[0\]: every rank must be a positive integer"),
    ('[recover]\nranks = [16]\ntokens = -1\n', r"\[recover\] \(rank = 16\): --tokens -1 must be a positive"),
    ('[eval]\nlimit = 0\n', r"limit = 0 must be a positive integer"),
    ('[eval]\ntasks = []\n', r"tasks = \[\] must be a non-empty list"),
    ('[eval]\nwindows = "many"\n', r"windows = 'many' must be a positive integer"),
    ('eval = 3\n', r"eval = 3 must be a table: write a \[eval\] section"),
    ('work_dir = 3\n', r"work_dir = 3 must be a string"),
    ('[tune]\nrank = 4\n', r"\[tune\]: unknown key\(s\) \['rank'\]; allowed keys: tokens, mix"),
    ('[tune]\nparams = "weights"\n', r"\[tune\]: --params 'weights': choose a comma-separated subset of tables, scales"),
    ('tune = 1\n', r"tune = 1 must be a table: write a \[tune\] section"),
    ('[compress\nbpw = 1\n', r"is not valid TOML"),
]


@pytest.mark.parametrize("text,match", BAD)
def test_bad_recipes_name_the_key_and_the_fix(tmp_path, text, match):
    (tmp_path / "r.toml").write_text(text)
    with pytest.raises(QRecoverError, match=match):
        load_recipe(tmp_path / "r.toml")


@pytest.mark.parametrize("text,match", [BAD[0], BAD[1], BAD[4], BAD[8], BAD[10], BAD[-1]])
def test_cli_bad_recipe_exits_2(tmp_path, capsys, text, match):
    (tmp_path / "r.toml").write_text(text)
    code, out, err = cli(["pipeline", tmp_path / "r.toml"], capsys)
    assert code == 2 and "error:" in err and "Traceback" not in err and out == ""


def test_cli_missing_recipe_and_unknown_stage_exit_2(tiny_model_dir, tmp_path, capsys):
    code, _, err = cli(["pipeline", tmp_path / "nope.toml"], capsys)
    err = flat(err)
    assert code == 2 and "does not exist" in err
    r = set_recipe(tmp_path, tiny_model_dir)
    (tmp_path / "mix.toml").write_text("")
    code, _, err = cli(["pipeline", r, "--dry-run", "--force", "compress-9bpw"], capsys)
    err = flat(err)
    assert code == 2 and "--force compress-9bpw: no such stage" in err and "compress-4.6bpw" in err
    (tmp_path / "mix.toml").unlink()
    code, _, err = cli(["pipeline", r, "--dry-run"], capsys)
    err = flat(err)
    assert code == 2 and "mix = 'mix.toml' does not exist" in err
    assert not (tmp_path / "work").exists()


# --- runs -----------------------------------------------------------------------------------------------


def test_first_run_executes_every_stage_and_writes_the_report(first):
    d, summary, events = first
    assert [s["name"] for s in summary["stages"]] == STAGES
    assert ran(summary) == STAGES
    assert [e for e, _ in events] == ["start", "ran", "done"] * len(STAGES)
    for s in summary["stages"]:
        marker = read_marker(Path(s["dir"]))
        assert marker["key"] == s["key"] and Path(s["dir"]).name == f"{s['name']}-{s['key'][:12]}"
        assert marker["inputs"] == {n: {"key": k, "dir": next(Path(t["dir"]).name for t in summary["stages"] if t["name"] == n)}
                                    for n, k in s["inputs"].items()}
        assert marker["seconds"] >= 0 and marker["finished"]
    report = d / "report"
    assert {"report.md", "report.json", "report.html", "pipeline.json"} <= {p.name for p in report.iterdir()}
    assert sorted(p.stem for p in (report / "results").iterdir()) == sorted(n for n in STAGES if n.startswith("eval-"))
    rep = json.loads((report / "report.json").read_text())
    assert rep["metrics"] == ["ppl", "kl"]
    rows = [(r["kind"], r["adapter_rank"]) for r in rep["rows"]]
    assert rows == [("quantized", None), ("recovered", 4)] * 2  # bpw descending, quantized before recovered
    assert rep["rows"][0]["bpw"] > rep["rows"][2]["bpw"]
    assert all(r["source"].startswith("results/eval-") for r in rep["rows"])  # relative to the report dir
    assert "| bpw |" in (report / "report.md").read_text()
    info = json.loads((report / "pipeline.json").read_text())
    assert [s["name"] for s in info["stages"]] == STAGES and info["stages"][0]["config"]["tasks"] == ["ppl", "kl"]
    assert summary["report"] == str(report / "report.md")


def test_second_run_executes_nothing_and_touches_nothing(exp):
    before = snapshot(exp)
    events = []
    summary = run_pipeline(exp / "recipe.toml", show_progress=False, hook=lambda e, s: events.append(e))
    assert ran(summary) == [] and events == ["skip"] * len(STAGES)
    assert summary["published"] == []
    assert snapshot(exp) == before


def test_changed_tokens_rerun_only_recover_its_evals_and_the_report(exp, tiny_model_dir):
    old = {s.name: s.key for s in make_plan(load_recipe(exp / "recipe.toml")).stages}
    set_recipe(exp, tiny_model_dir, tokens=256)
    plan = make_plan(load_recipe(exp / "recipe.toml"))
    changed = [s.name for s in plan.stages if s.key != old[s.name]]
    assert changed == ["recover-4.6bpw-r4", "recover-5bpw-r4", "eval-4.6bpw-r4", "eval-5bpw-r4", "report"]
    summary = run_pipeline(exp / "recipe.toml", show_progress=False)
    assert ran(summary) == changed
    meta = json.loads((plan.stage("recover-5bpw-r4").dir / "adapter" / "qrecover_adapter.json").read_text())
    assert meta["training"]["tokens"] == 256
    assert "report.json" in summary["published"]


def test_a_preset_whose_specs_change_reruns_compress_though_its_name_does_not(exp, monkeypatch):
    """The recipe names the default menu by its name; the key holds the expanded specs, so a release that changes
    what the name means recompresses instead of reusing checkpoints made with the old menu."""
    from qrecover.config import DEFAULT_ENCODINGS
    from qrecover.stages import specs

    old = {s.name: s.key for s in make_plan(load_recipe(exp / "recipe.toml")).stages}
    monkeypatch.setitem(specs.PRESETS, DEFAULT_ENCODINGS, specs.PRESETS[DEFAULT_ENCODINGS].replace("/refit=2", ""))
    changed = {s.name for s in make_plan(load_recipe(exp / "recipe.toml")).stages if s.key != old[s.name]}
    assert changed == set(old) - {"eval-original"}


def test_interrupted_stage_leaves_no_marker_and_is_redone(exp):
    def crash(event, stage):
        if event == "ran" and stage.name == "eval-5bpw":  # the work is done, the marker not yet written
            raise Crash

    with pytest.raises(Crash):
        run_pipeline(exp / "recipe.toml", force=["eval-5bpw"], show_progress=False, hook=crash)
    plan = make_plan(load_recipe(exp / "recipe.toml"))
    s = plan.stage("eval-5bpw")
    assert s.dir.is_dir() and read_marker(s.dir) is None
    assert {t.name: (t.status, t.reason) for t in plan.stages if t.status != "cached"} == {
        "eval-5bpw": ("run", "unfinished"), "report": ("run", "input eval-5bpw runs")}
    summary = run_pipeline(exp / "recipe.toml", show_progress=False)
    assert ran(summary) == ["eval-5bpw", "report"]
    assert read_marker(s.dir)["key"] == s.key


def test_interrupted_recover_resumes_its_checkpoint(exp, tiny_model_dir):
    set_recipe(exp, tiny_model_dir, tokens=64 * 2 * 3)  # 3 steps, a resumable checkpoint after each
    text = (exp / "recipe.toml").read_text().replace("checkpoint_every = 0", "checkpoint_every = 1")
    (exp / "recipe.toml").write_text(text)

    with pytest.raises(Crash):
        run_pipeline(exp / "recipe.toml", show_progress=False, recover_callback=crash_at_step_2)
    plan = make_plan(load_recipe(exp / "recipe.toml"))
    s = plan.stage("recover-4.6bpw-r4")
    assert (s.status, s.reason) == ("resume", "unfinished") and read_marker(s.dir) is None
    assert plan.stage("compress-4.6bpw").status == "cached"
    summary = run_pipeline(exp / "recipe.toml", show_progress=False)
    assert ran(summary) == ["recover-4.6bpw-r4", "recover-5bpw-r4", "eval-4.6bpw-r4", "eval-5bpw-r4", "report"]
    marker = read_marker(s.dir)
    assert marker["output"]["resumed"] is True
    steps = [json.loads(x)["step"] for x in (s.dir / "adapter" / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert read_marker(plan.stage("recover-5bpw-r4").dir)["output"]["resumed"] is False


def test_cli_dry_run_and_force(exp, capsys):
    before = snapshot(exp)
    code, out, _ = cli(["pipeline", exp / "recipe.toml", "--dry-run", "--json"], capsys)
    assert code == 0 and [s["status"] for s in json.loads(out)["stages"]] == ["cached"] * len(STAGES)
    code, out, err = cli(["pipeline", exp / "recipe.toml", "--dry-run", "--force", "eval-original"], capsys)
    err = flat(err)
    assert code == 0 and "eval-original" in err and "to run (forced)" in err and "input eval-original runs" in err
    assert snapshot(exp) == before  # a dry run writes nothing
    code, out, _ = cli(["pipeline", exp / "recipe.toml", "--force", "eval-original", "--json"], capsys)
    assert code == 0
    assert ran(json.loads(out)) == ["eval-original", "report"]


def test_only_runs_the_named_stages_and_publishes_when_all_are_done(exp, tiny_model_dir):
    set_recipe(exp, tiny_model_dir, tokens=256)  # recover, its evaluations and the report are to run again
    with pytest.raises(QRecoverError, match="needs 'recover-5bpw-r4', which is not done yet"):
        run_pipeline(exp / "recipe.toml", show_progress=False, only=["eval-5bpw-r4"])
    with pytest.raises(QRecoverError, match="'nope' is not a stage of this recipe"):
        run_pipeline(exp / "recipe.toml", show_progress=False, only=["nope"])
    report = exp / "report" / "report.json"
    before = report.read_bytes()
    summary = run_pipeline(exp / "recipe.toml", show_progress=False, only=["recover-5bpw-r4", "recover-4.6bpw-r4"])
    assert ran(summary) == ["recover-4.6bpw-r4", "recover-5bpw-r4"]
    assert summary["report"] is None and summary["published"] == [] and report.read_bytes() == before
    summary = run_pipeline(exp / "recipe.toml", show_progress=False, only=["eval-5bpw-r4"])
    assert ran(summary) == ["eval-5bpw-r4"] and summary["report"] is None
    summary = run_pipeline(exp / "recipe.toml", show_progress=False)  # the rest, then the report
    assert ran(summary) == ["eval-4.6bpw-r4", "report"] and "report.json" in summary["published"]


def test_recover_mix_may_name_a_prepared_data_directory_keyed_by_its_manifest(exp, tiny_model_dir):
    """``[recover] mix = "prepared"`` (a `qrecover data prepare` output) runs, and its key follows the manifest."""
    from qrecover.data.prepare import prepare_data

    prepare_data(exp / "mix.toml", exp / "prepared", model=str(tiny_model_dir), workers=1, decontaminate=False)
    (exp / "recipe.toml").write_text((exp / "recipe.toml").read_text().replace('mix = "mix.toml"', 'mix = "prepared"'))
    plan = make_plan(load_recipe(exp / "recipe.toml"))
    recover_stage = plan.stage("recover-5bpw-r4")
    assert recover_stage.config["mix"] == {"prepared_manifest_sha256": sha256_file(exp / "prepared" / "manifest.json")}
    summary = run_pipeline(exp / "recipe.toml", only=["recover-5bpw-r4"], show_progress=False)
    meta = json.loads((recover_stage.dir / "adapter" / "qrecover_adapter.json").read_text())
    assert meta["config"]["mix"] == str((exp / "prepared").resolve()) and "recover-5bpw-r4" in ran(summary)
    manifest = json.loads((exp / "prepared" / "manifest.json").read_text())
    manifest["note"] = "changed"
    (exp / "prepared" / "manifest.json").write_text(json.dumps(manifest))
    assert make_plan(load_recipe(exp / "recipe.toml")).stage("recover-5bpw-r4").key != recover_stage.key


# --- [tune] ---------------------------------------------------------------------------------------------

TUNE = """
[tune]
tokens = 256
seq_len = 64
batch_size = 2
objective = "ce"
decontaminate = false
checkpoint_every = 0
rounding_windows = 1
mix = "mix.toml"
"""
TUNED = ["tune-4.6bpw", "tune-5bpw", "eval-4.6bpw-tuned", "eval-5bpw-tuned", "report"]


def test_tune_section_adds_tuned_checkpoints_and_rows_and_reruns_nothing_else(exp):
    """Adding ``[tune]`` to a finished experiment runs the tune stages, their evaluations and the report; the
    compressed checkpoints and the adapters stay cached. Each tuned checkpoint has its source's exact bytes count
    and is a report row of its own (kind 'tuned', zero extra bytes)."""
    old = {s.name: s.key for s in make_plan(load_recipe(exp / "recipe.toml")).stages}
    (exp / "recipe.toml").write_text((exp / "recipe.toml").read_text() + TUNE)
    plan = make_plan(load_recipe(exp / "recipe.toml"))
    assert [s.name for s in plan.stages if s.status != "cached"] == TUNED
    assert all(s.key == old[s.name] for s in plan.stages if s.name in old and s.name != "report")
    assert plan.stage("tune-5bpw").inputs == {"compress-5bpw": old["compress-5bpw"]}
    assert plan.stage("tune-5bpw").config["mix"] == {"sha256": sha256_file(exp / "mix.toml")}
    summary = run_pipeline(exp / "recipe.toml", show_progress=False)
    assert ran(summary) == TUNED
    for b in ("4.6bpw", "5bpw"):
        src, tuned = plan.stage(f"compress-{b}").dir / "checkpoint", plan.stage(f"tune-{b}").dir / "checkpoint"
        manifest = json.loads((tuned / "qrecover.json").read_text())
        assert manifest["tuning"]["tokens"] == 256 and manifest["tuning"]["source"]["manifest_sha256"] == sha256_file(src / "qrecover.json")
        assert (tuned / "model.safetensors").stat().st_size == (src / "model.safetensors").stat().st_size
        assert (tuned / "model.safetensors").read_bytes() != (src / "model.safetensors").read_bytes()
        assert read_marker(plan.stage(f"tune-{b}").dir)["output"]["measured_bpw"] == manifest["measured_bpw"]
    rep = json.loads((exp / "report" / "report.json").read_text())
    assert [(r["kind"], r["adapter_rank"]) for r in rep["rows"]] == [("quantized", None), ("tuned", None), ("recovered", 4)] * 2
    tuned_rows = [r for r in rep["rows"] if r["kind"] == "tuned"]
    assert [r["label"].split(" bpw ")[1] for r in tuned_rows] == ["tuned", "tuned"]
    assert all(r["bpw_with_adapter"] == r["bpw"] for r in tuned_rows)  # zero extra bytes
    assert "| tuned |" in (exp / "report" / "report.md").read_text()
    assert ran(run_pipeline(exp / "recipe.toml", show_progress=False)) == []


def test_interrupted_tune_resumes_its_checkpoint(exp):
    (exp / "recipe.toml").write_text((exp / "recipe.toml").read_text() + TUNE.replace("checkpoint_every = 0", "checkpoint_every = 1"))

    with pytest.raises(Crash):
        run_pipeline(exp / "recipe.toml", show_progress=False, recover_callback=crash_at_step_2)
    plan = make_plan(load_recipe(exp / "recipe.toml"))
    s = plan.stage("tune-4.6bpw")
    assert (s.status, s.reason) == ("resume", "unfinished") and read_marker(s.dir) is None
    summary = run_pipeline(exp / "recipe.toml", show_progress=False)
    assert ran(summary) == TUNED and read_marker(s.dir)["output"]["resumed"] is True
    steps = [json.loads(x)["step"] for x in (s.dir / "checkpoint" / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2]

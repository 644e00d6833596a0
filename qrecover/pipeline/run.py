"""Running a pipeline's plan: each stage kind's runner, the stage markers, publishing the report (see
:mod:`qrecover.pipeline`)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .._version import __version__
from ..api import compress, prepare
from ..errors import QRecoverError
from ..evaluate.config import EvalConfig
from ..evaluate.runner import evaluate, save_results
from ..io_utils import write_bytes_atomic, write_text_atomic
from ..recovery.api import recover
from ..reports.render import write_report
from ..reports.results import load_results
from ..reports.table import normalise
from .plan import Plan, Stage, make_plan, model_sha256, read_marker, stage_key
from .recipe import (
    REPORT_FILES,
    STAGE_FILE,
    CompressSection,
    EvalSection,
    Recipe,
    RecoverSection,
    find_recipe,
    load_recipe,
)

# --- stages ---------------------------------------------------------------------------------------------


@dataclass
class _Context:
    plan: Plan
    show_progress: bool
    recover_callback: Callable[[dict[str, Any]], None] | None
    prepared: Any = None  # (CompressConfig minus bpw, Prepared, stage name): one calibration serves every budget
    todo: list[Stage] = dataclasses.field(default_factory=list)

    def dir_of(self, name: str) -> Path:
        return self.plan.stage(name).dir


def evaluate_model(model: str | None, adapter: str | None, tasks: list[str], limit: int | None, out: Path,
                   options: dict[str, Any], show_progress: bool) -> Any:
    """The one call into :mod:`qrecover.evaluate`: score ``model`` (+ ``adapter``), write ``out``."""

    cfg = EvalConfig(model=model, adapter=adapter, tasks=list(tasks), limit=limit, **options)
    results = evaluate(cfg, show_progress=show_progress)
    save_results(results, out, overwrite=True)
    return results


def _run_eval(s: Stage, ctx: _Context) -> dict[str, Any]:
    ev = ctx.plan.recipe.eval
    model, adapter = s.params.get("model"), None
    for name in s.inputs:
        kind = ctx.plan.stage(name).kind
        if kind in ("compress", "tune"):
            model = str(ctx.dir_of(name) / "checkpoint")
        elif kind == "recover":
            adapter = str(ctx.dir_of(name) / "adapter")
    res = evaluate_model(model, adapter, ev.tasks, ev.limit, s.dir / "results.json", s.params["options"], ctx.show_progress)
    return {"results": "results.json", "metrics": {n: m.value for n, m in res.metrics.items()}}


def _run_compress(s: Stage, ctx: _Context) -> dict[str, Any]:

    cfg = ctx.plan.recipe.compress.config(ctx.plan.recipe.model_spec, s.params["bpw"], s.params["options"])
    same = {k: v for k, v in cfg.to_dict().items() if k != "bpw"}
    if ctx.prepared is None or ctx.prepared[0] != same:
        ctx.prepared = None  # free the previous one first
        ctx.prepared = (same, prepare(cfg, ctx.show_progress), s.name)
    manifest = compress(cfg, out=s.dir / "checkpoint", overwrite=True, show_progress=ctx.show_progress,
                        prepared=ctx.prepared[1])
    calibrated_by = ctx.prepared[2]
    if not any(t.kind == "compress" for t in ctx.todo):
        ctx.prepared = None  # the model and every candidate encoding: not kept through training and evaluation
    return {"checkpoint": "checkpoint", "measured_bpw": manifest["measured_bpw"],
            "calibration": "own" if calibrated_by == s.name else f"shared with {calibrated_by} (same settings but bpw)"}


def _run_recover(s: Stage, ctx: _Context) -> dict[str, Any]:

    (dep,) = s.inputs
    cfg = ctx.plan.recipe.recover.config(s.params["rank"], s.params["options"])
    resume = s.status == "resume"
    meta = recover(ctx.dir_of(dep) / "checkpoint", s.dir / "adapter", cfg, overwrite=not resume, resume=resume,
                   show_progress=ctx.show_progress, callback=ctx.recover_callback)
    return {"adapter": "adapter", "resumed": resume, "bpw_cost": meta.get("bpw_cost"),
            "final_loss": meta.get("training", {}).get("final_loss")}


def _run_tune(s: Stage, ctx: _Context) -> dict[str, Any]:

    from ..recovery.tune import tune

    (dep,) = s.inputs
    cfg = ctx.plan.recipe.tune.config(s.params["options"])
    resume = s.status == "resume"
    manifest = tune(ctx.dir_of(dep) / "checkpoint", s.dir / "checkpoint", cfg, overwrite=not resume, resume=resume,
                    show_progress=ctx.show_progress, callback=ctx.recover_callback)
    t = manifest["tuning"]
    return {"checkpoint": "checkpoint", "resumed": resume, "measured_bpw": manifest["measured_bpw"],
            "final_loss": t["training"].get("final_loss"), "rounding": t.get("rounding")}


def _run_report(s: Stage, ctx: _Context) -> dict[str, Any]:

    (s.dir / "results").mkdir(parents=True, exist_ok=True)
    runs = {}
    for name in s.inputs:
        target = s.dir / "results" / f"{name}.json"
        shutil.copyfile(ctx.dir_of(name) / "results.json", target)
        r = load_results(target)
        r.source = f"results/{name}.json"  # as the report directory holds it
        runs[name] = r
    base = runs.pop("eval-original")
    rows = normalise(list(runs.values()), base)
    write_report(rows, base, s.dir / "report", overwrite=True)
    info = {k: v for k, v in ctx.plan.to_dict().items() if k not in ("recipe", "work_dir", "report_dir")}
    info["stages"] = [{k: v for k, v in t.to_dict().items() if k in ("name", "kind", "key", "inputs", "config")}
                      for t in ctx.plan.stages]
    (s.dir / "pipeline.json").write_text(json.dumps(info, indent=1) + "\n")
    return {"report": "report", "rows": [r.label for r in rows]}


_RUNNERS: dict[str, Callable[[Stage, _Context], dict[str, Any]]] = {
    "eval": _run_eval, "compress": _run_compress, "tune": _run_tune, "recover": _run_recover, "report": _run_report}


def _write_marker(s: Stage, plan: Plan, started: float, output: dict[str, Any]) -> None:
    now = time.time()
    s.seconds = round(now - started, 1)
    marker = {"stage": s.name, "kind": s.kind, "key": s.key,
              "inputs": {n: {"key": k, "dir": plan.stage(n).dir.name} for n, k in s.inputs.items()},
              "config": s.config, "qrecover": __version__, "seconds": s.seconds,
              "started": datetime.fromtimestamp(started, timezone.utc).isoformat(timespec="seconds"),
              "finished": datetime.fromtimestamp(now, timezone.utc).isoformat(timespec="seconds"), "output": output}
    write_text_atomic(s.dir / STAGE_FILE, json.dumps(marker, indent=1, default=str) + "\n")  # complete from here on


def publish(plan: Plan) -> list[str]:
    """Copy the report stage's files into ``report_dir`` (only those whose bytes differ); return what changed.

    Writes report.md/json/html, results/<stage>.json and pipeline.json, each atomically; removes results
    files of stages no longer in the recipe. Other files in ``report_dir`` are left alone.
    """
    src = plan.stage("report").dir
    dst = plan.report_dir
    files = {f"report/{n}": n for n in REPORT_FILES} | {"pipeline.json": "pipeline.json"}
    files |= {f"results/{p.name}": f"results/{p.name}" for p in sorted((src / "results").glob("*.json"))}
    changed = []
    for rel_src, rel_dst in files.items():
        data = (src / rel_src).read_bytes()
        target = dst / rel_dst
        if target.is_file() and target.read_bytes() == data:
            continue
        write_bytes_atomic(target, data)
        changed.append(rel_dst)
    keep = {Path(r).name for r in files.values() if r.startswith("results/")}
    for old in sorted((dst / "results").glob("*.json")) if (dst / "results").is_dir() else []:
        if old.name not in keep:
            old.unlink()
            changed.append(f"results/{old.name} (removed)")
    return changed


def execute(plan: Plan, show_progress: bool = True, hook: Callable[[str, Stage], None] | None = None,
            recover_callback: Callable[[dict[str, Any]], None] | None = None,
            only: Sequence[str] = ()) -> dict[str, Any]:
    """Run every stage of ``plan`` that is not cached, in order, then publish the report.

    ``only``: run just these stages (their inputs must be done already), e.g. to run two independent
    evaluations in two processes; the report is published only once every stage is done.

    ``hook(event, stage)`` is called with ``"skip"`` for a cached stage, and ``"start"``, ``"ran"`` (output
    written, ``stage.json`` not yet) and ``"done"`` for one that runs; an exception it raises stops the
    pipeline there, as a crash would. ``recover_callback``: passed to every recover and tune stage's training loop.
    Returns the plan's dict with each stage's status ``ran`` or ``cached`` and its seconds, plus the report.
    """
    from rich.console import Console
    from rich.markup import escape

    console = Console(stderr=True)
    say = (lambda m: console.print(m, highlight=False)) if show_progress else (lambda m: None)  # noqa: E731
    if only:
        names = {s.name: s for s in plan.stages}
        unknown = [n for n in only if n not in names]
        if unknown:
            raise QRecoverError(f"--only {unknown[0]!r} is not a stage of this recipe; stages: {', '.join(names)}")
        for n in only:
            pending = [i for i in names[n].inputs if names[i].status != "cached"]
            if pending:
                raise QRecoverError(f"--only {n!r} needs {pending[0]!r}, which is not done yet; run it first "
                                    f"(qrecover pipeline RECIPE --only {pending[0]}) or run the whole pipeline")
    todo = [s for s in plan.stages if s.status != "cached" and (not only or s.name in only)]
    ctx = _Context(plan, show_progress, recover_callback, todo=list(todo))
    t0 = time.time()
    for s in plan.stages:
        if s.status == "cached" or s not in todo:
            if hook and s.status == "cached":
                hook("skip", s)
            continue
        ctx.todo.remove(s)
        i = todo.index(s) + 1
        say(f"[bold]\\[{i}/{len(todo)}] {escape(s.name)}[/] ({escape(s.reason)}) in {escape(s.dir.name)}")
        if hook:
            hook("start", s)
        started = time.time()
        if s.status != "resume":  # a fresh start: nothing of an earlier attempt or an earlier key survives
            shutil.rmtree(s.dir, ignore_errors=True)
        s.dir.mkdir(parents=True, exist_ok=True)
        (s.dir / STAGE_FILE).unlink(missing_ok=True)
        try:
            output = _RUNNERS[s.kind](s, ctx)
            if hook:
                hook("ran", s)
        except BaseException:
            say(f"[bold red]{escape(s.name)} failed[/] after {time.time() - started:.0f} s; completed stages are kept, "
                "run the pipeline again to continue from here")
            raise
        _write_marker(s, plan, started, output)
        s.status = "ran"
        say(f"    done in {s.seconds:.1f} s")
        if hook:
            hook("done", s)
    complete = all(s.status in ("cached", "ran") for s in plan.stages)
    changed = publish(plan) if complete else []
    summary = plan.to_dict()
    summary["report"] = str(plan.report_dir / "report.md") if complete else None
    summary["published"] = changed
    summary["seconds"] = round(time.time() - t0, 1)
    return summary


def run_pipeline(recipe: Recipe | str | os.PathLike, dry_run: bool = False, force: Sequence[str] = (),
                 show_progress: bool = True, hook: Callable[[str, Stage], None] | None = None,
                 recover_callback: Callable[[dict[str, Any]], None] | None = None,
                 only: Sequence[str] = ()) -> dict[str, Any]:
    """Plan, and unless ``dry_run`` execute, a recipe (a :class:`Recipe`, a TOML path or a shipped recipe's name);
    see :func:`execute`."""
    if not isinstance(recipe, Recipe):
        recipe = load_recipe(recipe)
    plan = make_plan(recipe, force)
    if dry_run:
        return plan.to_dict()
    return execute(plan, show_progress=show_progress, hook=hook, recover_callback=recover_callback, only=only)


__all__ = ["Recipe", "EvalSection", "CompressSection", "RecoverSection", "Stage", "Plan", "load_recipe", "make_plan",
           "execute", "publish", "run_pipeline", "find_recipe", "stage_key", "model_sha256", "evaluate_model", "read_marker"]


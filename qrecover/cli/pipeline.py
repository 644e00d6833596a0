"""``qrecover pipeline``: compress, recover, evaluate and report from one recipe, every stage cached by content hash."""

from __future__ import annotations

import typer

from .common import JsonOpt, console, emit_json

EXAMPLES = """Examples:

  qrecover pipeline table10                  # the shipped Table-10 recipe: what is not done yet

  qrecover pipeline table10 --dry-run        # the plan only

  qrecover pipeline my-recipe.toml --force eval-original

  qrecover pipeline table10 --json | jq '.stages[].status'

  qrecover pipeline table10 --only eval-3.5bpw-r16 &  qrecover pipeline table10 --only eval-3.7bpw-r16

A second run does nothing; a changed setting reruns its stage and what consumes it.

After a crash only unfinished stages run; recovery training and tuning resume their checkpoints.
"""


def _plan_table(plan) -> None:
    from rich.markup import escape
    from rich.table import Table

    t = Table(title=escape(f"pipeline {plan.recipe.source or ''}: {plan.work_dir}"))
    for h in ("#", "stage", "key", "status"):
        t.add_column(h, justify="right" if h == "#" else "left")
    for i, s in enumerate(plan.stages, 1):
        status = "cached" if s.status == "cached" else f"{'resume' if s.status == 'resume' else 'to run'} ({s.reason})"
        t.add_row(str(i), escape(s.name), s.key[:12], escape(status), style="dim" if s.status == "cached" else None)
    console.print(t)


def pipeline(
    recipe: str = typer.Argument(..., help="Recipe TOML (model, work_dir, report_dir and the eval, compress and recover tables; an optional tune "
                                           "table), or the name of a "
                                           "shipped recipe: table10 (Table 10 on the default model; its relative paths are relative to the working "
                                           "directory)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the plan (stages, keys, cached or to run) and stop."),
    force: list[str] = typer.Option([], "--force", help="Run this stage even if cached (repeatable), e.g. --force eval-original; the stages that "
                                                        "consume it run too."),
    only: list[str] = typer.Option([], "--only", help="Run just this stage (repeatable) once its inputs are done, e.g. two evaluations in two "
                                                      "processes; the report is written when every stage is done."),
    json_out: bool = JsonOpt,
) -> None:
    r"""The whole experiment from one recipe: evaluate the original, compress at each bpw, tune each checkpoint (with
    a \[tune] table), recover at each rank, evaluate every model, write the Table-10 report. Completed stages are
    skipped."""
    from rich.markup import escape

    from ..pipeline import execute, load_recipe, make_plan  # lazy: pulls torch, transformers, peft

    plan = make_plan(load_recipe(recipe), force)
    if dry_run:
        if json_out:
            emit_json(plan.to_dict())
        else:
            _plan_table(plan)
        return
    if not json_out:
        _plan_table(plan)
    summary = execute(plan, show_progress=not json_out, only=only)
    if json_out:
        emit_json(summary)
        return
    from rich.table import Table

    t = Table(title="summary")
    for h in ("stage", "result", "seconds"):
        t.add_column(h, justify="right" if h == "seconds" else "left")
    for s in summary["stages"]:
        done = s["status"] == "ran"
        t.add_row(escape(s["name"]), s["status"], f"{s['seconds']:.1f}" if done else "—", style=None if done else "dim")
    console.print(t)
    n_ran = sum(s["status"] == "ran" for s in summary["stages"])
    n_cached = sum(s["status"] == "cached" for s in summary["stages"])
    console.print(f"{n_ran} stage(s) ran, {n_cached} cached, {summary['seconds']:.0f} s in all", highlight=False)
    if summary["published"]:
        console.print(escape(f"updated in {plan.report_dir}: {', '.join(summary['published'])}"), highlight=False)
    if summary["report"]:
        console.print(escape(f"report: {summary['report']}"), highlight=False)
    else:
        left = [s["name"] for s in summary["stages"] if s["status"] not in ("ran", "cached")]
        console.print(escape(f"no report yet: stages still to run: {', '.join(left)}"), highlight=False)

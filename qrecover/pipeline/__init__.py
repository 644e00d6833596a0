"""``qrecover pipeline RECIPE``: the whole experiment in one command, every stage cached by content hash.

``recipe``: the TOML recipe and its sections; ``plan``: the stages, their keys and what must run; ``run``:
the stage runners, markers and publishing.

**Recipe** (TOML, :class:`Recipe`)::

    model = ""                          # "" = the built-in default model; or an HF directory / .gguf
    work_dir = "runs/table10"           # stage outputs
    report_dir = "reports/table10"      # report.md/json/html, the results files, pipeline.json
    [eval]                              # tasks, limit + any other EvalConfig field (windows, seq_len, ...)
    tasks = ["ifeval", "gsm8k", "mmlu", "ppl", "kl"]
    limit = 20
    [compress]                          # bpw list + any other CompressConfig field (bits, scheme, ...)
    bpw = [3.5, 3.7]
    [recover]                           # ranks list + any other RecoverConfig field (tokens, objective, ...)
    ranks = [16]
    tokens = 65536
    [tune]                              # optional: any TuneConfig field (tokens, params, lr, ...)
    tokens = 32768

Relative paths (``model``, ``work_dir``, ``report_dir``, ``[compress] calib_data``, ``[recover] mix``, ``[tune] mix``,
``[eval] ppl_data`` and ``reference``) are relative to the recipe file, as in mix recipes, so a recipe
gives the same result from any working directory. RECIPE is a TOML path or the name of a recipe shipped with
qrecover (:mod:`qrecover.recipes`, e.g. ``table10``); a shipped recipe's relative paths are relative to the
working directory instead (its own directory is inside the installed package).

**Stages**, in order: ``eval-original``; ``compress-<bpw>bpw`` per budget; with ``[tune]``, ``tune-<bpw>bpw`` per
checkpoint (``qrecover tune``: zero extra bytes); ``recover-<bpw>bpw-r<rank>`` per (budget, rank), on the
compressed checkpoint; ``eval-<bpw>bpw`` per checkpoint; ``eval-<bpw>bpw-tuned`` per tuned checkpoint;
``eval-<bpw>bpw-r<rank>`` per adapter; ``report``. A
stage's key is the sha256 of its kind, its own config, the keys of the stages it consumes, the qrecover
version and, for the stages that read the original model, its weights hash; data named by path is keyed
by content (the mix recipe file, or the manifest of a ``qrecover data prepare`` directory named as ``mix``,
the calibration and perplexity text). Its output lives in
``work_dir/<name>-<key[:12]>/`` and is complete when ``stage.json`` (written last, atomically) holds the
key. So a rerun skips every completed stage, a changed config reruns that stage and what consumes it,
and after a crash only unfinished stages run (an unfinished recover or tune stage resumes its last checkpoint).
A stage that runs makes every stage consuming it run too: its output is new (a checkpoint's manifest
records when it was made, and adapters are bound to that manifest).

After the report stage, its files are copied into ``report_dir`` (only those whose bytes changed), with
the results files under ``results/`` and ``pipeline.json`` (every stage's key and config: the eval limit,
the budgets, the training tokens, ...).
"""

from .plan import Plan, Stage, make_plan, model_sha256, read_marker, stage_key
from .recipe import (
    KINDS,
    REPORT_FILES,
    STAGE_FILE,
    CompressSection,
    EvalSection,
    Recipe,
    RecoverSection,
    TuneSection,
    find_recipe,
    load_recipe,
)
from .run import evaluate_model, execute, publish, run_pipeline

__all__ = ["KINDS", "REPORT_FILES", "STAGE_FILE", "CompressSection", "EvalSection", "Plan", "Recipe", "RecoverSection", "Stage", "TuneSection",
           "evaluate_model", "execute", "find_recipe", "load_recipe", "make_plan", "model_sha256", "publish", "read_marker",
           "run_pipeline", "stage_key"]

"""The built-in tasks of ``qrecover eval``: one table entry per task, and the lm-eval YAMLs beside it.

* ``gsm8k_cot.yaml``: lm-eval's ``gsm8k_cot`` (8-shot chain of thought), GSM8K test split;
* ``ifeval.yaml`` (+ ``utils.py``): lm-eval's ``ifeval``, scored with the offline NLTK tokenizers;
* ``mmlu.yaml``: MMLU with lm-eval's default (zero-shot, A/B/C/D log-likelihood) template.

Each lacks its ``data_files``: :mod:`qrecover.evaluate.harness` writes a small YAML per run that includes one of
these and names the local file, so lm-eval (``lm_eval --include_path``) reads the same definitions.

:data:`TASKS` says, per task, how it runs (:class:`Task`'s ``kind``), which YAML and data file it uses, the
metrics it adds to the results and, for lm-eval's generative tasks, how lm-eval's results become those metrics.
Torch-free: the CLI reads it to check ``--tasks`` before anything heavy loads.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...benchdata import DATA
from ...reports.results import Metric
from ..ifeval_offline import SETTINGS as IFEVAL_SETTINGS

TASKS_DIR = Path(__file__).parent

GENERATE = "generate"  # lm-eval, greedy decoding with the model's chat template, few-shot as chat turns
CHOICE = "choice"  # lm-eval multiple choice by log-likelihood; the chosen answers feed answer flips
WINDOWS = "windows"  # qrecover's own held-out windows: perplexity, and KL against the reference on the same windows
JUDGE = "judge"  # answers judged by an OpenAI-compatible model (runs only with a judge URL)

Scorer = Callable[[dict[str, Any], str, dict[str, Any]], dict[str, Metric]]


@dataclass(frozen=True)
class Task:
    """One built-in task.

    ``yaml``/``lm_eval_task``: the file in :data:`TASKS_DIR` and the task name it defines (None: qrecover scores
    it itself); ``data``: its key in :data:`qrecover.benchdata.DATA` (checked before any model loads);
    ``metrics``: the metric names it adds, in order; ``score``: for generative tasks, ``(lm-eval results,
    lm_eval_task, settings shared by the run) -> metrics``.
    """

    name: str
    kind: str
    metrics: tuple[str, ...]
    yaml: str | None = None
    lm_eval_task: str | None = None
    data: str | None = None
    max_gen_toks: int | None = None  # lm-eval's generation length (gsm8k_cot: the generate_until default)
    score: Scorer | None = None


def stderr_or_none(x: Any) -> float | None:
    """lm-eval's stderr value as a float, None where it has none (``"N/A"``, NaN)."""
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def binomial_stderr(values: list[bool]) -> float | None:
    """lm-eval's stderr of a mean of 0/1 scores: ``sqrt(p (1 - p) / (n - 1))``."""
    n = len(values)
    if n < 2:
        return None
    p = sum(values) / n
    return math.sqrt(p * (1 - p) / (n - 1))


def score_gsm8k(res: dict[str, Any], task: str, settings: dict[str, Any]) -> dict[str, Metric]:
    """``gsm8k`` (lm-eval's ``flexible-extract``: the last number) and ``gsm8k_strict`` (``strict-match``)."""
    r, c = res["results"][task], res["configs"][task]
    s = {**settings, "until": list(c["generation_kwargs"]["until"]), "data_sha256": DATA["gsm8k"].sha256}
    out: dict[str, Metric] = {}
    for metric, filt in (("gsm8k", "flexible-extract"), ("gsm8k_strict", "strict-match")):
        out[metric] = Metric(value=float(r[f"exact_match,{filt}"]), stderr=stderr_or_none(r.get(f"exact_match_stderr,{filt}")),
                             higher_is_better=True, settings={**s, "metric": f"exact_match,{filt}"})
    return out


def score_ifeval(res: dict[str, Any], task: str, settings: dict[str, Any]) -> dict[str, Metric]:
    """IFEval's four accuracies (instruction/prompt level, strict/loose)."""
    r, samples = res["results"][task], res["samples"][task]
    s = {**settings, "data_sha256": DATA["ifeval"].sha256, **IFEVAL_SETTINGS}
    out: dict[str, Metric] = {}
    for metric, key in (("ifeval", "inst_level_strict_acc"), ("ifeval_prompt_strict", "prompt_level_strict_acc"),
                        ("ifeval_inst_loose", "inst_level_loose_acc"), ("ifeval_prompt_loose", "prompt_level_loose_acc")):
        if key.startswith("inst"):  # lm-eval has no stderr for its custom instruction-level aggregation
            se = binomial_stderr([bool(v) for smp in samples for v in smp[key]])
        else:
            se = stderr_or_none(r.get(f"{key}_stderr,none"))
        out[metric] = Metric(value=float(r[f"{key},none"]), stderr=se, higher_is_better=True, settings={**s, "metric": key})
    return out


TASKS: dict[str, Task] = {t.name: t for t in (
    Task("gsm8k", GENERATE, ("gsm8k", "gsm8k_strict"), "gsm8k_cot.yaml", "qrecover_gsm8k_cot", "gsm8k", 256, score_gsm8k),
    Task("ifeval", GENERATE, ("ifeval", "ifeval_prompt_strict", "ifeval_inst_loose", "ifeval_prompt_loose"),
         "ifeval.yaml", "qrecover_ifeval", "ifeval", 1280, score_ifeval),
    Task("mmlu", CHOICE, ("mmlu",), "mmlu.yaml", "qrecover_mmlu", "mmlu"),
    Task("ppl", WINDOWS, ("ppl",)),
    Task("kl", WINDOWS, ("kl",)),  # and mmlu_flips when mmlu runs too
    Task("alpacaeval", JUDGE, ("alpacaeval",)),
)}
JUDGE_TASK = "alpacaeval"
BUILTIN_TASKS = tuple(n for n, t in TASKS.items() if t.kind != JUDGE)  # the default set
MAX_GEN_TOKS = {n: t.max_gen_toks for n, t in TASKS.items() if t.max_gen_toks is not None}


def of_kind(names: list[str], kind: str) -> list[str]:
    """The tasks among ``names`` of ``kind``, in table order."""
    return [n for n, t in TASKS.items() if t.kind == kind and n in names]

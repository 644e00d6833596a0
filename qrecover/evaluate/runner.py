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
  a limit, questions are taken round-robin over subjects (see :data:`.config.MMLU_SELECTION`).
* ``ppl``: :func:`qrecover.evaluate.perplexity.perplexity` (held-out text, lower is better).
* ``kl``: agreement with the unquantized model: ``kl`` (mean token KL(reference || evaluated) on the
  perplexity windows) and, when ``mmlu`` runs too, ``mmlu_flips`` (fraction of MMLU answers that differ
  from the reference's). Both are 0 by definition for the unquantized model itself.
* ``alpacaeval``: scored by :func:`qrecover.evaluate.judge.evaluate_alpaca` against an OpenAI-compatible
  judge; runs only with a ``judge_url``.
* any other name: an lm-eval task (needs its dataset, usually from the Hugging Face hub).

Generative tasks decode greedily with the model's own chat template (few-shot exemplars as chat turns);
everything that defines a score (few-shot count, limit, chat template hash, generation length, data hash,
batch size, seeds, ...) is in that metric's ``settings``, so ``qrecover report`` refuses to compare scores
measured differently. Nothing touches the network: the Hugging Face hub and datasets libraries are put in
offline mode before lm-eval loads.
"""


from __future__ import annotations

import platform
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from rich.console import Console

from .._version import __version__
from ..benchdata import data_file
from ..checkpoint import MANIFEST
from ..errors import QRecoverError
from ..evaluate.perplexity import perplexity
from ..io_utils import atomic_file, sha256_file
from ..loading import load_any
from ..models import DEFAULT_MODEL, resolve, weights_sha256
from ..reports.results import Adapter, MeasuredBpw, Metric, Results, RunInfo
from .agreement import KLProbe, answer_flips, load_answers, store_answers
from .config import SEED, EvalConfig
from .harness import _hflm, check_tasks, extra_tasks, generative_tasks, mmlu_settings, mmlu_task
from .judge import evaluate_alpaca
from .offline import offline, rng_restored
from .tasks import CHOICE, GENERATE, TASKS, WINDOWS, of_kind

__all__ = ["SEED", "EvalConfig", "evaluate", "run_info", "save_results"]

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


# --- the entry point ------------------------------------------------------------------------------------


def evaluate(config: EvalConfig | None = None, show_progress: bool = True, **overrides: Any) -> Results:
    """Evaluate one model (see the module docstring); return its :class:`Results` (not saved).

    Leaves the process as found, also when it raises: the offline environment and library flags
    (:func:`offline`), lm-eval's IFEval globals (:func:`ifeval_patched`), the model's ``tie_weights`` and
    lm-eval's log level (:func:`_hflm`) and the global random states (:func:`rng_restored`; model loading and
    lm-eval's seeding change them) are restored.
    """
    cfg = config or EvalConfig(**overrides)
    cfg.validate()  # also a config changed after it was made
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
        if TASKS[name].data is not None:
            data_file(TASKS[name].data)

    show(f"loading {cfg.model or 'the default model'}" + (f" with adapter {cfg.adapter}" if cfg.adapter else ""))
    model, tok, info = load_any(cfg.model, cache=True, **({"adapter": cfg.adapter} if cfg.adapter else {}))
    manifest = getattr(model, "qrecover_manifest", None)
    run = run_info(cfg, info, manifest)
    metrics: dict[str, Metric] = {}
    gen, choice, windows = of_kind(builtin, GENERATE), of_kind(builtin, CHOICE), of_kind(builtin, WINDOWS)
    lm = _hflm(model, tok, cfg.batch_size) if gen or choice or other else None

    if gen:
        metrics.update(generative_tasks(lm, tok, cfg, gen, show))
    answers = None
    if choice:  # MMLU, the one multiple-choice task: its answers feed mmlu_flips
        metrics["mmlu"], answers = mmlu_task(lm, cfg, show)

    ref = find_reference(cfg, model, info) if "kl" in builtin else None
    reference = None  # (model, tokenizer) of the reference, once loaded
    if windows:
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
        model=info["path"], kind="recovered" if adapter else "tuned" if manifest.get("tuning") else "quantized",
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

"""``qrecover eval``: benchmark scores of one model, offline, as a results file for ``qrecover report``."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import QRecoverError
from ..evaluate.config import EvalConfig, parse_tasks
from .common import JsonOpt, console, emit_json

EXAMPLES = """Examples:

  qrecover eval --out results/original.json        # the unquantized default model

  qrecover eval out/smollm2-135m-instruct-3.7bpw --limit 50 --out results/3.7bpw.json

  qrecover eval out/smollm2-135m-instruct-3.7bpw --adapter out/lora-r16 --limit 50 --out results/3.7bpw-r16.json

  qrecover eval ./my-llama-q --tasks ppl,kl --reference ./my-llama --json | jq .metrics.kl.value

Tasks: gsm8k (lm-eval gsm8k_cot: 8-shot chain of thought; also gsm8k_strict), ifeval (four metrics),
mmlu (zero-shot A/B/C/D), ppl (held-out perplexity), kl (KL to the unquantized model, and mmlu_flips
when mmlu runs too), alpacaeval (only with --judge-url).

Any other name goes to lm-eval as a task name. Evaluation runs with the Hugging Face hub offline, so
such a task works only where its dataset is already in the local datasets cache.

Runs compare (`qrecover report`) only under the same --limit, --batch-size, --max-gen-toks,
--data, --windows and --seq-len.
"""


def eval_(
    model: Optional[str] = typer.Argument(None, help="Checkpoint directory, HF model directory or .gguf (default: the built-in model)."),
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="Recovery adapter directory (PEFT layout) for the checkpoint: the run is kind "
                                                                   "'recovered'."),
    tasks: str = typer.Option("gsm8k,ifeval,mmlu,ppl,kl", "--tasks", help="Comma-separated: gsm8k, ifeval, mmlu, ppl, kl, alpacaeval, or lm-eval "
                                                                          "task names (those need their dataset locally; no hub access)."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Score the first N items of each benchmark (MMLU: N questions round-robin over "
                                                              "subjects). Default: all."),
    batch_size: int = typer.Option(4, "--batch-size", help="lm-eval batch size (recorded: batched greedy generation can differ slightly)."),
    max_gen_toks: Optional[int] = typer.Option(None, "--max-gen-toks", help="Generation length for gsm8k and ifeval (default: lm-eval's, 256 and "
                                                                            "1280)."),
    data: str = typer.Option("python-docs", "--data", help="ppl/kl text source; its held-out 'eval' split is scored."),
    windows: int = typer.Option(32, "--windows", help="ppl/kl: number of non-overlapping windows."),
    seq_len: int = typer.Option(512, "--seq-len", help="ppl/kl: tokens per window."),
    reference: Optional[str] = typer.Option(None, "--reference", help="Unquantized model for kl and mmlu_flips (default: the checkpoint's source "
                                                                      "from its qrecover.json)."),
    judge_url: Optional[str] = typer.Option(None, "--judge-url", help="OpenAI-compatible endpoint of the alpacaeval judge; alpacaeval runs only with "
                                                                      "it."),
    judge_model: Optional[str] = typer.Option(None, "--judge-model", help="Judge model name at --judge-url."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Write the results file (schema v1) here, atomically."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --out if it exists."),
    json_out: bool = JsonOpt,
) -> None:
    """Evaluate a model offline with lm-eval: GSM8K, IFEval, MMLU, perplexity and agreement with the unquantized model."""
    from ..evaluate.runner import evaluate, save_results  # lazy: pulls torch, transformers, peft

    if out is not None and out.exists() and not overwrite:  # before minutes of evaluation
        raise QRecoverError(f"results file {str(out)!r} already exists; pass --overwrite to replace it")
    names = parse_tasks(tasks)
    if judge_url and "alpacaeval" not in names:
        names.append("alpacaeval")
    cfg = EvalConfig(model=model, adapter=str(adapter) if adapter else None, tasks=names, limit=limit,
                     batch_size=batch_size, max_gen_toks=max_gen_toks, ppl_data=data, windows=windows,
                     seq_len=seq_len, reference=reference, judge_url=judge_url, judge_model=judge_model)
    results = evaluate(cfg, show_progress=not json_out)
    if out is not None:
        save_results(results, out, overwrite=overwrite)
    if json_out:
        emit_json(results.to_dict())
        return
    from rich.markup import escape
    from rich.table import Table

    r = results.run
    t = Table(title=escape(f"{r.model} ({r.kind}" + (f", {r.measured_bpw.model:.2f} bpw" if r.measured_bpw else "") + ")"))
    for h in ("metric", "value", "± stderr", "better", "n"):
        t.add_column(h, justify="left" if h == "metric" else "right")
    for name, m in results.metrics.items():
        t.add_row(escape(name), f"{m.value:.4f}", "—" if m.stderr is None else f"{m.stderr:.4f}",
                  "higher" if m.higher_is_better else "lower", str(m.settings.get("n", m.settings.get("windows", ""))))
    console.print(t)
    if out is not None:
        console.print(escape(f"wrote {out}"), highlight=False)

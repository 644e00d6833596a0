"""``qrecover finetune``: a feature team's adapter, starting from the recovery adapter."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import QRecoverError
from ..recovery.config import FinetuneConfig
from .common import JsonOpt, console, emit_json
from .config_options import config_command

EXAMPLES = """Examples:

  qrecover finetune out/ckpt-3.7bpw --init-adapter out/ckpt-3.7bpw-lora-r16 --data summaries.jsonl --out out/summarize

  qrecover finetune CKPT --init-adapter RECOVERY_DIR --data 'notes/*.txt' --tokens 200000 --out out/notes --json

--data: a jsonl of {"text": ...} or {"messages": [{"role": ..., "content": ...}, ...]} rows (loss on the
assistant turns only), a text file, a directory or a glob of text files.
"""


# the training options are FinetuneConfig fields (qrecover.cli.config_options): their defaults and help texts
@config_command(FinetuneConfig, only=("tokens", "lr", "seq_len", "batch_size", "grad_accum", "checkpoint_every", "precision",
                                     "seed"))
def finetune(
    checkpoint: Path = typer.Argument(..., help="The compressed checkpoint the recovery adapter was trained on."),
    init_adapter: Path = typer.Option(..., "--init-adapter", help="The recovery adapter to start from (its weights are step 0)."),
    data: str = typer.Option(..., "--data", help="The feature's training data: jsonl (text or chat messages), text file, directory or glob."),
    out: Path = typer.Option(..., "--out", "-o", help="The feature adapter directory."),
    config: dict | None = None,
    allow_foreign_adapter: bool = typer.Option(False, "--allow-foreign-adapter", help="Accept an init adapter trained on another checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Train again from scratch if OUT exists."),
    resume: bool = typer.Option(False, "--resume", help="Continue OUT's last checkpoint."),
    json_out: bool = JsonOpt,
) -> None:
    """Train a feature adapter initialised from a recovery adapter, the quantized base frozen (cross-entropy)."""
    if overwrite and resume:
        raise QRecoverError("--overwrite and --resume contradict each other; pick one")
    cfg = FinetuneConfig(**config)
    from ..recovery.api import finetune as run  # lazy: torch, transformers, peft take seconds to import

    meta = run(checkpoint, init_adapter, data, out, cfg, overwrite=overwrite, resume=resume,
               show_progress=not json_out, allow_foreign_adapter=allow_foreign_adapter)
    if not meta:  # a non-main process of a distributed run (torchrun): the main process reports
        return
    summary = {"out": str(out), "rank": meta["rank"], "bytes": meta["bytes"]["tensors"], "bpw_cost": meta["bpw_cost"],
               "tokens": meta["training"]["tokens"], "final_loss": meta["training"]["final_loss"]}
    if json_out:
        emit_json(summary)
        return
    from rich.markup import escape

    console.print(f"[bold]{escape(str(out))}[/]: feature adapter (rank {summary['rank']}) from {escape(str(init_adapter))}, "
                  f"{summary['tokens']:,} tokens, final loss {summary['final_loss']:.4f}")

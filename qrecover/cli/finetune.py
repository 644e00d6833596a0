"""``qrecover finetune``: a feature team's adapter, starting from the recovery adapter."""

from __future__ import annotations

from pathlib import Path

import typer

from ..errors import QRecoverError
from ..recovery.config import RecoverConfig
from .common import JsonOpt, console, emit_json

EXAMPLES = """Examples:

  qrecover finetune out/ckpt-3.7bpw --init-adapter out/ckpt-3.7bpw-lora-r16 --data summaries.jsonl --out out/summarize

  qrecover finetune CKPT --init-adapter RECOVERY_DIR --data 'notes/*.txt' --tokens 200000 --out out/notes --json

--data: a jsonl of {"text": ...} or {"messages": [{"role": ..., "content": ...}, ...]} rows (loss on the
assistant turns only), a text file, a directory or a glob of text files.
"""


def finetune(
    checkpoint: Path = typer.Argument(..., help="The compressed checkpoint the recovery adapter was trained on."),
    init_adapter: Path = typer.Option(..., "--init-adapter", help="The recovery adapter to start from (its weights are step 0)."),
    data: str = typer.Option(..., "--data", help="The feature's training data: jsonl (text or chat messages), text file, directory or glob."),
    out: Path = typer.Option(..., "--out", "-o", help="The feature adapter directory."),
    tokens: int = typer.Option(65536, "--tokens", "-t", help="Training tokens."),
    lr: float = typer.Option(2e-4, "--lr", help="Peak learning rate (lower than recovery: the start is already good)."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per packed training sequence."),
    batch_size: int = typer.Option(4, "--batch-size", help="Sequences per micro-batch."),
    grad_accum: int = typer.Option(1, "--grad-accum", help="Micro-batches per optimizer step."),
    checkpoint_every: int = typer.Option(50, "--checkpoint-every", help="Optimizer steps between resumable checkpoints."),
    precision: str = typer.Option(RecoverConfig.default("precision"), "--precision", help="'auto' (bf16 autocast where the device computes it "
                                                                                          "natively), 'bf16' or 'fp32'."),
    seed: int = typer.Option(0, "--seed", help="Data-order seed."),
    allow_foreign_adapter: bool = typer.Option(False, "--allow-foreign-adapter", help="Accept an init adapter trained on another checkpoint."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Train again from scratch if OUT exists."),
    resume: bool = typer.Option(False, "--resume", help="Continue OUT's last checkpoint."),
    json_out: bool = JsonOpt,
) -> None:
    """Train a feature adapter initialised from a recovery adapter, the quantized base frozen (cross-entropy)."""
    if overwrite and resume:
        raise QRecoverError("--overwrite and --resume contradict each other; pick one")
    cfg = RecoverConfig(objective="ce", tokens=tokens, lr=lr, seq_len=seq_len, batch_size=batch_size,
                        grad_accum=grad_accum, checkpoint_every=checkpoint_every, seed=seed, decontaminate=False,
                        precision=precision)
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

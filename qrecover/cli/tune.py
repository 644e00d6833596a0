"""``qrecover tune``: train a checkpoint's tables, scales, norms and embedding end to end through its frozen codes."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..recovery.config import TuneConfig
from .common import JsonOpt, console, emit_json, training_data

D = TuneConfig.default

EXAMPLES = """Examples:

  qrecover tune out/smollm2-135m-instruct-3.5bpw --out out/3.5bpw-tuned          # tables, scales, norms, embedding

  qrecover tune CKPT --out out/tuned --params tables,scales --tokens 32768        # only the layers' tables and scales

  qrecover tune CKPT --out out/tuned --data data/my-mix                           # shards from `qrecover data prepare`

  qrecover tune CKPT --out out/tuned --resume                                     # continue an interrupted run

  accelerate launch -m qrecover.cli tune CKPT --out out/tuned --tokens 10000000   # data parallel on several GPUs

  qrecover recover out/tuned --out out/tuned-lora                                 # adapters on the tuned checkpoint

The tuned checkpoint has the source's exact byte count (codes frozen, tables/scales/norms rounded to fp16 on save);
`qrecover info OUT` shows what was tuned, on which data, and what the fp16 rounding cost.
"""


def tune(
    checkpoint: Path = typer.Argument(..., help="A compressed checkpoint directory (the output of `qrecover compress`)."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory of the tuned checkpoint (a new checkpoint of the same format)."),
    params: str = typer.Option(D("params"), "--params", help="What trains: a comma-separated subset of tables, scales, norms, "
                               "embedding."),
    mix: Optional[Path] = typer.Option(None, "--mix", help="Data-mix recipe (TOML); default: the shipped recovery mix."),
    data: Optional[Path] = typer.Option(None, "--data", help="A directory made by `qrecover data prepare` (same as --mix DIR)."),
    tokens: int = typer.Option(D("tokens"), "--tokens", "-t", help="Training tokens."),
    objective: str = typer.Option(D("objective"), "--objective", help="'kd' (distil from the unquantized model), 'ce' or 'mix'."),
    lr: float = typer.Option(D("lr"), "--lr", help="Peak learning rate of the fp32 masters (AdamW); 0 changes nothing."),
    schedule: str = typer.Option(D("schedule"), "--schedule", help="'cosine' or 'wsd' after the warm-up."),
    seq_len: int = typer.Option(D("seq_len"), "--seq-len", help="Tokens per packed training sequence."),
    batch_size: int = typer.Option(D("batch_size"), "--batch-size", help="Sequences per micro-batch (per process)."),
    grad_accum: int = typer.Option(D("grad_accum"), "--grad-accum", help="Micro-batches per optimizer step."),
    checkpoint_every: int = typer.Option(D("checkpoint_every"), "--checkpoint-every", help="Optimizer steps between resumable "
                                         "checkpoints (0: only at the end)."),
    gradient_checkpointing: bool = typer.Option(False, "--gradient-checkpointing", help="Recompute activations in backward."),
    precision: str = typer.Option(D("precision"), "--precision", help="'auto', 'bf16' or 'fp32'."),
    no_decontaminate: bool = typer.Option(False, "--no-decontaminate", help="Keep training documents that overlap the "
                                          "evaluation sets."),
    loss_chunk: int = typer.Option(D("loss_chunk"), "--loss-chunk", help="Positions per chunk of the loss; 0 = unchunked."),
    teacher_device: Optional[str] = typer.Option(None, "--teacher-device", help="Device of the distillation teacher, e.g. cuda:1."),
    rounding_windows: int = typer.Option(D("rounding_windows"), "--rounding-windows", help="Held-out windows scored before and "
                                         "after rounding the masters to fp16 (0: not measured)."),
    seed: int = typer.Option(0, "--seed", help="Seed for the data order."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Tune again from scratch if OUT exists."),
    resume: bool = typer.Option(False, "--resume", help="Continue OUT's last checkpoint (a finished one is left as it is)."),
    keep_checkpoints: bool = typer.Option(False, "--keep-checkpoints", help="Keep OUT/checkpoints after training."),
    json_out: bool = JsonOpt,
) -> None:
    """Train a checkpoint's continuous quantization parameters with distillation, codes frozen: zero extra bytes."""
    from ..recovery.tune import tune as run  # lazy: torch, transformers, peft take seconds to import

    mix = training_data(mix, data, overwrite, resume)
    cfg = TuneConfig(params=params, tokens=tokens, mix=None if mix is None else str(mix), objective=objective, lr=lr,
                     schedule=schedule, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum,
                     checkpoint_every=checkpoint_every, gradient_checkpointing=gradient_checkpointing, precision=precision,
                     decontaminate=not no_decontaminate, loss_chunk=loss_chunk, teacher_device=teacher_device,
                     rounding_windows=rounding_windows, seed=seed)
    manifest = run(checkpoint, out, cfg, overwrite=overwrite, resume=resume, show_progress=not json_out,
                   keep_checkpoints=keep_checkpoints)
    if not manifest:  # a non-main process of a distributed run: the main one reports
        return
    t = manifest["tuning"]
    if json_out:
        emit_json({"out": str(out), **{k: v for k, v in t.items() if k not in ("config", "tensors", "previous")}})
        return
    from rich.markup import escape

    r = t["rounding"]
    console.print(f"[bold]{escape(str(out))}[/]: tuned {', '.join(t['params'])} ({t['trainable_values']:,} values in "
                  f"{t['layers']} packed layers and {t['norms']} norms) on {t['tokens']:,} tokens in "
                  f"{t['training']['seconds']:.0f} s, final loss {t['training']['final_loss']:.4f}; "
                  f"{manifest['bytes']['file']:,} bytes as the source"
                  + ("" if r is None else f"; fp16 rounding: ppl {r['ppl_fp32_masters']:.4f} -> {r['ppl_rounded']:.4f}"))

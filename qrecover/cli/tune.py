"""``qrecover tune``: train a checkpoint's tables, scales, norms and embedding end to end through its frozen codes."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..recovery.config import TuneConfig
from .common import JsonOpt, console, emit_json, training_data
from .config_options import config_command

EXAMPLES = """Examples:

  qrecover tune out/smollm2-135m-instruct-3.5bpw --out out/3.5bpw-tuned          # tables, scales, norms, embedding

  qrecover tune CKPT --out out/tuned --params tables,scales --tokens 32768        # only the layers' tables and scales

  qrecover tune CKPT --out out/tuned --data data/my-mix                           # shards from `qrecover data prepare`

  qrecover tune CKPT --out out/tuned --resume                                     # continue an interrupted run

  qrecover tune CKPT --out out/tuned --block-tokens 32768                         # block-wise reconstruction first

  qrecover tune CKPT --out out/tuned --params tables,scales,norms,embedding,codes  # the codes too (straight through)

  accelerate launch -m qrecover.cli tune CKPT --out out/tuned --tokens 10000000   # data parallel on several GPUs

  qrecover recover out/tuned --out out/tuned-lora                                 # adapters on the tuned checkpoint

The tuned checkpoint has the source's exact byte count (codes frozen unless --params has codes, tables/scales/norms
rounded to fp16 on save);
`qrecover info OUT` shows what was tuned, on which data, and what the fp16 rounding cost.
"""


# the training options are TuneConfig fields (qrecover.cli.config_options): their defaults and help texts
@config_command(TuneConfig, only=("params", "tokens", "objective", "lr", "schedule", "seq_len", "batch_size", "grad_accum",
                                  "checkpoint_every", "gradient_checkpointing", "precision", "decontaminate", "loss_chunk",
                                  "teacher_device", "hidden_weight", "codes_lr", "rounding_windows", "block_tokens", "block_epochs",
                                  "block_lr", "seed"))
def tune(
    checkpoint: Path = typer.Argument(..., help="A compressed checkpoint directory (the output of `qrecover compress`)."),
    out: Path = typer.Option(..., "--out", "-o", help="Directory of the tuned checkpoint (a new checkpoint of the same format)."),
    mix: Optional[Path] = typer.Option(None, "--mix", help="Data-mix recipe (TOML); default: the shipped recovery mix."),
    data: Optional[Path] = typer.Option(None, "--data", help="A directory made by `qrecover data prepare` (same as --mix DIR)."),
    config: dict | None = None,
    overwrite: bool = typer.Option(False, "--overwrite", help="Tune again from scratch if OUT exists."),
    resume: bool = typer.Option(False, "--resume", help="Continue OUT's last checkpoint (a finished one is left as it is)."),
    keep_checkpoints: bool = typer.Option(False, "--keep-checkpoints", help="Keep OUT/checkpoints after training."),
    json_out: bool = JsonOpt,
) -> None:
    """Train a checkpoint's continuous quantization parameters with distillation (codes frozen unless --params has codes): zero extra bytes."""
    from ..recovery.tune import tune as run  # lazy: torch, transformers, peft take seconds to import

    mix = training_data(mix, data, overwrite, resume)
    cfg = TuneConfig(**config, mix=None if mix is None else str(mix))
    manifest = run(checkpoint, out, cfg, overwrite=overwrite, resume=resume, show_progress=not json_out,
                   keep_checkpoints=keep_checkpoints)
    if not manifest:  # a non-main process of a distributed run: the main one reports
        return
    t = manifest["tuning"]
    if json_out:
        emit_json({"out": str(out), **{k: v for k, v in t.items() if k not in ("config", "tensors", "previous")}})
        return
    from rich.markup import escape

    r, b, loss = t["rounding"], t.get("blocks"), t["training"]["final_loss"]
    console.print(f"[bold]{escape(str(out))}[/]: tuned {', '.join(t['params'])} ({t['trainable_values']:,} values in "
                  f"{t['layers']} packed layers and {t['norms']} norms)"
                  + ("" if not b else f"; block-wise on {b['tokens']:,} tokens x {b['epochs']} epochs in {b['seconds']:.0f} s, "
                     f"mean block output error {b['mean_error_before']:.4f} -> {b['mean_error_after']:.4f}")
                  + ("" if not t["tokens"] else f"; end to end on {t['tokens']:,} tokens in {t['training']['seconds']:.0f} s, "
                     f"final loss {loss:.4f}") + f"; {manifest['bytes']['file']:,} bytes as the source"
                  + ("" if r is None else f"; fp16 rounding: ppl {r['ppl_fp32_masters']:.4f} -> {r['ppl_rounded']:.4f}"))

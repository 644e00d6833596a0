"""``qrecover recover``: train LoRA recovery adapters on a frozen compressed checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import QRecoverError
from ..recovery.config import RecoverConfig
from .common import JsonOpt, console, emit_json, parse_ints, training_data
from .config_options import config_command

EXAMPLES = """Examples:

  qrecover recover out/smollm2-135m-instruct-3.7bpw                      # rank 16, shipped mix, distillation

  qrecover recover CKPT --ranks 8,16,32 --tokens 131072 --out out/lora   # AFM's suite: out/lora/rank-8, ...

  qrecover recover CKPT --objective ce --mix my-mix.toml --out out/lora-ce

  qrecover recover CKPT --data data/my-mix --tokens 100000000           # shards from `qrecover data prepare`

  qrecover recover CKPT --out out/lora-r16 --resume                      # continue an interrupted run

  accelerate launch -m qrecover.cli recover CKPT --tokens 10000000       # data parallel on several GPUs

  torchrun --nproc_per_node 8 -m qrecover.cli recover CKPT --shard-base --gradient-checkpointing   # base sharded

The adapter directory is standard PEFT: PeftModel.from_pretrained(qrecover.load(CKPT), OUT).
"""


@config_command(RecoverConfig)
def recover(
    checkpoint: Path = typer.Argument(..., help="A compressed checkpoint directory (the output of `qrecover compress`)."),
    ranks: Optional[str] = typer.Option(None, "--ranks", help="Several ranks in one command, e.g. 8,16,32: one adapter each, in OUT/rank-R."),
    mix: Optional[Path] = typer.Option(None, "--mix", help="Data-mix recipe (TOML); default: the shipped mix (qrecover/recipes/default-mix.toml)."),
    data: Optional[Path] = typer.Option(None, "--data", help="A directory made by `qrecover data prepare` (tokenized shards; same as --mix DIR)."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Adapter directory (default: CHECKPOINT-lora-rR; with --ranks the parent of "
                                                                 "rank-R)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Train again from scratch if OUT exists."),
    resume: bool = typer.Option(False, "--resume", help="Continue OUT's last checkpoint (a finished adapter is left as it is)."),
    keep_checkpoints: bool = typer.Option(False, "--keep-checkpoints", help="Keep OUT/checkpoints after training."),
    json_out: bool = JsonOpt,
    config: dict | None = None,
) -> None:
    """Train LoRA recovery adapters on the frozen quantized model (AFM section 5): PEFT adapters in 16 bits.

    Every RecoverConfig field is an option (:mod:`qrecover.cli.config_options`), with the field's own help text."""
    mix = training_data(mix, data, overwrite, resume)
    rank = config["rank"]
    rank_list = parse_ints(ranks, "--ranks") if ranks else [rank]
    if not rank_list:
        raise QRecoverError("--ranks must name at least one rank, e.g. --ranks 8,16,32")
    configs = [RecoverConfig(**{**config, "rank": r, "mix": None if mix is None else str(mix)}) for r in rank_list]
    # the options are valid: now the heavy modules (torch, transformers, peft; seconds to import)
    from ..recovery.api import read_mix_or_data  # lazy (both): torch, transformers, peft take seconds to import
    from ..recovery.api import recover as run  # lazy: pulls torch, transformers, peft

    read_mix_or_data(mix)  # the whole mix (TOML, keys, values, the files it names) before any model loads
    base = out or Path(f"{str(checkpoint).rstrip('/')}-lora" + ("" if ranks else f"-r{rank}"))
    results = []
    for cfg in configs:
        target = base / f"rank-{cfg.rank}" if ranks else base
        meta = run(checkpoint, target, cfg, overwrite=overwrite, resume=resume, show_progress=not json_out,
                   keep_checkpoints=keep_checkpoints)
        if not meta:  # a non-main process of a distributed run
            continue
        results.append({"out": str(target), "rank": meta["rank"],
                        "init_output_error_removed": meta["init"].get("output_error_removed"), "bytes": meta["bytes"]["tensors"],
                        "bpw_cost": meta["bpw_cost"], "tokens": meta["training"]["tokens"],
                        "final_loss": meta["training"]["final_loss"], "tok_per_s": meta["training"]["tok_per_s"],
                        "seconds": meta["training"]["seconds"]})
    if not results:  # a non-main process of a distributed run: the main one reports
        return
    if json_out:
        emit_json(results if ranks else results[0])
        return
    from rich.markup import escape

    for r in results:
        console.print(f"[bold]{escape(r['out'])}[/]: rank {r['rank']}, {r['bytes'] / 1e6:.2f} MB in 16 bits "
                      f"(+{r['bpw_cost']:.3f} bpw over the base model), "
                      + (f"init removed {100 * r['init_output_error_removed']:.0f}% of the layers' output error, "
                         if r["init_output_error_removed"] is not None else "")
                      + f"{r['tokens']:,} tokens in {r['seconds']:.0f} s "
                      f"({r['tok_per_s']:.0f} tok/s), final loss {r['final_loss']:.4f}")

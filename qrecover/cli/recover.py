"""``qrecover recover``: train LoRA recovery adapters on a frozen compressed checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..errors import QRecoverError
from ..recovery.config import RecoverConfig
from .common import JsonOpt, console, emit_json, parse_ints, training_data

D = RecoverConfig.default

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


def recover(
    checkpoint: Path = typer.Argument(..., help="A compressed checkpoint directory (the output of `qrecover compress`)."),
    rank: int = typer.Option(D("rank"), "--rank", "-r", help="LoRA rank."),
    ranks: Optional[str] = typer.Option(None, "--ranks", help="Several ranks in one command, e.g. 8,16,32: one adapter each, in OUT/rank-R."),
    mix: Optional[Path] = typer.Option(None, "--mix", help="Data-mix recipe (TOML); default: the shipped mix (qrecover/recipes/default-mix.toml)."),
    data: Optional[Path] = typer.Option(None, "--data", help="A directory made by `qrecover data prepare` (tokenized shards; same as --mix DIR)."),
    tokens: int = typer.Option(D("tokens"), "--tokens", "-t", help="Training tokens per adapter."),
    objective: str = typer.Option(D("objective"), "--objective", help="'kd' (distil from the unquantized model), 'ce' (next-token loss on the data) "
                                                                      "or 'mix'."),
    kd_weight: float = typer.Option(D("kd_weight"), "--kd-weight", help="With --objective mix: weight of the distillation term."),
    init: str = typer.Option(D("init"), "--init", help="'svd': adapters start as the rank-r approximation of each layer's quantization error "
                                                       "(weighted by calibration inputs; needs the unquantized model); 'zero': PEFT's default B = "
                                                       "0."),
    lr: float = typer.Option(D("lr"), "--lr", help="Peak learning rate (AdamW, warm-up then cosine)."),
    seq_len: int = typer.Option(D("seq_len"), "--seq-len", help="Tokens per packed training sequence."),
    batch_size: int = typer.Option(D("batch_size"), "--batch-size", help="Sequences per micro-batch (per process)."),
    grad_accum: int = typer.Option(D("grad_accum"), "--grad-accum", help="Micro-batches per optimizer step."),
    targets: str = typer.Option("all", "--targets", help="'all' quantized projections, or 'top:N' = the N most damaged layers (a smaller adapter)."),
    rank_allocation: str = typer.Option(D("rank_allocation"), "--rank-allocation", help="'uniform' (--rank on every layer) or "
                                        "'damage' (the same adapter size, ranks per layer by quantization damage and error "
                                        "spectrum; needs the unquantized model)."),
    checkpoint_every: int = typer.Option(D("checkpoint_every"), "--checkpoint-every", help="Optimizer steps between resumable checkpoints (0: only "
                                                                                           "at the end)."),
    gradient_checkpointing: bool = typer.Option(False, "--gradient-checkpointing", help="Recompute activations in backward: less memory, slower."),
    precision: str = typer.Option(D("precision"), "--precision", help="'auto' (bf16 autocast where the device computes bf16 natively: CUDA, CPUs "
                                                                      "with AVX512-BF16/AMX; else fp32), 'bf16' or 'fp32'."),
    no_cache: bool = typer.Option(False, "--no-cache-dequantized", help="Dequantize base weights on every forward instead of keeping them in "
                                                                        "memory."),
    shard_base: bool = typer.Option(False, "--shard-base", help="On several processes (torchrun, or accelerate launch without "
                                    "--use_fsdp): shard the frozen packed base across them (torch FSDP2, each decoder layer "
                                    "gathered as it runs) instead of a whole copy per process. For a base that does not fit one "
                                    "device beside training; add --gradient-checkpointing, else backward keeps every layer's "
                                    "dequantized weight. Implies --no-cache-dequantized; nothing on one process."),
    no_decontaminate: bool = typer.Option(False, "--no-decontaminate", help="Keep training documents that overlap the evaluation sets."),
    loss_chunk: int = typer.Option(D("loss_chunk"), "--loss-chunk", help="Positions per chunk of the loss (vocabulary-sized logits one chunk "
                                                                         "at a time); 0 = unchunked."),
    teacher_device: Optional[str] = typer.Option(D("teacher_device"), "--teacher-device", help="Device of the distillation teacher, e.g. "
                                                                                               "cuda:1 (default: the training device)."),
    log_every: int = typer.Option(D("log_every"), "--log-every", help="Optimizer steps between reads of the loss from the device "
                                  "(the steps between never wait for it)."),
    compile_layers: bool = typer.Option(False, "--compile-layers", help="torch.compile each decoder layer (for GPUs; the first "
                                        "steps compile)."),
    seed: int = typer.Option(0, "--seed", help="Seed for the adapter initialisation and data order."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Adapter directory (default: CHECKPOINT-lora-rR; with --ranks the parent of "
                                                                 "rank-R)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Train again from scratch if OUT exists."),
    resume: bool = typer.Option(False, "--resume", help="Continue OUT's last checkpoint (a finished adapter is left as it is)."),
    keep_checkpoints: bool = typer.Option(False, "--keep-checkpoints", help="Keep OUT/checkpoints after training."),
    head_rank: int = typer.Option(D("head_rank"), "--head-rank", help="Rank of a LoRA on the tied output head (logits only; "
                                  "0 = none). Rank 16 costs +0.095 bpw on the default model."),
    schedule: str = typer.Option(D("schedule"), "--schedule", help="'cosine' (decays over the whole run) or 'wsd' (stable at "
                                 "the peak lr, then a 1-sqrt decay over the last --decay-fraction of steps)."),
    decay_fraction: float = typer.Option(D("decay_fraction"), "--decay-fraction", help="With --schedule wsd: the fraction of "
                                         "steps that decays."),
    adapter_bits: int = typer.Option(D("adapter_bits"), "--adapter-bits", help="16 (fp16 PEFT tensors) or 8 (per-row int8 + "
                                     "fp16 scales in adapter_model.int8.safetensors, counted; an fp16 expansion for PEFT)."),
    json_out: bool = JsonOpt,
) -> None:
    """Train LoRA recovery adapters on the frozen quantized model (AFM section 5): PEFT adapters in 16 bits."""
    mix = training_data(mix, data, overwrite, resume)
    rank_list = parse_ints(ranks, "--ranks") if ranks else [rank]
    if not rank_list:
        raise QRecoverError("--ranks must name at least one rank, e.g. --ranks 8,16,32")
    configs = [RecoverConfig(rank=r, tokens=tokens, mix=None if mix is None else str(mix), objective=objective,
                             kd_weight=kd_weight, init=init, lr=lr, seq_len=seq_len, batch_size=batch_size, grad_accum=grad_accum,
                             targets=targets, rank_allocation=rank_allocation, checkpoint_every=checkpoint_every,
                             gradient_checkpointing=gradient_checkpointing, cache_dequantized=not no_cache, shard_base=shard_base,
                             precision=precision,
                             decontaminate=not no_decontaminate, seed=seed, loss_chunk=loss_chunk,
                             teacher_device=teacher_device, head_rank=head_rank, schedule=schedule,
                             decay_fraction=decay_fraction, adapter_bits=adapter_bits, log_every=log_every,
                             compile_layers=compile_layers) for r in rank_list]
    # the options are valid: now the heavy modules (torch, transformers, peft; seconds to import)
    from ..recovery.api import read_mix_or_data  # lazy (both): torch, transformers, peft take seconds to import
    from ..recovery.api import recover as run

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

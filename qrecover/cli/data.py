"""``qrecover data prepare``: tokenize a data mix once into memory-mapped shards for training at scale."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer
from rich.markup import escape

from ..errors import QRecoverError
from .common import JsonOpt, ModelArg, console, emit_json

EXAMPLES = """Examples:

  qrecover data prepare qrecover/recipes/default-mix.toml --out data/default      # the shipped mix, default tokenizer

  qrecover data prepare my-mix.toml --model path/to/model --workers 8 --out data/my-mix

  qrecover data prepare web.toml --tokens 2000000000 --out data/web-2b             # stop each source at its share of 2B tokens

  qrecover recover CKPT --data data/my-mix --tokens 100000000                      # train from the shards

The output directory holds manifest.json and sources/NN-NAME/{tokens,mask}-NNNNN.npy + documents.npy
(numpy .npy: np.load(path, mmap_mode='r')); see docs/data.md.
"""

app = typer.Typer(name="data", help="Prepare training data: tokenize a mix once into sharded, memory-mapped token files.",
                  no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False)


@app.command("prepare", epilog=EXAMPLES)
def prepare_command(
    mix: Path = typer.Argument(..., help=escape("Data-mix recipe (TOML with [[source]] tables), as `qrecover recover --mix` takes.")),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory (written atomically)."),
    model: Optional[str] = ModelArg,
    workers: Optional[int] = typer.Option(None, "--workers", "-j", help="Tokenizer processes (default: min(cores, 8)); the output is "
                                                                        "identical for any number."),
    tokens: Optional[int] = typer.Option(None, "--tokens", "-t", help="Stop each source once it holds its share (weight / sum of "
                                                                      "weights) of this many tokens (default: every document)."),
    shard_tokens: int = typer.Option(1 << 26, "--shard-tokens", help="Tokens per shard file."),
    no_decontaminate: bool = typer.Option(False, "--no-decontaminate", help="Keep documents that overlap the evaluation sets."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT if it exists."),
    json_out: bool = JsonOpt,
) -> None:
    """Tokenize each source of MIX once (decontaminated, chat loss masks included) into sharded token files."""
    from ..data.prepare import prepare_data  # lazy: pulls torch
    from ..recovery.api import read_mix  # lazy: pulls torch, transformers, peft

    if not mix.is_file():
        raise QRecoverError(f"mix {str(mix)!r} does not exist; pass a data-mix TOML with [[source]] tables "
                            "(e.g. qrecover/recipes/default-mix.toml)")
    m = read_mix(mix)
    manifest = prepare_data(m, out, model=model, workers=workers, tokens=tokens, shard_tokens=shard_tokens, overwrite=overwrite,
                            decontaminate=not no_decontaminate, show_progress=not json_out)
    summary = {"out": str(out), "data_id": manifest["data_id"], "dtype": manifest["dtype"], **manifest["totals"],
               "seconds": manifest["stats"]["seconds"], "workers": manifest["stats"]["workers"],
               "sources": {s["name"]: {k: s[k] for k in ("documents", "tokens", "loss_tokens", "complete")} | {"shards": len(s["shards"])}
                           for s in manifest["sources"]}}
    if json_out:
        emit_json(summary)
        return
    from rich.markup import escape

    for name, s in summary["sources"].items():
        console.print(f"  {escape(name)}: {s['tokens']:,} tokens ({s['loss_tokens']:,} with loss), {s['documents']:,} documents, "
                      f"{s['shards']} shard(s)" + ("" if s["complete"] else " (stopped at its --tokens share)"))
    console.print(f"[bold]{escape(str(out))}[/]: {summary['tokens']:,} tokens ({manifest['dtype']}) in {summary['seconds']:.1f} s "
                  f"with {summary['workers']} worker(s)")

"""``qrecover ppl``: held-out perplexity of an original model or a compressed checkpoint."""

from __future__ import annotations

from typing import Optional

import typer

from ..errors import QRecoverError
from .common import AdapterOpt, AllowForeignOpt, JsonOpt, console, emit_json

EXAMPLES = """Examples:

  qrecover ppl                                      # the unquantized default model

  qrecover ppl out/smollm2-135m-instruct-3.7bpw --json

  qrecover ppl out/smollm2-135m-instruct-3.7bpw --adapter out/smollm2-135m-instruct-3.7bpw-lora-r16
"""


def ppl(
    model: Optional[str] = typer.Argument(None, help="Checkpoint directory, HF model directory or .gguf (default: the built-in model)."),
    data: str = typer.Option("python-docs", "--data", help="Text source; its held-out 'eval' split is scored."),
    windows: int = typer.Option(32, "--windows", help="Number of non-overlapping windows."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per window."),
    adapter: Optional[str] = AdapterOpt,
    allow_foreign_adapter: bool = AllowForeignOpt,
    json_out: bool = JsonOpt,
) -> None:
    """Perplexity on held-out text under a fixed protocol (windows x seq-len tokens of the eval split)."""
    if windows <= 0 or seq_len <= 1:
        raise QRecoverError(f"--windows {windows} and --seq-len {seq_len} must be positive (seq-len at least 2)")
    from ..evaluate.perplexity import perplexity  # lazy (and load_any): torch and transformers take seconds to import
    from ..loading import load_any  # lazy: pulls torch, transformers, peft

    m, tok, meta = load_any(model, adapter=adapter, allow_foreign_adapter=allow_foreign_adapter)
    r = perplexity(m, tok, data, windows, seq_len, show_progress=not json_out)
    r.update(model=meta["path"], kind=meta["kind"], measured_bpw=meta["measured_bpw"], adapter=meta["adapter"])
    if json_out:
        emit_json(r)
    else:
        with_adapter = f" with adapter {meta['adapter']['path']}" if meta.get("adapter") else ""
        console.print(f"perplexity {r['ppl']:.4f} (mean NLL {r['nll']:.4f} over {r['tokens']:,} tokens of {data}'s eval split) "
                      f"for {meta['path']}{with_adapter}")

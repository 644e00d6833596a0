"""``qrecover export``: a checkpoint (and its adapter) in a serving runtime's format."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import JsonOpt, console, emit_json

EXAMPLES = """Examples:

  qrecover export out/smollm2-b4 --format gguf --out out/smollm2-b4-gguf

  qrecover export out/smollm2-b4 --format compressed-tensors --out out/smollm2-b4-ct --adapter out/smollm2-b4-lora

  qrecover export out/smollm2-3.7bpw --format compressed-tensors --requantize int4/g64 --out out/smollm2-ct

  qrecover export out/smollm2-3.7bpw --format coreml --out out/smollm2-coreml

  qrecover export out/smollm2-b4 --format gguf --adapter out/smollm2-b4-lora --merge-adapter --out out/smollm2-b4-merged
"""


def export(
    checkpoint: Path = typer.Argument(..., help="A checkpoint directory written by `qrecover compress`."),
    fmt: str = typer.Option(..., "--format", "-f", help="gguf (llama.cpp), compressed-tensors (vLLM, transformers) or coreml."),
    out: Path = typer.Option(..., "--out", "-o", help="Output directory (written atomically)."),
    adapter: Optional[Path] = typer.Option(None, "--adapter", help="A recovery adapter trained on CHECKPOINT, exported beside the base in the "
                                                                   "runtime's layout (another base's adapter is refused)."),
    merge_adapter: bool = typer.Option(False, "--merge-adapter", help="Merge --adapter into the weights, re-quantizing each layer with "
                                                                      "its own encoding; the measured cost (held-out perplexity, KL to "
                                                                      "the unquantized model) is printed and stored. Unmerged is better."),
    merge_windows: int = typer.Option(8, "--merge-windows", help="--merge-adapter: calibration windows (the checkpoint's own "
                                                                "calibration text and length) for the re-quantization statistics."),
    cost_windows: int = typer.Option(8, "--cost-windows", help="--merge-adapter: held-out windows of 512 tokens the cost is measured on."),
    requantize: Optional[str] = typer.Option(None, "--requantize", help="compressed-tensors: re-quantize layers the format cannot hold (palettized) "
                                                                        "to e.g. int4/g64, reporting the measured loss."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --out if it exists."),
    json_out: bool = JsonOpt,
) -> None:
    """Export a checkpoint to GGUF, compressed-tensors or Core ML: exact where the format holds a layer, the loss measured where not."""
    from rich.markup import escape

    from ..export import cost_lines  # lazy: qrecover.export pulls torch, transformers, peft
    from ..export import export as run  # lazy: as above

    report = run(checkpoint, fmt, out, adapter=adapter, merge_adapter=merge_adapter, requantize=requantize,
                 overwrite=overwrite, merge_windows=merge_windows, cost_windows=cost_windows,
                 log=(lambda s: None) if json_out else (lambda s: console.print(escape(s), highlight=False)))
    if json_out:
        emit_json(report)
        return
    lossy = {n: v for n, v in report["layers"].items() if not v["exact"]}
    console.print(
        f"[bold green]wrote[/] {escape(str(out))}  ({report['bytes']:,} bytes, {report['bpw']:.3f} bpw, {report['seconds']:.0f} s)\n"
        f"  {report['exact_layers']}/{report['total_layers']} layers exact; "
        + (f"{len(lossy)} converted, total relative weight error {report['total_rel_error']:.3e}" if lossy else "no loss")
        + (f"\n  adapter: {escape(str(out / 'adapter'))}" if "adapter" in report else ""),
        highlight=False)
    if "merge" in report:
        lines = cost_lines(report["merge"])
        console.print(f"[bold yellow]{escape(lines[0])}[/]\n" + "\n".join(escape(x) for x in lines[1:]), highlight=False)

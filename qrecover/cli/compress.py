"""``qrecover compress``: quantize a model to a bits-per-weight budget."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import CalibDataOpt, JsonOpt, ModelArg, console, emit_json, parse_ints

EXAMPLES = """Examples:

  qrecover compress --bpw 3.7                       # the default model, AFM's production budget

  qrecover compress --bpw 3.5 --bits 2,4 --out out/afm35

  qrecover compress --bits 4                        # uniform: every linear layer palettized at 4 bits


  qrecover compress --model ./my-llama --bpw 3.7 --scope linear --embedding-bits 8 --json
"""


def compress(
    bpw: Optional[float] = typer.Option(None, "--bpw", help="Bits-per-weight budget, measured from packed bytes on disk (default 3.7; without --bpw a single --bits width gives a uniform model)."),
    uniform: bool = typer.Option(False, "--uniform", help="No budget: every linear layer at the single width of --bits (the same as giving one --bits width and no --bpw)."),
    model: Optional[str] = ModelArg,
    bits: str = typer.Option("2,3,4", "--bits", help="Candidate widths for the decoder linear layers, e.g. 2,4 (AFM) or 2,3,4."),
    scope: str = typer.Option("model", "--scope", help="What --bpw counts: 'model' (every weight) or 'linear' (decoder linear layers)."),
    scheme: str = typer.Option("palettize", "--scheme", help="Quantizer for the linear layers: palettize or blockwise."),
    group_size: Optional[int] = typer.Option(None, "--group-size", help="palettize: rows sharing a look-up table (default 16)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="palettize: columns per table (default: whole row); blockwise: elements per scale (default 64)."),
    embedding_bits: str = typer.Option("auto", "--embedding-bits", help="'auto' (the allocator picks among 4-bit row-wise blocks of 128/64/32 and 8-bit per-channel), 4 or 8."),
    allocation: str = typer.Option("sensitivity", "--allocation", help="'sensitivity' (knapsack on estimated damage) or 'position' (baseline)."),
    calib_data: str = CalibDataOpt,
    calib_samples: int = typer.Option(32, "--calib-samples", help="Calibration windows."),
    seq_len: int = typer.Option(512, "--seq-len", help="Tokens per calibration window."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory (default: out/MODEL-BPWbpw)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --out if it exists."),
    json_out: bool = JsonOpt,
) -> None:
    """Compress a model: calibrate, estimate each layer's sensitivity, allocate bits to the budget, pack, save."""
    from ..api import compress as run
    from ..config import CompressConfig
    from ..errors import QRecoverError
    from ..models import DEFAULT_MODEL

    params: dict = {}
    if group_size is not None:
        params["group_size"] = group_size
    if block_size is not None:
        params["block_size"] = block_size
    widths = parse_ints(bits, "--bits")
    if uniform or (bpw is None and len(widths) == 1):
        if bpw is not None:
            raise QRecoverError(f"--uniform and --bpw {bpw} contradict each other; drop one")
        target = None
    else:
        target = 3.7 if bpw is None else bpw
    cfg = CompressConfig(
        model=model, bpw=target, scope=scope, bits=widths, scheme=scheme,
        scheme_params=params, embedding_bits=embedding_bits, allocation=allocation, calib_data=calib_data,
        calib_samples=calib_samples, seq_len=seq_len,
    )
    if out is None:
        name = Path(model).stem if model else DEFAULT_MODEL
        out = Path("out") / (f"{name}-{cfg.bpw}bpw" if cfg.bpw is not None else f"{name}-uniform{cfg.bits[0]}bit")
    manifest = run(cfg, out=out, overwrite=overwrite, show_progress=not json_out)
    summary = {"out": str(out), "measured_bpw": manifest["measured_bpw"], "bytes": manifest["bytes"],
               "budget": manifest["budget"], "seconds": manifest["seconds"],
               "predicted_loss_increase": manifest["sensitivity"]["predicted_loss_increase"]}
    if json_out:
        emit_json(summary)
        return
    from collections import Counter

    from rich.markup import escape

    mix = Counter(v["label"] for v in manifest["layers"].values() if v["kind"] == "linear")
    emb = {k: v["label"] for k, v in manifest["layers"].items() if v["kind"] != "linear"}
    console.print(
        f"[bold green]wrote[/] {escape(str(out))}  measured bpw: model {manifest['measured_bpw']['model']:.4f}, "
        f"linear {manifest['measured_bpw']['linear']:.4f}  ({manifest['bytes']['total']:,} bytes of tensors, "
        f"{manifest['seconds']:.0f} s)\n  linear layers: {dict(sorted(mix.items()))}  embedding: {emb}"
    )

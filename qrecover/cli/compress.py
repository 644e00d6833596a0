"""``qrecover compress``: quantize a model to a bits-per-weight budget."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from ..config import CompressConfig
from ..errors import QRecoverError
from .common import INVOKED, JsonOpt, console, emit_json, parse_ints
from .config_options import config_command

EXAMPLES = """Examples:

  qrecover compress --bpw 3.7                       # the default model, AFM's production budget

  qrecover compress --bpw 3.5 --bits 2,4 --out out/afm35

  qrecover compress --bits 4                        # uniform: every linear layer palettized at 4 bits


  qrecover compress --model ./my-llama --bpw 3.7 --scope linear --embedding-bits 8 --json

  qrecover compress --bpw 3.5 --encodings palettize:2,palettize:3,blockwise:4/b32/asym,blockwise:8/pc

  qrecover compress --bpw 3.7 --encodings gptq:3/g128,gptq:4/g64 --scheme-param damp=0.02 --device cuda

  qrecover compress --bpw 3.7 --embedding-encodings blockwise:3/b32/asym,palettize:3/g1,blockwise:4/b32/asym

  qrecover compress --bpw 3.7 --no-finalize          # keep the candidates quantized on unquantized inputs

  qrecover compress --bpw 3.7 --encodings quick      # the quick start: the default menu without table refits, 32 windows

  qrecover compress --bpw 3.7 --calib-samples 128    # more calibration windows (default 64): slower, a little better

  qrecover compress --bpw 3.7 --encodings mixed-blocks  # the same menu unrotated

  qrecover compress --bpw 3.7 --procs 1              # one process (default on the CPU: one per core, same bytes)

  qrecover compress --bpw 3.7 --encodings mixed      # palettize and GPTQ layers

  qrecover compress --bpw 3.7 --encodings afm        # whole-row tables only (AFM's format; Core ML export)

Encoding specs: SCHEME:BITS, then optional /OPTION parts and an optional TRANSFORM+ prefix; OPTION is gN (group_size=N), bN (block_size=N),
pc (per channel), sym, asym, key=value (any field of the scheme's config); e.g. gptq:4/g64/sym,
awq+gptq:3/g128, palettize:3/g1 (one table per row). A transform (awq+...) is model-level: applied once,
every candidate then quantizes the transformed weights. Transforms: awq (activation-aware scales), rot
(Hadamard rotations R1 + R2 fused into the weights, docs/rotations.md; rot-block, rot-random: other
matrices; rot1: R1 only; rot2: R2 only), e.g. rot+gptq:3/g64, rot+palettize:3, rot+awq+gptq:3/g64 (rotations run first).

Presets for --encodings (measured at --bpw 3.7 on the default model, reports/schemes.md, schemes-heldout.md):
rot-mixed-blocks (the default: mixed-blocks on the model rotated by rot+, R1 + R2 Hadamard rotations fused into the
weights; the best measured menu without an online input rotation, on every held-out domain: worst 1.39x; GGUF and
Core ML export write its tied head untied, docs/export.md), quick (rot-mixed-blocks without the table refits
and the range search, calibrated on 32 windows unless --calib-samples says otherwise: the quick start's menu; worst
held-out 1.48x), mixed-blocks (afm-blocks + gptq:3/g64/mse=true, gptq:4/g64/mse=true, GPTQ with its range search; unrotated:
worst held-out 1.89x), afm (palettize:2,3,4: AFM's whole-row tables, the only palettization Core ML export takes),
afm-blocks (palettize:2,3,4 with whole-row tables and tables per ~192 columns, each refitted twice: the best
palettization-only menu), mixed (afm + gptq:3/g64, gptq:4/g64), mixed-awq (awq+gptq:3/g64, palettize:2,3,4,
gptq:4/g64; architectures with an AWQ mapping; good on the calibration domain only). They mix with
specs: --encodings mixed,blockwise:8/pc. An encoding that fits only some layers (a block width that does not divide
every layer's columns) is offered to those layers only.
"""


# the options but --bpw/--uniform, --bits, --group-size/--block-size/--scheme-param (the CLI's forms of bpw, bits and
# scheme_params) and the CLI's own are CompressConfig fields (qrecover.cli.config_options): their defaults and help texts
@config_command(CompressConfig, only=("model", "scope", "scheme", "embedding_bits", "encodings", "embedding_encodings",
                                      "finalize", "finalize_groups", "device", "allocation", "calib_data", "calib_samples",
                                      "seq_len", "grad_samples", "grad_precision", "finalize_precision"))
def compress(
    bpw: Optional[float] = typer.Option(None, "--bpw", help="Bits-per-weight budget, measured from packed bytes on disk (default 3.7; without --bpw "
                                                            "a single --bits width gives a uniform model)."),
    uniform: bool = typer.Option(False, "--uniform", help="No budget: every linear layer at the single width of --bits (the same as giving one "
                                                          "--bits width and no --bpw)."),
    bits: Optional[str] = typer.Option(None, "--bits", help="Candidate widths for the decoder linear layers with --scheme, e.g. 2,4 (AFM) or "
                                                            "2,3,4 (the default with --scheme). Without --bits, --scheme and --encodings: the "
                                                            "default menu, rot-mixed-blocks."),
    config: dict | None = None,
    group_size: Optional[int] = typer.Option(None, "--group-size", help="palettize: rows sharing a look-up table (default 16)."),
    block_size: Optional[int] = typer.Option(None, "--block-size", help="palettize: columns per table (default: whole row); blockwise: elements per "
                                                                        "scale (default 64)."),
    scheme_param: Optional[list[str]] = typer.Option(None, "--scheme-param", help="KEY=VALUE for the linear layers' scheme(s), repeatable, e.g. "
                                                                                  "--scheme-param group_size=8 --scheme-param iters=50."),
    out: Optional[Path] = typer.Option(None, "--out", "-o", help="Output directory (default: out/MODEL-BPWbpw)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace --out if it exists."),
    procs: str = typer.Option("auto", "--procs", help="Processes on the CPU, one thread each, splitting the calibration windows and the "
                                                      "candidates (torch's elastic launcher; the same bytes as one process): auto (one per "
                                                      "core, as the memory allows; one for a model under 100 MB or on CUDA) or N."),
    json_out: bool = JsonOpt,
) -> None:
    """Compress a model: calibrate, estimate each layer's sensitivity, allocate bits to the budget, pack, save."""
    params = _scheme_params(group_size, block_size, scheme_param)
    widths = parse_ints(bits, "--bits") if bits is not None else None
    target = _target_bpw(bpw, uniform, widths, config["encodings"], config["scheme"])
    cfg = CompressConfig(**config, bpw=target, bits=widths, scheme_params=params)
    from .launch import procs_for, relaunch  # lazy: pulls torch

    n = procs_for(procs, config["model"], config["device"])
    if n > 1 and INVOKED:
        relaunch(n, INVOKED)  # before the heavy imports below: each process makes its own
    # the options are valid: now the heavy modules (torch, transformers; seconds to import)
    from ..api import compress as run  # lazy (both): torch and transformers take seconds to import
    from ..distributed import join  # lazy: pulls torch

    if out is None:
        out = _default_out(config["model"], cfg, config["encodings"])
    rank = join().rank  # under torchrun: one process of several (qrecover.distributed); rank 0 writes and prints
    manifest = run(cfg, out=out, overwrite=overwrite, show_progress=not json_out and rank == 0)  # bad specs fail before any work
    if rank > 0:
        return
    summary = {"out": str(out), "measured_bpw": manifest["measured_bpw"], "bytes": manifest["bytes"],
               "budget": manifest["budget"], "seconds": manifest["seconds"],
               "predicted_loss_increase": manifest["sensitivity"]["predicted_loss_increase"],
               "finalize": manifest["finalize"]["enabled"]}
    if json_out:
        emit_json(summary)
        return
    _print_written(out, manifest)


def _scheme_params(group_size: Optional[int], block_size: Optional[int], scheme_param: Optional[list[str]]) -> dict:
    """The linear layers' scheme parameters from --group-size, --block-size and every --scheme-param KEY=VALUE."""
    params: dict = {}
    if group_size is not None:
        params["group_size"] = group_size
    if block_size is not None:
        params["block_size"] = block_size
    if scheme_param:
        from ..stages.specs import parse_params  # lazy: the scheme registry imports torch

        params.update(parse_params(scheme_param))
    return params


def _target_bpw(bpw: Optional[float], uniform: bool, widths: Optional[list[int]], encodings: Optional[str],
                scheme: Optional[str]) -> Optional[float]:
    """The budget in bits per weight, or None for a uniform model: --uniform, or no --bpw and a single encoding
    (one --bits width, or one spec in --encodings); otherwise --bpw, by default 3.7."""
    n_encodings = (len([e for e in encodings.split(",") if e.strip()]) if encodings
                   else len(widths) if widths is not None else 3 if scheme is not None else 0)
    if uniform or (bpw is None and n_encodings == 1):
        if bpw is not None:
            raise QRecoverError(f"--uniform and --bpw {bpw} contradict each other; drop one")
        return None
    return 3.7 if bpw is None else bpw


def _default_out(model: Optional[str], cfg: CompressConfig, encodings: Optional[str]) -> Path:
    """out/MODEL-BPWbpw, or out/MODEL-uniformENCODING for a uniform model."""
    from ..models import DEFAULT_MODEL  # lazy: qrecover.models imports torch

    name = Path(model).stem if model else DEFAULT_MODEL
    uniform_name = (encodings or "").strip().replace(":", "").replace("/", "-").replace("+", "-") or f"{cfg.bits[0]}bit"
    return Path("out") / (f"{name}-{cfg.bpw}bpw" if cfg.bpw is not None else f"{name}-uniform{uniform_name}")


def _print_written(out: Path, manifest: dict) -> None:
    """One line for people: where the model went, its measured bpw, bytes and time, and the mix of encodings."""
    from collections import Counter

    from rich.markup import escape

    mix = Counter(v["label"] for v in manifest["layers"].values() if v["kind"] == "linear")
    emb = {k: v["label"] for k, v in manifest["layers"].items() if v["kind"] != "linear"}
    console.print(
        f"[bold green]wrote[/] {escape(str(out))}  measured bpw: model {manifest['measured_bpw']['model']:.4f}, "
        f"linear {manifest['measured_bpw']['linear']:.4f}  ({manifest['bytes']['total']:,} bytes of tensors, "
        f"{manifest['seconds']:.0f} s)\n  linear layers: {dict(sorted(mix.items()))}  embedding: {emb}"
    )

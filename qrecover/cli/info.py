"""``qrecover info``: what a checkpoint holds, from its manifest."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from .common import JsonOpt, console, emit_json

EXAMPLES = """Examples:

  qrecover info out/smollm2-135m-instruct-3.7bpw

  qrecover info out/smollm2-135m-instruct-3.7bpw --json | jq .measured_bpw.model
"""


def info(
    path: Path = typer.Argument(..., help="A checkpoint directory written by `qrecover compress`."),
    layers: bool = typer.Option(False, "--layers", help="List every layer (encoding, scheme, bits, bytes, estimated damage)."),
    json_out: bool = JsonOpt,
) -> None:
    """Show a checkpoint's manifest: source, budget, measured bits per weight, per-layer choices."""
    from ..checkpoint import read_manifest  # lazy: pulls torch

    m = read_manifest(path)
    if json_out:
        emit_json(m)
        return
    t = Table(title=escape(f"qrecover checkpoint {path}"), show_header=False)
    t.add_row("source", f"{m['source']['name']} ({m['source']['kind']}) sha256 {m['source']['weights_sha256'][:12]}…")
    t.add_row("architecture", m["architecture"])
    t.add_row("parameters", f"{m['parameters']['model']:,} (linear {m['parameters']['linear']:,})")
    b = m["budget"]
    t.add_row("budget", f"{b['bpw']} bpw over {b['scope']}, allocation {b['allocation']}")
    t.add_row("candidates", f"linear {', '.join(b.get('encodings') or [str(x) for x in b['bits']])}; "
              f"embedding {', '.join(b.get('embedding_encodings') or [str(b.get('embedding_bits'))])}")
    t.add_row("measured bpw", f"model {m['measured_bpw']['model']:.4f}, linear {m['measured_bpw']['linear']:.4f}")
    t.add_row("bytes", ", ".join(f"{k} {v:,}" for k, v in m["bytes"].items()))
    mix = Counter(v["label"] for v in m["layers"].values() if v["kind"] == "linear")
    t.add_row("linear layers", ", ".join(f"{k} x{v}" for k, v in sorted(mix.items())))
    for n, v in m["layers"].items():
        if v["kind"] != "linear":
            t.add_row(v["kind"], f"{n}: {v['label']} {v['params']}" + (f", tied to {v['tied_to']}" if "tied_to" in v else ""))
    pred = m["sensitivity"]["predicted_loss_increase"]
    t.add_row("predicted loss increase", "not estimated (nothing to allocate)" if pred is None else f"{pred:.4f} nats")
    fin = m.get("finalize", {})
    t.add_row("finalize", f"on: {fin.get('mode')}, {fin.get('seconds')} s" if fin.get("enabled") else "off")
    if m.get("moe"):
        n = len(m["moe"]["unfused"])
        t.add_row("MoE", f"{n} experts blocks quantized per expert; {len(m.get('routers', {}))} routers in 16 bits")
    if m.get("unquantized_matrices"):
        u = m["unquantized_matrices"]
        t.add_row("not quantized", f"{len(u)} matrices in 16 bits (e.g. {next(iter(u))}): not nn.Linear weights qrecover can quantize")
    if m.get("transforms"):
        t.add_row("transforms", f"{'+'.join(m['transforms']['names'])} ({m['transforms']['applies_to']})")
        if online := m["transforms"].get("online"):
            why = "; ".join(sorted({s.get("why", "") for s in online.values()}))
            where = ("compressed-tensors carries them; GGUF and Core ML refuse r4"  # an input-side rotation: r4
                     if any(s.get("side") == "input" for s in online.values()) else "every export folds it into an untied head")
            t.add_row("online", f"{len(online)} rotation(s) at run time ({why}): qrecover.load re-attaches them; {where}")
    c = m["calibration"]
    loss = "" if c.get("loss") is None else f", loss {c['loss']:.3f}"
    t.add_row("calibration", f"{c['source']} split {c['split']}: {c['windows']} x {c['seq_len']} tokens{loss}")
    t.add_row("created", f"{m.get('created')} in {m.get('seconds')} s with {m['versions']}")
    if m.get("tuning"):
        tu, r, b = m["tuning"], m["tuning"].get("rounding"), m["tuning"].get("blocks")
        t.add_row("tuned", f"{', '.join(tu['params'])} ({tu['trainable_values']:,} values) "
                  + ("" if not b else f"block-wise on {b['tokens']:,} tokens x {b['epochs']} (block output error "
                     f"{b['mean_error_before']:.4f} -> {b['mean_error_after']:.4f}), then ")
                  + f"end to end on {tu['tokens']:,} tokens of "
                  f"{tu['data']} ({tu['objective']}) from {tu['source']['path']} (weights sha256 "
                  f"{tu['source']['weights_sha256'][:12]}…), codes frozen, same bytes"
                  + ("" if r is None else f"; fp16 rounding: ppl {r['ppl_fp32_masters']:.3f} -> {r['ppl_rounded']:.3f}"))
    console.print(t)
    if layers:  # plain aligned lines: full layer names, easy to grep
        print(f"{'layer':<48} {'encoding':<24} {'scheme':<10} {'bits':>4} {'bpw':>6} {'bytes':>12} {'est. damage':>12}")
        for n, v in m["layers"].items():
            dmg = "-" if v.get("damage") is None else f"{v['damage']:.2e}"
            print(f"{n:<48} {v['label']:<24} {v['scheme']:<10} {v['bits']:>4} {v['bpw']:>6.3f} {v['nbytes']:>12,} {dmg:>12}")

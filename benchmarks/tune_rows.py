"""The ``:tune`` rows of benchmarks/recover.py: a checkpoint tuned end to end (`qrecover tune`, zero extra bytes) alone
(rank 0) or under a LoRA adapter (tables then LoRA).

``3.5:kd:0:tune@32768``          the tuned checkpoint alone, 32k tuning tokens
``3.5:kd:16:tune=32768@65536``   tuned on 32k tokens, then a rank-16 adapter on 65k tokens on the tuned checkpoint
``:params=tables+scales``        what trains (TuneConfig.params, '+' for ','); default: TuneConfig's
``3.5:kd:0:tune:lr=1e-4@16384``  with rank 0, ':lr=' is the tuning's learning rate (else the adapter's)
``:params=tables+scales+norms+embedding+codes:codes_lr=2e-2``  the codes too, at that lr (TuneConfig.codes_lr)
``:hidden=1``                    --hidden-weight 1: every decoder layer's output matched beside the logits (the LoRA's
                                 training too, where the row has one)
``3.5:kd:0:tune=0:blocks=32768@32768``  block-wise reconstruction on 32k tokens alone (TuneConfig.block_tokens), no
                                 end-to-end pass; ``tune=32768:blocks=32768`` both

A tuned checkpoint is cached in OUT/tuned-<source>-<params>-<tokens>tok and reused when its manifest records the same
config and source weights.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

from qrecover.checkpoint import read_manifest
from qrecover.loading import load
from qrecover.recovery.tune import TuneConfig, tune


def tune_config(run: dict, seq_len: int, mix: str | None) -> TuneConfig:
    """The row's tuning config: ``run["tune"]`` tokens, ``run["params"]`` (None: the default), the row's data mix."""
    return TuneConfig(tokens=run["tune"], seq_len=seq_len, checkpoint_every=0, mix=mix, block_tokens=run.get("blocks", 0),
                      **({} if run.get("params") is None else {"params": run["params"]}),
                      **({} if run.get("codes_lr") is None else {"codes_lr": run["codes_lr"]}),
                      hidden_weight=run.get("hidden", 0.0),
                      **({"lr": run["lr"]} if run["rank"] == 0 and run.get("lr") is not None else {}))


def tuned_base(ckpt: Path, cfg: TuneConfig, out: Path, teacher: Any,
               callback: Callable[[dict], None] | None = None) -> tuple[Path, dict]:
    """``(tuned checkpoint, record)``: ``ckpt`` tuned with ``cfg`` (reused when already there); the record holds the
    tuning's tokens, training and CPU seconds and what fp16 rounding cost."""
    d = out / (f"tuned-{ckpt.name}-{cfg.params.replace(',', '+')}-{cfg.tokens}tok"
               + (f"-blocks{cfg.block_tokens}" if cfg.block_tokens else "")
               + (f"-clr{cfg.codes_lr:g}" if "codes" in cfg.kinds else "")
               + (f"-hid{cfg.hidden_weight:g}" if cfg.hidden_weight else "")
               + (f"-mix{Path(cfg.mix).stem}" if cfg.mix else ""))  # rows on other mixes never share a directory
    source = read_manifest(ckpt)["weights_file"]["sha256"]
    done = (d / "qrecover.json").is_file() and (d / "bench_cpu.json").is_file() and read_manifest(d).get("tuning", {})
    if done and done["config"] == cfg.to_dict() and done["source"]["weights_sha256"] == source and callback is None:
        t = {**done, "cpu_seconds": json.loads((d / "bench_cpu.json").read_text())["cpu_seconds"]}
        print("reused", d, flush=True)
    else:
        cpu = time.process_time()  # this process, one thread: the tuning's CPU time (its callback's scoring included)
        t = tune(ckpt, d, cfg, overwrite=True, teacher=teacher, callback=callback)["tuning"]
        t["cpu_seconds"] = time.process_time() - cpu
        (d / "bench_cpu.json").write_text(json.dumps({"cpu_seconds": t["cpu_seconds"]}))
    blocks = t.get("blocks")
    return d, {"params": t["params"], "tokens": t["tokens"], "seconds": t["training"]["seconds"] + (blocks or {}).get("seconds", 0),
               "blocks": None if not blocks else {k: blocks[k] for k in ("tokens", "epochs", "lr", "seconds", "mean_error_before",
                                                                           "mean_error_after")},
               "tok_per_s": t["training"]["tok_per_s"], "cpu_seconds": t.get("cpu_seconds"), "rounding": t["rounding"],
               "path": str(d)}


def tune_alone(name: str, run: dict, cfg: TuneConfig, ckpt: Path, measured_bpw: float, out: Path, teacher: Any,
               ppl: Callable[[Any], dict], gap: Callable[[float, dict], dict], points: list[float]) -> dict:
    """The row of the checkpoint ``ckpt`` tuned with ``cfg`` alone: held-out perplexity (``ppl(model)``, gap closed by
    ``gap(bpw, ppl)``) as it starts and at the ``points`` fractions of its tokens; CPU seconds without that scoring."""
    b, curve, scoring, t0 = run["bpw"], [], [0.0], time.time()
    marks = sorted({round(f * cfg.tokens) for f in points if 0 < f < 1})

    def measure(info: dict) -> None:
        if (info["step"] == 0 and 0.0 in points) or any(info["tokens"] - cfg.tokens_per_step < m <= info["tokens"] for m in marks):
            c = time.process_time()
            p = ppl(info["model"])
            curve.append({"tokens": info["tokens"], "ppl": p, "gap_closed": gap(b, p)})
            print(b, "tune", info["tokens"], p, flush=True)
            info["model"].train()
            scoring[0] += time.process_time() - c

    d, tuned = tuned_base(ckpt, cfg, out, teacher, callback=measure)
    final = ppl(load(d, cache=True))
    curve.append({"tokens": tuned["tokens"], "ppl": final, "gap_closed": gap(b, final)})
    tuned["cpu_seconds"] -= scoring[0]
    return _row(name, run, measured_bpw, tuned, curve, time.time() - t0, cfg.lr)


def _row(name: str, run: dict, measured_bpw: float, tuned: dict, curve: list[dict], wall: float, lr: float) -> dict:
    """A benchmark row for the tuned checkpoint alone: no adapter, zero extra bytes."""
    return {"name": name, "bpw": run["bpw"], "measured_bpw": measured_bpw, "objective": run["objective"], "rank": 0,
            "targets": "all", "init": "none", "lr": lr, "head_rank": 0, "schedule": "cosine", "rank_allocation": "uniform",
            "mix": run["mix"],
            "adapter_bits": 16, "init_output_error_removed": None, "layers": 0, "adapter_mb": 0.0, "adapter_bpw_cost": 0.0,
            "tok_per_s": tuned["tok_per_s"], "train_seconds": tuned["seconds"], "wall_seconds": wall,
            "cpu_seconds": tuned["cpu_seconds"], "tune": tuned, "curve": curve}

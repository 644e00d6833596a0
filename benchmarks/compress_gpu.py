"""Default-menu compression on a GPU (issue 23): ``compress --bpw 3.7`` (rot-mixed-blocks, 32 x 512 calibration tokens,
finalize on) of a Llama-3.2-1B-geometry and a Llama-3.1-8B-geometry model with random weights, timed stage by stage.

On the GPU machine (one command; nothing to download: the models are built from the configs with random N(0, 0.02)
matrices, a byte-level tokenizer and a synthetic text, under benchmarks/out/compress_gpu/, reused by later runs):

    python benchmarks/compress_gpu.py --budget-s 240   # fits 4 minutes on an H100: the 1B whole, the 8B on fewer layers
    python benchmarks/compress_gpu.py                  # both models whole (the 8B: 32 layers; the issue's target: <= 20 min)
    python benchmarks/compress_gpu.py --only 8b        # one of them

On CPU, for the plumbing only (toy models of the same two shapes of config; timings mean nothing here):

    python benchmarks/compress_gpu.py --tiny

Each model is compressed lazily (the default for a safetensors directory: one decoder layer read from disk and
resident on the GPU at a time; the embedding and an untied head stay on the CPU between their turns), with
``qrecover.api.compress`` exactly as ``qrecover compress --bpw 3.7 --device cuda`` runs it. Stage times come from
wrapping qrecover's stage functions (top-level calls only): load, calibration windows, gradient pass, layer pass
(statistics + every linear's candidates), embedding/head candidates, finalize, write. Peak GPU memory is
``torch.cuda.max_memory_allocated``; peak host memory the process's VmHWM (reset before each model).

``--budget-s S``: the 1B model whole; then the 8B model with only its first K decoder layers (K chosen from the
time left, at least 2), a separate model file; its row says so, and a second row PROJECTS the 32-layer time as
the measured per-layer stages x 32 / K plus the measured fixed stages (load, windows, embedding, write). The
projection is labelled as one; run without ``--budget-s`` to measure the whole 8B.

Candidate encodings of one layer run one after another on the GPU (not batched across encodings; encodings of
one scheme and parameters share work through ``quantize_many``).

Prints a Markdown table; writes benchmarks/out/compress_gpu/compress_gpu-<device>.json (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

import qrecover.api  # noqa: E402  (the stage functions below are found in the modules it loads)
from benchmarks.train_speed import LLAMA_1B  # noqa: E402  (the geometry the training benchmark measures)
from qrecover.config import DEFAULT_ENCODINGS, CompressConfig  # noqa: E402
from qrecover.io_utils import write_text_atomic  # noqa: E402

OUT = ROOT / "benchmarks" / "out" / "compress_gpu"
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0)
TINY = {"1b": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True),
        "8b": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False)}
#: qrecover's stage functions, timed where called from outside another (their names, found in the loaded modules)
STAGES = {"load_model": "load", "calibration_windows": "windows", "gradient_stats": "gradients",
          "layer_pass": "layers + candidates", "quantize_shared": "embedding candidates", "finalize": "finalize",
          "write_checkpoint": "write"}
PER_LAYER = ("gradients", "layers + candidates", "finalize")  # stages whose time grows with the decoder layers


def build(d: Path, config: dict[str, Any], device: str) -> tuple[Path, int]:
    """A random model (bf16 on disk, one safetensors shard per decoder layer: lazy loading reads one at a time), a
    byte-level tokenizer and a synthetic text under ``d``, reused when present. Returns ``(model dir, parameters)``."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from benchmarks.common import save_byte_level_tokenizer

    src = d / "model"
    cfg = LlamaConfig(**config)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in meta.parameters())
    if (d / "built.json").is_file() and json.loads((d / "built.json").read_text()) == config:
        return src, n
    shutil.rmtree(d, ignore_errors=True)
    src.mkdir(parents=True)
    save_byte_level_tokenizer(src)
    cfg.save_pretrained(src)
    gen = torch.Generator(device).manual_seed(0)
    shards: dict[str, list[str]] = {}
    state = meta.state_dict()
    for name in state:
        if not (name == "lm_head.weight" and cfg.tie_word_embeddings):
            shards.setdefault(name.split(".")[2] if ".layers." in name else "rest", []).append(name)
    weight_map = {}
    for shard, names in shards.items():
        tensors = {k: (torch.ones(state[k].shape, dtype=torch.bfloat16) if state[k].dim() == 1 else
                       (torch.randn(state[k].shape, generator=gen, device=device) * 0.02).to(torch.bfloat16).cpu()) for k in names}
        save_file(tensors, str(src / f"model-{shard}.safetensors"), metadata={"format": "pt"})
        weight_map.update({k: f"model-{shard}.safetensors" for k in names})
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    g = torch.Generator().manual_seed(0)
    words = ["the", "layer", "reads", "packed", "codes", "table", "row", "bits", "weight", "scale", "token", "of", "loss"]
    (d / "texts").mkdir()
    for i in range(64):  # ~ 1 M characters: 24 documents gave 16,336 tokens, under the 32 x 512 needed
        paras = [" ".join(words[j] for j in torch.randint(0, len(words), (150,), generator=g).tolist()) for _ in range(20)]
        (d / "texts" / f"doc{i}.txt").write_text("\n\n".join(paras))
    (d / "built.json").write_text(json.dumps(config))
    return src, n


class StageTimer:
    """Wall seconds of qrecover's stage functions (:data:`STAGES`), wrapped wherever a loaded qrecover module holds
    them; a call made inside another timed call counts toward that one only."""

    def __init__(self, name: str = "") -> None:
        self.name = name  # printed with each finished stage, so that a run cut by its time limit still reports some
        self.seconds: dict[str, float] = {}
        self._depth = 0
        self._undo: list[tuple[Any, str, Any]] = []

    def __enter__(self) -> "StageTimer":
        mods = [m for name, m in list(sys.modules.items()) if name.startswith("qrecover") and m is not None]
        for fname, label in STAGES.items():
            originals = {id(v): v for m in mods for v in vars(m).values() if callable(v) and getattr(v, "__name__", None) == fname
                         and getattr(v, "__module__", "").startswith("qrecover")}
            if not originals:
                raise RuntimeError(f"no qrecover stage function named {fname!r} is loaded: update STAGES in {__file__}")
            for fn in originals.values():
                wrapped = self._wrap(fn, label)
                for m in mods:
                    for k, v in list(vars(m).items()):
                        if v is fn:
                            self._undo.append((m, k, v))
                            setattr(m, k, wrapped)
        return self

    def __exit__(self, *exc) -> None:
        for m, k, v in reversed(self._undo):
            setattr(m, k, v)

    def _wrap(self, fn: Callable, label: str) -> Callable:
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    sync()
                    dt = time.perf_counter() - t0
                    self.seconds[label] = self.seconds.get(label, 0.0) + dt
                    print(f"  {self.name}: {label} {dt:.1f} s", flush=True)
        return timed


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _reset_host_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (Linux)
    except OSError:
        pass


def _host_peak_gb() -> float:
    try:
        with open("/proc/self/status") as f:
            return int(next(line.split()[1] for line in f if line.startswith("VmHWM:"))) * 1024 / 1e9
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def compress_one(root: Path, name: str, config: dict[str, Any], device: str, calib: int, seq_len: int) -> dict[str, Any]:
    """Build (or reuse) the model under ``root``, compress it at the default menu and --bpw 3.7; one table row."""
    t0 = time.time()
    src, params = build(root / name, config, device)
    build_s = time.time() - t0
    print(f"  {name}: built in {build_s:.1f} s ({params / 1e6:,.1f} M parameters)", flush=True)
    out = root / f"{name}-3.7bpw"
    cfg = CompressConfig(model=str(src), bpw=3.7, calib_data=str(root / name / "texts"), calib_samples=calib, seq_len=seq_len,
                         device=device)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    _reset_host_peak()
    t0 = time.perf_counter()
    with StageTimer(name) as timer:
        manifest = qrecover.api.compress(cfg, out=out, overwrite=True, show_progress=False)
    sync()
    total = time.perf_counter() - t0
    shutil.rmtree(out, ignore_errors=True)
    return {"model": name, "parameters": params, "layers": config["num_hidden_layers"], "build_s": round(build_s, 1),
            "stages_s": {k: round(v, 2) for k, v in timer.seconds.items()}, "total_s": round(total, 2),
            "gpu_peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2) if torch.cuda.is_available() else None,
            "host_peak_gb": round(_host_peak_gb(), 2), "measured_bpw": manifest["measured_bpw"]["model"],
            "linear_bpw": manifest["measured_bpw"]["linear"], "calibration": f"{calib} x {seq_len}"}


def project(row: dict[str, Any], layers: int) -> dict[str, Any]:
    """The whole model's time from a run on ``row['layers']`` of its ``layers`` decoder layers: per-layer stages
    scaled, the others as measured. A projection, labelled as one."""
    scale = layers / row["layers"]
    stages = {k: round(v * scale, 2) if k in PER_LAYER else v for k, v in row["stages_s"].items()}
    return {**row, "model": f"{row['model']} PROJECTED to {layers} layers (not measured)", "layers": layers,
            "stages_s": stages, "total_s": round(row["total_s"] + sum(stages.values()) - sum(row["stages_s"].values()), 2),
            "gpu_peak_gb": None, "host_peak_gb": None, "projected": True}


def plan_layers(budget_left: float, spent_1b: float, cfg_1b: dict, cfg_8b: dict) -> int:
    """How many of the 8B's decoder layers fit ``budget_left`` seconds, from the 1B run's per-layer time scaled by the
    layers' parameters (only to choose; the figures reported are measured). At least 2."""
    def layer_params(c):
        d, i = c["hidden_size"], c["intermediate_size"]
        kv = c["num_key_value_heads"] * d // c["num_attention_heads"]
        return 2 * d * d + 2 * d * kv + 3 * d * i
    per_layer = spent_1b / cfg_1b["num_hidden_layers"] * layer_params(cfg_8b) / layer_params(cfg_1b)
    fits = int(0.6 * budget_left / max(per_layer, 1e-9))  # the fixed stages (a 4x larger embedding and head) take the rest
    return max(2, min(cfg_8b["num_hidden_layers"], fits))


def table(rows: list[dict[str, Any]]) -> str:
    stages = list(dict.fromkeys(k for r in rows for k in r["stages_s"]))
    lines = ["| model | params | layers | " + " | ".join(f"{s} (s)" for s in stages) + " | total (s) | GPU peak | host peak | bpw (model / linear) |",
             "|---" * (len(stages) + 7) + "|"]
    for r in rows:
        mem = lambda v: "-" if v is None else f"{v:.2f} GB"  # noqa: E731
        lines.append(f"| {r['model']} | {r['parameters'] / 1e6:,.1f} M | {r['layers']} | "
                     + " | ".join(f"{r['stages_s'].get(s, 0.0):.1f}" for s in stages)
                     + f" | {r['total_s']:.1f} | {mem(r['gpu_peak_gb'])} | {mem(r['host_peak_gb'])} | "
                     + f"{r['measured_bpw']:.3f} / {r['linear_bpw']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-s", type=float, default=None, help="fit the run (builds included) in this many seconds")
    ap.add_argument("--only", choices=["1b", "8b"], default=None)
    ap.add_argument("--tiny", action="store_true", help="toy configs on the CPU, 4 x 64 calibration tokens: the plumbing only")
    ap.add_argument("--device", default=None, help="default: cuda when available (cpu with --tiny)")
    ap.add_argument("--out", type=Path, default=OUT, help="where the models are built and the JSON report is written")
    args = ap.parse_args()
    t_start = time.time()
    device = args.device or ("cpu" if args.tiny or not torch.cuda.is_available() else "cuda")
    configs = dict(TINY) if args.tiny else {"1b": LLAMA_1B, "8b": LLAMA_8B}
    calib, seq_len = (4, 64) if args.tiny else (32, 512)
    out = args.out / "tiny" if args.tiny else args.out
    rows = []
    if args.only in (None, "1b"):
        rows.append(compress_one(out, "1b", configs["1b"], device, calib, seq_len))
        print(table(rows[-1:]), flush=True)
    if args.only in (None, "8b"):
        full = configs["8b"]
        cfg = full
        if args.budget_s is not None:
            left = args.budget_s - (time.time() - t_start)
            spent = rows[0]["total_s"] if rows else left / 4
            k = plan_layers(left, spent, configs["1b"], full) if rows else 2
            cfg = {**full, "num_hidden_layers": k} if k < full["num_hidden_layers"] else full
        name = "8b" if cfg is full else f"8b-{cfg['num_hidden_layers']}layers"
        rows.append(compress_one(out, name, cfg, device, calib, seq_len))
        if cfg is not full:
            rows.append(project(rows[-1], full["num_hidden_layers"]))
    wall = time.time() - t_start
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() and device != "cpu" else platform.processor() or "cpu"
    report = {"device": gpu, "torch": torch.__version__, "budget_s": args.budget_s, "wall_s": round(wall, 1), "rows": rows,
              "command": "python benchmarks/compress_gpu.py " + " ".join(sys.argv[1:])}
    write_text_atomic(args.out / f"compress_gpu-{'tiny' if args.tiny else device.split(':')[0]}.json", json.dumps(report, indent=1))
    print(f"\ncompress --bpw 3.7 (default menu, {DEFAULT_ENCODINGS}), {calib} x {seq_len} calibration tokens, on {gpu} "
          f"(torch {torch.__version__}); whole run {wall:.0f} s" + (f" of a {args.budget_s:.0f} s budget" if args.budget_s else ""))
    print(table(rows))


if __name__ == "__main__":
    main()

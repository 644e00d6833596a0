"""Peak memory and wall time of `qrecover compress` against model size: the lazy path (the default for a
safetensors directory: one decoder layer in memory at a time) and the whole-model path it replaced.

Models: the default model (SmolLM2-135M, 0.54 GB of fp32 weights) and a randomly initialised model of
the same architecture about 8x larger, built from its config alone (hidden 1536, 24 heads of 64, 8 KV
heads, intermediate 6144, 30 layers, the same 49152 vocabulary and tokenizer: 1.11 B parameters, 4.4 GB of
fp32 weights), saved in fp32, one shard per decoder layer, under benchmarks/out/ (gitignored).

Each row is one `qrecover compress` subprocess at one cheap encoding (uniform `blockwise:4/b64`, embedding
`blockwise:4/b64`, no budget: no gradient pass), `--calib-samples 2 --seq-len 256` (a small calibration:
at 8 x 512 tokens the default model alone took 3 minutes a run on one shared core), finalize on, `--device cpu`, OMP_NUM_THREADS=1; peak RSS
= the child's own VmHWM (not os.wait4's ru_maxrss, which Linux keeps across fork + execve), wall time around the
subprocess and its CPU time (user + system). The whole-model path is the same CLI
with `api.compress(lazy=False)`; it is skipped for a model whose fp32 weights exceed a third of the
memory available now (`--force-full` runs it anyway).

    python benchmarks/compress_memory.py                 # both models, both paths where they fit
    python benchmarks/compress_memory.py --only default  # the default model only

Prints a markdown table; writes benchmarks/out/compress_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from qrecover.measure import peak_rss_command, read_peak_rss  # noqa: E402
from qrecover.models import default_model_dir  # noqa: E402

OUT = ROOT / "benchmarks" / "out"
BIG = dict(hidden_size=1536, num_attention_heads=24, num_key_value_heads=8, head_dim=64, intermediate_size=6144,
           num_hidden_layers=30)
ARGS = ["--procs", "1", "--uniform", "--encodings", "blockwise:4/b64", "--embedding-encodings", "blockwise:4/b64",
        "--calib-samples", "2", "--seq-len", "256", "--device", "cpu", "--json", "--overwrite"]


def build_big(dst: Path) -> int:
    """The ~8x model: the default model's config with :data:`BIG`'s shapes, random N(0, 0.02) matrices and
    unit norms, fp32, one safetensors shard per decoder layer (never all in memory). Returns parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src = default_model_dir()
    config = AutoConfig.from_pretrained(src)
    for k, v in BIG.items():
        setattr(config, k, v)
    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(config)
    tmp = dst.with_name(dst.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(src).save_pretrained(tmp)
    gen = torch.Generator().manual_seed(0)
    shards: dict[str, list[str]] = {}
    state = meta.state_dict()
    for name in state:
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        shards.setdefault(name.split(".")[2] if ".layers." in name else "rest", []).append(name)
    weight_map = {}
    for shard, names in shards.items():
        fname = f"model-{shard}.safetensors"
        tensors = {n: (torch.ones(state[n].shape) if state[n].dim() == 1 else torch.randn(state[n].shape, generator=gen) * 0.02)
                   for n in names}
        save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in names})
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=1))
    tmp.rename(dst)
    return sum(p.numel() for p in meta.parameters())


def run(model: Path, lazy: bool, out: Path) -> dict:
    """One compress subprocess: ``{peak_rss_gb, wall_s, cpu_s, rc}`` (peak: the child's own VmHWM)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryFile() as err:
        report = Path(tmp) / "vmhwm"
        cmd = peak_rss_command(report, ["compress", "--model", str(model), "--out", str(out)] + ARGS, lazy)
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=err)
        stdout = proc.stdout.read()
        _, status, usage = os.wait4(proc.pid, 0)  # its rusage: the CPU seconds (user + system)
        wall = time.time() - t0
        proc.stdout.close()
        rc = proc.returncode = os.waitstatus_to_exitcode(status)
        if rc != 0:
            err.seek(0)
            sys.stderr.write(err.read().decode()[-3000:])
        peak = read_peak_rss(report)
    summary = json.loads(stdout) if rc == 0 else None
    return {"peak_rss_gb": None if peak is None else round(peak / 1e9, 2), "wall_s": round(wall, 1),
            "cpu_s": round(usage.ru_utime + usage.ru_stime, 1), "rc": rc,
            "measured_bpw": summary["measured_bpw"]["model"] if summary else None}


def available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["default", "8x"], default=None)
    ap.add_argument("--force-full", action="store_true", help="run the whole-model path even where it may not fit")
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    models = {}
    if args.only in (None, "default"):
        models["default (SmolLM2-135M)"] = default_model_dir()
    if args.only in (None, "8x"):
        big = OUT / "smollm2-8x-random"
        if not big.exists():
            print(f"building {big} ...", flush=True)
            build_big(big)
        models["random, same family ~8x"] = big
    from transformers import AutoConfig, AutoModelForCausalLM

    rows = []
    for label, path in models.items():
        with torch.device("meta"):
            n = sum(p.numel() for p in AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)).parameters())
        for lazy in (True, False):
            if not lazy and 4 * n > available_bytes() / 3 and not args.force_full:
                rows.append({"model": label, "params": n, "path": "whole model", "skipped": "fp32 weights > 1/3 of available memory"})
                continue
            print(f"{label}: {'lazy' if lazy else 'whole model'} ...", flush=True)
            r = run(path, lazy, OUT / f"cm-{'lazy' if lazy else 'full'}-{path.name}")
            rows.append({"model": label, "params": n, "path": "lazy (one layer)" if lazy else "whole model", **r})
            shutil.rmtree(OUT / f"cm-{'lazy' if lazy else 'full'}-{path.name}", ignore_errors=True)
    (OUT / "compress_memory.json").write_text(json.dumps({"args": ARGS, "rows": rows}, indent=1))
    print("\n| model | parameters | fp32 weights | path | peak RSS | wall time |\n|---|---|---|---|---|---|")
    for r in rows:
        cost = (f"{r['peak_rss_gb']:.2f} GB | {r['wall_s']:.0f} s" if "skipped" not in r else f"skipped ({r['skipped']}) | -")
        print(f"| {r['model']} | {r['params'] / 1e6:.0f} M | {4 * r['params'] / 1e9:.2f} GB | {r['path']} | {cost} |")


if __name__ == "__main__":
    main()

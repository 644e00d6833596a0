"""Recovery training speed on a GPU (issue 14): tokens/s, peak memory and model-FLOPs utilisation for a
1B-parameter Llama-style model, and the projected wall time for 1B and 10B tokens on 1 and 8 GPUs.

On the GPU machine (one command; nothing to download: the model is built from Llama-3.2-1B's geometry with
random weights, a byte-level tokenizer and a synthetic text are generated):

    python benchmarks/train_speed.py                     # build + compress + train, ~6-9 min on one H100
    python benchmarks/train_speed.py --batches 1,2,4,8   # micro-batch sizes to try (seq 2048)

Steps: the model (16 layers, hidden 2048, intermediate 8192, 32 heads / 8 KV heads, vocabulary 128256, tied
head: 1.24 B parameters) is saved in fp32 (what ``compress`` reads) under benchmarks/out/train_speed/;
``qrecover.api.compress`` at 3.5 bpw over the linear layers (3- and 4-bit palettization, no error feedback: the
values do not change the speed, and it saves minutes) on CUDA; then for each micro-batch size,
``qrecover.recovery.api.recover`` with rank 16 on every projection, distillation from the unquantized model
(the teacher in bf16 on the same GPU), bf16 autocast, sequences of 2048 tokens, the dequantized-weight cache on,
``--steps`` optimizer steps of one micro-batch each (the first is timed too: a conservative figure). A size
that runs out of memory is reported as such. tokens/s and peak memory come from the trainer's own summary
(``torch.cuda.max_memory_allocated``).

FLOPs per trained token, counted as work the model must do: the frozen student's forward (``2 N``) and its
backward to the activations (``2 N``: no weight gradients for a frozen base; LoRA's are negligible), the
teacher's forward (``2 N``), N = the parameters of every matrix multiply (linear layers and the head), plus
causal attention (``2 L s d`` per token per forward, twice that for a backward). MFU = tokens/s x that /
the GPU's dense bf16 peak (H100/H200 SXM: 989 TFLOP/s; ``--peak-tflops`` to override).

Projection: wall time = tokens / (tokens/s) on one GPU; on 8 GPUs the same divided by 8 (data parallel; the
gradient all-reduce is the adapter's ~10-20 MB per step, small next to a step's compute). Not measured on 8
GPUs: the machine has one.

On CPU, for the plumbing only (a toy model; timings mean nothing here):

    python benchmarks/train_speed.py --quick

Prints a Markdown table; writes benchmarks/out/train_speed-<device>.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(ROOT))

from qrecover.io_utils import write_text_atomic  # noqa: E402

OUT = ROOT / "benchmarks" / "out" / "train_speed"
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=500000.0)
TOY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True)
PEAK_TFLOPS = 989.0  # H100 / H200 SXM dense bf16


def build(d: Path, config: dict) -> Path:
    """The random model, a byte-level tokenizer and a synthetic text under ``d`` (reused when present)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.common import save_byte_level_tokenizer

    src = d / "model"
    if (src / "config.json").is_file() and json.loads((src / "config.json").read_text())["hidden_size"] == config["hidden_size"]:
        return src
    shutil.rmtree(d, ignore_errors=True)
    src.mkdir(parents=True)
    save_byte_level_tokenizer(src)
    g = torch.Generator().manual_seed(0)
    words = ["the", "adapter", "reads", "packed", "codes", "table", "row", "bits", "weight", "teacher", "token", "of",
             "loss", "gradient", "step", "batch"]
    texts = d / "texts"
    texts.mkdir()
    for i in range(40):  # ~ 0.6 M characters: more than any run below reads (the loader repeats epochs anyway)
        paras = [" ".join(words[j] for j in torch.randint(0, len(words), (150,), generator=g).tolist()) for _ in range(20)]
        (texts / f"doc{i}.txt").write_text("\n\n".join(paras))
    (d / "mix.toml").write_text(f'[[source]]\nname = "synthetic"\nkind = "text"\npath = "{texts}/*.txt"\nweight = 1.0\n')
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(src)
    return src


def compress_model(src: Path, ckpt: Path, device: str, seq_len: int) -> float:
    from qrecover.api import compress
    from qrecover.config import CompressConfig

    if (ckpt / "qrecover.json").is_file():
        return 0.0
    t0 = time.time()
    cfg = CompressConfig(model=str(src), bpw=3.5, scope="linear", bits=[3, 4], calib_data=str(src.parent / "texts"),
                         calib_samples=4, seq_len=seq_len, scheme_params={"error_feedback": False}, device=device)
    compress(cfg, out=ckpt, overwrite=True, show_progress=False)
    return time.time() - t0


def flops_per_token(config: dict, seq_len: int) -> dict:
    d, L, i, v = config["hidden_size"], config["num_hidden_layers"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * d // config["num_attention_heads"]
    n = L * (2 * d * d + 2 * d * kv + 3 * d * i) + d * v  # every matrix multiply's weights, the head included
    attn = 2 * L * seq_len * d  # causal QK^T and AV, per token, one forward
    return {"params_matmul": n, "student_fwd": 2 * n + attn, "student_bwd": 2 * n + 2 * attn, "teacher_fwd": 2 * n + attn,
            "total": 6 * n + 4 * attn}


def train_once(ckpt: Path, mix: Path, out: Path, batch: int, seq_len: int, steps: int) -> dict:
    from qrecover.recovery.api import recover
    from qrecover.recovery.config import RecoverConfig

    cfg = RecoverConfig(rank=16, objective="kd", tokens=batch * seq_len * steps, seq_len=seq_len, batch_size=batch,
                        mix=str(mix), decontaminate=False, checkpoint_every=0, precision="auto")
    try:
        meta = recover(ckpt, out, cfg, overwrite=True, show_progress=False)
    except torch.cuda.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return {"batch": batch, "oom": str(e).splitlines()[0][:200]}
    t = meta["training"]
    return {"batch": batch, "tokens": t["tokens"], "tok_per_s": t["tok_per_s"], "seconds": t["seconds"],
            "peak_memory_gb": t["peak_memory_bytes"] / 1e9, "precision": t.get("mixed_precision"),
            "init_seconds": meta["init"].get("seconds"), "adapter_mb": meta["bytes"]["tensors"] / 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a toy model on this device (plumbing only)")
    ap.add_argument("--batches", default="1,2,4,8", help="micro-batch sizes to try")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=8, help="optimizer steps per batch size")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config, seq_len = (TOY, 64) if args.quick else (LLAMA_1B, args.seq_len)
    batches = [1, 2] if args.quick else [int(b) for b in args.batches.split(",")]
    steps = 2 if args.quick else args.steps
    d = OUT / ("toy" if args.quick else "llama-1b")
    t0 = time.time()
    src = build(d, config)
    build_s = time.time() - t0
    compress_s = compress_model(src, d / "ckpt", device, min(seq_len, 512))
    fl = flops_per_token(config, seq_len)
    rows = []
    for b in batches:
        r = train_once(d / "ckpt", d / "mix.toml", d / f"adapter-b{b}", b, seq_len, steps)
        if "tok_per_s" in r:
            r["tflops"] = r["tok_per_s"] * fl["total"] / 1e12
            r["mfu"] = r["tflops"] / args.peak_tflops
        rows.append(r)
        print(json.dumps(r), flush=True)
    ok = [r for r in rows if "tok_per_s" in r]
    best = max(ok, key=lambda r: r["tok_per_s"]) if ok else None
    projection = {}
    if best:
        for tokens in (1e9, 1e10):
            for gpus in (1, 8):
                projection[f"{tokens:.0e} tokens, {gpus} GPU(s)"] = tokens / (best["tok_per_s"] * gpus) / 3600
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "config": config, "seq_len": seq_len, "steps": steps, "build_s": build_s,
              "compress_s": compress_s, "flops_per_token": fl, "peak_tflops": args.peak_tflops, "rows": rows,
              "best": best, "projection_hours": projection, "quick": args.quick}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(ROOT / "benchmarks" / "out" / f"train_speed-{device}.json", json.dumps(result, indent=1) + "\n")
    print(f"\n{result['device']}, seq {seq_len}, rank 16, kd (teacher bf16 on the same GPU), {steps} steps per size; "
          f"{fl['total'] / 1e9:.2f} GFLOP per token ({fl['params_matmul'] / 1e9:.3f} B matmul parameters)\n")
    print("| micro-batch | tokens/s | peak memory (GB) | TFLOP/s | MFU |\n|---|---|---|---|---|")
    for r in rows:
        if "oom" in r:
            print(f"| {r['batch']} x {seq_len} | out of memory | | | |")
        else:
            print(f"| {r['batch']} x {seq_len} | {r['tok_per_s']:,.0f} | {r['peak_memory_gb']:.1f} | {r['tflops']:.1f} | "
                  f"{100 * r['mfu']:.1f}% |")
    if projection:
        print("\n| tokens, GPUs | projected wall time (h) |\n|---|---|")
        for k, h in projection.items():
            print(f"| {k} | {h:,.1f} |")
    if args.quick:
        print("\n(--quick: a toy model; the timings mean nothing)")


if __name__ == "__main__":
    main()

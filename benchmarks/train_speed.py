"""Recovery training speed (issues 14, 23): steady-state tokens/s and model-FLOPs utilisation after warm-up, the
warm-up apart, peak memory, host synchronisations and operator dispatches per step, and the projected wall time for
1B and 10B tokens on 1 and 8 GPUs, for a 1B-parameter Llama-style model.

On the GPU machine (one command; nothing to download: the model is built from Llama-3.2-1B's geometry with
random weights, a byte-level tokenizer and a synthetic text are generated):

    python benchmarks/train_speed.py --budget-s 240      # build + compress + train + table within 4 minutes
    python benchmarks/train_speed.py --batches 1,2,4,8   # micro-batch sizes to try (seq 2048)
    python benchmarks/train_speed.py --micro-batch auto  # the largest micro-batch that fits (CUDA; 1 on a CPU)
    python benchmarks/train_speed.py --budget-s 240 --loss-chunk 1024,4096   # the loss's chunk size, one run each
    python benchmarks/train_speed.py --budget-s 240 --teacher-graph on,off   # the teacher's CUDA graph, with and without

On this CPU, end to end on a tiny config in seconds (what tests/test_train_speed.py runs; timings are the
plumbing's, not a GPU's):

    python benchmarks/train_speed.py --tiny

Steps: the model (16 layers, hidden 2048, intermediate 8192, 32 heads / 8 KV heads, vocabulary 128256, tied
head: 1.24 B parameters) is saved in fp32 (what ``compress`` reads) under benchmarks/out/train_speed/;
``qrecover.api.compress`` at 3.5 bpw over the linear layers (3- and 4-bit palettization, no error feedback: the
values do not change the speed, and it saves minutes) on the device; then for each micro-batch size,
``qrecover.recovery.api.recover`` with rank 16 on every projection, distillation from the unquantized model
(the teacher in bf16 on the same GPU), bf16 autocast, sequences of 2048 tokens, ``--steps`` optimizer steps of
one micro-batch each. The trainer reads the loss back at its first 2 steps (the warm-up: compilation, allocator,
autotuning) and then only every ``--log-every`` steps: steady-state tokens/s is the tokens after the warm-up over
the time after it; the warm-up's seconds are reported apart. The second optimizer step (the last of the warm-up)
runs under :class:`qrecover.recovery.host_sync.HostSyncCounter`: its host synchronisations (device reads) and ATen
operator dispatches (about one kernel launch each on a GPU) are printed per step; on the CPU these counts are what
a GPU run would see, the timings not. A size that runs out of memory is reported as such.

FLOPs per trained token, counted as work the model must do: the frozen student's forward (``2 N``) and its
backward to the activations (``2 N``: no weight gradients for a frozen base; LoRA's are negligible), the
teacher's forward (``2 N``), N = the parameters of every matrix multiply (linear layers and the head), plus
causal attention (``2 L s d`` per token per forward, twice that for a backward). MFU = steady-state tokens/s x
that / the GPU's dense bf16 peak (H100/H200 SXM: 989 TFLOP/s; ``--peak-tflops`` to override).

Projection: wall time = tokens / (steady-state tokens/s) on one GPU; on 8 GPUs the same divided by 8 (data
parallel; the gradient all-reduce is the adapter's ~10-20 MB per step, small next to a step's compute). Not
measured on 8 GPUs.

Prints a Markdown table; writes benchmarks/out/train_speed-<device>[-tiny].json.
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
from qrecover.recovery import train as T  # noqa: E402
from qrecover.recovery.api import recover  # noqa: E402
from qrecover.recovery.config import RecoverConfig  # noqa: E402
from qrecover.recovery.host_sync import HostSyncCounter  # noqa: E402

OUT = ROOT / "benchmarks" / "out" / "train_speed"
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                num_key_value_heads=8, max_position_embeddings=4096, tie_word_embeddings=True, rope_theta=500000.0)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
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


#: ATen operators that copy or cast a tensor (a GPU step's pure data movement)
COPY_OPS = ("copy_", "_to_copy", "clone", "contiguous")


class StepCounts:
    """Wraps the trainer's optimizer step for one run and counts, under :class:`HostSyncCounter`, the host
    synchronisations and ATen dispatches of its second step only: the last warm-up step, timed apart, so that the
    counter's own Python overhead (per operator) never enters the steady-state timings. With ``--compile-layers`` the
    counts are the eager path's (compiled graphs do not run under a dispatch mode)."""

    def __init__(self, profile: bool = False) -> None:
        self.calls = 0
        self.counted: HostSyncCounter | None = None
        self._real = T.optimizer_step
        self.profile = profile
        self.profile_table: str | None = None

    def _profiled(self, ctx, micro):
        """One steady-state step under ``torch.profiler``: the operators and kernels by device time, printed."""
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        with profile(activities=acts) as prof:
            out = self._real(ctx, micro)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        ka = prof.key_averages()
        keys = ("self_device_time_total", "self_cuda_time_total") if torch.cuda.is_available() else ("self_cpu_time_total",)
        for key in keys:
            try:
                self.profile_table = ka.table(sort_by=key, row_limit=30, max_name_column_width=70)
                break
            except (AttributeError, KeyError, ValueError):
                continue
        return out

    COUNTED = 2  # the step counted under HostSyncCounter; with a profile, the next one is profiled

    def __enter__(self) -> "StepCounts":
        # with a profile, the warm-up (excluded from the steady-state figures) takes in the profiled step too
        self._warmup = T.WARMUP_LOG_STEPS
        T.WARMUP_LOG_STEPS = self.COUNTED + 1 if self.profile else self.COUNTED
        def counted(ctx, micro):
            self.calls += 1
            if self.profile and self.calls == self.COUNTED + 1:
                return self._profiled(ctx, micro)
            if self.calls != self.COUNTED:
                return self._real(ctx, micro)
            with HostSyncCounter() as c:
                out = self._real(ctx, micro)
            self.counted = c
            return out

        T.optimizer_step = counted
        return self

    def __exit__(self, *exc) -> None:
        T.optimizer_step = self._real
        T.WARMUP_LOG_STEPS = self._warmup

    def steady(self) -> dict:
        c = self.counted
        top = c.out_bytes.most_common(8) if c else []
        return {"syncs_per_step": c.syncs if c else None, "dispatches_per_step": c.dispatches if c else None,
                "sync_kinds": dict(c.by_name) if c else None,
                "copies_per_step": sum(c.ops[k] for k in COPY_OPS) if c else None,
                "copy_mb_per_step": sum(c.out_bytes[k] for k in COPY_OPS) / 1e6 if c else None,
                "top_ops_by_output_mb": {k: [c.ops[k], round(v / 1e6, 1)] for k, v in top},
                "ops_per_step": dict(c.ops.most_common()) if c else None}


def train_once(ckpt: Path, mix: Path, out: Path, batch: int, seq_len: int, steps: int, log_every: int,
               compile_layers: bool = False, checkpointing: bool = False, profile: bool = False,
               precision: str = "auto", base_dtype: str = "auto", loss_chunk: int | None = None, teacher_graph: bool = True,
               fused_layers: bool = True) -> dict:
    """One recovery run of ``steps`` optimizer steps of one ``batch x seq_len`` micro-batch; its speed record."""
    chunk = {} if loss_chunk is None else {"loss_chunk": loss_chunk}
    cfg = RecoverConfig(rank=16, objective="kd", tokens=batch * seq_len * steps, seq_len=seq_len, batch_size=batch,
                        mix=str(mix), decontaminate=False, checkpoint_every=0, precision=precision, base_dtype=base_dtype, log_every=log_every,
                        compile_layers=compile_layers, gradient_checkpointing=checkpointing, teacher_graph=teacher_graph,
                        fused_layers=fused_layers, **chunk)
    t0 = time.perf_counter()
    try:
        with StepCounts(profile) as counts:
            meta = recover(ckpt, out, cfg, overwrite=True, show_progress=False)
        if counts.profile_table:
            print(f"\nprofile of one step after warm-up (micro-batch {batch}; counted in the warm-up, so the "
                  f"steady-state tokens/s exclude the profiler's overhead):\n{counts.profile_table}", flush=True)
    except torch.cuda.OutOfMemoryError as e:
        torch.cuda.empty_cache()
        return {"batch": batch, "loss_chunk": cfg.loss_chunk, "teacher_graph_on": teacher_graph, "oom": str(e).splitlines()[0][:200]}
    t = meta["training"]
    warm = t.get("warmup")
    steady_tokens = t["tokens"] - warm["tokens"] if warm else t["tokens"]
    steady_s = t["seconds"] - warm["seconds"] if warm else t["seconds"]
    return {"batch": batch, "loss_chunk": cfg.loss_chunk, "teacher_graph_on": teacher_graph, "teacher_graph": t.get("teacher_graph"),
            "tokens": t["tokens"], "steps": t["steps"], "tok_per_s": steady_tokens / steady_s,
            "tok_per_s_incl_warmup": t["tok_per_s"], "warmup_s": warm["seconds"] if warm else None,
            "warmup_steps": warm["steps"] if warm else 0, "train_s": t["seconds"], "run_s": time.perf_counter() - t0,
            "peak_memory_gb": t["peak_memory_bytes"] / 1e9, "precision": t.get("mixed_precision"),
            "attention": t.get("attention"), "fused_layers": t.get("fused_layers"), "init_seconds": meta["init"].get("seconds"),
            "adapter_mb": meta["bytes"]["tensors"] / 1e6, **counts.steady()}


def auto_micro_batch(ckpt: Path, mix: Path, out: Path, seq_len: int, checkpointing: bool, largest: int = 64) -> list[int]:
    """``--micro-batch auto``: on CUDA, the largest power-of-two micro-batch whose training step fits (one 2-step
    run per size, doubling until out of memory); on a CPU nothing to probe: ``[1]``."""
    if not torch.cuda.is_available():
        print("--micro-batch auto: no CUDA device, nothing to probe; micro-batch 1", flush=True)
        return [1]
    fits, b = 1, 1
    while b <= largest:
        r = train_once(ckpt, mix, out, b, seq_len, 2, 1, checkpointing=checkpointing)
        if "oom" in r:
            break
        fits, b = b, 2 * b
    print(f"--micro-batch auto: {fits} x {seq_len} fits ({2 * fits} did not, or the cap {largest})", flush=True)
    return [fits]


def projections(tok_per_s: float) -> dict:
    return {f"{tokens:.0e} tokens, {gpus} GPU(s)": tokens / (tok_per_s * gpus) / 3600 for tokens in (1e9, 1e10) for gpus in (1, 8)}


def print_table(result: dict) -> None:
    fl, seq_len = result["flops_per_token"], result["seq_len"]
    print(f"\n{result['device']}, seq {seq_len}, rank 16, kd (teacher on the training device, bf16 on a GPU), {result['steps']} steps per "
          f"size; {fl['total'] / 1e9:.2f} GFLOP per token ({fl['params_matmul'] / 1e9:.3f} B matmul parameters); build "
          f"{result['build_s']:.1f} s, compress {result['compress_s']:.1f} s, total {result['total_s']:.1f} s\n")
    chunks = {r.get("loss_chunk") for r in result["rows"]}
    graphs = {r.get("teacher_graph_on") for r in result["rows"]}

    def label(r: dict) -> str:  # the loss chunk and the teacher graph named where the rows differ in them
        return (f"{r['batch']} x {seq_len}" + (f", loss chunk {r['loss_chunk']}" if len(chunks) > 1 else "")
                + (f", teacher graph {'on' if r.get('teacher_graph_on') else 'off'}" if len(graphs) > 1 else ""))

    print("| micro-batch | steady tokens/s | TFLOP/s | MFU | warm-up (steps, s) | peak memory (GB) | host syncs / step "
          "| dispatches / step | copies / step (MB) | SVD init (s) |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        if "oom" in r:
            print(f"| {label(r)} | out of memory | | | | | | | | |")
            continue
        init = f"{r['init_seconds']:.1f}" if r.get("init_seconds") is not None else ""
        print(f"| {label(r)} | {r['tok_per_s']:,.0f} | {r['tflops']:.2f} | {100 * r['mfu']:.2f}% | "
              f"{r['warmup_steps']}, {r['warmup_s'] or 0:.1f} | {r['peak_memory_gb']:.1f} | {r['syncs_per_step']:g} | "
              f"{r['dispatches_per_step']:,.0f} | {r.get('copies_per_step') or 0:,} ({r.get('copy_mb_per_step') or 0:,.1f}) | {init} |")
    if result["projection_hours"]:
        print("\n| tokens, GPUs | projected wall time (h) |\n|---|---|")
        for k, h in result["projection_hours"].items():
            print(f"| {k} | {h:,.1f} |")
    replays = [f"{label(r)}: {r['teacher_graph']}" for r in result["rows"] if r.get("teacher_graph")]
    if replays:
        print("\nteacher's CUDA graph (replays; failed = the capture's error, eager after):", "; ".join(replays))
    if any(r.get("sync_kinds") for r in result["rows"]):
        print("\nhost syncs by kind:", "; ".join(f"{label(r)}: {r['sync_kinds']}" for r in result["rows"] if r.get("sync_kinds")))
    if result["tiny"]:
        print("\n(--tiny: a tiny config on this device; the counts per step are what a GPU run would see, the timings not)")


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", "--quick", action="store_true", help="a tiny config on this device, end to end in seconds")
    ap.add_argument("--batches", default="1,2,4,8", help="micro-batch sizes to try")
    ap.add_argument("--micro-batch", default=None,
                    help="'auto': the largest that fits (CUDA; 1 on a CPU), a size, or sizes (4,8: one run each, also "
                    "with --budget-s, whose limit then covers them all)")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--loss-chunk", default=None,
                    help="positions per chunk of the loss (RecoverConfig.loss_chunk; default its 1024), or sizes (1024,4096: one "
                    "run each per micro-batch): a larger chunk gives the head's gradient GEMM (chunk x hidden outputs, "
                    "reduced over the vocabulary) more output tiles for the SMs, for more transient memory")
    ap.add_argument("--teacher-graph", default="on",
                    help="the teacher's forward as a CUDA graph (RecoverConfig.teacher_graph): on, off, or on,off (one run each "
                    "per micro-batch, named in the table)")
    ap.add_argument("--no-fused-layers", action="store_true",
                    help="RecoverConfig.fused_layers off: no LoRA addmm, no Liger RMSNorm/SwiGLU/rotary embedding (to compare, or "
                    "to measure around a fused kernel that fails on this GPU)")
    ap.add_argument("--steps", type=int, default=None,
                    help="optimizer steps per batch size (the first 2 are the warm-up; default 12, 4 with --tiny)")
    ap.add_argument("--log-every", type=int, default=5, help="steps between the trainer's loss reads")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="one run within this many seconds: micro-batch 4 (or --micro-batch), --steps, exit 1 if over")
    ap.add_argument("--precision", default="auto", choices=["auto", "bf16", "fp32"],
                    help="the trainer's precision (auto: bf16 autocast on a GPU; --tiny --precision bf16 counts a GPU "
                    "step's casts on the CPU)")
    ap.add_argument("--base-dtype", default="auto", choices=["auto", "bf16", "fp32"],
                    help="RecoverConfig.base_dtype (auto: bf16 on CUDA with bf16 precision; --tiny --precision bf16 "
                    "--base-dtype bf16 counts that step's copies on the CPU)")
    ap.add_argument("--profile", action="store_true", help="also print a torch.profiler table of one step after warm-up "
                    "(a third warm-up step: the steady-state figures stay free of the profiler's overhead)")
    ap.add_argument("--compile-layers", action="store_true", help="torch.compile each decoder layer (RecoverConfig.compile_layers)")
    ap.add_argument("--gradient-checkpointing", action="store_true",
                    help="activation checkpointing (recompute in backward): with --micro-batch auto, a larger micro-batch fits")
    ap.add_argument("--peak-tflops", type=float, default=PEAK_TFLOPS)
    ap.add_argument("--out", type=Path, default=OUT.parent, help="where the model, checkpoint and JSON go")
    args = ap.parse_args()
    if (args.steps is not None and args.steps < 1) or args.seq_len < 8 or (args.budget_s is not None and args.budget_s <= 0):
        ap.error(f"--steps {args.steps} must be >= 1, --seq-len {args.seq_len} >= 8, --budget-s {args.budget_s} > 0")
    if args.micro_batch not in (None, "auto") and not all(b.isdigit() and int(b) > 0 for b in args.micro_batch.split(",")):
        ap.error(f"--micro-batch {args.micro_batch!r} must be 'auto' or positive integers, e.g. --micro-batch 4 or 4,8")
    if not set(args.teacher_graph.split(",")) <= {"on", "off"}:
        ap.error(f"--teacher-graph {args.teacher_graph!r} must be on, off, or on,off")
    if args.loss_chunk is not None and not all(c.isdigit() for c in args.loss_chunk.split(",")):
        ap.error(f"--loss-chunk {args.loss_chunk!r} must be integers >= 0 (0 = unchunked), e.g. --loss-chunk 1024,4096")
    return args


def main() -> None:
    args = parse()
    t_start = time.perf_counter()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config, seq_len = (TINY, 64) if args.tiny else (LLAMA_1B, args.seq_len)
    steps = args.steps or (4 if args.tiny else 12)
    d = args.out / "train_speed" / ("tiny" if args.tiny else "llama-1b")
    src = build(d, config)
    build_s = time.perf_counter() - t_start
    compress_s = compress_model(src, d / "ckpt", device, min(seq_len, 512))
    if args.micro_batch == "auto":
        batches = auto_micro_batch(d / "ckpt", d / "mix.toml", d / "adapter-probe", seq_len, args.gradient_checkpointing)
    elif args.micro_batch is not None:
        batches = [int(b) for b in args.micro_batch.split(",")]
    elif args.budget_s is not None:
        batches = [2 if args.tiny else 4]
    else:
        batches = [1, 2] if args.tiny else [int(b) for b in args.batches.split(",")]
    fl = flops_per_token(config, seq_len)
    rows = []
    chunks = [None] if args.loss_chunk is None else [int(c) for c in args.loss_chunk.split(",")]
    graphs = [g == "on" for g in args.teacher_graph.split(",")]
    for b, chunk, graph in ((b, c, g) for b in batches for c in chunks for g in graphs):
        r = train_once(d / "ckpt", d / "mix.toml", d / f"adapter-b{b}", b, seq_len, steps, args.log_every, args.compile_layers,
                       args.gradient_checkpointing, args.profile, args.precision, args.base_dtype, chunk, graph,
                       not args.no_fused_layers)
        if "tok_per_s" in r:
            r["tflops"] = r["tok_per_s"] * fl["total"] / 1e12
            r["mfu"] = r["tflops"] / args.peak_tflops
        rows.append(r)
        print(json.dumps(r), flush=True)
    ok = [r for r in rows if "tok_per_s" in r]
    best = max(ok, key=lambda r: r["tok_per_s"]) if ok else None
    total_s = time.perf_counter() - t_start
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu",
              "torch": torch.__version__, "config": config, "seq_len": seq_len, "steps": steps, "build_s": build_s,
              "compress_s": compress_s, "total_s": total_s, "budget_s": args.budget_s, "flops_per_token": fl,
              "peak_tflops": args.peak_tflops, "rows": rows, "best": best,
              "projection_hours": projections(best["tok_per_s"]) if best else {}, "tiny": args.tiny,
              "threads": torch.get_num_threads()}
    args.out.mkdir(parents=True, exist_ok=True)
    write_text_atomic(args.out / f"train_speed-{device}{'-tiny' if args.tiny else ''}.json",
                      json.dumps(result, indent=1) + "\n")
    print_table(result)
    if args.budget_s is not None:
        within = total_s <= args.budget_s
        print(f"\nbudget: {total_s:.1f} s of {args.budget_s:.0f} s ({'within' if within else 'OVER BUDGET'})")
        if not within:
            sys.exit(1)


if __name__ == "__main__":
    main()

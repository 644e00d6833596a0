"""Fused dequant-matmul and multi-adapter LoRA kernels: speed on a GPU, correctness everywhere.

On CUDA (one command, nothing to edit):

    python benchmarks/kernels.py
    python benchmarks/kernels.py --parts layers      # or adapters, decode: one part per 10-minute slot

- layers of 1B/3B/8B Llama-style models (2048x8192, 3072x8192, 4096x4096, 4096x14336, 14336x4096; out x in)
  in three packed formats (palettize 3-bit and 4-bit with per-16-row tables, blockwise 4-bit B=64) at
  batch 1, 4, 16, 64: the fused kernel vs fp16 ``torch.matmul`` vs dequantize-then-matmul (the reference
  path), GPU time from CUDA-graph replays (``triton.testing.do_bench_cudagraph``), and the bandwidth each
  achieves as a fraction of a device-to-device copy measured in the same run;
- multi-adapter LoRA: rank 16, 8 distinct adapters in a batch of 16 on a 4096x4096 3-bit base: the batched
  shrink/expand kernels vs the base kernel alone and vs applying the adapters one by one;
- end-to-end greedy decoding tokens/s (batch 1, 64 new tokens): fused vs reference vs the fp16 model, on a
  model built from a 1B Llama-style config (Llama-3.2-1B geometry) with random weights, saved, and
  compressed by ``qrecover.api.compress`` at 3.7 bpw over the whole model: 3/4-bit palettization, the tied
  embedding and head 4-bit blockwise (the head on the kernels too: ``QuantLMHead``) (a byte-level tokenizer and
  synthetic calibration text are generated, so nothing is downloaded); fused vs reference checked on the
  prompt's logits.

On CPU, for correctness only (the kernels run in triton's interpreter; timings would mean nothing and are
not reported):

    python benchmarks/kernels.py --device cpu --interpret

runs toy shapes and a toy model through the same code and checks every fused result against the reference.

Prints a Markdown table; writes benchmarks/out/kernels-<device>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.kernel_timing import cold_ms, gemlite_call, int4_call, l2_bytes, n_copies, repack_costs  # noqa: E402
from qrecover import kernels  # noqa: E402  (does not import triton)
from qrecover.adapters.serve import quantize_adapter  # noqa: E402
from qrecover.io_utils import write_text_atomic  # noqa: E402
from qrecover.kernels import reference  # noqa: E402
from qrecover.kernels.multi_adapter import MultiAdapterLinear, add_lora  # noqa: E402
from qrecover.packing import packed_nbytes  # noqa: E402
from qrecover.qlinear import QuantEmbedding, QuantLinear, QuantLMHead  # noqa: E402
from qrecover.schemes import QuantizedWeight  # noqa: E402

GPU_SHAPES = [(2048, 8192), (3072, 8192), (4096, 4096), (4096, 14336), (14336, 4096)]
TOY_SHAPES = [(48, 128), (96, 256)]
QUICK_SHAPES = [(4096, 14336), (14336, 4096), (4096, 4096)]  # the issue's table
BATCHES = [1, 4, 16, 64]
QUICK_BATCHES = [1, 16]
FORMATS = {  # name -> (scheme, bits, params)
    "palettize-3": ("palettize", 3, {"group_size": 16, "block_size": None}),
    "palettize-4": ("palettize", 4, {"group_size": 16, "block_size": None}),
    "blockwise-4-b64": ("blockwise", 4, {"block_size": 64, "symmetric": True}),
}
LLAMA_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, tie_word_embeddings=True)
LLAMA_TOY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True)


def random_layer(fmt: str, out_f: int, in_f: int, device: str, seed: int = 0) -> QuantLinear:
    """A packed layer with random codes and tables/scales in exactly the stored format (speed does not depend
    on the values; quantizing 58M-weight matrices would only cost time)."""
    scheme, bits, params = FORMATS[fmt]
    g = torch.Generator().manual_seed(seed)
    tensors = {"qdata": torch.randint(0, 256, (packed_nbytes(out_f * in_f, bits),), generator=g, dtype=torch.uint8)}
    if scheme == "palettize":
        n_tables = out_f // params["group_size"] * (in_f // (params["block_size"] or in_f))
        tensors["lut"] = (torch.randn(n_tables, 2**bits, generator=g) * 0.02).sort(dim=1).values.half()
    else:
        tensors["scale"] = (torch.rand(out_f, in_f // params["block_size"], generator=g) * 0.01).half()
    return QuantLinear(QuantizedWeight(scheme, bits, (out_f, in_f), params, tensors)).to(device)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def gpu_time_ms(fn) -> float:
    import triton.testing

    fn()  # compile and tune outside the graph
    torch.cuda.synchronize()
    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=50))
    except RuntimeError as e:  # not capturable: time launches instead (includes launch overhead)
        print(f"note: CUDA graph capture failed ({str(e)[:80]}); timing with do_bench", file=sys.stderr)
        return float(triton.testing.do_bench(fn, rep=50))


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy of 1 GiB (read + write)."""
    src = torch.empty(1 << 29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = gpu_time_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * 2 / (ms * 1e-3)


def environment(device: str) -> dict:
    env = {"device": device, "torch": torch.__version__, "python": platform.python_version()}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        env["cuda"] = torch.version.cuda
        try:
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, check=True).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            env["driver"] = "unknown"
    return env


def _cold_row(layer, x: torch.Tensor, w16: torch.Tensor, l2: int) -> dict:
    """L2-cold ms per call of fp16, the fused kernel, torch's int4 and gemlite (rotated copies, one CUDA graph)."""
    row = {}
    fp16 = [w16] + [w16.clone() for _ in range(n_copies(w16.numel() * 2, l2) - 1)]
    row["ms_fp16_cold"] = cold_ms([lambda w=w: torch.matmul(x, w.T) for w in fp16])
    del fp16
    layers = [layer] + [copy.deepcopy(layer) for _ in range(n_copies(layer.nbytes, l2) - 1)]
    row["ms_fused_cold"] = cold_ms([lambda m=m: kernels.fused_linear(m, x) for m in layers])
    for name, make in (("int4", int4_call), ("gemlite", gemlite_call)):
        calls = [make(m, x) for m in layers[:n_copies(layer.nbytes, l2)]]
        if isinstance(calls[0], str):
            row[f"{name}_note"] = calls[0]
        else:
            row[f"ms_{name}_cold"] = cold_ms(calls)
    row["speedup_vs_fp16_cold"] = row["ms_fp16_cold"] / row["ms_fused_cold"]
    return row


def bench_layers(device: str, shapes: list, timed: bool, copy_bw: float | None, batches=BATCHES, formats=FORMATS,
                 warm: bool = True, dry_run: bool = False) -> list[dict]:
    """One row per (shape, format, batch): correctness vs the reference, one-time repack costs, and on CUDA the
    L2-cold times (and, with ``warm``, the L2-warm replay times of the same weights). ``dry_run``: build every case
    (at its real shape, on ``device``) and measure the repacks, but run no kernel."""
    rows = []
    l2 = l2_bytes() if timed else 50 << 20
    for out_f, in_f in shapes:
        w16 = None
        for fmt in formats:
            layer = random_layer(fmt, out_f, in_f, device)
            costs = repack_costs(layer, device)
            if timed:
                w16 = layer.dequantize(torch.float16)
            for batch in batches:
                x = torch.randn(batch, in_f, device=device, dtype=torch.float16 if timed else torch.float32)
                row = {"shape": f"{out_f}x{in_f}", "format": fmt, "batch": batch, "packed_bytes": layer.nbytes,
                       "copies_fused": n_copies(layer.nbytes, l2), "copies_fp16": n_copies(out_f * in_f * 2, l2), **costs}
                if dry_run:
                    row["path"] = kernels.select(layer, "cuda", batch).name
                    rows.append(row)
                    continue
                with torch.no_grad():
                    y = kernels.fused_linear(layer, x)
                    ref = reference.linear(layer, x.float())
                row.update(path=kernels.select(layer, "cuda", batch).name, rel_err_vs_reference=rel_err(y, ref))
                from qrecover.kernels import qmatmul  # imported by fused_linear above (after TRITON_INTERPRET is set)

                fmt_key, bucket = kernels.layer_format(layer), qmatmul._bucket(batch)
                tuned = [c for k, c in qmatmul._TUNED.items() if k[0] == fmt_key and k[1] == bucket]
                if tuned:  # the launch configuration the tuner kept for this case
                    row["config"] = str(tuned[-1])
                measured = [t for k, t in qmatmul.TIMINGS.items() if k[0] == fmt_key and k[1] == bucket]
                if measured:  # every candidate the tuner ran, in its order: ms (L2-cold) or why it was skipped
                    row["candidates"] = [[config_label(c), t] for c, t in measured[-1].items()]
                if timed:
                    with torch.no_grad():
                        row.update(_cold_row(layer, x, w16, l2))
                    if warm:
                        io = (x.numel() + batch * out_f) * 2
                        t_fused = gpu_time_ms(lambda: kernels.fused_linear(layer, x))
                        t_fp16 = gpu_time_ms(lambda: torch.matmul(x, w16.T))
                        t_deq = gpu_time_ms(lambda: reference.linear(layer, x))
                        row.update(ms_fused=t_fused, ms_fp16=t_fp16, ms_dequant_matmul=t_deq,
                                   speedup_vs_fp16=t_fp16 / t_fused,
                                   bw_frac_fused=(layer.nbytes + io) / (t_fused * 1e-3) / copy_bw,
                                   bw_frac_fp16=(w16.numel() * 2 + io) / (t_fp16 * 1e-3) / copy_bw)
                rows.append(row)
    return rows


def bench_multi_adapter(device: str, shape: tuple[int, int], timed: bool, rank: int = 16, n_adapters: int = 8,
                        batch: int = 16) -> dict:
    out_f, in_f = shape
    dtype = torch.float16 if timed else torch.float32
    base = random_layer("palettize-3", out_f, in_f, device)
    g = torch.Generator().manual_seed(1)
    lora_a = (torch.randn(n_adapters, rank, in_f, generator=g) / in_f**0.5).to(device, dtype)
    lora_b = (torch.randn(n_adapters, out_f, rank, generator=g) * 0.01).to(device, dtype)
    layer = MultiAdapterLinear(base, lora_a, lora_b, torch.full((n_adapters,), 2.0)).to(device)
    # the same adapters as 8-bit adapter files store them (int8 per row, fp16-exact scales): half the bytes
    q8 = MultiAdapterLinear.from_int8(base, [quantize_adapter(a.cpu(), b.cpu(), 2.0) for a, b in zip(lora_a, lora_b)]).to(device)
    index = (torch.arange(batch) % n_adapters).to(device)
    x = torch.randn(batch, in_f, device=device, dtype=dtype)

    def fused_base():
        return kernels.fused_linear(base, x)

    def fused_multi():
        return add_lora(fused_base(), x, layer.lora_a, layer.lora_b, layer.scaling, index, use_kernels=True)

    def fused_multi_int8():
        return add_lora(fused_base(), x, q8.lora_a, q8.lora_b, q8.scaling, index, use_kernels=True, a_scale=q8.a_scale,
                        b_scale=q8.b_scale)

    def one_by_one():
        return add_lora(fused_base(), x, layer.lora_a, layer.lora_b, layer.scaling, index, use_kernels=False)

    def nbytes(*ts: torch.Tensor) -> int:
        return sum(t.numel() * t.element_size() for t in ts)

    with torch.no_grad():
        int8_ref = add_lora(fused_base(), x, q8.lora_a, q8.lora_b, q8.scaling, index, use_kernels=False, a_scale=q8.a_scale,
                            b_scale=q8.b_scale)
        row = {"shape": f"{out_f}x{in_f}", "rank": rank, "adapters": n_adapters, "batch": batch,
               "rel_err_multi_vs_one_by_one": rel_err(fused_multi(), one_by_one()),
               "rel_err_int8_vs_one_by_one": rel_err(fused_multi_int8(), int8_ref),
               "bytes_base": base.nbytes, "adapter_dtype": str(dtype).removeprefix("torch."), "bytes_adapters": nbytes(lora_a, lora_b),
               "bytes_adapters_int8": nbytes(q8.lora_a, q8.lora_b, q8.a_scale, q8.b_scale)}
        if timed:
            t_base, t_multi = gpu_time_ms(fused_base), gpu_time_ms(fused_multi)
            t_int8 = gpu_time_ms(fused_multi_int8)
            row.update(ms_multi_int8=t_int8, overhead_int8_vs_base=t_int8 / t_base - 1)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(20):
                one_by_one()  # data-dependent indexing: not graph-capturable, so wall time
            torch.cuda.synchronize()
            t_obo = (time.perf_counter() - t0) / 20 * 1e3
            row.update(ms_base=t_base, ms_multi=t_multi, ms_one_by_one=t_obo, overhead_vs_base=t_multi / t_base - 1)
    return row


def _tokenizer_and_text(d: Path) -> str:
    """A byte-level tokenizer saved into ``d`` and a synthetic calibration text file; returns the text path."""
    from benchmarks.common import save_byte_level_tokenizer

    save_byte_level_tokenizer(d)
    g = torch.Generator().manual_seed(0)
    words = ["the", "kernel", "reads", "packed", "codes", "table", "row", "bits", "weight", "decode", "token", "of"]
    paras = [" ".join(words[i] for i in torch.randint(0, len(words), (200,), generator=g).tolist()) for _ in range(400)]
    text = d.parent / "calib.txt"
    text.write_text("\n\n".join(paras))
    return str(text)


def embed_in_dtype(model, dtype: torch.dtype):
    """Look embeddings up in ``dtype``: ``QuantEmbedding.forward`` dequantizes in fp32, so a model cast to fp16
    would run fp32 activations, and the tied head (which dequantizes in the activation dtype) would make the
    embedding's dense cache alternate between dtypes at every step."""
    emb = model.get_input_embeddings()
    if isinstance(emb, QuantEmbedding):
        emb.forward = lambda ids: F.embedding(ids, emb.dequantize(dtype), emb.padding_idx)
    return model


def bench_decode(device: str, config: dict, timed: bool, new_tokens: int) -> dict:
    """Build, save and compress a random Llama of ``config``; decode fused vs reference vs the uncompressed model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from qrecover.api import compress
    from qrecover.config import CompressConfig

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "model"
        src.mkdir()
        calib = _tokenizer_and_text(src)
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(**config)).save_pretrained(src)
        t0 = time.time()
        # a 3/4-bit mix, 3.7 bpw over the whole model: the embedding (and so the tied head, 21% of a 1B Llama's
        # weights) 4-bit in blocks of 32 with zero points, as `--embedding-bits auto` stores it; no error feedback:
        # the values do not change the speed, and it saves minutes
        cfg = CompressConfig(model=str(src), bpw=3.7, scope="model", bits=[3, 4], calib_data=calib, calib_samples=4,
                             seq_len=128, scheme_params={"error_feedback": False}, embedding_encodings="blockwise:4/b32/asym")
        compress(cfg, out=tmp / "ckpt", show_progress=False)
        compress_s = time.time() - t0
        dtype = torch.float16 if timed else torch.float32
        dense = LlamaForCausalLM.from_pretrained(src, dtype=dtype).to(device).eval() if timed else None
        row = decode_checkpoint(tmp / "ckpt", device, timed, new_tokens, dense)
    row.update(config={k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "vocab_size")},
               compress_s=compress_s)
    return row


def decode_checkpoint(ckpt: Path, device: str, timed: bool, new_tokens: int, dense=None) -> dict:
    """Greedy decoding of a qrecover checkpoint with the fused kernels and with the reference path (and of
    ``dense``, the uncompressed model, when given): tokens/s when timed, and the fused-vs-reference agreement."""
    from qrecover.loading import load

    dtype = torch.float16 if timed else torch.float32
    qmodel = embed_in_dtype(load(ckpt).to(device=device, dtype=dtype), dtype)
    ids = torch.tensor([[5, 17, 42, 7]], device=device)

    def generate(model) -> tuple[list[int], float, torch.Tensor, float]:
        """Greedy tokens, tokens/s, the prompt's logits, and the first use's seconds (the prompt's forward and a
        2-token warm-up: on CUDA with the kernels, every layer kind's tuning, compilations included)."""
        with torch.no_grad():
            t_first = time.perf_counter()
            logits = model(input_ids=ids).logits[0].float()
            model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0)  # warm-up, tuning
            if device == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            first_use = t0 - t_first
            out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
        return out[0, ids.shape[1]:].tolist(), new_tokens / (time.perf_counter() - t0), logits, first_use

    quant = [m for m in qmodel.modules() if isinstance(m, QuantLinear)]
    calls = {"fused": 0}
    head = qmodel.get_output_embeddings()
    row = {"checkpoint": str(ckpt), "measured_bpw": qmodel.qrecover_manifest.get("measured_bpw"), "new_tokens": new_tokens,
           "kernel_layers": f"{sum(not isinstance(kernels.layer_format(m), str) for m in quant)}/{len(quant)}",
           # a tied packed head takes the kernels' path on CUDA too (QuantLMHead); an unquantized head is a dense matmul
           "head": (f"packed, {kernels.layer_format(head)}" if isinstance(head, QuantLMHead) else f"dense {type(head).__name__}"),
           **weight_mb_per_token(qmodel)}
    # QuantLinear.forward (and QuantLMHead's) only dispatches CUDA inputs: route the packed layers to the kernel here
    routed = quant + ([head] if isinstance(head, QuantLMHead) else []) if device == "cpu" else []
    for m in routed:
        if not isinstance(kernels.layer_format(m), str):
            m.forward = lambda x, m=m: calls.__setitem__("fused", calls["fused"] + 1) or kernels.fused_linear(m, x)
    with kernels_env("1"):
        fused_tokens, fused_tps, fused_logits, fused_first = generate(qmodel)
    for m in routed:
        m.__dict__.pop("forward", None)
    if device == "cpu" and not calls["fused"]:
        raise RuntimeError("no layer went through the fused kernel")
    with kernels_env("0"):
        ref_tokens, ref_tps, ref_logits, _ = generate(qmodel)
    row["greedy_tokens_match"] = sum(a == b for a, b in zip(fused_tokens, ref_tokens)) / new_tokens
    row["prompt_logits_rel_err"] = rel_err(fused_logits, ref_logits)
    if timed:
        from qrecover.kernels import qmatmul

        row.update(tok_s_fused=fused_tps, tok_s_reference=ref_tps, first_use_s_fused=round(fused_first, 2),
                   tune_limit=qmatmul.tune_limit(), compile_threads=qmatmul.compile_threads())
        if dense is not None:
            row["tok_s_fp16"] = generate(dense)[1]
        row.update(static_graph_decode(qmodel, dense, ids, new_tokens))
    return row


def weight_mb_per_token(model) -> dict:
    """MB of weights one decoded token reads (every linear layer and the output head once; lookups and norms are
    negligible), packed as stored and as fp16 for the same shapes: their ratio bounds the decode speed-up when
    bandwidth bounds decoding."""
    head = model.get_output_embeddings()
    mods = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head] + [head]
    packed = fp16 = 0
    for m in mods:
        shape = tuple(m.shape) if isinstance(m, (QuantLinear, QuantLMHead)) else tuple(m.weight.shape)
        fp16 += shape[0] * shape[1] * 2
        packed += m.nbytes if isinstance(m, (QuantLinear, QuantLMHead)) else m.weight.numel() * m.weight.element_size()
    return {"weight_mb_per_token": packed / 1e6, "weight_mb_per_token_fp16": fp16 / 1e6, "bandwidth_bound_vs_fp16": fp16 / packed}


def static_graph_decode(qmodel, dense, ids: torch.Tensor, new_tokens: int) -> dict:
    """Greedy tokens/s with a static cache and CUDA-graph replays (benchmarks/decode_graph.py): the checkpoint on
    the fused kernels (``QRECOVER_KERNELS=1``) and the fp16 model, and the ratio the issue asks >= 2x of."""
    from benchmarks.decode_graph import greedy_static

    with kernels_env():
        q = greedy_static(qmodel, ids, new_tokens)
    row = {"graph_tok_s_fused": q["tok_per_s"], "graph_fused": q["graph"], "graph_fused_error": q["graph_error"],
           "graph_warmup_s_fused": q["warmup_s"]}
    if dense is not None:
        d = greedy_static(dense, ids, new_tokens)
        row.update(graph_tok_s_fp16=d["tok_per_s"], graph_fp16=d["graph"], graph_fp16_error=d["graph_error"],
                   graph_tokens_match_fp16=sum(a == b for a, b in zip(q["tokens"], d["tokens"])) / new_tokens)
        if q["tok_per_s"] and d["tok_per_s"]:
            row["graph_speedup_vs_fp16"] = q["tok_per_s"] / d["tok_per_s"]
    print(json.dumps({"static_graph_decode": row}), flush=True)  # before the compiled runs, which a time limit may cut
    # gpt-fast's protocol: the one-token step compiled (the elementwise work between the matmuls fused), both models
    for name, model in (("fused", qmodel), ("fp16", dense)):
        if model is None:
            continue
        with kernels_env() if name == "fused" else contextlib.nullcontext():
            try:
                c = greedy_static(model, ids, new_tokens, compile=True)
            except Exception as e:  # noqa: BLE001 - reported in the row; the eager rows above stand
                row[f"compiled_error_{name}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
                continue
        row.update({f"compiled_tok_s_{name}": c["tok_per_s"], f"compiled_graph_{name}": c["graph"],
                    f"compiled_graph_error_{name}": c["graph_error"], f"compiled_warmup_s_{name}": c["warmup_s"]})
    if row.get("compiled_tok_s_fused") and row.get("compiled_tok_s_fp16"):
        row["compiled_speedup_vs_fp16"] = row["compiled_tok_s_fused"] / row["compiled_tok_s_fp16"]
    return row


@contextlib.contextmanager
def kernels_env(value: str = "1"):
    """``QRECOVER_KERNELS=value`` inside ("1": every packed layer on the fused kernel, "0": the reference path), the
    old value restored after."""
    old = os.environ.get("QRECOVER_KERNELS")
    os.environ["QRECOVER_KERNELS"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("QRECOVER_KERNELS", None)
        else:
            os.environ["QRECOVER_KERNELS"] = old


def markdown(result: dict) -> str:
    env, timed = result["environment"], result["timed"]
    lines = [f"## Fused kernels on {env.get('gpu', env['device'])}",
             "", " | ".join(f"{k} {v}" for k, v in env.items()), ""]
    if result.get("dry_run"):
        lines += ["**Dry run, no kernel ran**: every case built at its real shape on the CPU; repack times are this "
                  "process's CPU time (one thread), memory is the repacked tensors' bytes. `copies` = weight copies rotated per "
                  "L2-cold call at a 50 MB L2.", ""]
    elif not timed:
        lines += ["**No GPU figure was measured**: CPU run under triton's interpreter at toy shapes, for correctness "
                  "only (timings would mean nothing and are not reported).", ""]
    if "layers" in result:
        lines += _layer_table(result, timed)
    m = result.get("multi_adapter")
    if m:
        lines += ["", f"multi-adapter LoRA ({m['shape']}, rank {m['rank']}, {m['adapters']} adapters, batch {m['batch']}): "
                  f"rel. err vs one by one {m['rel_err_multi_vs_one_by_one']:.1e} (int8 adapters vs their torch reference "
                  f"{m['rel_err_int8_vs_one_by_one']:.1e}); bytes read: base {m['bytes_base'] / 1e6:.2f} MB, adapters {m['adapter_dtype']} "
                  f"{m['bytes_adapters'] / 1e6:.2f} MB, int8 {m['bytes_adapters_int8'] / 1e6:.2f} MB; 2 launches beside the base"]
        if timed:
            lines[-1] += (f"; base {m['ms_base']:.4f} ms, with adapters {m['ms_multi']:.4f} ms "
                          f"(+{m['overhead_vs_base']:.0%}), int8 adapters {m['ms_multi_int8']:.4f} ms "
                          f"(+{m['overhead_int8_vs_base']:.0%}), one by one {m['ms_one_by_one']:.4f} ms")
    for key in ("decode", "checkpoint_decode"):
        d = result.get(key)
        if not d:
            continue
        what = f"{d['config']}, compressed in {d['compress_s']:.0f} s" if "config" in d else d["checkpoint"]
        lines += ["", f"greedy decode ({what}, bpw {d['measured_bpw']}): "
                  f"{d['kernel_layers']} linear layers on the kernel, head {d.get('head', '?')}; weights read per token "
                  f"{d['weight_mb_per_token']:.1f} MB against {d['weight_mb_per_token_fp16']:.1f} in fp16 (at most "
                  f"{d['bandwidth_bound_vs_fp16']:.2f}x where bandwidth bounds decoding); prompt logits fused vs "
                  "reference rel. err "
                  f"{d['prompt_logits_rel_err']:.1e}; greedy tokens agree on {d['greedy_tokens_match']:.0%} of {d['new_tokens']}"]
        if timed:
            lines[-1] += (f"; first use (tuning, {d['tune_limit'] or 'all'} candidates per layer kind, compiled in "
                          f"{d['compile_threads']} threads) {d['first_use_s_fused']:.1f} s")
            lines[-1] += f"; tokens/s fused {d['tok_s_fused']:.1f}, reference {d['tok_s_reference']:.1f}"
            if "tok_s_fp16" in d:
                lines[-1] += f", fp16 {d['tok_s_fp16']:.1f}"
            if d.get("graph_tok_s_fused"):
                how = lambda ok, err: "CUDA graph" if ok else f"eager: {err}"  # noqa: E731
                lines[-1] += (f"; static cache, {how(d['graph_fused'], d['graph_fused_error'])}: fused "
                              f"{d['graph_tok_s_fused']:.1f} tokens/s")
                if d.get("graph_tok_s_fp16"):
                    lines[-1] += (f", fp16 ({how(d['graph_fp16'], d['graph_fp16_error'])}) {d['graph_tok_s_fp16']:.1f}, "
                                  f"{d.get('graph_speedup_vs_fp16', 0):.2f}x")
            for name in ("fused", "fp16"):
                if d.get(f"compiled_tok_s_{name}"):
                    lines[-1] += (f"; compiled step ({how(d[f'compiled_graph_{name}'], d[f'compiled_graph_error_{name}'])}) "
                                  f"{name} {d[f'compiled_tok_s_{name}']:.1f} tokens/s")
                elif d.get(f"compiled_error_{name}"):
                    lines[-1] += f"; compiled step {name} failed: {d[f'compiled_error_{name}']}"
            if d.get("compiled_speedup_vs_fp16"):
                lines[-1] += f", compiled {d['compiled_speedup_vs_fp16']:.2f}x fp16"
    return "\n".join(lines)


def _fmt(v, spec: str = ".4f") -> str:
    return "-" if v is None else format(v, spec)


def config_label(c) -> str:
    """A launch configuration in a few characters: tile, split-K, kernel, table layout and the variants' flags."""
    kind = "dot" if type(c).__name__ == "DotDecode" else ("gemv" if not c.use_dot else "tiled")
    return (f"{kind} {c.block_m}x{c.block_n}x{c.block_k} s{c.split_k} lut{c.lut}{' asm' if c.asm else ''}"
            f"{f' pipe{c.pipe}' if c.pipe else ''}{' serial' if c.serial else ''}{' swap' if c.swap else ''}")


def _candidate_lines(result: dict) -> list[str]:
    """Per timed case, the tuner's candidates in its order (ms L2-cold, or why skipped), the fastest marked."""
    lines = []
    for r in result["layers"]:
        if not r.get("candidates"):
            continue
        times = [t for _, t in r["candidates"] if isinstance(t, float)]
        best = min(times) if times else None
        cells = [f"{label} {t * 1e3:.1f} us{' (best)' if t == best else ''}" if isinstance(t, float) else f"{label}: {t}"
                 for label, t in r["candidates"]]
        lines.append(f"- {r['shape']} {r['format']} batch {r['batch']}: " + "; ".join(cells))
    return ["", "tuner candidates (L2-cold, in the tuner's order):"] + lines if lines else []


def _layer_table(result: dict, timed: bool) -> list[str]:
    lines = []
    if timed and "copy_GBps" in result:
        lines += [f"device-to-device copy: {result['copy_GBps']:.0f} GB/s", ""]
    head = ("| shape | format | batch | path on CUDA | packed MB | repack ms | repack MB | int4 repack ms | int4 MB | "
            "nibble codes ms | nibble codes MB |")
    if not result.get("dry_run"):
        head += " rel. err vs reference |"
    if timed:
        head += " fp16 cold ms | fused cold ms | torch int4 cold ms | gemlite cold ms | fused vs fp16 (cold) |"
    if timed and any("ms_fused" in r for r in result["layers"]):
        head += " fused warm ms | fp16 warm ms | dequant+matmul warm ms | fused BW / copy |"
    lines += [head, "|" + "---|" * (head.count("|") - 1)]
    for r in result["layers"]:
        line = (f"| {r['shape']} | {r['format']} | {r['batch']} | {r['path']} | {r['packed_MB']:.2f} | {r['repack_ms']:.2f} | "
                f"{r['repack_MB']:.3f} | {_fmt(r.get('int4_repack_ms'), '.1f')} | {_fmt(r.get('int4_MB'), '.2f')} | "
                f"{_fmt(r.get('nibble_repack_ms'), '.1f')} | {_fmt(r.get('nibble_MB'), '.2f')} |")
        if not result.get("dry_run"):
            line += f" {r['rel_err_vs_reference']:.1e} |"
        if timed:
            line += (f" {r['ms_fp16_cold']:.4f} | {r['ms_fused_cold']:.4f} | {_fmt(r.get('ms_int4_cold'))} | "
                     f"{_fmt(r.get('ms_gemlite_cold'))} | {r['speedup_vs_fp16_cold']:.2f}x |")
        if "ms_fused" in r:
            line += f" {r['ms_fused']:.4f} | {r['ms_fp16']:.4f} | {r['ms_dequant_matmul']:.4f} | {r['bw_frac_fused']:.0%} |"
        lines.append(line)
    notes = sorted({f"{k[:-5]}: {v}" for r in result["layers"] for k, v in r.items() if k.endswith("_note")})
    return lines + [f"- {n}" for n in notes] + _candidate_lines(result)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--interpret", action="store_true", help="run the kernels in triton's interpreter (CPU)")
    ap.add_argument("--parts", default="layers,adapters,decode",
                    help="comma-separated subset of layers,adapters,decode (on a GPU each fits a 10-minute slot; "
                         "decode compresses a 1B model on the CPU first, a few minutes on 16 cores)")
    ap.add_argument("--checkpoint", help="also decode this qrecover checkpoint (e.g. the default model's), fused vs reference")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out"))
    ap.add_argument("--quick", action="store_true", help="the issue's three shapes at batch 1 and 16, L2-cold only, "
                    "6 tuning configs per case (layers only unless --parts says otherwise): a table within ~4 minutes on an H100")
    ap.add_argument("--dry-run", action="store_true", help="build every case at its real shape on the CPU and measure the "
                    "one-time repacks (time, memory), run no kernel (checks the benchmark itself without a GPU)")
    args = ap.parse_args()
    if args.dry_run:
        args.device = "cpu"
        if args.parts == ap.get_default("parts"):
            args.parts = "layers"
    elif args.quick and args.parts == ap.get_default("parts"):
        args.parts = "layers"
    if args.device == "cpu" and not args.interpret and not args.dry_run:
        ap.error("on CPU the kernels only run in triton's interpreter: pass --interpret (correctness only)")
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"  # read by @triton.jit when qrecover.kernels.qmatmul is first imported
    parts = set(args.parts.split(","))
    if not parts or parts - {"layers", "adapters", "decode"}:
        ap.error(f"--parts {args.parts!r}: choose from layers,adapters,decode")
    if args.dry_run and parts != {"layers"}:
        ap.error("--dry-run checks the layer cases only: drop --parts or pass --parts layers")
    timed = args.device == "cuda" and not args.interpret and not args.dry_run
    torch.manual_seed(0)
    result = {"environment": environment(args.device), "timed": timed, "parts": sorted(parts), "quick": args.quick,
              "dry_run": args.dry_run}
    checks = []
    if args.quick:
        from qrecover.kernels import qmatmul  # after TRITON_INTERPRET is settled: it builds the kernels on import
        qmatmul.TUNE_LIMIT = 6
    if "layers" in parts:
        if timed and not args.quick:
            result["copy_GBps"] = copy_bandwidth(args.device) / 1e9
        shapes = QUICK_SHAPES if (args.quick or args.dry_run) else GPU_SHAPES if timed else TOY_SHAPES
        result["layers"] = bench_layers(args.device, shapes, timed, result.get("copy_GBps", 0) * 1e9,
                                        batches=QUICK_BATCHES if args.quick else BATCHES, warm=not args.quick,
                                        dry_run=args.dry_run)
        if not args.dry_run:
            checks.append(max(r["rel_err_vs_reference"] for r in result["layers"]) < (2e-3 if timed else 1e-5))
    if "adapters" in parts:
        result["multi_adapter"] = bench_multi_adapter(args.device, (4096, 4096) if timed else (96, 128), timed)
        m = result["multi_adapter"]
        checks.append(max(m["rel_err_multi_vs_one_by_one"], m["rel_err_int8_vs_one_by_one"]) < 1e-2)
    if "decode" in parts:
        result["decode"] = bench_decode(args.device, LLAMA_1B if timed else LLAMA_TOY, timed, 64 if timed else 8)
        checks.append(result["decode"]["prompt_logits_rel_err"] < (2e-2 if timed else 1e-5))
    if args.checkpoint:
        result["checkpoint_decode"] = decode_checkpoint(Path(args.checkpoint), args.device, timed, 64 if timed else 8)
        checks.append(result["checkpoint_decode"]["prompt_logits_rel_err"] < (2e-2 if timed else 1e-5))
    result["correct"] = all(checks)
    print(markdown(result))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suffix = ("" if parts == {"layers", "adapters", "decode"} else "-" + "-".join(sorted(parts))) + (
        "-quick" if args.quick else "") + ("-dry-run" if args.dry_run else "")
    path = write_text_atomic(out / f"kernels-{args.device}{suffix}.json", json.dumps(result, indent=2))
    if args.dry_run:
        print(f"\nwrote {path}; dry run: {len(result['layers'])} cases built, no kernel ran")
    else:
        print(f"\nwrote {path}; every fused result {'matches' if result['correct'] else 'DOES NOT match'} the reference")
    sys.exit(0 if result["correct"] else 1)


if __name__ == "__main__":
    main()

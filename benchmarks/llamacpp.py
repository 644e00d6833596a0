"""Exports run in llama.cpp itself (issue 24, item 5): a checkpoint's GGUF export scored by llama.cpp's own kernels
(llama-cpp-python, built from PyPI's source distribution), against the checkpoint's perplexity in qrecover, on the
same held-out windows (qrecover's protocol, :data:`qrecover.evaluate.perplexity.PPL_PROTOCOL`: the same token ids
go into both, so the tokenizers cannot differ).

Where every layer maps exactly onto a GGUF type (Q4_0, Q8_0, Q4_1), llama.cpp's perplexity should match the
checkpoint's within 1% (llama.cpp multiplies Q4_0/Q8_0 weights with activations it rounds to 8 bits itself, so
not to the last digit); where layers are re-quantized (palettized layers, 2/3-bit integers), the export states its
loss (exact layers, weight relative error) and this measures what it costs.

Setup (optional, not in CI: a source build of llama.cpp, 3 min 32 s measured on 2 cores; the extra ``llamacpp``):

    CMAKE_ARGS="-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TOOLS=OFF \\
        -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON \\
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF" \\
        pip install --no-cache-dir --no-binary llama-cpp-python "qrecover[llamacpp]"

(The native build, GGML_NATIVE, detects AMX on these machines and segfaults in llama_decode on every GGUF; without
native flags and AMX it runs: docs/export.md, "Measured in llama.cpp itself".)

    python benchmarks/llamacpp.py                       # the two checkpoints below, compressed once under --out
    python benchmarks/llamacpp.py --checkpoint DIR ...  # any checkpoints
    python benchmarks/llamacpp.py --windows 4           # quicker (default 16 x 512 tokens)
    python benchmarks/llamacpp.py --adapter CKPT=ADAPTER  # a checkpoint with its recovery adapter (repeatable)

Default checkpoints (the default model): blockwise 4-bit symmetric in blocks of 32 with an 8-bit embedding (every
layer exact in GGUF), and the default ``--bpw 3.7`` menu (``rot-mixed-blocks`` since 2026-11-27: palettized and
2/3-bit layers, which GGUF cannot hold and the export re-quantizes, and a tied head written untied); and the first
again with a rank-16 SVD-initialised recovery adapter, unmerged: llama.cpp loads the export's ``adapter/adapter.gguf``
at run time (``--adapter CKPT=DIR`` for your own adapters, ``--no-adapter`` for none). One thread
count for both runtimes (``--threads``, default: all cores), run one after the other. Prints a Markdown table;
writes ``<out>/llamacpp.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import svd_adapter  # noqa: E402
from qrecover import api  # noqa: E402
from qrecover.checkpoint import read_manifest  # noqa: E402
from qrecover.config import CompressConfig  # noqa: E402
from qrecover.data.corpus import token_windows  # noqa: E402
from qrecover.export import export  # noqa: E402

DEFAULTS = {
    "blockwise-4-b32-sym": dict(bpw=None, bits=[4], embedding_bits="8", calib_samples=8, scheme="blockwise",
                                scheme_params={"block_size": 32, "symmetric": True}),
    "default-3.7bpw": dict(bpw=3.7),
}
ADAPTED = "blockwise-4-b32-sym"  # the default adapter row's checkpoint: every layer exact in GGUF, so the adapter is what differs


def llama_cpp_nll(gguf: Path, windows: list[torch.Tensor], threads: int, lora: Path | None = None) -> tuple[float, float]:
    """Mean NLL of every predicted token of ``windows`` (each scored alone, as qrecover does) under llama.cpp, with the
    LoRA GGUF ``lora`` applied at run time (scale 1: llama.cpp multiplies by the file's alpha / rank, as PEFT does);
    and the seconds it took. Logits of every position (``logits_all``), log-softmax in float64 here."""
    from llama_cpp import Llama

    n = int(windows[0].numel())
    llm = Llama(model_path=str(gguf), n_ctx=n, n_batch=n, n_ubatch=n, logits_all=True, n_threads=threads,
                n_threads_batch=threads, verbose=False, lora_path=None if lora is None else str(lora), lora_scale=1.0)
    nll, count, t0 = 0.0, 0, time.perf_counter()
    for w in windows:
        ids = w.tolist()
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: n - 1], dtype=np.float64)
        logits -= logits.max(axis=1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
        nll -= float(logp[np.arange(n - 1), ids[1:]].sum())
        count += n - 1
    return nll / count, time.perf_counter() - t0


def score(ckpt: Path, adapter: Path | None, out: Path, windows_n: int, threads: int) -> dict:
    """One row: ``ckpt`` (with ``adapter`` unmerged, if any) in qrecover and its GGUF export in llama.cpp."""
    model, tok, _ = api.load_any(str(ckpt), adapter=adapter)
    windows = token_windows(tok, "python-docs", "eval", windows_n, 512)
    t0 = time.perf_counter()
    own = api.perplexity(model, tok, windows=windows_n, seq_len=512, show_progress=False)
    own_s = time.perf_counter() - t0
    del model
    dest = out / (f"{ckpt.name}.{adapter.name}.gguf" if adapter is not None else f"{ckpt.name}.gguf")
    rep = export(ckpt, "gguf", dest, adapter=adapter, overwrite=True)
    lora = dest / "adapter" / rep["adapter"]["file"] if adapter is not None else None
    nll, cpp_s = llama_cpp_nll(dest / rep["file"], windows, threads, lora)
    return {"checkpoint": str(ckpt), "adapter": None if adapter is None else str(adapter),
            "adapter_tensors": None if adapter is None else rep["adapter"]["tensors"],
            "bpw_checkpoint": read_manifest(ckpt)["measured_bpw"]["model"],
            "bpw_gguf": rep["bpw"], "gguf_bytes": (dest / rep["file"]).stat().st_size,
            "exact_layers": f"{rep['exact_layers']}/{rep['total_layers']}", "weight_rel_error": rep["total_rel_error"],
            "types": rep.get("types"), "ppl_qrecover": own["ppl"], "ppl_llama_cpp": math.exp(nll),
            "ratio": math.exp(nll) / own["ppl"], "seconds_qrecover": round(own_s, 1), "seconds_llama_cpp": round(cpp_s, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", action="append", default=[], help="a checkpoint directory (repeatable); default: "
                    + ", ".join(DEFAULTS) + ", compressed once under --out")
    ap.add_argument("--adapter", action="append", default=[], metavar="CHECKPOINT=ADAPTER",
                    help="also score CHECKPOINT with this recovery adapter (PEFT directory) unmerged: llama.cpp loads the "
                         "export's adapter.gguf at run time (repeatable); default: a rank-16 SVD-initialised adapter of "
                         f"{ADAPTED}, made once under --out")
    ap.add_argument("--no-adapter", action="store_true", help="no adapter rows")
    ap.add_argument("--windows", type=int, default=16, help="held-out windows of 512 tokens (python-docs 'eval')")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "llamacpp"))
    args = ap.parse_args()
    try:
        import llama_cpp
    except ImportError as e:
        print(f"llama-cpp-python does not import ({e}): see this script's docstring (pip install --no-binary "
              "llama-cpp-python 'qrecover[llamacpp]')", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    runs: list[tuple[Path, Path | None]] = [(Path(c), None) for c in args.checkpoint]
    for spec in args.adapter:
        ckpt, sep, adapter = spec.partition("=")
        if not sep:
            print(f"--adapter {spec!r}: give CHECKPOINT=ADAPTER (a checkpoint directory and its recovery adapter)", file=sys.stderr)
            return 2
        runs.append((Path(ckpt), Path(adapter)))
    if not args.checkpoint and not args.adapter:
        for name, spec in DEFAULTS.items():
            ckpt = out / name
            if not (ckpt / "qrecover.json").is_file():
                t = time.time()
                api.compress(CompressConfig(**spec), out=ckpt, show_progress=False)
                print(f"compressed {name} in {time.time() - t:.0f} s", flush=True)
            runs.append((ckpt, None))
        if not args.no_adapter:
            ckpt, adapter = out / ADAPTED, out / f"{ADAPTED}.svd-r16"
            t = time.time()
            if (info := svd_adapter(ckpt, adapter)) is not None:
                print(f"svd-initialised rank-16 adapter in {time.time() - t:.0f} s (captures {info['_total']:.2f} of the "
                      "output error)", flush=True)
            runs.append((ckpt, adapter))
    rows = []
    for ckpt, adapter in runs:
        rows.append(score(ckpt, adapter, out, args.windows, args.threads))
        print(json.dumps(rows[-1], default=str), flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "llamacpp.json").write_text(json.dumps({"llama_cpp_python": llama_cpp.__version__, "windows": args.windows,
                                                   "seq_len": 512, "threads": args.threads, "rows": rows}, indent=1, default=str))
    print(f"\nllama-cpp-python {llama_cpp.__version__}, {args.windows} x 512 held-out tokens (python-docs 'eval'), "
          f"{args.threads} threads\n")
    print("| checkpoint | adapter | bpw (checkpoint / GGUF) | exact layers | weight rel. error | ppl qrecover | "
          "ppl llama.cpp | ratio | s (qrecover / llama.cpp) |\n|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {Path(r['checkpoint']).name} | {Path(r['adapter']).name if r['adapter'] else '-'} | "
              f"{r['bpw_checkpoint']:.3f} / {r['bpw_gguf']:.3f} | {r['exact_layers']} | "
              f"{r['weight_rel_error']:.2e} | {r['ppl_qrecover']:.3f} | {r['ppl_llama_cpp']:.3f} | {r['ratio']:.4f} | "
              f"{r['seconds_qrecover']} / {r['seconds_llama_cpp']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

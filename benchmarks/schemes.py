"""Quantizer benchmark on the default model (issue 11): palettize, blockwise (RTN), gptq, awq, awq+gptq, a mixed
3.7 bpw allocation, and llm-compressor's GPTQ / AWQ at the same settings, all under one perplexity protocol.

Every row runs in fresh subprocesses (one at a time: the CPU is shared), so each row's wall time and peak RSS are
its own (``os.wait4`` rusage of the child):

- qrecover rows: ``qrecover compress --encodings SPEC --embedding-bits 8 --json`` (one spec = a uniform model;
  several plus ``--bpw`` = a whole-model allocation), then ``qrecover ppl DIR --json`` (README protocol: 32 windows
  x 512 tokens of the python-docs eval split). bpw (model and linear) come from the manifest's measured_bpw.
- llm-compressor rows: this file re-runs itself under the llm-compressor venv (``--llmc-python``, default
  ``$QRECOVER_LLMC_PYTHON`` or ``venv-llmc/bin/python``; make it with ``python3 -m venv venv-llmc &&
  venv-llmc/bin/pip install torch==2.13.0 llmcompressor==0.14.0.1``: it pins transformers<=5.17, so it cannot
  share qrecover's venv; the row is skipped with a note when it or ``llmcompressor`` is missing) with
  ``--llmc-worker``: ``oneshot`` with GPTQModifier (or AWQModifier + QuantizationModifier) on Linear layers except
  lm_head, int asymmetric groups, calibrated on *qrecover's own* calibration token windows (dumped by this script
  from ``qrecover.data.corpus.token_windows``). The worker saves the dequantized (fake-quantized) linear weights and every
  other tensor oneshot changed (AWQ folds its scales into the norms) with safetensors; their perplexity is then
  measured in qrecover's venv on the original model with those tensors loaded (same protocol). Its embedding
  (tied lm_head) stays unquantized, fp32; qrecover's rows keep it at 8-bit per channel, so the same weights are also
  scored with qrecover's 8-bit embedding (``ppl_embedding8``, in the row's note): the two libraries' rows then
  differ in their linear layers alone. The llmc bpw is the nominal one of its packed format (bits + fp16 scale and
  zero per group).

Finished rows are cached in benchmarks/out/schemes/*.json, keyed by the row's settings, so a re-run skips them.

Second architectures (``--arch qwen2|gemma3``, issue 11's "runs on a second architecture"): a randomly initialised
model from a config only (:data:`ARCHS`: Qwen2 with q/k/v biases and an untied head; Gemma-3's text model with the
``sqrt(hidden)``-scaled embedding, sandwich norms and a tied head), built once under benchmarks/out/models/ with the
default model's tokenizer (vocabulary 49152, so qrecover's calibration and perplexity protocol apply unchanged) and
saved with ``save_pretrained``. Every row then runs on it (``--model DIR``; the llm-compressor worker loads the same
directory), plus g128 rows (its 256/768 columns allow them) and ``awq-fold-exact``: qrecover's AWQ transform, with
scales searched on the calibration windows, applied to the unquantized model, and the largest logit difference
against the untouched model on held-out windows. Cache: benchmarks/out/schemes/<arch>/; report:
reports/schemes-<arch>.md/.json. A random model's perplexity (about the vocabulary size) says nothing about quality:
those rows show that every scheme, AWQ mapping, finalize and the allocator run on the architecture, with the bpw.

    python benchmarks/schemes.py                         # every row (hours on 2 CPU cores)
    python benchmarks/schemes.py --rows gptq-w4g64,rtn-w4g64
    python benchmarks/schemes.py --list                  # row names
    python benchmarks/schemes.py --arch qwen2            # every row on a random Qwen2-style model (minutes each)

Writes reports/schemes.md and reports/schemes.json (every cached row, in the table's order).

Note: this file runs under two Python environments (qrecover's and llm-compressor's), so its top-level imports are
the standard library and torch only; qrecover / llmcompressor / transformers are imported where each mode runs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# run as a script, this directory is sys.path[0]; its kernels.py would shadow the ``kernels`` package that
# transformers probes for on import (a circular import when transformers is imported before qrecover)
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / "out" / "schemes"
MODELS = ROOT / "benchmarks" / "out" / "models"
MODEL_DIR = Path("~/.cache/qrecover/models/smollm2-135m-instruct").expanduser()
LLMC_PY = os.environ.get("QRECOVER_LLMC_PYTHON", "venv-llmc/bin/python")
MIXED = "palettize:2,palettize:3,palettize:4,gptq:3/g64/act_order=false,gptq:4/g64/act_order=false"
# The same menu on the AWQ-transformed model (the transform is model-level; its scale search optimises the first
# encoding that names it, 3-bit g64 here, the width most linear layers get at 3.7 bpw).
PAL_BLOCKS = "palettize:2,palettize:3,palettize:4,palettize:2/b192,palettize:3/b192,palettize:4/b192"
MIXED_AWQ = "awq+gptq:3/g64/act_order=false,palettize:2,palettize:3,palettize:4,gptq:4/g64/act_order=false"

# name -> settings. kind "qrecover": compress args; kind "llmc": llm-compressor modifier and quant args.
# Group size 64: the default group of 128 does not divide the default model's 576 input columns (g128 rows are
# impossible on it; 1536-column down_proj would allow it, but one group size per row keeps rows comparable).
ROWS: dict[str, dict] = {
    "gptq-w4g64": {"kind": "qrecover", "encodings": "gptq:4/g64/asym/act_order=false"},
    "rtn-w4g64": {"kind": "qrecover", "encodings": "blockwise:4/b64/asym"},
    "llmc-gptq-w4g64": {"kind": "llmc", "method": "gptq", "bits": 4, "group": 64},
    "gptq-w3g64": {"kind": "qrecover", "encodings": "gptq:3/g64/asym/act_order=false"},
    "rtn-w3g64": {"kind": "qrecover", "encodings": "blockwise:3/b64/asym"},
    "palettize-4": {"kind": "qrecover", "encodings": "palettize:4"},
    "palettize-3": {"kind": "qrecover", "encodings": "palettize:3"},
    "mixed-3.7": {"kind": "qrecover", "encodings": MIXED, "bpw": 3.7, "embedding": "auto"},
    "default-3.7": {"kind": "qrecover", "bpw": 3.7, "embedding": "auto"},
    "mixed-3.7-fisher": {"kind": "qrecover", "encodings": MIXED, "bpw": 3.7, "embedding": "auto",
                         "scheme_params": ["weighting=fisher"]},
    "mixed-awq-3.7": {"kind": "qrecover", "encodings": MIXED_AWQ, "bpw": 3.7, "embedding": "auto"},
    "llmc-gptq-w3g64": {"kind": "llmc", "method": "gptq", "bits": 3, "group": 64},
    "awq-w4g64": {"kind": "qrecover", "encodings": "awq+blockwise:4/b64/asym"},
    "awq+gptq-w3g64": {"kind": "qrecover", "encodings": "awq+gptq:3/g64/asym/act_order=false"},
    "llmc-awq-w4g64": {"kind": "llmc", "method": "awq", "bits": 4, "group": 64},
    "awq+gptq-w4g64": {"kind": "qrecover", "encodings": "awq+gptq:4/g64/asym/act_order=false"},
    "awq-w3g64": {"kind": "qrecover", "encodings": "awq+blockwise:3/b64/asym"},
    "llmc-awq-w3g64": {"kind": "llmc", "method": "awq", "bits": 3, "group": 64},
    # AutoAWQ's clip search after the scales (llm-compressor's AWQ leaves it out), and the same search on plain rounding
    "awq-clip-w4g64": {"kind": "qrecover", "encodings": "awq+blockwise:4/b64/asym/clip=true"},
    "awq-clip-w3g64": {"kind": "qrecover", "encodings": "awq+blockwise:3/b64/asym/clip=true"},
    "rtn-clip-w3g64": {"kind": "qrecover", "encodings": "blockwise:3/b64/asym/clip=true"},
    "gptq-w4g64-layer": {"kind": "qrecover", "encodings": "gptq:4/g64/asym/act_order=false", "finalize_groups": "layer"},
    "gptq-w4g64-actorder": {"kind": "qrecover", "encodings": "gptq:4/g64/asym/act_order=true"},
    "llmc-gptq-w4g64-actorder": {"kind": "llmc", "method": "gptq", "bits": 4, "group": 64, "actorder": "static"},
    # issue 25's peer row: llm-compressor's SpinQuantModifier (R1 + R2, random Hadamard: 576 is not a power of two;
    # it unties a tied head) before its GPTQ, against qrecover's rot-gptq-w*g64-actorder rows
    "llmc-spinquant-gptq-w4g64-actorder": {"kind": "llmc", "method": "spinquant-gptq", "bits": 4, "group": 64, "actorder": "static"},
    "llmc-spinquant-gptq-w3g64-actorder": {"kind": "llmc", "method": "spinquant-gptq", "bits": 3, "group": 64, "actorder": "static"},
    "gptq-w3g64-actorder": {"kind": "qrecover", "encodings": "gptq:3/g64/asym/act_order=true"},
    "default-3.7-calibmix": {"kind": "qrecover", "bpw": 3.7, "embedding": "auto", "calib_data": "calib-mix"},
    "blocks-3.7-calibmix": {"kind": "qrecover", "encodings": PAL_BLOCKS, "bpw": 3.7, "embedding": "auto", "scheme_params": ["refit=2"],
                            "calib_data": "calib-mix"},
    "default-3.7-refit2": {"kind": "qrecover", "bpw": 3.7, "embedding": "auto", "scheme_params": ["refit=2"]},
    "blocks-3.7": {"kind": "qrecover", "encodings": PAL_BLOCKS, "bpw": 3.7, "embedding": "auto", "scheme_params": ["refit=2"]},
    "mixed-blocks-3.7": {"kind": "qrecover", "encodings": PAL_BLOCKS + ",gptq:3/g64/act_order=true,gptq:4/g64/act_order=true",
                         "bpw": 3.7, "embedding": "auto", "scheme_params": ["refit=2"]},
    "mixed-blocks-3.7-mse": {"kind": "qrecover", "encodings": PAL_BLOCKS + ",gptq:3/g64/act_order=true/mse=true,"
                             "gptq:4/g64/act_order=true/mse=true", "bpw": 3.7, "embedding": "auto", "scheme_params": ["refit=2"]},
    # the default since 2026-11-27 (fifth session)
    "rot-mixed-blocks-3.7-mse": {"kind": "qrecover", "encodings": "rot-mixed-blocks", "bpw": 3.7, "embedding": "auto"},
    "rotr4-mixed-blocks-3.7-mse": {"kind": "qrecover", "encodings": "rot+r4+" + PAL_BLOCKS + ",gptq:3/g64/act_order=true/mse=true,"
                                   "gptq:4/g64/act_order=true/mse=true", "bpw": 3.7, "embedding": "auto", "scheme_params": ["refit=2"]},
    "mixed-blocks-3.7-calibmix": {"kind": "qrecover", "encodings": PAL_BLOCKS + ",gptq:3/g64/act_order=true,gptq:4/g64/act_order=true",
                                  "bpw": 3.7, "embedding": "auto", "scheme_params": ["refit=2"], "calib_data": "calib-mix"},
    # rotations (issue 25): R1 + R2 fused into the weights (qrecover.transforms.rotate), same settings as the rows above;
    # rot = randomised Kronecker/Paley Hadamard, rot-block = block-diagonal Hadamard, rot-random = random orthogonal
    "rot-gptq-w3g64-actorder": {"kind": "qrecover", "encodings": "rot+gptq:3/g64/asym/act_order=true"},
    "rot-rtn-w3g64": {"kind": "qrecover", "encodings": "rot+blockwise:3/b64/asym"},
    "rotblock-rtn-w3g64": {"kind": "qrecover", "encodings": "rot-block+blockwise:3/b64/asym"},
    "rotrandom-rtn-w3g64": {"kind": "qrecover", "encodings": "rot-random+blockwise:3/b64/asym"},
    "rot-mixed-blocks-3.7": {"kind": "qrecover", "encodings": "rot+" + PAL_BLOCKS + ",gptq:3/g64/act_order=true,gptq:4/g64/act_order=true",
                             "bpw": 3.7, "embedding": "auto", "scheme_params": ["refit=2"]},
    "rot-gptq-w4g64-actorder": {"kind": "qrecover", "encodings": "rot+gptq:4/g64/asym/act_order=true"},
    "rot-rtn-w4g64": {"kind": "qrecover", "encodings": "rot+blockwise:4/b64/asym"},
    "rot-palettize-4": {"kind": "qrecover", "encodings": "rot+palettize:4"},
    "rot-palettize-3": {"kind": "qrecover", "encodings": "rot+palettize:3"},
    "rotr4-palettize-3": {"kind": "qrecover", "encodings": "rot+r4+palettize:3"},
    # online R4 (qrecover.transforms.online_r4): down_proj's input rotated at run time, its weight's rows fused
    "rotr4-gptq-w3g64-actorder": {"kind": "qrecover", "encodings": "rot+r4+gptq:3/g64/asym/act_order=true"},
    "r4-gptq-w3g64-actorder": {"kind": "qrecover", "encodings": "r4+gptq:3/g64/asym/act_order=true"},
    # GPTQ with the reference's MSE range search per group (gptq's mse=true), with and without rotations
    "gptq-w3g64-actorder-mse": {"kind": "qrecover", "encodings": "gptq:3/g64/asym/act_order=true/mse=true"},
    "rotr4-gptq-w3g64-actorder-mse": {"kind": "qrecover", "encodings": "rot+r4+gptq:3/g64/asym/act_order=true/mse=true"},
    "rotr4-mixed-blocks-3.7": {"kind": "qrecover", "encodings": "rot+r4+" + PAL_BLOCKS + ",gptq:3/g64/act_order=true,gptq:4/g64/act_order=true",
                               "bpw": 3.7, "embedding": "auto", "scheme_params": ["refit=2"]},
    "gptq-w2g64-actorder": {"kind": "qrecover", "encodings": "gptq:2/g64/asym/act_order=true"},
    "rot-gptq-w2g64-actorder": {"kind": "qrecover", "encodings": "rot+gptq:2/g64/asym/act_order=true"},
}


# Rows only for the second architectures (their 256 and 768 input columns divide 128), and the folding check.
ARCH_ROWS: dict[str, dict] = {
    "gptq-w4g128": {"kind": "qrecover", "encodings": "gptq:4/g128/asym/act_order=false"},
    "rtn-w4g128": {"kind": "qrecover", "encodings": "blockwise:4/b128/asym"},
    "awq-w4g128": {"kind": "qrecover", "encodings": "awq+blockwise:4/b128/asym"},
    "awq+gptq-w3g128": {"kind": "qrecover", "encodings": "awq+gptq:3/g128/asym/act_order=false"},
    "llmc-gptq-w4g128": {"kind": "llmc", "method": "gptq", "bits": 4, "group": 128},
    "llmc-awq-w4g128": {"kind": "llmc", "method": "awq", "bits": 4, "group": 128},
    "awq-fold-exact": {"kind": "fold", "encodings": "awq+blockwise:4/b64/asym", "heldout_windows": 8},
}

# Randomly initialised models for --arch (config only). 4 layers, hidden 256, head_dim 64, intermediate 768: every
# linear's input columns divide 64 and 128; small enough that a row takes minutes on one core (the 49152-token
# head dominates). Norms and biases are perturbed (seeded) so that AWQ's folding into them is not a no-op.
ARCHS: dict[str, dict] = {
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": False, "num_key_value_heads": 2},  # q/k/v biases (default)
    "gemma3": {"model_type": "gemma3_text", "tie_word_embeddings": True, "num_key_value_heads": 1, "head_dim": 64,
               "query_pre_attn_scalar": 64, "sliding_window": 128,
               "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]},
}
ARCH_COMMON = dict(vocab_size=49152, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                   max_position_embeddings=2048)


# Why a row has no numbers in the committed report (two sessions' runs of 2026-11-24 on 2 shared cores).
NOT_RUN: dict[str, str] = {}  # row name -> why the committed report has no numbers for it (else NOT_RUN_DEFAULT)
NOT_RUN_DEFAULT = ("not run (time): on 2 shared cores a qrecover row took 4-22 min of CPU here, llm-compressor's "
                   "AWQ 28 min")


# The embedding candidates of ``--embedding-bits auto`` (rows with "embedding": "auto" hash it: a cached row made with
# another menu is not reused). v2: GPTQ candidates against the tied head's Hessian added (qrecover.stages.specs).
EMBEDDING_MENU = "v2: blockwise 4/b128 4/b64 4/b32 8 3/b32 2/b32, palettize 4/g1 3/g1, gptq 4/g32 3/g32"


def encodings_label(r: dict) -> str:
    """What a row compresses with, as a user would write it (its --scheme-param values included)."""
    if r["kind"] == "llmc":
        return f"llm-compressor {r['method']} w{r['bits']} g{r['group']} asym" + (f" actorder={r['actorder']}" if r.get("actorder") else "")
    enc = r.get("encodings") or "afm (palettize:2,3,4; the default until 2026-11)"
    return (enc + "".join(f" --scheme-param {p}" for p in r.get("scheme_params", ()))
            + (f" --calib-data {r['calib_data']}" if r.get("calib_data") else ""))


def row_key(name: str, calib_samples: int) -> str:
    row = ROWS[name]
    extra = {"embedding_menu": EMBEDDING_MENU} if row.get("embedding") == "auto" else {}
    blob = json.dumps({"row": row, "calib_samples": calib_samples, **extra}, sort_keys=True)
    return f"{name}-{hashlib.sha1(blob.encode()).hexdigest()[:10]}"


def arch_rows(arch: str) -> dict[str, dict]:
    return ROWS if arch == "default" else {**ROWS, **ARCH_ROWS}


def arch_spec(arch: str) -> dict:
    return {**ARCH_COMMON, **ARCHS[arch], "seed": 0, "perturb": 0.3}


def cache_dir(arch: str) -> Path:
    return CACHE if arch == "default" else CACHE / arch


def cache_path(name: str, calib_samples: int, arch: str) -> Path:
    """The default architecture's rows keep :func:`row_key` exactly; the others' keys also hash the model's spec."""
    if arch == "default":
        return CACHE / f"{row_key(name, calib_samples)}.json"
    blob = json.dumps({"row": arch_rows(arch)[name], "calib_samples": calib_samples, "model": arch_spec(arch)},
                      sort_keys=True)
    return cache_dir(arch) / f"{name}-{hashlib.sha1(blob.encode()).hexdigest()[:10]}.json"


def build_arch_model(arch: str) -> Path:
    """The random ``arch`` model's directory (weights, config, the default model's tokenizer), built once."""
    spec = arch_spec(arch)
    digest = hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]
    out = MODELS / f"{arch}-{digest}"
    if out.exists():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # qrecover's venv (module docstring)

    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    kw = {k: v for k, v in spec.items() if k not in ("model_type", "seed", "perturb")}
    special = {k: getattr(tok, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    cfg = AutoConfig.for_model(spec["model_type"], **kw, **{k: v for k, v in special.items() if v is not None})
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # non-trivial norms (Gemma's start at 0, Qwen's at 1) and q/k/v biases
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * spec["perturb"])
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    tmp = Path(tempfile.mkdtemp(prefix=f".{arch}-", dir=MODELS.mkdir(parents=True, exist_ok=True) or MODELS))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)  # atomic: a crash leaves no half-written model
    return out


CPU_SECONDS: list[float] = []  # user + system CPU seconds of the last child (its rusage): contention-robust time


def run_child(cmd: list[str], env: dict | None = None) -> tuple[int, str, str, float, float]:
    """Run one child; (returncode, stdout, stderr, wall seconds, peak RSS MiB of that child). Its CPU seconds
    (user + system) are left in ``CPU_SECONDS[-1]``: on a shared machine wall time measures the neighbours too."""
    t = time.time()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=out, stderr=err, cwd=ROOT, env=env)
        try:
            _, status, usage = os.wait4(p.pid, 0)
        except BaseException:  # Ctrl-C or SIGTERM (see main): never leave an orphan compress running
            p.kill()
            p.wait()
            raise
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.time() - t
        CPU_SECONDS.append(usage.ru_utime + usage.ru_stime)
        out.seek(0)
        err.seek(0)
        return p.returncode, out.read().decode(), err.read().decode(), wall, usage.ru_maxrss / 1024


def child_env() -> dict:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    env.setdefault("MKL_NUM_THREADS", env["OMP_NUM_THREADS"])
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def last_json(text: str) -> dict:
    start = text.find("{")
    return json.loads(text[start:])


def qrecover_cli() -> list[str]:
    return [sys.executable, "-m", "qrecover.cli"]


def run_original(model: Path | None = None) -> dict:
    """The unquantized model's perplexity (``model`` None: the built-in default, as ``qrecover ppl`` takes it)."""
    rc, out, err, wall, rss = run_child(qrecover_cli() + ["ppl", "--json"] + ([str(model)] if model else []), child_env())
    if rc:
        raise SystemExit(f"qrecover ppl failed:\n{err[-2000:]}")
    return {"ppl": last_json(out)["ppl"], "ppl_seconds": wall, "ppl_peak_rss_mb": rss}


def run_qrecover(name: str, s: dict, calib_samples: int, work: Path, model: Path | None = None) -> dict:
    ck = work / name
    cmd = qrecover_cli() + ["compress", "--json", "--overwrite", "--out", str(ck), "--calib-samples", str(calib_samples),
                            "--device", "cpu", "--procs", "1",  # one process: the CPU-time protocol of every row
                            "--embedding-bits", "8" if s.get("embedding") is None else s["embedding"]]
    if model is not None:
        cmd += ["--model", str(model)]
    # rows without encodings ("default-3.7", ...) were measured on the default of their time, AFM's menu: keep it
    cmd += ["--encodings", s.get("encodings") or "afm"]
    if s.get("bpw") is not None:
        cmd += ["--bpw", str(s["bpw"])]
    for p in s.get("scheme_params", []):
        cmd += ["--scheme-param", p]
    if s.get("finalize_groups"):
        cmd += ["--finalize-groups", s["finalize_groups"]]
    if s.get("calib_data"):
        cmd += ["--calib-data", s["calib_data"]]
    rc, out, err, wall, rss = run_child(cmd, child_env())
    cpu = CPU_SECONDS[-1]
    if rc:
        return {"error": f"compress exit {rc}: {err.strip().splitlines()[-1] if err.strip() else out[-500:]}",
                "command": " ".join(cmd[2:])}
    summary = last_json(out)
    rc, pout, perr, pwall, prss = run_child(qrecover_cli() + ["ppl", str(ck), "--json"], child_env())
    if rc:
        return {"error": f"ppl exit {rc}: {perr[-500:]}"}
    return {"bpw_model": summary["measured_bpw"]["model"], "bpw_linear": summary["measured_bpw"]["linear"],
            "ppl": last_json(pout)["ppl"], "seconds": wall, "cpu_seconds": cpu, "peak_rss_mb": rss, "ppl_seconds": pwall,
            "threads": child_env()["OMP_NUM_THREADS"], "command": "qrecover " + " ".join(cmd[3:])}


def dump_windows(calib_samples: int, path: Path, model_dir: Path = MODEL_DIR) -> None:
    from transformers import AutoTokenizer  # qrecover's venv (see the module docstring)

    from qrecover.data.corpus import token_windows
    tok = AutoTokenizer.from_pretrained(model_dir)
    torch.save(token_windows(tok, "python-docs", "calib", calib_samples, 512), path)


def run_llmc(name: str, s: dict, calib_samples: int, work: Path, llmc_py: str, model: Path | None = None) -> dict:
    if not Path(llmc_py).exists():
        return {"skipped": f"no llm-compressor venv at {llmc_py}"}
    rc, _, err, _, _ = run_child([llmc_py, "-c", "import llmcompressor"])
    if rc:
        return {"skipped": f"llmcompressor not importable with {llmc_py}"}
    windows = work / f"calib-{calib_samples}.pt"
    if not windows.exists():
        dump_windows(calib_samples, windows, model or MODEL_DIR)
    weights = work / f"{name}.safetensors"
    cmd = [llmc_py, str(Path(__file__).resolve()), "--llmc-worker", json.dumps(s), str(windows), str(weights)]
    given = ["--model-dir", str(model)] if model is not None else []
    cmd += given
    env = child_env()
    env.pop("PYTHONPATH")
    rc, out, err, wall, rss = run_child(cmd, env)
    cpu = CPU_SECONDS[-1]
    if rc:
        return {"error": f"llmc worker exit {rc}: {err[-1500:]}"}
    info = last_json(out.strip().splitlines()[-1])
    rc, pout, perr, pwall, prss = run_child([sys.executable, str(Path(__file__).resolve()), "--ppl-with", str(weights)]
                                            + given, child_env())
    if rc:
        return {"error": f"ppl of llmc weights exit {rc}: {perr[-1500:]}"}
    scored = last_json(pout)
    bits, g = s["bits"], s["group"]
    n_lin, n_all = info["linear_params"], info["all_params"]
    lin_bpw = bits + 32 / g  # fp16 scale + zero point per group (compressed-tensors pack-quantized)
    return {"bpw_model": (n_lin * lin_bpw + (n_all - n_lin) * 16) / n_all, "bpw_linear": lin_bpw,
            "ppl": scored["ppl"], "ppl_embedding8": scored["ppl_embedding8"], "seconds": wall,
            "cpu_seconds": cpu, "peak_rss_mb": rss, "ppl_seconds": pwall,
            "threads": env["OMP_NUM_THREADS"], "oneshot_seconds": info["oneshot_seconds"], "on_grid": info["on_grid"],
            "note": f"llm-compressor 0.14 oneshot; dequantized weights; embedding fp32 (bpw_model nominal: embedding "
                    f"counted at 16); with qrecover's 8-bit embedding: ppl {scored['ppl_embedding8']:.3f}"}


def llmc_worker(settings: str, windows_path: str, out_path: str, model_dir: Path = MODEL_DIR) -> None:
    """Runs under llm-compressor's venv: oneshot on qrecover's calibration windows, save dequantized linears (and
    the other tensors it changed)."""
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.pipelines import cache as llmc_cache
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    llmc_cache.IntermediatesCache.pin_memory = lambda self, *a, **k: None  # CPU only: nothing to pin
    s = json.loads(settings)
    windows = torch.load(windows_path)
    ds = Dataset.from_dict({"input_ids": windows.tolist(), "attention_mask": torch.ones_like(windows).tolist()})
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # every tensor but the linear weights, to save those AWQ changes (its smoothing scales are folded into the
    # norms before each group of linears: the linears alone on the original norms are a different function)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()
              if not (k.endswith(".weight") and isinstance(model.get_submodule(k.rsplit(".", 1)[0]), torch.nn.Linear))}
    weights = {"num_bits": s["bits"], "type": "int", "symmetric": False, "strategy": "group", "group_size": s["group"]}
    groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
    if s["method"] in ("gptq", "spinquant-gptq"):
        recipe = [GPTQModifier(config_groups=groups, ignore=["lm_head"], block_size=128, dampening_frac=0.01,
                                actorder=s.get("actorder"))]  # None: no act order (rows with act_order=false)
        if s["method"] == "spinquant-gptq":
            from llmcompressor.modifiers.transform import SpinQuantModifier

            recipe.insert(0, SpinQuantModifier(rotations=["R1", "R2"], transform_type="random-hadamard"))
    else:
        recipe = [AWQModifier(), QuantizationModifier(config_groups=groups, ignore=["lm_head"])]
    t = time.time()
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(windows), max_seq_length=windows.shape[1],
            pipeline="sequential")
    seconds = time.time() - t
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize  # dequantize exactly as it stores
    sd, on_grid, lin = {}, True, 0
    for n, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and hasattr(m, "weight_scale"):
            w = m.weight.detach().float()
            dq = fake_quantize(w, m.weight_scale, m.weight_zero_point, m.quantization_scheme.weights).float()
            on_grid = on_grid and bool(torch.allclose(dq, w, atol=1e-5))
            sd[n + ".weight"] = dq.contiguous()
            lin += w.numel()
    state = model.state_dict()
    changed = [k for k, v in before.items() if k in state and not torch.equal(state[k].detach().float(), v.float())]
    sd.update({k: state[k].detach().float().clone().contiguous() for k in changed})  # e.g. AWQ's rescaled norms
    if s["method"] == "spinquant-gptq":  # SpinQuant unties a tied head and rotates it: a matrix of its own, saved
        head = model.get_output_embeddings()
        sd[next(n for n, m in model.named_modules() if m is head) + ".weight"] = head.weight.detach().float().clone().contiguous()
    save_file(sd, out_path)
    all_params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"oneshot_seconds": seconds, "on_grid": on_grid, "linear_params": lin, "all_params": all_params,
                      "layers": len(sd) - len(changed), "changed_other_tensors": len(changed)}))


def ppl_with(weights: str, model_dir: Path | None = None) -> None:
    """qrecover's venv: the original model with these linear weights, perplexity under the README protocol."""
    from safetensors.torch import load_file

    from qrecover import api
    from qrecover.models import load_model
    model, tok, _ = load_model(str(model_dir) if model_dir else None)
    sd = load_file(weights)
    head, emb = model.get_output_embeddings(), model.get_input_embeddings()
    head_name = next((n for n, m in model.named_modules() if m is head), None)
    if head is not None and head.weight is emb.weight and f"{head_name}.weight" in sd:  # weights with an untied head
        head.weight = torch.nn.Parameter(head.weight.detach().clone())
        model.config.tie_word_embeddings = False
    missing = set(sd) - set(model.state_dict())
    if missing:
        raise SystemExit(f"weights not in the model: {sorted(missing)[:5]}")
    model.load_state_dict(sd, strict=False)
    with torch.no_grad():
        result = api.perplexity(model, tok, show_progress=False)
        # the same linear weights with the embedding (and an untied head) as qrecover's uniform rows store it, so that
        # the two libraries' rows differ in their linear layers alone
        heads = (model.get_input_embeddings(), model.get_output_embeddings())
        for w in {id(m.weight): m.weight for m in heads if m is not None}.values():  # a tied matrix once
            w.copy_(embedding8(w))
        result["ppl_embedding8"] = api.perplexity(model, tok, show_progress=False)["ppl"]
    print(json.dumps(result))


def embedding8(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` quantized and dequantized with ``blockwise:8/pc``, the embedding of qrecover's uniform rows
    (``--embedding-bits 8``: round to nearest, symmetric, one scale per row; needs no calibration statistics)."""
    from qrecover.stages.specs import parse_encoding

    enc = parse_encoding("blockwise:8/pc", what="--embedding-encodings")
    return enc.quantizer.quantize(weight.detach().float(), enc.bits, {}).dequantize(weight.dtype)


def run_fold(s: dict, calib_samples: int, model: Path | None) -> dict:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--fold-exact", json.dumps(s), "--calib-samples",
           str(calib_samples)] + (["--model-dir", str(model)] if model is not None else [])
    rc, out, err, wall, rss = run_child(cmd, child_env())
    if rc:
        return {"error": f"fold check exit {rc}: {err[-1500:]}"}
    return {**last_json(out.strip().splitlines()[-1]), "seconds": wall, "peak_rss_mb": rss}


def fold_exact(settings: str, calib_samples: int, model_dir: Path | None = None) -> None:
    """qrecover's venv: AWQ (the transform stage of ``qrecover compress``, scales searched on the calibration
    windows) applied to the unquantized model; the largest logit difference against the untouched model on held-out
    windows, next to the float32 rounding floor (the untouched model in float32 against float64)."""
    import copy
    import math

    from qrecover.data.corpus import token_windows
    from qrecover.models import load_model
    from qrecover.stages.specs import parse_encodings
    from qrecover.stages.transform import apply_transforms
    s = json.loads(settings)
    model, tok, _ = load_model(str(model_dir) if model_dir else None)
    ref = copy.deepcopy(model)
    calib = token_windows(tok, "python-docs", "calib", calib_samples, 512)
    t = time.time()
    info = apply_transforms(model, calib, parse_encodings(s["encodings"]), torch.device("cpu"), show_progress=False)
    seconds = time.time() - t
    maps = [m for layer in info["layers"]["awq"] for m in layer["mappings"]]
    before = ref.state_dict()
    changed = sorted(k for k, v in model.state_dict().items() if not torch.equal(v, before[k]))
    ref64 = copy.deepcopy(ref).double()
    diff = floor = max_logit = 0.0
    nll = [0.0, 0.0]
    agree = count = 0
    with torch.no_grad():
        for w in token_windows(tok, "python-docs", "eval", s["heldout_windows"], 512):
            ids = w.unsqueeze(0)
            want = ref(input_ids=ids, use_cache=False).logits[0].float()
            got = model(input_ids=ids, use_cache=False).logits[0].float()
            exact = ref64(input_ids=ids, use_cache=False).logits[0]
            diff = max(diff, float((got - want).abs().max()))
            floor = max(floor, float((want.double() - exact).abs().max()))
            max_logit = max(max_logit, float(want.abs().max()))
            for i, lg in enumerate((want, got)):
                nll[i] += float(torch.nn.functional.cross_entropy(lg[:-1], w[1:], reduction="sum"))
            agree += int((got.argmax(-1) == want.argmax(-1)).sum())
            count += w.numel()
    n_tok = count - s["heldout_windows"]
    print(json.dumps({"max_abs_logit_diff": diff, "fp32_rounding_floor": floor, "max_abs_logit": max_logit,
                      "relative_diff": diff / max_logit, "top1_agreement": agree / count,
                      "ppl_untouched": math.exp(nll[0] / n_tok), "ppl_folded": math.exp(nll[1] / n_tok),
                      "mappings": len(maps), "folded": sum(m.get("ratio") is not None for m in maps),
                      "skipped": sorted({m["prev"] + ": " + m["skipped"] for m in maps if "skipped" in m}),
                      "changed_tensors": len(changed), "changed_examples": changed[:6],
                      "transform_seconds": seconds, "heldout_tokens": count}))


def fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def write_report(names: list[str], calib_samples: int, report: Path, arch: str = "default") -> None:
    orig_path = cache_dir(arch) / "original.json"
    orig = json.loads(orig_path.read_text()) if orig_path.exists() else None
    rows = []
    table_rows = arch_rows(arch)
    for name in table_rows:
        p = cache_path(name, calib_samples, arch)
        rows.append({"name": name, **table_rows[name],
                     **(json.loads(p.read_text()) if p.exists() else {"missing": True})})
    if arch != "default":
        return write_arch_report(arch, rows, orig, calib_samples, report)
    lines = [f"Default model (SmolLM2-135M-Instruct), calibration {calib_samples} x 512 tokens of python-docs; held-out "
             f"ppl = 32 x 512 tokens of the eval split (README protocol); original ppl "
             f"{fmt(orig and orig['ppl'], '.3f')}. Uniform rows: linear layers only at the setting, embedding 8-bit "
             f"per channel (qrecover) / fp32 (llm-compressor); 3.7 rows: whole-model allocation, the embedding's "
             f"candidates those of `--embedding-bits auto` ({EMBEDDING_MENU}). CPU, 2 cores shared "
             f"with other work, one row at a time, OMP_NUM_THREADS as in the threads column. Wall and CPU time (user + "
             f"system, robust to the neighbours) and peak RSS: the compress (or llm-compressor oneshot) process alone.", "",
             "| row | encodings | bpw model | bpw linear | ppl | ratio | wall (s) | CPU (s) | threads | peak RSS (MiB) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        enc = encodings_label(r)
        if "ppl" not in r:
            why = r.get("skipped") or r.get("error") or NOT_RUN.get(r["name"], NOT_RUN_DEFAULT)
            lines.append(f"| {r['name']} | `{enc}` | | | | | | | | | {why[:200]} |")
            continue
        ratio = r["ppl"] / orig["ppl"] if orig else None
        r["ratio"] = ratio
        lines.append(f"| {r['name']} | `{enc}` | {r['bpw_model']:.3f} | {r['bpw_linear']:.3f} | {r['ppl']:.3f} | "
                     f"{fmt(ratio, '.3f')} | {r['seconds']:.0f} | {fmt(r.get('cpu_seconds'), '.0f')} | {r.get('threads', '—')} | "
                     f"{r['peak_rss_mb']:.0f} | {r.get('note', '')} |")
    table = "\n".join(lines)
    print(table)
    report.mkdir(parents=True, exist_ok=True)
    (report / "schemes.md").write_text("# Quantizers on the default model (benchmarks/schemes.py)\n\n" + table + "\n")
    (report / "schemes.json").write_text(json.dumps({"calib_samples": calib_samples, "original": orig, "rows": rows},
                                                    indent=1) + "\n")


def write_arch_report(arch: str, rows: list[dict], orig: dict | None, calib_samples: int, report: Path) -> None:
    spec = arch_spec(arch)
    threads = os.environ.get("OMP_NUM_THREADS", "2")
    head = ("The head is tied to the embedding." if spec["tie_word_embeddings"] else "The untied head is quantized "
            "like the embedding (qrecover) / kept fp32, counted at 16 bits (llm-compressor).")
    lines = [f"**Randomly initialised `{spec['model_type']}` model** (config only, `benchmarks/schemes.py` ARCHS: "
             f"{spec['num_hidden_layers']} layers, hidden {spec['hidden_size']}, intermediate "
             f"{spec['intermediate_size']}, {spec['num_attention_heads']} heads of 64, {spec['num_key_value_heads']} "
             f"key/value heads, {'tied' if spec['tie_word_embeddings'] else 'untied'} head, vocabulary 49152 with the "
             f"default model's tokenizer; norms and biases perturbed, seed {spec['seed']}). **Its perplexity (about "
             f"the vocabulary size) is meaningless as quality**: these rows show that every scheme, AWQ mapping, "
             f"finalize and the allocator run on the architecture and what they measure in bpw. Calibration "
             f"{calib_samples} x 512 tokens of python-docs; held-out ppl = 32 x 512 tokens of the eval split (README "
             f"protocol); original ppl {fmt(orig and orig['ppl'], '.1f')}. Uniform rows: linear layers only at the "
             f"setting, embedding 8-bit per channel (qrecover) / fp32 (llm-compressor); 3.7 rows: whole-model "
             f"allocation. {head} "
             f"bpw: qrecover's measured from the packed bytes (manifest), llm-compressor's nominal (bits + fp16 scale "
             f"and zero per group). CPU, shared, one row at a time, OMP_NUM_THREADS={threads}. Time and peak RSS: the "
             f"compress (or llm-compressor oneshot) process alone.", "",
             "| row | encodings | bpw model | bpw linear | ppl | ratio | time (s) | peak RSS (MiB) | note |",
             "|---|---|---|---|---|---|---|---|---|"]
    fold = None
    for r in rows:
        if r["kind"] == "fold":
            fold = r
            continue
        enc = encodings_label(r)
        if "ppl" not in r:
            why = r.get("skipped") or r.get("error") or "not run (the helper's time; rows ran in priority order)"
            why = " ".join(why.split()).replace("|", "\\|")
            lines.append(f"| {r['name']} | `{enc}` | | | | | | | {why[-400:]} |")
            continue
        ratio = r["ppl"] / orig["ppl"] if orig else None
        r["ratio"] = ratio
        lines.append(f"| {r['name']} | `{enc}` | {r['bpw_model']:.3f} | {r['bpw_linear']:.3f} | {r['ppl']:.1f} | "
                     f"{fmt(ratio, '.4f')} | {r['seconds']:.0f} | {r['peak_rss_mb']:.0f} | {r.get('note', '')} |")
    if fold is not None:
        lines += ["", f"**awq-fold-exact** (`{fold['encodings']}`'s AWQ transform, scales searched on the calibration "
                      f"windows as `qrecover compress` does, applied to the unquantized model; logits against the "
                      f"untouched model on {fold['heldout_windows']} held-out windows of 512 tokens):", ""]
        if "max_abs_logit_diff" in fold:
            lines.append(
                f"max |Δlogit| {fold['max_abs_logit_diff']:.3g} (max |logit| {fold['max_abs_logit']:.3g}, relative "
                f"{fold['relative_diff']:.2g}); float32 rounding floor of the untouched model (float32 vs float64 "
                f"logits) {fold['fp32_rounding_floor']:.3g}; top-1 agreement {fold['top1_agreement']:.4%}; held-out "
                f"ppl {fold['ppl_untouched']:.4f} untouched, {fold['ppl_folded']:.4f} folded; "
                f"{fold['folded']} of {fold['mappings']} mappings folded (a ratio chosen), {fold['changed_tensors']} "
                f"tensors changed; skipped: {'; '.join(fold['skipped']) or 'none'}; {fold['seconds']:.0f} s.")
        else:
            lines.append(fold.get("error") or "not run")
    table = "\n".join(lines)
    print(table)
    report.mkdir(parents=True, exist_ok=True)
    (report / f"schemes-{arch}.md").write_text(
        f"# Quantizers on a random {spec['model_type']} model (benchmarks/schemes.py --arch {arch})\n\n" + table + "\n")
    (report / f"schemes-{arch}.json").write_text(json.dumps(
        {"arch": arch, "model": spec, "calib_samples": calib_samples, "original": orig, "rows": rows}, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", help="comma-separated row names (default: all of --arch's, in value order)")
    ap.add_argument("--arch", default="default", choices=["default", *ARCHS],
                    help="default: the built-in model; qwen2 / gemma3: a random model of that architecture (config only)")
    ap.add_argument("--calib-samples", type=int, default=32, help="calibration windows of 512 tokens, every row")
    ap.add_argument("--llmc-python", default=LLMC_PY, help="python of a venv with llmcompressor installed")
    ap.add_argument("--report", default=str(ROOT / "reports"))
    ap.add_argument("--list", action="store_true", help="print the row names and exit")
    ap.add_argument("--report-only", action="store_true", help="write the report from cached rows, run nothing")
    ap.add_argument("--llmc-worker", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--ppl-with", help=argparse.SUPPRESS)
    ap.add_argument("--fold-exact", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so run_child's cleanup runs on `kill`
    if args.llmc_worker:
        return llmc_worker(*args.llmc_worker, **({"model_dir": args.model_dir} if args.model_dir else {}))
    if args.ppl_with:
        return ppl_with(args.ppl_with, args.model_dir)
    if args.fold_exact:
        return fold_exact(args.fold_exact, args.calib_samples, args.model_dir)
    rows = arch_rows(args.arch)
    if args.list:
        print("\n".join(rows))
        return
    names = [n.strip() for n in (args.rows or ",".join(rows)).split(",") if n.strip()]
    unknown = [n for n in names if n not in rows]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; rows are {list(rows)}")
    cache = cache_dir(args.arch)
    cache.mkdir(parents=True, exist_ok=True)
    work = ROOT / "benchmarks" / "out" / "schemes-work"
    if args.arch != "default":
        work = work / args.arch
    work.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        model = None if args.arch == "default" else build_arch_model(args.arch)
        if not (cache / "original.json").exists():
            (cache / "original.json").write_text(json.dumps(run_original(model)))
        for name in names:
            path = cache_path(name, args.calib_samples, args.arch)
            if path.exists():
                print(f"{name}: cached", flush=True)
                continue
            s = rows[name]
            print(f"{name}: running {s}", flush=True)
            if s["kind"] == "fold":
                r = run_fold(s, args.calib_samples, model)
            elif s["kind"] == "qrecover":
                r = run_qrecover(name, s, args.calib_samples, work, model)
            else:
                r = run_llmc(name, s, args.calib_samples, work, args.llmc_python, model)
            print(f"{name}: {json.dumps(r)}", flush=True)
            # a second architecture keeps failures too (the report shows the error); the default, finished rows only
            if "ppl" in r or "max_abs_logit_diff" in r or (args.arch != "default" and "error" in r):
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(r, indent=1))
                os.replace(tmp, path)  # atomic: a crash leaves no half-written row
            write_report(names, args.calib_samples, Path(args.report), args.arch)
    write_report(names, args.calib_samples, Path(args.report), args.arch)


if __name__ == "__main__":
    main()

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
  from ``qrecover.data.token_windows``). The worker saves the dequantized (fake-quantized) linear weights with
  safetensors; their perplexity is then measured in qrecover's venv on the original model with those weights
  loaded (same protocol). Its embedding (tied lm_head) stays unquantized, fp32; qrecover's rows keep it at 8-bit
  per channel. The llmc bpw is the nominal one of its packed format (bits + fp16 scale and zero per group).

Finished rows are cached in benchmarks/out/schemes/*.json, keyed by the row's settings, so a re-run skips them.

    python benchmarks/schemes.py                         # every row (hours on 2 CPU cores)
    python benchmarks/schemes.py --rows gptq-w4g64,rtn-w4g64
    python benchmarks/schemes.py --list                  # row names

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

import torch

ROOT = Path(__file__).resolve().parents[1]
CACHE = ROOT / "benchmarks" / "out" / "schemes"
MODEL_DIR = Path("~/.cache/qrecover/models/smollm2-135m-instruct").expanduser()
LLMC_PY = os.environ.get("QRECOVER_LLMC_PYTHON", "venv-llmc/bin/python")
MIXED = "palettize:2,palettize:3,palettize:4,gptq:3/g64,gptq:4/g64"

# name -> settings. kind "qrecover": compress args; kind "llmc": llm-compressor modifier and quant args.
# Group size 64: the default group of 128 does not divide the default model's 576 input columns (g128 rows are
# impossible on it; 1536-column down_proj would allow it, but one group size per row keeps rows comparable).
ROWS: dict[str, dict] = {
    "gptq-w4g64": {"kind": "qrecover", "encodings": "gptq:4/g64/asym"},
    "rtn-w4g64": {"kind": "qrecover", "encodings": "blockwise:4/b64/asym"},
    "llmc-gptq-w4g64": {"kind": "llmc", "method": "gptq", "bits": 4, "group": 64},
    "gptq-w3g64": {"kind": "qrecover", "encodings": "gptq:3/g64/asym"},
    "rtn-w3g64": {"kind": "qrecover", "encodings": "blockwise:3/b64/asym"},
    "palettize-4": {"kind": "qrecover", "encodings": "palettize:4"},
    "palettize-3": {"kind": "qrecover", "encodings": "palettize:3"},
    "mixed-3.7": {"kind": "qrecover", "encodings": MIXED, "bpw": 3.7, "embedding": "auto"},
    "default-3.7": {"kind": "qrecover", "bpw": 3.7, "embedding": "auto"},
    "mixed-3.7-fisher": {"kind": "qrecover", "encodings": MIXED, "bpw": 3.7, "embedding": "auto",
                         "scheme_params": ["weighting=fisher"]},
    "llmc-gptq-w3g64": {"kind": "llmc", "method": "gptq", "bits": 3, "group": 64},
    "awq-w4g64": {"kind": "qrecover", "encodings": "awq+blockwise:4/b64/asym"},
    "awq+gptq-w3g64": {"kind": "qrecover", "encodings": "awq+gptq:3/g64/asym"},
    "llmc-awq-w4g64": {"kind": "llmc", "method": "awq", "bits": 4, "group": 64},
    "awq+gptq-w4g64": {"kind": "qrecover", "encodings": "awq+gptq:4/g64/asym"},
    "awq-w3g64": {"kind": "qrecover", "encodings": "awq+blockwise:3/b64/asym"},
    "llmc-awq-w3g64": {"kind": "llmc", "method": "awq", "bits": 3, "group": 64},
    "gptq-w4g64-actorder": {"kind": "qrecover", "encodings": "gptq:4/g64/asym/act_order=true"},
    "llmc-gptq-w4g64-actorder": {"kind": "llmc", "method": "gptq", "bits": 4, "group": 64, "actorder": "static"},
}


# Why a row has no numbers in the committed report (the helper's run of 2026-11-24 had ~55 min of shared CPU).
NOT_RUN = {
    "llmc-gptq-w4g64": "started, stopped for time: llm-compressor's sequential GPTQ ran ~65 s per decoder layer here "
                       "(9 of 30 layers in 10.3 min CPU), projected ~33 min, vs 15.7 min for qrecover's whole gptq row",
    "rtn-w3g64": "started, stopped at the helper's deadline",
}


def row_key(name: str, calib_samples: int) -> str:
    blob = json.dumps({"row": ROWS[name], "calib_samples": calib_samples}, sort_keys=True)
    return f"{name}-{hashlib.sha1(blob.encode()).hexdigest()[:10]}"


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


def run_original() -> dict:
    rc, out, err, wall, rss = run_child(qrecover_cli() + ["ppl", "--json"], child_env())
    if rc:
        raise SystemExit(f"qrecover ppl failed:\n{err[-2000:]}")
    return {"ppl": last_json(out)["ppl"], "ppl_seconds": wall, "ppl_peak_rss_mb": rss}


def run_qrecover(name: str, s: dict, calib_samples: int, work: Path) -> dict:
    ck = work / name
    cmd = qrecover_cli() + ["compress", "--json", "--overwrite", "--out", str(ck), "--calib-samples", str(calib_samples),
                            "--device", "cpu", "--embedding-bits", "8" if s.get("embedding") is None else s["embedding"]]
    if s.get("encodings"):
        cmd += ["--encodings", s["encodings"]]
    if s.get("bpw") is not None:
        cmd += ["--bpw", str(s["bpw"])]
    for p in s.get("scheme_params", []):
        cmd += ["--scheme-param", p]
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


def dump_windows(calib_samples: int, path: Path) -> None:
    from transformers import AutoTokenizer  # qrecover's venv (see the module docstring)

    from qrecover.data import token_windows
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    torch.save(token_windows(tok, "python-docs", "calib", calib_samples, 512), path)


def run_llmc(name: str, s: dict, calib_samples: int, work: Path, llmc_py: str) -> dict:
    if not Path(llmc_py).exists():
        return {"skipped": f"no llm-compressor venv at {llmc_py}"}
    rc, _, err, _, _ = run_child([llmc_py, "-c", "import llmcompressor"])
    if rc:
        return {"skipped": f"llmcompressor not importable with {llmc_py}"}
    windows = work / f"calib-{calib_samples}.pt"
    if not windows.exists():
        dump_windows(calib_samples, windows)
    weights = work / f"{name}.safetensors"
    cmd = [llmc_py, str(Path(__file__).resolve()), "--llmc-worker", json.dumps(s), str(windows), str(weights)]
    env = child_env()
    env.pop("PYTHONPATH")
    rc, out, err, wall, rss = run_child(cmd, env)
    cpu = CPU_SECONDS[-1]
    if rc:
        return {"error": f"llmc worker exit {rc}: {err[-1500:]}"}
    info = last_json(out.strip().splitlines()[-1])
    rc, pout, perr, pwall, prss = run_child([sys.executable, str(Path(__file__).resolve()), "--ppl-with", str(weights)],
                                            child_env())
    if rc:
        return {"error": f"ppl of llmc weights exit {rc}: {perr[-1500:]}"}
    bits, g = s["bits"], s["group"]
    n_lin, n_all = info["linear_params"], info["all_params"]
    lin_bpw = bits + 32 / g  # fp16 scale + zero point per group (compressed-tensors pack-quantized)
    return {"bpw_model": (n_lin * lin_bpw + (n_all - n_lin) * 16) / n_all, "bpw_linear": lin_bpw,
            "ppl": last_json(pout)["ppl"], "seconds": wall, "cpu_seconds": cpu, "peak_rss_mb": rss, "ppl_seconds": pwall,
            "threads": env["OMP_NUM_THREADS"], "oneshot_seconds": info["oneshot_seconds"], "on_grid": info["on_grid"],
            "note": "llm-compressor 0.14 oneshot; dequantized weights; embedding fp32 (bpw_model nominal: embedding "
                    "counted at 16)"}


def llmc_worker(settings: str, windows_path: str, out_path: str) -> None:
    """Runs under llm-compressor's venv: oneshot on qrecover's calibration windows, save dequantized linears."""
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
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    weights = {"num_bits": s["bits"], "type": "int", "symmetric": False, "strategy": "group", "group_size": s["group"]}
    groups = {"group_0": {"targets": ["Linear"], "weights": weights}}
    if s["method"] == "gptq":
        recipe = [GPTQModifier(config_groups=groups, ignore=["lm_head"], block_size=128, dampening_frac=0.01,
                                actorder=s.get("actorder"))]  # None: no act order, as qrecover's gptq default
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
    save_file(sd, out_path)
    all_params = sum(p.numel() for p in model.parameters())
    print(json.dumps({"oneshot_seconds": seconds, "on_grid": on_grid, "linear_params": lin, "all_params": all_params,
                      "layers": len(sd)}))


def ppl_with(weights: str) -> None:
    """qrecover's venv: the original model with these linear weights, perplexity under the README protocol."""
    from safetensors.torch import load_file

    from qrecover import api
    from qrecover.models import load_model
    model, tok, _ = load_model(None)
    sd = load_file(weights)
    missing = set(sd) - set(model.state_dict())
    if missing:
        raise SystemExit(f"weights not in the model: {sorted(missing)[:5]}")
    model.load_state_dict(sd, strict=False)
    with torch.no_grad():
        print(json.dumps(api.perplexity(model, tok, show_progress=False)))


def fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def write_report(names: list[str], calib_samples: int, report: Path) -> None:
    orig_path = CACHE / "original.json"
    orig = json.loads(orig_path.read_text()) if orig_path.exists() else None
    rows = []
    for name in ROWS:
        p = CACHE / f"{row_key(name, calib_samples)}.json"
        rows.append({"name": name, **ROWS[name], **(json.loads(p.read_text()) if p.exists() else {"missing": True})})
    lines = [f"Default model (SmolLM2-135M-Instruct), calibration {calib_samples} x 512 tokens of python-docs; held-out "
             f"ppl = 32 x 512 tokens of the eval split (README protocol); original ppl "
             f"{fmt(orig and orig['ppl'], '.3f')}. Uniform rows: linear layers only at the setting, embedding 8-bit "
             f"per channel (qrecover) / fp32 (llm-compressor); 3.7 rows: whole-model allocation. CPU, 2 cores shared "
             f"with other work, one row at a time, OMP_NUM_THREADS as in the threads column. Wall and CPU time (user + "
             f"system, robust to the neighbours) and peak RSS: the compress (or llm-compressor oneshot) process alone.", "",
             "| row | encodings | bpw model | bpw linear | ppl | ratio | wall (s) | CPU (s) | threads | peak RSS (MiB) | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        enc = r.get("encodings") or (f"llm-compressor {r['method']} w{r['bits']} g{r['group']} asym" if r["kind"] == "llmc"
                                     else "default (palettize:2,3,4)")
        if "ppl" not in r:
            why = r.get("skipped") or r.get("error") or NOT_RUN.get(r["name"], "not run (time)")
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated row names (default: all, in value order)")
    ap.add_argument("--calib-samples", type=int, default=32, help="calibration windows of 512 tokens, every row")
    ap.add_argument("--llmc-python", default=LLMC_PY, help="python of a venv with llmcompressor installed")
    ap.add_argument("--report", default=str(ROOT / "reports"))
    ap.add_argument("--list", action="store_true", help="print the row names and exit")
    ap.add_argument("--report-only", action="store_true", help="write the report from cached rows, run nothing")
    ap.add_argument("--llmc-worker", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--ppl-with", help=argparse.SUPPRESS)
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so run_child's cleanup runs on `kill`
    if args.llmc_worker:
        return llmc_worker(*args.llmc_worker)
    if args.ppl_with:
        return ppl_with(args.ppl_with)
    if args.list:
        print("\n".join(ROWS))
        return
    names = [n.strip() for n in args.rows.split(",") if n.strip()]
    unknown = [n for n in names if n not in ROWS]
    if unknown:
        raise SystemExit(f"--rows: unknown {unknown}; rows are {list(ROWS)}")
    CACHE.mkdir(parents=True, exist_ok=True)
    work = ROOT / "benchmarks" / "out" / "schemes-work"
    work.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        if not (CACHE / "original.json").exists():
            (CACHE / "original.json").write_text(json.dumps(run_original()))
        for name in names:
            path = CACHE / f"{row_key(name, args.calib_samples)}.json"
            if path.exists():
                print(f"{name}: cached", flush=True)
                continue
            s = ROWS[name]
            print(f"{name}: running {s}", flush=True)
            r = (run_qrecover(name, s, args.calib_samples, work) if s["kind"] == "qrecover"
                 else run_llmc(name, s, args.calib_samples, work, args.llmc_python))
            print(f"{name}: {json.dumps(r)}", flush=True)
            if "ppl" in r:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(r, indent=1))
                os.replace(tmp, path)  # atomic: a crash leaves no half-written row
            write_report(names, args.calib_samples, Path(args.report))
    write_report(names, args.calib_samples, Path(args.report))


if __name__ == "__main__":
    main()

"""Recovery benchmark on the default model: how much of the quantization gap LoRA adapters close, where it must generalise.

For 3.5 and 3.7 bpw checkpoints (the `compress` defaults), trains recovery adapters with the shipped default mix and
measures, at several token counts, perplexity of the original, quantized and recovered models on fixed windows of
held-out texts (`qrecover/evaluate/heldout.py`, each pinned by sha256):

- **held-out domains** no training source covers: Shakespeare (literature), GSM8K problems with worked solutions
  (math), MMLU questions with their choices (academic); the **worst** of them is the headline;
- AlpacaEval's GPT-4 answers (assistant prose: close to the self-generated training chats, reported, not counted
  in the worst);
- **in-domain** text: the Python-docs `eval` split (documents never trained on).

gap closed = (ppl_quantized - ppl_recovered) / (ppl_quantized - ppl_original), per text.

Rows (each a curve: perplexity at 0 tokens = as initialised, then at the --points fractions of its tokens): a long
distillation run at 3.5 bpw rank 16 (the one-hour target); both objectives (distillation 'kd' and cross-entropy
'ce') at 3.5 bpw rank 16; both initialisations (the default error-SVD init and PEFT's B = 0, ':zero'); 3.7 bpw
rank 16 (kd); ranks 8, 16 and 32 at 3.5 bpw and equal tokens; a 'top:N' adapter on the most damaged layers only.
Row options: ':head=R' adds a rank-R LoRA on the tied output head; ':wsd' the warm-up-stable-decay schedule;
':damage' spreads the rank-R adapter's parameters over the layers by damage and error spectrum (`--rank-allocation
damage`); ':int8' also scores the same adapter exported with 8-bit weights (`--adapter-bits 8`: per-row int8 + fp16 scales,
quantized at save time from the same trained weights, so it needs no second training run); ':mix=NAME' trains on
another data mix, benchmarks/mixes/NAME.toml or a .toml path (the data lever: `more-data` holds four times the
shipped mix's teacher-written chats).
**Equal total bytes**: for every row, the adapter-free checkpoint of `qrecover compress --bpw <base + adapter bpw>`
(the same total size) is scored as a reference row (`--no-references` skips them).
Then the speed of the training base path: dequantized weights cached in memory or dequantized every forward,
bf16 autocast or fp32, in the same process.
Adapter sizes are from the written files, with their cost in bits per weight of the base model.
':tune[=N]' tunes the checkpoint's tables, scales, norms and embedding end to end first (`qrecover tune`, N tokens,
default the row's; ':params=tables+scales' picks what trains), zero extra bytes; rank 0 scores the tuned checkpoint
alone (benchmarks/tune_rows.py). Each row records its CPU seconds (this process, one thread).

    python benchmarks/recover.py                 # ~2 h on 2 CPU cores
    python benchmarks/recover.py --quick         # a smoke test (few tokens, few windows)
    python benchmarks/recover.py --runs 3.5:kd:16@262144 --no-speed --name recover-long
                                                 # only the long run (reports/recover-long.md)
    python benchmarks/recover.py --runs 3.5:kd:16:int8,3.5:kd:8,3.5:kd:16:head=16,3.5:kd:16:wsd --tokens 16384 \
        --points 0,1 --no-speed --name recover-domains --out benchmarks/out/recover-domains
                                                 # the levers at equal total bytes (reports/recover-domains.md)
    python benchmarks/recover.py --runs 3.5:kd:0:tune@32768,3.5:kd:16:tune=32768@65536 --points 0,0.5,1 --no-speed \
        --no-references --name recover-tune      # tuned alone, tuned then LoRA (reports/recover-tune.md)

Writes reports/NAME.md and reports/NAME.json; checkpoints and adapters go to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))  # tune_rows.py beside this file

from tune_rows import tune_alone, tune_config, tuned_base  # noqa: E402

from qrecover import api  # noqa: E402
from qrecover.adapters.int8 import INT8_FILE, save_int8  # noqa: E402
from qrecover.adapters.lora import ADAPTER_META  # noqa: E402
from qrecover.checkpoint import read_manifest  # noqa: E402
from qrecover.config import CompressConfig  # noqa: E402
from qrecover.evaluate.heldout import DOMAINS, HELD_OUT, heldout_windows, windows_perplexity  # noqa: E402
from qrecover.io_utils import sha256_file  # noqa: E402
from qrecover.models import load_model  # noqa: E402
from qrecover.recovery.api import default_mix_path, recover  # noqa: E402
from qrecover.recovery.config import RecoverConfig  # noqa: E402
from qrecover.recovery.train import peak_memory_bytes  # noqa: E402

TEXTS = (*HELD_OUT, "alpaca_eval", "python-docs")  # scored for every row; the worst is taken over HELD_OUT


_PREPARED: list = []  # the one calibration (api.prepare), kept for the equal-size references made after the rows


#: the default menu before GPTQ's range search joined it (2026-11-27): the base of the recover-tune* rows
FORMER_MENU = ("palettize:2/refit=2,palettize:3/refit=2,palettize:4/refit=2,palettize:2/b192/block_fit=nearest/refit=2,"
               "palettize:3/b192/block_fit=nearest/refit=2,palettize:4/b192/block_fit=nearest/refit=2,gptq:3/g64,gptq:4/g64")


def menu(cfg: CompressConfig) -> list[str]:
    """The decoder layers' candidate encodings of ``cfg`` as the manifest records them (``budget.encodings``)."""
    from qrecover.stages.specs import linear_encodings

    return [e.label for e in linear_encodings(cfg.scheme, cfg.bits, cfg.scheme_params, cfg.encodings)]


def made_with(manifest: dict, cfg: CompressConfig) -> bool:
    """Whether the checkpoint of ``manifest`` was made with ``cfg``: a field added to CompressConfig since it was written
    is equal when it holds its default; the menus are compared expanded (labels), so a preset whose specs changed under
    the same name does not match."""
    def rest(d: dict) -> dict:
        return {k: v for k, v in d.items() if k != "encodings"}

    return (rest({**CompressConfig().to_dict(), **manifest["config"]}) == rest(cfg.to_dict())
            and manifest["budget"]["encodings"] == menu(cfg))


def checkpoints(out: Path, budgets: list[float], encodings: str | None = None, calib_data: str | None = None,
                calib_samples: int | None = None) -> dict[float, Path]:
    """One calibration per process, one checkpoint per budget (``encodings``: the menu, default the compress
    default; ``calib_data``/``calib_samples``: the calibration text and windows, default the compress defaults);
    reused when a checkpoint with the same config exists."""
    calib = ({} if calib_data is None else {"calib_data": calib_data}) | (
        {} if calib_samples is None else {"calib_samples": calib_samples})
    paths, todo = {}, []
    for bpw in budgets:
        d = out / f"ckpt-{bpw}"
        cfg = CompressConfig(bpw=bpw, encodings=encodings, **calib)
        if (d / "qrecover.json").exists() and made_with(read_manifest(d), cfg):
            paths[bpw] = d
        else:
            todo.append((bpw, d, cfg))
    if todo:
        if not _PREPARED:
            _PREPARED.append(api.prepare(CompressConfig(bpw=todo[0][0], encodings=encodings, **calib)))
        for bpw, d, cfg in todo:
            api.compress(cfg, out=d, overwrite=True, prepared=_PREPARED[0])
            paths[bpw] = d
    return paths


# RUN_GRAMMAR: every run is a curve (held-out perplexity
# as initialised and at the --points fractions of its tokens). The first is the long run of the one-hour target; the
# others compare objectives, bit widths, ranks, a smaller adapter and the initialisation (':zero' = PEFT's B = 0
# instead of the default error-SVD init, at the lr that suits it) at equal tokens.
DEFAULT_RUNS = ["3.5:kd:16@262144", "3.5:kd:16@16384", "3.5:kd:16:zero:lr=2e-3@16384", "3.5:ce:16@16384",
                "3.5:ce:16:zero:lr=2e-3@16384", "3.7:kd:16@16384", "3.5:kd:8@16384", "3.5:kd:32@16384",
                "3.5:kd:16:top:70@16384"]
RUN_GRAMMAR = ("BPW:OBJECTIVE:RANK[:top:N][:zero][:lr=X][:head=R][:wsd][:damage][:mix=NAME][:int8][:tune[=N]][:blocks=N][:params=A+B]"
               "[:codes_lr=X][:hidden=W]"
              "[@TOKENS]")
MIXES = ROOT / "benchmarks" / "mixes"  # ':mix=NAME' trains on benchmarks/mixes/NAME.toml (or a .toml path)


def mix_path(name: str | None) -> Path:
    """The data-mix TOML a row trains on: the shipped default (None), benchmarks/mixes/NAME.toml, or a path."""
    if name is None:
        return default_mix_path()
    path = Path(name) if name.endswith(".toml") else MIXES / f"{name}.toml"
    if not path.is_file():
        sys.exit(f":mix={name}: {path} does not exist; name a file of {MIXES} (without .toml) or a .toml path")
    return path


def parse_runs(spec: str, tokens: int) -> list[dict]:
    """``"3.5:kd:16@262144,3.5:kd:16:top:70:zero:lr=2e-3,3.5:kd:16:head=16:wsd:int8"`` -> one dict per run with keys
    bpw, objective, rank, targets, init, lr (None = the RecoverConfig default), head_rank, schedule, int8 and tokens
    (``tokens`` where an item names none)."""
    runs = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        body, _, n = item.partition("@")
        parts = body.split(":")
        run = {"targets": "all", "init": "svd", "lr": None, "head_rank": 0, "schedule": "cosine", "int8": False,
               "rank_allocation": "uniform", "mix": None, "tune": None, "params": None, "blocks": 0,
               "codes_lr": None, "hidden": 0.0}
        ok = len(parts) >= 3 and parts[1] in ("kd", "ce", "mix") and parts[2].isdigit() and (not n or n.isdigit())
        rest = parts[3:]
        while ok and rest:
            if rest[0] == "top" and len(rest) >= 2 and rest[1].isdigit():
                run["targets"], rest = f"top:{rest[1]}", rest[2:]
            elif rest[0] in ("zero", "svd"):
                run["init"], rest = rest[0], rest[1:]
            elif rest[0] in ("wsd", "cosine"):
                run["schedule"], rest = rest[0], rest[1:]
            elif rest[0] == "int8":
                run["int8"], rest = True, rest[1:]
            elif rest[0] == "damage":
                run["rank_allocation"], rest = "damage", rest[1:]
            elif rest[0].startswith("mix=") and rest[0][4:]:
                run["mix"], rest = rest[0][4:], rest[1:]
            elif rest[0] == "tune" or (rest[0].startswith("tune=") and rest[0][5:].isdigit()):  # tune first (tune_rows.py)
                run["tune"], rest = int(rest[0][5:]) if "=" in rest[0] else (int(n) if n else tokens), rest[1:]
            elif rest[0].startswith("blocks=") and rest[0][7:].isdigit():  # block-wise reconstruction first (tune_rows.py)
                run["blocks"], rest = int(rest[0][7:]), rest[1:]
            elif rest[0].startswith("params=") and rest[0][7:]:
                run["params"], rest = rest[0][7:].replace("+", ","), rest[1:]
            elif rest[0].startswith("head=") and rest[0][5:].isdigit():
                run["head_rank"], rest = int(rest[0][5:]), rest[1:]
            elif rest[0].startswith("codes_lr="):  # the codes' lr when params has codes (tune_rows.py)
                try:
                    run["codes_lr"], rest = float(rest[0][9:]), rest[1:]
                except ValueError:
                    ok = False
            elif rest[0].startswith("hidden="):  # --hidden-weight: the decoder layers' outputs matched (tune and LoRA)
                try:
                    run["hidden"], rest = float(rest[0][7:]), rest[1:]
                except ValueError:
                    ok = False
            elif rest[0].startswith("lr="):
                try:
                    run["lr"], rest = float(rest[0][3:]), rest[1:]
                except ValueError:
                    ok = False
            else:
                ok = False
        if ok and ((int(parts[2]) == 0 and run["tune"] is None) or (run["tune"] == 0 and not run["blocks"])):
            ok = False  # rank 0 is the tuned checkpoint alone
        if not ok:
            sys.exit(f"--runs item {item!r}: expected {RUN_GRAMMAR}, e.g. 3.5:kd:16, 3.5:kd:16:top:70, "
                     "3.5:kd:16:zero:lr=2e-3, 3.5:kd:16:head=16:wsd or 3.5:kd:16@262144")
        runs.append({"bpw": float(parts[0]), "objective": parts[1], "rank": int(parts[2]), **run,
                     "tokens": int(n) if n else tokens})
    return runs


def run_name(r: dict) -> str:
    """The row's directory name; the int8 export is a variant of the same run, not part of the name."""
    return (f"{r['bpw']}bpw-{r['objective']}-r{r['rank']}"
            + ("" if r["targets"] == "all" else f"-{r['targets'].replace(':', '')}")
            + ("" if r["init"] == "svd" else f"-{r['init']}") + ("" if r["lr"] is None else f"-lr{r['lr']:g}")
            + ("" if not r.get("head_rank") else f"-head{r['head_rank']}")
            + ("" if r.get("schedule", "cosine") == "cosine" else f"-{r['schedule']}")
            + ("" if r.get("rank_allocation", "uniform") == "uniform" else "-damage")
            + ("" if not r.get("mix") else f"-mix{Path(r['mix']).stem}")
            + ("" if r.get("tune") is None else f"-tune{r['tune']}" + ("" if not r.get("blocks") else f"-blocks{r['blocks']}")
               + ("" if not r.get("params") else "-" + r["params"].replace(",", "+"))
               + ("" if r.get("codes_lr") is None else f"-clr{r['codes_lr']:g}"))
            + ("" if not r.get("hidden") else f"-hid{r['hidden']:g}")
            + f"-{r['tokens']}tok")


def int8_variant(adapter: Path, out: Path) -> dict:
    """``out``: a copy of the adapter directory ``adapter`` as `--adapter-bits 8` writes it (the int8 file from the
    same fp16 tensors save_adapter quantizes, and their fp16 expansion); returns its updated qrecover_adapter.json."""
    from safetensors.torch import load_file, save_file

    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(adapter, out)
    nbytes, expanded = save_int8(load_file(str(adapter / "adapter_model.safetensors")), out / INT8_FILE)
    save_file({k: v.contiguous() for k, v in expanded.items()}, str(out / "adapter_model.safetensors"),
              metadata={"format": "pt"})
    meta = json.loads((adapter / ADAPTER_META).read_text())
    meta["bytes"] = {"tensors": nbytes, "file": (out / INT8_FILE).stat().st_size}
    meta["bpw_cost"] = nbytes * 8 / meta["base_parameters"]
    meta["dtype"] = "int8 per row + float16 scales"
    (out / ADAPTER_META).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="512 tokens per run, 2 windows")
    ap.add_argument("--tokens", type=int, default=65536, help="training tokens of a run that names none (@TOKENS)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--windows", type=int, default=8, help="evaluation windows of 512 tokens per text")
    ap.add_argument("--points", default="0,0.125,0.25,0.5,1",
                    help="fractions of each run's tokens at which the texts are scored (0 = as initialised, 1 = the end)")
    ap.add_argument("--runs", default=",".join(DEFAULT_RUNS),
                    help=f"comma-separated {RUN_GRAMMAR} runs (default: {','.join(DEFAULT_RUNS)})")
    ap.add_argument("--no-references", action="store_true",
                    help="skip the adapter-free checkpoints of each row's total size")
    ap.add_argument("--references", default="",
                    help="comma-separated --bpw budgets of adapter-free checkpoints to score first (before the rows), e.g. "
                         "4.081,3.79; the rows' own total sizes are added at the end unless --no-references")
    ap.add_argument("--calib-data", default=None,
                    help="the checkpoints' calibration text (compress --calib-data: python-docs, calib-mix or a path); "
                         "default compress's")
    ap.add_argument("--calib-samples", type=int, default=None,
                    help="the checkpoints' calibration windows (compress --calib-samples); default compress's")
    ap.add_argument("--base-encodings", default=None,
                    help="the base checkpoints' candidate menu (compress --encodings; default: the compress default). "
                         f"The former default (before GPTQ's range search, the rows of 2026-11-26/27): {FORMER_MENU}")
    ap.add_argument("--no-speed", action="store_true", help="skip the cached-vs-uncached base path measurement")
    ap.add_argument("--name", default="recover", help="report file stem: reports/NAME.md and NAME.json")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "out" / "recover"))
    ap.add_argument("--report", default=str(ROOT / "reports"))
    args = ap.parse_args()
    tokens, windows = (1024, 2) if args.quick else (args.tokens, args.windows)
    runs = [{**r, "tokens": min(r["tokens"], tokens) if args.quick else r["tokens"]} for r in parse_runs(args.runs, tokens)]
    points = sorted({float(x) for x in args.points.split(",")} | {1.0})
    seq_len = 128 if args.quick else args.seq_len
    out = Path(args.out)
    t_start = time.time()

    # --- references: original and quantized -----------------------------------------------------------
    teacher, tok, _ = load_model(None)
    eval_windows = {k: heldout_windows(tok, k, windows, 512) for k in TEXTS}

    def ppl(model) -> dict[str, float]:
        return {k: windows_perplexity(model, w)["ppl"] for k, w in eval_windows.items()}

    original = ppl(teacher)
    print("original", original, flush=True)
    ckpts = checkpoints(out, sorted({r["bpw"] for r in runs}), args.base_encodings, args.calib_data, args.calib_samples)
    quantized, bpw = {}, {}
    for b, d in ckpts.items():
        m = api.load(d, cache=True)
        quantized[b], bpw[b] = ppl(m), m.qrecover_manifest["measured_bpw"]
        print(b, "quantized", quantized[b], flush=True)
        del m

    def gap(b: float, p: dict[str, float]) -> dict[str, float]:
        g = {k: (quantized[b][k] - p[k]) / (quantized[b][k] - original[k]) for k in p}
        return {**g, "worst": min(g[k] for k in HELD_OUT)}

    references: dict[str, dict] = {}

    def score_references(budgets: list[float]) -> None:
        """The adapter-free checkpoint of each total size, scored (and compared with the smallest base budget)."""
        for b, d in checkpoints(out, [x for x in budgets if str(x) not in references], args.base_encodings,
                                   args.calib_data, args.calib_samples).items():
            m = api.load(d, cache=True)
            p = ppl(m)
            references[str(b)] = {"bpw": b, "measured_bpw": m.qrecover_manifest["measured_bpw"]["model"], "ppl": p,
                                  "gap_closed_of_base": gap(min(quantized), p), "base_bpw": min(quantized)}
            print("reference", b, p, flush=True)
            del m

    def report(seconds: float, speed: dict) -> None:
        write_report(Path(args.report), args.name, original, quantized, bpw, rows, references, speed, windows, seconds,
                     peak_memory_bytes())

    if args.references and not args.no_references:
        score_references(sorted(float(x) for x in args.references.split(",")))

    # --- recovery runs -------------------------------------------------------------------------------------
    rows = []
    for run in runs:
        b, objective, rank, targets, init, n_tokens = (run[k] for k in ("bpw", "objective", "rank", "targets", "init", "tokens"))
        milestones = sorted({round(f * n_tokens) for f in points if 0 < f < 1})
        base, tuned = ckpts[b], None
        if run["tune"] is not None:  # the checkpoint tuned end to end first (tune_rows.py); rank 0: that checkpoint alone
            tcfg = tune_config(run, seq_len, None if run["mix"] is None else str(mix_path(run["mix"])))
            if rank == 0:
                rows.append(tune_alone(run_name(run), run, tcfg, ckpts[b], bpw[b]["model"], out, teacher, ppl, gap, points))
                report(time.time() - t_start, {})
                continue
            base, tuned = tuned_base(ckpts[b], tcfg, out, teacher)
        cpu0 = time.process_time()
        cfg = RecoverConfig(rank=rank, tokens=n_tokens, objective=objective, targets=targets, init=init,
                            seq_len=seq_len, checkpoint_every=0, head_rank=run["head_rank"], schedule=run["schedule"],
                            rank_allocation=run.get("rank_allocation", "uniform"),
                            mix=None if run["mix"] is None else str(mix_path(run["mix"])), hidden_weight=run.get("hidden", 0.0),
                            **({} if run["lr"] is None else {"lr": run["lr"]}))
        curve = []  # the first at 0 tokens: the quantized model with the adapter as initialised
        per_step = cfg.tokens_per_step

        def measure(info, b=b, curve=curve, per_step=per_step, milestones=milestones):
            if (info["step"] == 0 and 0.0 in points) or any(info["tokens"] - per_step < m <= info["tokens"] for m in milestones):
                p = ppl(info["model"])
                curve.append({"tokens": info["tokens"], "ppl": p, "gap_closed": gap(b, p)})
                print(b, objective, rank, info["tokens"], p, flush=True)
                info["model"].train()

        name = run_name(run)
        key = {"config": cfg.to_dict(), "milestones": milestones, "points": points, "windows": windows,
               "texts": {k: DOMAINS[k].text_sha256 for k in TEXTS}, "mix_sha256": sha256_file(mix_path(run["mix"])),
               "checkpoint": read_manifest(base)["weights_file"]["sha256"]}
        done = out / name / "bench_row.json"  # a finished row is reused: an interrupted benchmark picks up here
        if done.is_file() and json.loads(done.read_text())["key"] == key:
            row = json.loads(done.read_text())["row"]
            print("reused", name, flush=True)
        else:
            t = time.time()
            # the teacher goes in for 'ce' too: it writes the mix's self-generated chats (cached by its weights, so
            # every row trains on the same data); cross-entropy training itself never runs it
            meta = recover(base, out / name, cfg, overwrite=True, callback=measure, teacher=teacher)
            train_wall = time.time() - t
            m = api.load(base, cache=True, adapter=out / name)
            final = ppl(m)
            curve.append({"tokens": meta["training"]["tokens"], "ppl": final, "gap_closed": gap(b, final)})
            row = {"name": name, "bpw": b, "measured_bpw": bpw[b]["model"], "objective": objective, "rank": rank,
                   "targets": targets, "init": init, "lr": cfg.lr, "head_rank": cfg.head_rank, "schedule": cfg.schedule,
                   "rank_allocation": cfg.rank_allocation, "mix": run["mix"], "adapter_bits": 16,
                   "init_output_error_removed": meta["init"].get("output_error_removed"),
                   "layers": meta["layers"], "adapter_mb": meta["bytes"]["tensors"] / 1e6,
                   "adapter_bpw_cost": meta["bpw_cost"], "tok_per_s": meta["training"]["tok_per_s"],
                   "train_seconds": meta["training"]["seconds"], "wall_seconds": time.time() - t,
                   "train_wall_seconds": train_wall, "data_setup_seconds": meta["training"]["data_setup_seconds"],
                   "peak_memory_mb": meta["training"]["peak_memory_bytes"] / 1e6, "curve": curve, "tune": tuned,
                   # CPU of this process (one thread): tuning (when not reused) + training + the held-out scoring
                   "cpu_seconds": time.process_time() - cpu0 + (0 if tuned is None else tuned["cpu_seconds"] or 0)}
            done.write_text(json.dumps({"key": key, "row": row}))
            del m
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "curve"}), flush=True)
        if run["int8"]:  # the same adapter exported with --adapter-bits 8: scored, no second training run
            t = time.time()
            meta8 = int8_variant(out / name, out / f"{name}-int8")
            m = api.load(ckpts[b], cache=True, adapter=out / f"{name}-int8")
            p8 = ppl(m)
            rows.append({**row, "name": f"{name}-int8", "adapter_bits": 8, "adapter_mb": meta8["bytes"]["tensors"] / 1e6,
                         "adapter_bpw_cost": meta8["bpw_cost"], "wall_seconds": row["wall_seconds"] + time.time() - t,
                         "curve": [{"tokens": row["curve"][-1]["tokens"], "ppl": p8, "gap_closed": gap(b, p8)}]})
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "curve"}), flush=True)
            del m
        gc.collect()
        report(time.time() - t_start, {})  # the table so far: an interrupted benchmark still leaves its rows

    # --- equal total bytes: the adapter-free checkpoint of each row's base + adapter size ----------------------
    if not args.no_references:
        score_references(sorted({round(r["measured_bpw"] + r["adapter_bpw_cost"], 3) for r in rows}))

    # --- the training base path: dequantized weights cached or not, bf16 autocast or fp32 (same process) -------
    speed = {}
    for cache, precision in () if args.no_speed else ((True, "auto"), (False, "auto"), (True, "fp32")):
        cfg = RecoverConfig(rank=16, tokens=4 * 4 * seq_len, objective="kd", seq_len=seq_len, batch_size=4,
                            checkpoint_every=0, cache_dequantized=cache, precision=precision)
        meta = recover(ckpts[min(ckpts)], out / f"speed-cache{int(cache)}-{precision}", cfg, overwrite=True,
                       teacher=teacher)
        speed[f"kd, batch 4 x {seq_len}, cache_dequantized={cache}, "
              f"{'bf16 autocast' if meta['training']['mixed_precision'] == 'bf16' else 'fp32'}"] = \
            meta["training"]["tok_per_s"]
    report(time.time() - t_start, speed)


def _init(row: dict) -> str:
    """'svd (40%)' or 'zero, lr 0.002': the init, what it removed, and the lr where it is not the default."""
    removed, lr = row.get("init_output_error_removed"), row.get("lr")
    return (row.get("init", "zero") + ("" if removed is None else f" ({100 * removed:.0f}%)")
            + ("" if lr is None or lr == RecoverConfig.default("lr") else f", lr {lr:g}"))


def _adapter(r: dict) -> str:
    t = r.get("tune")
    b = (t or {}).get("blocks")
    tuned = "" if not t else (f"tuned {'+'.join(t['params'])}"
                              + ("" if not b else f" block-wise on {b['tokens']:,} tok x {b['epochs']} (lr {b['lr']:g})")
                              + ("" if not t["tokens"] else (" then end to end" if b else "") + f" on {t['tokens']:,} tok")
                              + (", then " if r["rank"] else ""))
    if not r["rank"]:
        return tuned + " (no adapter, zero extra bytes)"
    return tuned + (f"{r['objective']} r{r['rank']} " + ("" if r["targets"] == "all" else r["targets"] + " ")
            + (f"+ head r{r['head_rank']} " if r.get("head_rank") else "") + f"({r['layers']} layers)"
            + (", wsd" if r.get("schedule") == "wsd" else "") + (", int8" if r.get("adapter_bits") == 8 else "")
            + (", ranks by damage" if r.get("rank_allocation") == "damage" else "")
            + (f", mix {Path(r['mix']).stem}" if r.get("mix") else ""))


def _each(values: dict, fmt: str = "{:.2f}", scale: float = 1.0) -> str:
    """``values[k]`` for every text k, formatted and joined by ' / '."""
    return " / ".join(fmt.format(scale * values[k]) for k in TEXTS)


SHORT = {"shakespeare": "shak.", "gsm8k": "gsm8k", "mmlu": "mmlu", "alpaca_eval": "alpaca", "python-docs": "docs"}


def write_report(report: Path, name: str, original, quantized, bpw, rows, references, speed, windows, seconds,
                 peak) -> None:
    report.mkdir(parents=True, exist_ok=True)
    (report / f"{name}.json").write_text(json.dumps({
        "texts": {k: {"what": DOMAINS[k].what, "held_out": DOMAINS[k].held_out, "text_sha256": DOMAINS[k].text_sha256}
                  for k in TEXTS},
        "original": original, "quantized": {str(k): v for k, v in quantized.items()},
        "measured_bpw": {str(k): v for k, v in bpw.items()}, "rows": rows, "references": references,
        "speed_tok_per_s": speed, "eval_windows": windows, "seconds": seconds, "peak_memory_bytes": peak}, indent=1))
    cols = " / ".join(SHORT[k] for k in TEXTS)
    lines = [
        f"# Recovery benchmark, held-out domains (`python benchmarks/recover.py --name {name}`)\n",
        f"Perplexity on {windows} x 512 tokens of each text (`qrecover/evaluate/heldout.py`, sha256-pinned): "
        + "; ".join(f"**{k}** = {DOMAINS[k].what}" for k in TEXTS) + ". The held-out domains (no training source "
        f"covers them) are {', '.join(HELD_OUT)}; **worst** = the smallest gap closed among them. Gap closed = "
        "(quantized - recovered) / (quantized - original). Training: the shipped default mix (Python docs 40%, docs "
        "chats 20%, self-generated general chats 40%), LoRA on every quantized projection (unless top:N), AdamW with "
        "warm-up + cosine (or wsd), the RecoverConfig defaults (batch 1 x 512, lr 5e-4, svd init, bf16 autocast) unless "
        "listed. tok/s counts training steps alone; wall = training with its data setup and the svd init, plus the "
        f"final scoring. This invocation took {seconds / 60:.0f} min (rows finished earlier are reused with their own "
        "timings).\n",
        f"Original ppl ({cols}): " + " / ".join(f"{original[k]:.2f}" for k in TEXTS) + ".\n",
        "| checkpoint | quantized ppl (" + cols + ") | adapter | init (output error removed) | adapter MB | + bpw | bpw with "
        "adapter | tokens | recovered ppl (" + cols + ") | gap closed (" + cols + ") | **worst held-out** | equal-size "
        "adapter-free ppl (" + cols + ") | beats it on | tok/s | wall min | CPU min |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        q, f = quantized[r["bpw"]], r["curve"][-1]
        total = r["measured_bpw"] + r["adapter_bpw_cost"]
        ref = references.get(str(round(total, 3)))
        beats = "-" if ref is None else (", ".join(k for k in HELD_OUT if f["ppl"][k] < ref["ppl"][k]) or "none")
        lines.append(
            f"| {r['measured_bpw']:.3f} bpw | {_each(q, '{:.1f}')} | {_adapter(r)} | {_init(r)} | "
            f"{r['adapter_mb']:.2f} | {r['adapter_bpw_cost']:.3f} | {total:.3f} | {f['tokens']:,} | {_each(f['ppl'])} | "
            f"{_each(f['gap_closed'], '{:.0f}%', 100)} | **{100 * f['gap_closed']['worst']:.0f}%** | "
            f"{'-' if ref is None else _each(ref['ppl'])} | {beats} | "
            + ("-" if r.get("tok_per_s") is None else f"{r['tok_per_s']:.0f}") + f" | {r.get('wall_seconds', 0) / 60:.1f} | "
            + ("-" if r.get("cpu_seconds") is None else f"{r['cpu_seconds'] / 60:.1f}") + " |")
    if references:
        lines += ["", "## Adapter-free references (`qrecover compress --bpw B`, the compress defaults)", "",
                  f"| --bpw | measured bpw | ppl ({cols}) | gap of the {min(quantized)} bpw checkpoint closed ({cols}) | "
                  "worst held-out |",
                  "|---|---|---|---|---|"]
        for ref in references.values():
            g = ref["gap_closed_of_base"]
            lines.append(f"| {ref['bpw']} | {ref['measured_bpw']:.3f} | {_each(ref['ppl'])} | "
                         + ("-" if g is None else _each(g, "{:.0f}%", 100)) + " | "
                         + ("-" if g is None else f"{100 * g['worst']:.0f}%") + " |")
    lines += ["", f"## Gap closed against tokens trained (worst held-out; {cols})", "",
              "| run | points |", "|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | " + "; ".join(
            f"{p['tokens']:,} tok: **{100 * p['gap_closed']['worst']:.0f}%** (" + _each(p["gap_closed"], "{:.0f}%", 100) + ")"
            for p in r["curve"]) + " |")
    if speed:
        lines += ["", "## Training base path", "", "| setting | tokens/s |", "|---|---|"]
        lines += [f"| {k} | {v:.0f} |" for k, v in speed.items()]
    (report / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()

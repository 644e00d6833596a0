"""One entry point per stage. The CLI only parses arguments and calls these."""

from __future__ import annotations

import json
import math
import platform
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from . import __version__
from .allocate import Choice, InfeasibleBudget, Plan, allocate, allocate_by_position
from .calibrate import _progress, gradient_stats, sequential
from .config import CompressConfig
from .data import token_windows
from .errors import QRecoverError
from .io_utils import atomic_dir, sha256_file
from .models import count_parameters, decoder_layers, is_tied, linear_layers, load_model, module_name, resolve
from .qlinear import QuantEmbedding, QuantLinear, QuantLMHead
from .schemes import QuantizedWeight, get_quantizer
from .sensitivity import METHOD, linear_damage, lookup_damage

FORMAT_VERSION = 1
MANIFEST = "qrecover.json"
WEIGHTS = "model.safetensors"


@dataclass
class Candidate:
    """One way to store one layer: ``label`` like ``palettize:4``, the quantizer and its bits."""

    label: str
    scheme: str
    params: dict[str, Any]
    bits: int

    @property
    def quantizer(self):
        return get_quantizer(self.scheme, **self.params)


def _linear_candidates(cfg: CompressConfig) -> list[Candidate]:
    return [Candidate(f"{cfg.scheme}:{b}", cfg.scheme, dict(cfg.scheme_params), b) for b in sorted(cfg.bits)]


def _embedding_candidates(cfg: CompressConfig, scope_has_embedding: bool) -> list[Candidate]:
    int8 = Candidate("blockwise:8", "blockwise", {"block_size": None, "symmetric": True}, 8)  # AFM: per-channel int8
    pal4 = Candidate("palettize:4", "palettize", {"group_size": 16, "block_size": None}, 4)
    mode = cfg.embedding_bits
    if mode == "auto" and not (scope_has_embedding and cfg.bpw is not None):
        mode = "8"  # nothing to trade it against: keep AFM's default
    return {"auto": [pal4, int8], "4": [pal4], "8": [int8]}[mode]


def _bpw(nbytes: int, params: int) -> float:
    return 8.0 * nbytes / params


# --- compress -------------------------------------------------------------------------------------------


def compress(config: CompressConfig | None = None, out: str | Path | None = None, overwrite: bool = False,
             show_progress: bool = True, **overrides: Any) -> dict[str, Any]:
    """Compress a model to ``config.bpw`` bits per weight; write a checkpoint to ``out``; return its manifest."""
    cfg = config or CompressConfig(**overrides)
    t0 = time.time()
    out = Path(out) if out is not None else None
    if out is not None and out.exists() and not overwrite:
        raise QRecoverError(f"output directory {str(out)!r} already exists; pass --overwrite to replace it")
    model, tok, source = load_model(cfg.model)
    n_params = count_parameters(model)
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    linears = {f"{prefix}.{i}.{n}": m for i, l in enumerate(layers) for n, m in linear_layers(l).items()}
    emb, head, tied = model.get_input_embeddings(), model.get_output_embeddings(), is_tied(model)
    emb_name = module_name(model, emb)
    head_name = module_name(model, head) if head is not None else None
    n_linear = sum(m.weight.numel() for m in linears.values())

    # the units the allocator chooses for, and their candidate encodings
    lin_cands = _linear_candidates(cfg)
    for c in lin_cands:
        for name, m in linears.items():
            c.quantizer.check(tuple(m.weight.shape), c.bits)
    in_scope_emb = cfg.scope == "model"
    emb_cands = _embedding_candidates(cfg, in_scope_emb)
    untied_head = head is not None and not tied
    units: dict[str, dict[str, Any]] = {n: {"kind": "linear", "module": m, "cands": lin_cands} for n, m in linears.items()}
    units[emb_name] = {"kind": "embedding", "module": emb, "cands": emb_cands, "tied": tied}
    if untied_head:
        units[head_name] = {"kind": "head", "module": head, "cands": emb_cands}
    quantized_params = {f"{n}.weight" for n in units} | ({f"{head_name}.weight"} if tied else set())
    remainder = {k: v for k, v in model.state_dict().items() if k not in quantized_params}
    remainder_bytes = sum(v.numel() * 2 for v in remainder.values())  # stored as 16-bit

    # fail fast on an impossible budget, before minutes of calibration
    sizes = {n: [c.quantizer.nbytes(tuple(u["module"].weight.shape), c.bits) for c in u["cands"]] for n, u in units.items()}
    budget_units = [n for n, u in units.items() if u["kind"] == "linear" or in_scope_emb]
    if cfg.bpw is not None:
        denom = n_params if in_scope_emb else n_linear
        fixed = remainder_bytes if in_scope_emb else 0
        budget_bytes = math.floor(cfg.bpw * denom / 8) - fixed
        lo = sum(min(sizes[n]) for n in budget_units) + fixed
        hi = sum(max(sizes[n]) for n in budget_units) + fixed
        if budget_bytes < lo - fixed:
            raise QRecoverError(
                f"--bpw {cfg.bpw} is below what these choices can reach: with --bits {','.join(map(str, cfg.bits))} "
                f"and --scope {cfg.scope} the smallest is {_bpw(lo, denom):.3f} bpw and the largest "
                f"{_bpw(hi, denom):.3f} bpw; raise --bpw or allow lower --bits"
            )

    # calibration
    windows = token_windows(tok, cfg.calib_data, "calib", cfg.calib_samples, cfg.seq_len)
    grads = gradient_stats(model, windows, show_progress)
    results: dict[str, list[tuple[QuantizedWeight, float]]] = {}

    def quantize_unit(name: str, weight: torch.Tensor, stats: dict, damage_fn) -> None:
        cands = units[name]["cands"]
        by_scheme: dict[str, list[Candidate]] = {}
        for c in cands:  # same scheme and parameters: quantize every width in one go (shared sort)
            by_scheme.setdefault(json.dumps([c.scheme, c.params], sort_keys=True), []).append(c)
        done = {}
        for group in by_scheme.values():
            for c, qw in zip(group, group[0].quantizer.quantize_many(weight, [c.bits for c in group], stats)):
                done[c.label] = qw
        w = weight.detach().float()
        results[name] = [(done[c.label], damage_fn(w - done[c.label].dequantize())) for c in cands]

    def on_layer(_i: int, _layer: nn.Module, stats: dict) -> None:
        for name, st in stats.items():
            g = grads["out_grad_sq"][name]
            quantize_unit(name, linears[name].weight, st, lambda dw: linear_damage(dw, st["hessian"], g))

    sequential(model, windows, on_layer, show_progress)
    with _progress() as bar:
        task = bar.add_task("quantize: embedding", total=1, visible=show_progress)
        hd = grads["head"]
        h_diag = hd["hessian"].diagonal()
        if tied:
            imp = grads["emb_fisher"] + hd["out_grad_sq"].unsqueeze(1) * h_diag.unsqueeze(0)
            fn = lambda dw: lookup_damage(dw, grads["emb_fisher"]) + linear_damage(dw, hd["hessian"], hd["out_grad_sq"])  # noqa: E731
        else:
            imp = grads["emb_fisher"]
            fn = lambda dw: lookup_damage(dw, grads["emb_fisher"])  # noqa: E731
        quantize_unit(emb_name, emb.weight, {"element_sq": imp}, fn)
        if untied_head:
            quantize_unit(head_name, head.weight, {"input_sq": h_diag, "hessian": hd["hessian"]},
                          lambda dw: linear_damage(dw, hd["hessian"], hd["out_grad_sq"]))
        bar.advance(task)

    # allocation
    table = {n: [Choice(c.label, qw.nbytes, max(d, 0.0)) for c, (qw, d) in zip(units[n]["cands"], results[n])] for n in units}
    for n in units:
        assert [ch.nbytes for ch in table[n]] == sizes[n], f"predicted bytes differ from packed bytes for {n}"
    if cfg.bpw is None:
        plan_idx = {n: 0 for n in units}
    else:
        sub = {n: table[n] for n in budget_units}
        fn = allocate if cfg.allocation == "sensitivity" else allocate_by_position
        try:
            plan: Plan = fn(sub, budget_bytes)
        except InfeasibleBudget as e:  # the early check should have caught it
            raise QRecoverError(str(e)) from None
        plan_idx = dict(plan.choices)
        for n in units:
            plan_idx.setdefault(n, 0 if len(table[n]) == 1 else max(range(len(table[n])), key=lambda k: table[n][k].nbytes))

    # assemble and save
    tensors: dict[str, torch.Tensor] = {k: v.detach().to(torch.float16).contiguous() for k, v in remainder.items()}
    layer_info: dict[str, Any] = {}
    for n, u in units.items():
        c = u["cands"][plan_idx[n]]
        qw = results[n][plan_idx[n]][0]
        for tname, t in qw.tensors.items():
            tensors[f"{n}.{tname}"] = t.contiguous()
        layer_info[n] = {
            "kind": u["kind"], "scheme": qw.scheme, "bits": qw.bits, "params": qw.params, "shape": list(qw.shape),
            "tensors": sorted(qw.tensors), "nbytes": qw.nbytes, "bpw": _bpw(qw.nbytes, qw.numel),
            "damage": results[n][plan_idx[n]][1], "label": c.label,
            **({"tied_to": head_name} if u.get("tied") and tied else {}),
        }
    manifest: dict[str, Any] = {
        "format": "qrecover",
        "format_version": FORMAT_VERSION,
        "source": {"path": source.path, "kind": source.kind, "name": source.name, "weights_sha256": source.weights_sha256},
        "architecture": type(model).__name__,
        "parameters": {"model": n_params, "linear": n_linear},
        "budget": {"bpw": cfg.bpw, "scope": cfg.scope, "bits": cfg.bits, "allocation": cfg.allocation,
                   "embedding_bits": cfg.embedding_bits},
        "config": cfg.to_dict(),
        "layers": layer_info,
        "remainder": {k: {"dtype": "float16", "shape": list(v.shape)} for k, v in remainder.items()},
        "sensitivity": {"method": METHOD, "unit": "predicted increase of mean next-token loss (nats)",
                        "table": {n: {ch.label: ch.damage for ch in table[n]} for n in units},
                        "predicted_loss_increase": sum(results[n][plan_idx[n]][1] for n in units)},
        "calibration": {"source": cfg.calib_data, "split": "calib", "windows": cfg.calib_samples,
                        "seq_len": cfg.seq_len, "tokens": grads["tokens"], "loss": grads["loss"]},
        "versions": _versions(),
    }
    if out is None:
        return manifest
    with atomic_dir(out, overwrite=overwrite) as tmp:
        save_file(tensors, str(tmp / WEIGHTS), metadata={"format": "qrecover"})
        measured = measure_bpw(tmp / WEIGHTS, manifest)
        manifest["measured_bpw"] = measured["bpw"]
        manifest["bytes"] = measured["bytes"]
        manifest["weights_file"] = {"name": WEIGHTS, "sha256": sha256_file(tmp / WEIGHTS)}
        manifest["created"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        manifest["seconds"] = round(time.time() - t0, 1)
        config = model.config
        config.save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def measure_bpw(weights: Path, manifest: dict[str, Any]) -> dict[str, Any]:
    """Bits per weight from the bytes of every tensor in the weights file (nothing left out)."""
    per_tensor: dict[str, int] = {}
    with safe_open(str(weights), framework="pt") as f:
        for k in f.keys():
            sl = f.get_slice(k)
            shape, dtype = sl.get_shape(), sl.get_dtype()
            per_tensor[k] = math.prod(shape) * {"U8": 1, "I8": 1, "F16": 2, "BF16": 2, "F32": 4, "I32": 4, "I64": 8}[dtype]
    layer_bytes = {n: sum(per_tensor[f"{n}.{t}"] for t in info["tensors"]) for n, info in manifest["layers"].items()}
    total = sum(per_tensor.values())
    linear = sum(b for n, b in layer_bytes.items() if manifest["layers"][n]["kind"] == "linear")
    p = manifest["parameters"]
    return {
        "bpw": {"model": _bpw(total, p["model"]), "linear": _bpw(linear, p["linear"])},
        "bytes": {"total": total, "linear": linear, "file": weights.stat().st_size,
                  "embedding": sum(b for n, b in layer_bytes.items() if manifest["layers"][n]["kind"] != "linear"),
                  "remainder": total - sum(layer_bytes.values())},
    }


def _versions() -> dict[str, str]:
    import safetensors
    import transformers

    return {"qrecover": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "python": platform.python_version()}


# --- load -----------------------------------------------------------------------------------------------


def read_manifest(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    mf = path / MANIFEST
    if not mf.exists():
        raise QRecoverError(f"{str(path)!r} is not a qrecover checkpoint (no {MANIFEST}); compress a model first")
    try:
        manifest = json.loads(mf.read_text())
    except json.JSONDecodeError as e:
        raise QRecoverError(f"{mf} is not valid JSON ({e}); the checkpoint is corrupted, compress again") from None
    version = manifest.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise QRecoverError(
            f"{str(path)!r} has format_version={version!r}, newer than this qrecover reads ({FORMAT_VERSION}); "
            "upgrade qrecover"
        )
    return manifest


def load(path: str | Path, cache: bool = False, verify: bool = True) -> nn.Module:
    """Load a compressed checkpoint as a transformers model with :class:`QuantLinear` layers.

    ``verify`` checks the weights file against the manifest's sha256 (a tampered or corrupted file is
    refused). ``cache`` keeps dequantized weights after first use (faster repeated CPU evaluation).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    manifest = read_manifest(path)
    weights = path / manifest["weights_file"]["name"]
    if not weights.exists():
        raise QRecoverError(f"{weights} is missing; the checkpoint is incomplete, compress again")
    if verify:
        digest = sha256_file(weights)
        if digest != manifest["weights_file"]["sha256"]:
            raise QRecoverError(
                f"{weights} has sha256 {digest[:16]}..., the manifest says {manifest['weights_file']['sha256'][:16]}...: "
                "the weights were changed or corrupted after compression; compress again"
            )
    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with safe_open(str(weights), framework="pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    for name, info in manifest["layers"].items():
        qw = QuantizedWeight(info["scheme"], info["bits"], tuple(info["shape"]), info["params"],
                             {t: state.pop(f"{name}.{t}") for t in info["tensors"]})
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        old = getattr(parent, child)
        if info["kind"] == "embedding":
            new = QuantEmbedding(qw, padding_idx=getattr(old, "padding_idx", None), cache=True)
        else:
            bias = state.pop(f"{name}.bias", None)
            new = QuantLinear(qw, bias=bias.float() if bias is not None else None, cache=cache)
        setattr(parent, child, new)
        if "tied_to" in info:
            hp, _, hc = info["tied_to"].rpartition(".")
            setattr(model.get_submodule(hp), hc, QuantLMHead(new))
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not any(k.startswith(f"{n}.") for n in manifest["layers"])]
    if missing or unexpected:
        raise QRecoverError(f"checkpoint {str(path)!r} does not match its config: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.eval()
    model.qrecover_manifest = manifest
    return model


def load_any(spec: str | None, cache: bool = True) -> tuple[nn.Module, Any, dict[str, Any]]:
    """An original model or a qrecover checkpoint, for evaluation: ``(model, tokenizer, info)``."""
    from transformers import AutoTokenizer

    path, kind = resolve(spec)
    if kind == "qrecover":
        model = load(path, cache=cache)
        return model, AutoTokenizer.from_pretrained(path), {"kind": "qrecover", "path": str(path),
                                                             "measured_bpw": model.qrecover_manifest.get("measured_bpw")}
    model, tok, source = load_model(spec)
    return model, tok, {"kind": source.kind, "path": source.path, "measured_bpw": {"model": 32.0, "linear": 32.0}}


# --- perplexity -----------------------------------------------------------------------------------------

PPL_PROTOCOL = ("held-out split 'eval' of the text source (documents never used for calibration or training), "
                "documents in hash order joined by EOS, the first windows*seq_len tokens cut into non-overlapping "
                "windows, each scored independently (no context carried over); ppl = exp(mean NLL of every predicted token)")


@torch.no_grad()
def perplexity(model: nn.Module, tokenizer: Any, source: str = "python-docs", windows: int = 32, seq_len: int = 512,
               show_progress: bool = True) -> dict[str, Any]:
    """Held-out perplexity under the fixed protocol :data:`PPL_PROTOCOL`."""
    data = token_windows(tokenizer, source, "eval", windows, seq_len)
    nll, count = 0.0, 0
    with _progress() as bar:
        task = bar.add_task("perplexity", total=windows, visible=show_progress)
        for w in data:
            logits = model(input_ids=w.unsqueeze(0), use_cache=False).logits[0, :-1].float()
            nll += float(nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            count += seq_len - 1
            bar.advance(task)
    return {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count, "source": source, "split": "eval",
            "windows": windows, "seq_len": seq_len, "protocol": PPL_PROTOCOL}

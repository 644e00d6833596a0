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
from .calibrate import gradient_stats, progress, sequential
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


# Embedding encodings the allocator may choose from (the embedding is a fifth of a 135M model's weights).
# Row-wise integer blocks, not palettization: a look-up table shared by 16 rows would tie unrelated tokens
# together, and k-means weighted by calibration statistics fits the few thousand tokens calibration sees
# while the rest of the vocabulary pays (measured: 4-bit palettized with 64-column tables lost 0.39-0.44
# nats of held-out loss where its estimate said 0.10-0.19; 4-bit blocks of 32 lost 0.09, estimated 0.11).
_EMB_CANDS = [
    Candidate("blockwise:4/b128", "blockwise", {"block_size": 128, "symmetric": False}, 4),  # 4.16 bpw
    Candidate("blockwise:4/b64", "blockwise", {"block_size": 64, "symmetric": False}, 4),  # 4.31 bpw
    Candidate("blockwise:4/b32", "blockwise", {"block_size": 32, "symmetric": False}, 4),  # 4.63 bpw
    Candidate("blockwise:8", "blockwise", {"block_size": None, "symmetric": True}, 8),  # AFM: per-channel int8
]


def _fits(c: Candidate, shape: tuple[int, int]) -> bool:
    try:
        c.quantizer.check(shape, c.bits)
        return True
    except QRecoverError:
        return False


def _embedding_labels(cfg: CompressConfig) -> list[str]:
    mode = cfg.embedding_bits
    if mode == "auto" and (cfg.scope != "model" or cfg.bpw is None):
        mode = "8"  # nothing to trade it against: keep AFM's default
    return [c.label for c in _EMB_CANDS if mode == "auto" or c.bits == int(mode)]


def _bpw(nbytes: int, params: int) -> float:
    return 8.0 * nbytes / params


# --- compress -------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    """The expensive part of compression, reusable for any budget, scope, allocation or embedding width:
    the loaded model, and for every quantizable unit its candidate encodings with their estimated damage."""

    cfg: CompressConfig
    model: nn.Module
    tokenizer: Any
    source: Any
    params: dict[str, int]
    units: dict[str, dict[str, Any]]  # name -> {"kind", "tied", "cands": [Candidate], "results": [(QuantizedWeight, damage)]}
    remainder: dict[str, torch.Tensor]
    head_name: str | None
    calibration: dict[str, Any]
    seconds: float


def prepare(cfg: CompressConfig, show_progress: bool = True) -> Prepared:
    """Load, calibrate, and quantize every unit at every candidate width (see :mod:`qrecover.calibrate`)."""
    t0 = time.time()
    model, tok, source = load_model(cfg.model)
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    linears = {f"{prefix}.{i}.{n}": m for i, l in enumerate(layers) for n, m in linear_layers(l).items()}
    emb, head, tied = model.get_input_embeddings(), model.get_output_embeddings(), is_tied(model)
    emb_name = module_name(model, emb)
    head_name = module_name(model, head) if head is not None else None
    lin_cands = _linear_candidates(cfg)
    for c in lin_cands:
        for m in linears.values():
            c.quantizer.check(tuple(m.weight.shape), c.bits)
    emb_cands = [c for c in _EMB_CANDS if c.label in _embedding_labels(cfg) and _fits(c, tuple(emb.weight.shape))]
    if not emb_cands:
        raise QRecoverError(f"no embedding encoding allowed by --embedding-bits {cfg.embedding_bits} fits shape {tuple(emb.weight.shape)}")
    units: dict[str, dict[str, Any]] = {n: {"kind": "linear", "module": m, "cands": lin_cands} for n, m in linears.items()}
    units[emb_name] = {"kind": "embedding", "module": emb, "cands": emb_cands, "tied": tied}
    untied_head = head is not None and not tied
    if untied_head:
        units[head_name] = {"kind": "head", "module": head, "cands": emb_cands}
    quantized = {f"{n}.weight" for n in units} | ({f"{head_name}.weight"} if tied else set())
    remainder = {k: v for k, v in model.state_dict().items() if k not in quantized}

    windows = token_windows(tok, cfg.calib_data, "calib", cfg.calib_samples, cfg.seq_len)
    grads = gradient_stats(model, windows, show_progress)

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
        units[name]["results"] = [(done[c.label], max(damage_fn(w - done[c.label].dequantize()), 0.0)) for c in cands]

    def on_layer(_i: int, _layer: nn.Module, stats: dict) -> None:
        for name, st in stats.items():
            g = grads["out_grad_sq"][name]
            quantize_unit(name, linears[name].weight, st, lambda dw: linear_damage(dw, st["hessian"], g))

    sequential(model, windows, on_layer, show_progress)
    with progress() as bar:
        task = bar.add_task("quantize: embedding", total=1, visible=show_progress)
        hd = grads["head"]
        h_diag = hd["hessian"].diagonal()
        # Lookup damage with every token row weighted alike: calibration sees a few thousand of the
        # vocabulary's tokens, too few to estimate per-token frequencies (see sensitivity.lookup_damage).
        fisher = (grads["emb_fisher"].sum(0) / emb.weight.shape[0]).expand(emb.weight.shape)
        if tied:  # the matrix serves both the lookup and the logits: importance and damage of both
            imp = fisher + hd["out_grad_sq"].unsqueeze(1) * h_diag.unsqueeze(0)
            fn = lambda dw: lookup_damage(dw, fisher) + linear_damage(dw, hd["hessian"], hd["out_grad_sq"])  # noqa: E731
        else:
            imp, fn = fisher, (lambda dw: lookup_damage(dw, fisher))  # noqa: E731
        quantize_unit(emb_name, emb.weight, {"element_sq": imp}, fn)
        if untied_head:
            quantize_unit(head_name, head.weight, {"input_sq": h_diag, "hessian": hd["hessian"]},
                          lambda dw: linear_damage(dw, hd["hessian"], hd["out_grad_sq"]))
        bar.advance(task)
    calibration = {"source": cfg.calib_data, "split": "calib", "windows": cfg.calib_samples, "seq_len": cfg.seq_len,
                   "tokens": grads["tokens"], "loss": grads["loss"]}
    params = {"model": count_parameters(model), "linear": sum(m.weight.numel() for m in linears.values())}
    return Prepared(cfg, model, tok, source, params, units, remainder, head_name, calibration, time.time() - t0)


def compress(config: CompressConfig | None = None, out: str | Path | None = None, overwrite: bool = False,
             show_progress: bool = True, prepared: Prepared | None = None, **overrides: Any) -> dict[str, Any]:
    """Compress a model to ``config.bpw`` bits per weight; write a checkpoint to ``out``; return its manifest.

    ``prepared`` (from :func:`prepare` with the same model, scheme and calibration, and bits that include
    ``config.bits``) skips the expensive stage, so one calibration serves several budgets and bit sets.
    """
    cfg = config or CompressConfig(**overrides)
    t0 = time.time()
    out = Path(out) if out is not None else None
    if out is not None and out.exists() and not overwrite:
        raise QRecoverError(f"output directory {str(out)!r} already exists; pass --overwrite to replace it")
    in_scope_emb = cfg.scope == "model"
    emb_labels = _embedding_labels(cfg)
    supported = get_quantizer(cfg.scheme, **cfg.scheme_params).supported_bits
    if bad := [b for b in cfg.bits if b not in supported]:
        raise QRecoverError(f"--bits {','.join(map(str, cfg.bits))}: scheme {cfg.scheme!r} does not support {bad}; choose from {list(supported)}")
    if prepared is None:
        _check_budget_early(cfg)
        prepared = prepare(cfg, show_progress)
    p = prepared
    same = ("model", "scheme", "scheme_params", "calib_data", "calib_samples", "seq_len")
    if not set(cfg.bits) <= set(p.cfg.bits) or any(getattr(cfg, k) != getattr(p.cfg, k) for k in same):
        raise QRecoverError(
            f"the prepared candidates were made with {({k: getattr(p.cfg, k) for k in (*same, 'bits')})}; "
            f"this config asks for {({k: getattr(cfg, k) for k in (*same, 'bits')})}: prepare again"
        )
    have = {c.label for n, u in p.units.items() if u["kind"] != "linear" for c in u["cands"]}
    if missing := [lb for lb in emb_labels if lb not in have and any(lb == c.label for c in _EMB_CANDS if _fits(c, tuple(p.model.get_input_embeddings().weight.shape)))]:
        raise QRecoverError(f"the prepared candidates lack embedding encodings {missing}; prepare with --embedding-bits auto")
    remainder_bytes = sum(v.numel() * 2 for v in p.remainder.values())  # stored as 16-bit

    # the choices the allocator may make: every linear candidate; the embedding's allowed widths
    table: dict[str, list[Choice]] = {}
    picks: dict[str, list[int]] = {}
    for n, u in p.units.items():
        keep = [k for k, c in enumerate(u["cands"]) if (c.bits in cfg.bits if u["kind"] == "linear" else c.label in emb_labels)]
        picks[n] = keep
        table[n] = [Choice(u["cands"][k].label, u["results"][k][0].nbytes, u["results"][k][1]) for k in keep]
    budget_units = [n for n, u in p.units.items() if u["kind"] == "linear" or in_scope_emb]
    if cfg.bpw is None:
        chosen = {n: 0 for n in p.units}
        if len(cfg.bits) != 1:
            raise QRecoverError(f"a uniform model needs a single width in --bits, got {cfg.bits}")
    else:
        denom = p.params["model"] if in_scope_emb else p.params["linear"]
        fixed = remainder_bytes if in_scope_emb else 0
        budget_bytes = math.floor(cfg.bpw * denom / 8) - fixed
        lo = sum(min(c.nbytes for c in table[n]) for n in budget_units) + fixed
        hi = sum(max(c.nbytes for c in table[n]) for n in budget_units) + fixed
        if budget_bytes + fixed < lo:
            raise _infeasible(cfg, _bpw(lo, denom), _bpw(hi, denom))
        fn = allocate if cfg.allocation == "sensitivity" else allocate_by_position
        plan: Plan = fn({n: table[n] for n in budget_units}, budget_bytes)
        chosen = dict(plan.choices)
        for n in p.units:  # outside the budget's scope: the largest allowed choice
            chosen.setdefault(n, max(range(len(table[n])), key=lambda k: table[n][k].nbytes))

    tensors: dict[str, torch.Tensor] = {k: v.detach().to(torch.float16).contiguous() for k, v in p.remainder.items()}
    layer_info: dict[str, Any] = {}
    damage_total = 0.0
    for n, u in p.units.items():
        k = picks[n][chosen[n]]
        qw, damage = u["results"][k]
        damage_total += damage
        for tname, t in qw.tensors.items():
            tensors[f"{n}.{tname}"] = t.contiguous()
        layer_info[n] = {
            "kind": u["kind"], "scheme": qw.scheme, "bits": qw.bits, "params": qw.params, "shape": list(qw.shape),
            "tensors": sorted(qw.tensors), "nbytes": qw.nbytes, "bpw": _bpw(qw.nbytes, qw.numel),
            "damage": damage, "label": u["cands"][k].label,
            **({"tied_to": p.head_name} if u.get("tied") else {}),
        }
    manifest: dict[str, Any] = {
        "format": "qrecover",
        "format_version": FORMAT_VERSION,
        "source": {"path": p.source.path, "kind": p.source.kind, "name": p.source.name, "weights_sha256": p.source.weights_sha256},
        "architecture": type(p.model).__name__,
        "parameters": p.params,
        "budget": {"bpw": cfg.bpw, "scope": cfg.scope, "bits": cfg.bits, "allocation": cfg.allocation,
                   "embedding_bits": cfg.embedding_bits},
        "config": cfg.to_dict(),
        "layers": layer_info,
        "remainder": {k: {"dtype": "float16", "shape": list(v.shape)} for k, v in p.remainder.items()},
        "sensitivity": {"method": METHOD, "unit": "predicted increase of mean next-token loss (nats)",
                        "table": {n: {c.label: d for c, (_, d) in zip(u["cands"], u["results"])} for n, u in p.units.items()},
                        "predicted_loss_increase": damage_total},
        "calibration": p.calibration,
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
        manifest["seconds"] = round(time.time() - t0, 1)  # this call; includes preparing unless it was given
        manifest["prepare_seconds"] = round(p.seconds, 1)
        p.model.config.save_pretrained(tmp)
        if getattr(p.model, "generation_config", None) is not None:
            p.model.generation_config.save_pretrained(tmp)
        p.tokenizer.save_pretrained(tmp)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return manifest


def _infeasible(cfg: CompressConfig, lo: float, hi: float) -> QRecoverError:
    return QRecoverError(
        f"--bpw {cfg.bpw} is below what these choices can reach: with --bits {','.join(map(str, cfg.bits))}, "
        f"--embedding-bits {cfg.embedding_bits} and --scope {cfg.scope} the smallest is {lo:.3f} bpw and the "
        f"largest {hi:.3f} bpw; raise --bpw or allow lower --bits"
    )


def _check_budget_early(cfg: CompressConfig) -> None:
    """Refuse an impossible budget from shapes alone, before minutes of calibration."""
    if cfg.bpw is None:
        return
    from transformers import AutoConfig, AutoModelForCausalLM

    path, kind = resolve(cfg.model)
    if kind not in ("hf", "default"):
        return  # a GGUF is checked after loading
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    except ValueError as e:
        raise QRecoverError(f"{str(path)!r} is not a causal language model: {e}") from None
    layers = decoder_layers(model)
    lin = [m for l in layers for m in linear_layers(l).values()]
    emb = model.get_input_embeddings()
    cands = _linear_candidates(cfg)
    emb_cands = [c for c in _EMB_CANDS if c.label in _embedding_labels(cfg) and _fits(c, tuple(emb.weight.shape))]
    sizes = [[c.quantizer.nbytes(tuple(m.weight.shape), c.bits) for c in cands] for m in lin]
    n_lin = sum(m.weight.numel() for m in lin)
    if cfg.scope == "model":
        n_all = count_parameters(model)
        rem = 2 * (n_all - n_lin - emb.weight.numel())
        if not is_tied(model) and model.get_output_embeddings() is not None:
            rem -= 2 * model.get_output_embeddings().weight.numel()
            sizes.append([c.quantizer.nbytes(tuple(model.get_output_embeddings().weight.shape), c.bits) for c in emb_cands])
        sizes.append([c.quantizer.nbytes(tuple(emb.weight.shape), c.bits) for c in emb_cands])
        denom, fixed = n_all, rem
    else:
        denom, fixed = n_lin, 0
    lo = sum(min(s) for s in sizes) + fixed
    if math.floor(cfg.bpw * denom / 8) < lo:
        raise _infeasible(cfg, _bpw(lo, denom), _bpw(sum(max(s) for s in sizes) + fixed, denom))


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


def load(path: str | Path, cache: bool = False, verify: bool = True, adapter: str | Path | None = None,
         allow_foreign_adapter: bool = False) -> nn.Module:
    """Load a compressed checkpoint as a transformers model with :class:`QuantLinear` layers.

    ``verify`` checks the weights file against the manifest's sha256 (a tampered or corrupted file is
    refused). ``cache`` keeps dequantized weights after first use (faster repeated CPU evaluation).
    ``adapter``: a recovery adapter directory; the model comes back wrapped in PEFT's ``PeftModel``. An
    adapter trained on another checkpoint is refused unless ``allow_foreign_adapter``.
    """
    if adapter is not None:
        from .recovery.lora import check_base

        check_base(adapter, path, allow_foreign_adapter)  # before the expensive load
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
    if adapter is not None:
        from .recovery.lora import peft_from_pretrained

        model = peft_from_pretrained(model, adapter)  # qrecover's LoRA layer: merging re-quantizes
        model.eval()
        model.qrecover_manifest = manifest
    return model


def load_any(spec: str | None, cache: bool = True, adapter: str | Path | None = None,
             allow_foreign_adapter: bool = False) -> tuple[nn.Module, Any, dict[str, Any]]:
    """An original model or a qrecover checkpoint (with an optional recovery adapter), for evaluation.

    Returns ``(model, tokenizer, info)``; ``info["adapter"]`` is ``{path, rank, bpw_cost}`` when an adapter
    is loaded, else None.
    """
    from transformers import AutoTokenizer

    path, kind = resolve(spec)
    if kind == "qrecover":
        model = load(path, cache=cache, adapter=adapter, allow_foreign_adapter=allow_foreign_adapter)
        info = {"kind": "qrecover", "path": str(path), "measured_bpw": model.qrecover_manifest.get("measured_bpw"),
                "adapter": None}
        if adapter is not None:
            from .recovery.lora import adapter_summary

            info["adapter"] = adapter_summary(adapter, model.qrecover_manifest)
        return model, AutoTokenizer.from_pretrained(path), info
    if adapter is not None:
        raise QRecoverError(f"--adapter needs a qrecover checkpoint; {spec or 'the default model'!r} is an unquantized "
                            "model. Pass the checkpoint the adapter was trained on")
    model, tok, source = load_model(spec)
    return model, tok, {"kind": source.kind, "path": source.path, "measured_bpw": {"model": 32.0, "linear": 32.0},
                        "adapter": None}


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
    with progress() as bar:
        task = bar.add_task("perplexity", total=windows, visible=show_progress)
        for w in data:
            logits = model(input_ids=w.unsqueeze(0), use_cache=False).logits[0, :-1].float()
            nll += float(nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            count += seq_len - 1
            bar.advance(task)
    return {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count, "source": source, "split": "eval",
            "windows": windows, "seq_len": seq_len, "protocol": PPL_PROTOCOL}

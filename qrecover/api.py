"""One entry point per stage. The CLI only parses arguments and calls these."""

from __future__ import annotations

import math
import platform
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ._version import __version__
from .allocate import Choice
from .checkpoint import FORMAT_VERSION
from .config import CompressConfig
from .data.mix import calibration_windows
from .distributed import SINGLE, join, local_device
from .errors import QRecoverError
from .evaluate.perplexity import PPL_PROTOCOL, perplexity  # noqa: F401  (re-exported: qrecover.api is the facade)
from .loading import load, load_any  # noqa: F401  (re-exported: qrecover.api is the facade)
from .models import count_parameters, decoder_layers, is_tied, linear_layers, load_model, module_name, resolve, state_tensors, unquantized_matrices
from .moe import unfuse_experts
from .progress import progress
from .sensitivity import METHOD, linear_damage
from .stages.allocation import Budget, Infeasible, choose
from .stages.calibrate import gradients, layer_pass, plan_stats
from .stages.candidates import embedding_stats, quantize_shared
from .stages.finalize import finalize
from .stages.specs import Encoding, embedding_encodings, linear_encodings
from .stages.transform import apply_transforms, transforms_of
from .stages.write import bpw as _bpw
from .stages.write import write_checkpoint
from .transforms import get_transform


def _fits(c: Encoding, shape: tuple[int, int]) -> bool:
    try:
        c.quantizer.check(shape, c.bits)
        return True
    except QRecoverError:
        return False


def _encodings(cfg: CompressConfig) -> tuple[list[Encoding], list[Encoding]]:
    """``(linear candidates, embedding candidates)`` of a config, parsed and checked (no model needed)."""
    lin = linear_encodings(cfg.scheme, cfg.bits, cfg.scheme_params, cfg.encodings)
    emb = embedding_encodings(cfg.embedding_bits, cfg.embedding_encodings, cfg.scope == "model" and cfg.bpw is not None)
    if cfg.bpw is None and len(lin) != 1:
        raise QRecoverError(f"a uniform model (no --bpw) needs a single linear encoding, got {[e.label for e in lin]}; "
                            "give one, or a --bpw budget")
    if cfg.bpw is None and len(emb) != 1:
        raise QRecoverError(f"a uniform model (no --bpw) needs a single embedding encoding, got {[e.label for e in emb]}; "
                            "give one, or a --bpw budget")
    return lin, emb


def resolve_device(spec: str) -> torch.device:
    """``--device`` -> a torch device: 'auto' is CUDA when available, else the CPU."""
    if spec == "auto":
        return local_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise QRecoverError(f"--device {spec}: CUDA is not available here; use --device cpu or auto")
    return local_device(torch.device(spec))  # under torchrun: cuda:LOCAL_RANK


def _check_linears(model: nn.Module, linears: dict[str, nn.Module]) -> None:
    """Refuse a model whose decoder layers hold no ``nn.Linear`` (GPT-2's ``Conv1D``, say): nothing to quantize."""
    if not linears:
        kinds = sorted({type(m).__name__ for layer in decoder_layers(model)[:1] for m in layer.modules()
                        if any(p.dim() >= 2 for p in m.parameters(recurse=False))})
        raise QRecoverError(f"{type(model).__name__}'s decoder layers have no nn.Linear layers to quantize (their "
                            f"matrices live in {kinds}); qrecover quantizes nn.Linear projections: convert the model "
                            "to one whose projections are nn.Linear")


def _check_shapes(lin: list[Encoding], shapes: dict[str, tuple[int, int]]) -> None:
    """Every linear layer needs an encoding of the menu that fits it, and every encoding a layer it fits: refuse
    with the spec and the shape. A menu may hold encodings that fit only some layers (tables per 192 columns on
    a model with 576- and 1536-column layers, say); the other layers choose without them. An encoding from a preset
    (``optional``) may fit no layer at all: a preset serves models of every width."""
    errors: dict[tuple[str, str], str] = {}
    for e in lin:
        for n, shape in shapes.items():
            try:
                e.quantizer.check(shape, e.bits)
            except QRecoverError as err:
                errors[e.label, n] = str(err)
    for e in lin:
        if not e.optional and all((e.label, n) in errors for n in shapes):
            n = next(iter(shapes))
            raise QRecoverError(f"encoding {e.label!r} cannot store {n} {shapes[n]}: {errors[e.label, n]}")
    for n, shape in shapes.items():
        if all((e.label, n) in errors for e in lin):
            raise QRecoverError(f"no encoding of {[e.label for e in lin]} can store {n} {shape} (e.g. {lin[0].label!r}: "
                                f"{errors[lin[0].label, n]})")


# --- compress -------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    """The expensive part of compression, reusable for any budget, scope, allocation or embedding width:
    the loaded (and transformed) model, and for every quantizable unit its candidate encodings with their
    estimated damage."""

    cfg: CompressConfig
    model: nn.Module
    tokenizer: Any
    source: Any
    params: dict[str, int]
    units: dict[str, dict[str, Any]]  # name -> {"kind", "tied", "cands": [Encoding], "results": [(QuantizedWeight, damage)]}
    remainder: dict[str, torch.Tensor]
    head_name: str | None
    calibration: dict[str, Any]
    seconds: float
    windows: torch.Tensor | None = None
    grads: dict[str, Any] | None = None
    transforms: dict[str, Any] | None = None


def prepare(cfg: CompressConfig, show_progress: bool = True, lazy: bool = True) -> Prepared:
    """Stages ``transform`` -> ``calibrate`` -> ``candidates`` (see :mod:`qrecover.stages`): load, transform,
    calibrate what the candidates need, and quantize every unit at every candidate encoding.

    ``lazy`` (the default): a safetensors model is loaded with one decoder layer in memory at a time (read
    from disk when a stage reaches it, :func:`qrecover.models.load_model`); the result is bit-identical to
    ``lazy=False``, which loads the whole model in fp32 first (as a GGUF source always is). A lazily loaded
    ``Prepared.model`` holds its decoder layers on the meta device: it cannot run as a whole."""
    t0 = time.time()
    lin_encs, emb_all = _encodings(cfg)
    group = join()  # under torchrun: windows and candidates shared out, statistics reduced (qrecover.distributed)
    if cfg.calib_samples < group.size:
        raise QRecoverError(f"--calib-samples {cfg.calib_samples} is fewer than the {group.size} processes; give at least one window per process")
    device = resolve_device(cfg.device)
    model, tok, source = load_model(cfg.model, lazy=lazy)
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    linears = {f"{prefix}.{i}.{n}": m for i, l in enumerate(layers) for n, m in linear_layers(l).items()}
    _check_linears(model, linears)
    emb, head, tied = model.get_input_embeddings(), model.get_output_embeddings(), is_tied(model)
    emb_name = module_name(model, emb)
    head_name = module_name(model, head) if head is not None else None
    _check_shapes(lin_encs, {n: tuple(m.weight.shape) for n, m in linears.items()})
    emb_encs = [c for c in emb_all if _fits(c, tuple(emb.weight.shape))]
    if not emb_encs:
        raise QRecoverError(f"no embedding encoding of {[e.label for e in emb_all]} fits shape {tuple(emb.weight.shape)}; "
                            "allow others with --embedding-encodings")
    for t in transforms_of(lin_encs + emb_encs):
        get_transform(t).check(model)
    units: dict[str, dict[str, Any]] = {n: {"kind": "linear", "module": m, "cands": [e for e in lin_encs if _fits(e, tuple(m.weight.shape))]}
                                        for n, m in linears.items()}
    units[emb_name] = {"kind": "embedding", "module": emb, "cands": emb_encs, "tied": tied}
    untied_head = head is not None and not tied
    if untied_head:
        units[head_name] = {"kind": "head", "module": head, "cands": emb_encs}
    windows = calibration_windows(tok, cfg.calib_data, cfg.calib_samples, cfg.seq_len, model=cfg.model, show_progress=show_progress)

    # stage transform (optional, model-level, function-preserving)
    tinfo = apply_transforms(model, windows, lin_encs + emb_encs, device, show_progress)
    # stage calibrate: only what the candidates and the damage estimate need
    damage = cfg.bpw is not None or any(len(u["cands"]) > 1 for u in units.values())
    plan = plan_stats(lin_encs, emb_encs, damage)
    grads = gradients(model, windows, plan, device, show_progress, group)

    # stage candidates, layer by layer (one decoder layer's statistics at a time)
    def on_layer(_i: int, _layer: nn.Module, stats: dict) -> None:
        jobs = {}
        for name, st in stats.items():
            st = dict(st)
            if grads is not None:
                st["out_grad_sq"] = grads["out_grad_sq"][name].to(device)
            fn = (lambda dw, st=st: linear_damage(dw, st["hessian"], st["out_grad_sq"])) if plan.damage else None
            jobs[name] = (linears[name].weight, units[name]["cands"], st, fn)
        for name, results in quantize_shared(jobs, group).items():
            units[name]["results"] = results

    # A uniform model (one linear encoding, no budget) with finalize on: finalize re-quantizes every linear on
    # quantized inputs and nothing reads the candidates, so their pass is skipped (about half the time of a
    # uniform GPTQ compress); their results stay DEFERRED and such a Prepared serves only that config.
    if cfg.bpw is None and cfg.finalize and len(lin_encs) == 1:
        for name in linears:
            units[name]["results"] = [DEFERRED]
    else:
        layer_pass(model, windows, plan.layer, on_layer, device, show_progress, group=group)
    with progress() as bar:
        task = bar.add_task("quantize: embedding", total=1, visible=show_progress)
        (emb_stats, fn), (head_stats, hfn) = embedding_stats(grads, tuple(emb.weight.shape), tied, device)
        jobs = {emb_name: (emb.weight.detach().to(device), emb_encs, emb_stats, fn if plan.damage else None)}
        if untied_head:
            jobs[head_name] = (head.weight.detach().to(device), emb_encs, head_stats, hfn if plan.damage else None)
        for name, results in quantize_shared(jobs, group).items():
            units[name]["results"] = results
        bar.advance(task)
    quantized = {f"{n}.weight" for n in units} | ({f"{head_name}.weight"} if tied else set())
    remainder = state_tensors(model, [k for k in model.state_dict() if k not in quantized])  # after the transform
    calibration = {"source": cfg.calib_data, "split": "calib", "windows": cfg.calib_samples, "seq_len": cfg.seq_len,
                   "tokens": int(windows.numel()), "loss": grads["loss"] if grads is not None else None,
                   "computed": {"layer_stats": sorted(plan.layer), "gradients": plan.gradients, "damage": plan.damage},
                   "device": str(device)}
    params = {"model": count_parameters(model), "linear": sum(m.weight.numel() for m in linears.values())}
    return Prepared(cfg, model, tok, source, params, units, remainder, head_name, calibration, time.time() - t0,
                    windows=windows, grads=grads, transforms=tinfo)


_SAME = ("model", "calib_data", "calib_samples", "seq_len")
#: a candidate that :func:`prepare` did not quantize (a uniform model that ``finalize`` quantizes)
DEFERRED = (None, None)


def compress(config: CompressConfig | None = None, out: str | Path | None = None, overwrite: bool = False,
             show_progress: bool = True, prepared: Prepared | None = None, lazy: bool = True,
             **overrides: Any) -> dict[str, Any]:
    """Compress a model to ``config.bpw`` bits per weight; write a checkpoint to ``out``; return its manifest.

    Stages ``allocate`` -> ``finalize`` -> ``write`` after :func:`prepare`'s. ``prepared`` (from
    :func:`prepare` with the same model and calibration, and candidates that include this config's) skips
    the expensive stages, so one calibration serves several budgets and encoding subsets. ``lazy``: see
    :func:`prepare` (one decoder layer in memory at a time; same result).
    """
    cfg = config or CompressConfig(**overrides)
    t0 = time.time()
    out = Path(out) if out is not None else None
    if out is not None and out.exists() and not overwrite:
        raise QRecoverError(f"output directory {str(out)!r} already exists; pass --overwrite to replace it")
    lin_encs, emb_encs = _encodings(cfg)
    owned = prepared is None  # no caller keeps this Prepared for another budget: its candidates may be dropped
    if prepared is None:
        _check_budget_early(cfg, lin_encs, emb_encs)
        prepared = prepare(cfg, show_progress, lazy=lazy)
    p = prepared
    have_lin = list(dict.fromkeys(e for u in p.units.values() if u["kind"] == "linear" for e in u["cands"]))
    lin_shapes = {tuple(u["module"].weight.shape) for u in p.units.values() if u["kind"] == "linear"}
    want_lin = [e for e in lin_encs if any(_fits(e, shape) for shape in lin_shapes)]  # a preset's misfits dropped
    emb_unit = next(u for u in p.units.values() if u["kind"] == "embedding")
    emb_shape = tuple(emb_unit["module"].weight.shape)
    emb_want = [e for e in emb_encs if _fits(e, emb_shape)]
    if (any(getattr(cfg, k) != getattr(p.cfg, k) for k in _SAME) or any(e not in have_lin for e in want_lin)
            or any(e not in emb_unit["cands"] for e in emb_want)):
        raise QRecoverError(
            f"the prepared candidates were made with {({k: getattr(p.cfg, k) for k in _SAME})}, linear "
            f"{[e.label for e in have_lin]}, embedding {[e.label for e in emb_unit['cands']]}; this config asks for "
            f"{({k: getattr(cfg, k) for k in _SAME})}, linear {[e.label for e in want_lin]}, embedding "
            f"{[e.label for e in emb_want]}: prepare again"
        )
    if any(u["results"][0] is DEFERRED for u in p.units.values()) and (cfg.bpw is not None or not cfg.finalize):
        raise QRecoverError("the prepared model has no linear candidates (it was prepared for a uniform model with "
                            "finalize on, which quantizes them itself); prepare again with this config")
    if not emb_want:
        raise QRecoverError(f"no embedding encoding of {[e.label for e in emb_encs]} fits shape {emb_shape}; allow others with --embedding-encodings")
    in_scope_emb = cfg.scope == "model"
    remainder_bytes = sum(v.numel() * 2 for v in p.remainder.values())  # stored as 16-bit

    # stage allocate: the choices the allocator may make
    table: dict[str, list[Choice]] = {}
    picks: dict[str, list[int]] = {}
    for n, u in p.units.items():
        allowed = lin_encs if u["kind"] == "linear" else emb_want
        keep = [k for k, c in enumerate(u["cands"]) if c in allowed]
        picks[n] = keep
        table[n] = [Choice(u["cands"][k].label, 0, 0.0) if u["results"][k] is DEFERRED else
                    Choice(u["cands"][k].label, u["results"][k][0].nbytes, u["results"][k][1] or 0.0) for k in keep]
    budget = Budget(cfg.bpw, p.params["model"] if in_scope_emb else p.params["linear"],
                    remainder_bytes if in_scope_emb else 0,
                    [n for n, u in p.units.items() if u["kind"] == "linear" or in_scope_emb])
    unquantized, routers = unquantized_matrices(p.model, {f"{n}.weight" for n, u in p.units.items() if u["kind"] == "linear"})
    try:
        chosen = choose(table, budget, cfg.allocation)
    except Infeasible as e:
        raise _infeasible(cfg, e.lo, e.hi, unquantized) from None
    if unquantized:
        warnings.warn(f"qrecover: {_unquantized_note(unquantized)}", stacklevel=2)

    enc_of = {n: u["cands"][picks[n][chosen[n]]] for n, u in p.units.items()}
    qws = {n: u["results"][picks[n][chosen[n]]][0] for n, u in p.units.items()}
    cand_damage = {n: u["results"][picks[n][chosen[n]]][1] for n, u in p.units.items()}
    damage_table = {n: {c.label: d for c, (_, d) in zip(u["cands"], u["results"])} for n, u in p.units.items()}
    # stage finalize: re-quantize each chosen linear on the outputs of the quantized layers before it
    finfo: dict[str, Any] = {"enabled": bool(cfg.finalize)}
    if cfg.finalize:
        lin_names = [n for n, u in p.units.items() if u["kind"] == "linear"]
        if owned:  # finalize replaces every linear's packed weights: free the candidates before it makes them
            for n in lin_names:
                p.units[n]["results"] = None
                qws[n] = None
        fixed = {n: qws[n] for n, u in p.units.items() if u["kind"] != "linear"}
        final, info = finalize(p.model, p.windows, {n: enc_of[n] for n in lin_names}, fixed,
                               p.grads["out_grad_sq"] if p.grads is not None else None,
                               resolve_device(cfg.device), show_progress, groups=cfg.finalize_groups, world=join())
        qws.update(final)
        finfo.update(info)

    # stage write
    tensors: dict[str, torch.Tensor] = {k: v.detach().to(torch.float16).contiguous() for k, v in p.remainder.items()}
    layer_info: dict[str, Any] = {}
    damages = []
    for n, u in p.units.items():
        k = picks[n][chosen[n]]
        qw, damage = qws[n], cand_damage[n]
        damages.append(damage)
        for tname, t in qw.tensors.items():
            tensors[f"{n}.{tname}"] = t.contiguous()
        layer_info[n] = {
            "kind": u["kind"], "scheme": qw.scheme, "bits": qw.bits, "params": qw.params, "shape": list(qw.shape),
            "tensors": sorted(qw.tensors), "nbytes": qw.nbytes, "bpw": _bpw(qw.nbytes, qw.numel),
            "damage": damage, "label": u["cands"][k].label,
            **({"transforms": list(enc_of[n].transforms)} if enc_of[n].transforms else {}),
            **({"tied_to": p.head_name} if u.get("tied") else {}),
        }
    manifest: dict[str, Any] = {
        "format": "qrecover",
        "format_version": FORMAT_VERSION,
        "source": {"path": p.source.path, "kind": p.source.kind, "name": p.source.name, "weights_sha256": p.source.weights_sha256},
        "architecture": type(p.model).__name__,
        "parameters": p.params,
        "budget": {"bpw": cfg.bpw, "scope": cfg.scope, "bits": cfg.bits, "allocation": cfg.allocation,
                   "embedding_bits": cfg.embedding_bits,
                   "encodings": [e.label for e in lin_encs], "embedding_encodings": [e.label for e in emb_want]},
        "config": cfg.to_dict(),
        "layers": layer_info,
        "remainder": {k: {"dtype": "float16", "shape": list(v.shape)} for k, v in p.remainder.items()},
        "unquantized_matrices": unquantized,
        **({"routers": routers} if routers else {}),
        **({"moe": {"unfused": p.model.qrecover_moe}} if getattr(p.model, "qrecover_moe", None) else {}),
        "sensitivity": {"method": METHOD, "unit": "predicted increase of mean next-token loss (nats)",
                        "table": damage_table,
                        "predicted_loss_increase": None if any(d is None for d in damages) else sum(damages)},
        "calibration": p.calibration,
        "finalize": finfo,
        "transforms": p.transforms or {},
        "versions": _versions(),
    }
    if out is None:
        return manifest
    group = join()
    if group.rank > 0:  # rank 0 writes; the others wait for it (and it for them before the checkpoint is moved into place)
        group.barrier()
        return group.broadcast(None)
    manifest = write_checkpoint(out, tensors, manifest, p.model, p.tokenizer, overwrite,
                                extra={"seconds": round(time.time() - t0, 1),  # this call; includes preparing unless given
                                       "prepare_seconds": round(p.seconds, 1)},
                                before_commit=group.barrier if group is not SINGLE else None)
    return group.broadcast(manifest)


def _infeasible(cfg: CompressConfig, lo: float, hi: float, unquantized: dict[str, list[int]] | None = None) -> QRecoverError:
    choices = f"--encodings {cfg.encodings}" if cfg.encodings else f"--bits {','.join(map(str, cfg.bits))}"
    emb = f"--embedding-encodings {cfg.embedding_encodings}" if cfg.embedding_encodings else f"--embedding-bits {cfg.embedding_bits}"
    why = (f" ({_unquantized_note(unquantized)}; --scope linear budgets the quantized layers alone)"
           if unquantized and cfg.scope == "model" else "")
    return QRecoverError(
        f"--bpw {cfg.bpw} is below what these choices can reach: with {choices}, "
        f"{emb} and --scope {cfg.scope} the smallest is {lo:.3f} bpw and the "
        f"largest {hi:.3f} bpw{why}; raise --bpw or allow lower --bits"
    )


def _unquantized_note(unquantized: dict[str, list[int]]) -> str:
    n = sum(math.prod(s) for s in unquantized.values())
    names = ", ".join(f"{k} {tuple(v)}" for k, v in list(unquantized.items())[:2])
    return (f"{len(unquantized)} matrices of the decoder layers ({n:,} parameters, e.g. {names}) are not nn.Linear "
            "weights qrecover can quantize (fused experts of a layout qrecover.moe does not convert, convolutions) "
            "and stay in 16 bits, counted in the bpw")


def _meta_model(cfg: CompressConfig):
    """The model built on the meta device from its config alone (no weights), or None for a GGUF."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path, kind = resolve(cfg.model)
    if kind not in ("hf", "default"):
        return None  # a GGUF is checked after loading
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
        unfuse_experts(model)  # as load_model will (on the meta device: shapes only)
        return model
    except ValueError as e:
        raise QRecoverError(f"{str(path)!r} is not a causal language model: {e}") from None


def _check_budget_early(cfg: CompressConfig, lin_encs: list[Encoding], emb_encs: list[Encoding]) -> None:
    """Refuse what shapes alone can refuse, before minutes of calibration: an encoding that does not fit a
    layer, a transform the architecture has no mapping for, an impossible budget."""
    model = _meta_model(cfg)
    if model is None:
        return
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    lin = {f"{prefix}.{i}.{n}": m for i, l in enumerate(layers) for n, m in linear_layers(l).items()}
    _check_linears(model, lin)
    _check_shapes(lin_encs, {n: tuple(m.weight.shape) for n, m in lin.items()})
    for t in transforms_of(lin_encs + emb_encs):
        get_transform(t).check(model)
    if cfg.bpw is None:
        return
    emb = model.get_input_embeddings()
    emb_cands = [c for c in emb_encs if _fits(c, tuple(emb.weight.shape))]
    if not emb_cands:
        raise QRecoverError(f"no embedding encoding of {[e.label for e in emb_encs]} fits shape {tuple(emb.weight.shape)}; "
                            "allow others with --embedding-encodings")
    sizes = [[c.quantizer.nbytes(tuple(m.weight.shape), c.bits) for c in lin_encs if _fits(c, tuple(m.weight.shape))]
             for m in lin.values()]
    n_lin = sum(m.weight.numel() for m in lin.values())
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
        raise _infeasible(cfg, _bpw(lo, denom), _bpw(sum(max(s) for s in sizes) + fixed, denom),
                          unquantized_matrices(model, {f"{n}.weight" for n in lin})[0])


def _versions() -> dict[str, str]:
    import safetensors
    import transformers

    return {"qrecover": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
            "safetensors": safetensors.__version__, "python": platform.python_version()}

"""Refusals before work: what a compress config and a model's shapes alone can refuse (an encoding that fits
no layer, a model without linear layers, a transform without a mapping, a budget no plan reaches), each a
QRecoverError naming the value and the fix. :func:`check_budget_early` runs before minutes of calibration."""

from __future__ import annotations

import dataclasses
import math
import warnings

import torch
import torch.nn as nn

from ..config import CompressConfig
from ..distributed import local_device
from ..errors import QRecoverError
from ..models import count_parameters, decoder_layers, is_tied, linear_layers, module_name, resolve, unquantized_matrices
from ..moe import unfuse_experts
from ..transforms import get_transform
from .specs import Encoding, embedding_encodings, linear_encodings
from .transform import transforms_of


def bpw(nbytes: int, params: int) -> float:
    """Bits per weight of ``nbytes`` over ``params`` parameters."""
    return 8.0 * nbytes / params


def fits(c: Encoding, shape: tuple[int, int]) -> bool:
    try:
        c.quantizer.check(shape, c.bits)
        return True
    except QRecoverError:
        return False


def encodings_of(cfg: CompressConfig, model: nn.Module | None = None) -> tuple[list[Encoding], list[Encoding]]:
    """``(linear candidates, embedding candidates)`` of a config, parsed and checked; a preset's model-level
    transforms that ``model``'s architecture cannot take are dropped (:func:`drop_unfoldable`; ``model``: the loaded
    model, else the config's built on the meta device where the model has a transformers config)."""
    lin = linear_encodings(cfg.scheme, cfg.bits, cfg.scheme_params, cfg.encodings)
    emb = embedding_encodings(cfg.embedding_bits, cfg.embedding_encodings, cfg.scope == "model" and cfg.bpw is not None)
    if any(e.optional and e.transforms for e in lin + emb):
        model = model if model is not None else meta_model(cfg)
        lin, emb = (drop_unfoldable(lin, model), drop_unfoldable(emb, model)) if model is not None else (lin, emb)
    if cfg.bpw is None and len(lin) != 1:
        raise QRecoverError(f"a uniform model (no --bpw) needs a single linear encoding, got {[e.label for e in lin]}; "
                            "give one, or a --bpw budget")
    if cfg.bpw is None and len(emb) != 1:
        raise QRecoverError(f"a uniform model (no --bpw) needs a single embedding encoding, got {[e.label for e in emb]}; "
                            "give one, or a --bpw budget")
    return lin, emb


def drop_unfoldable(encodings: list[Encoding], model: nn.Module) -> list[Encoding]:
    """``encodings`` with each preset encoding's transforms that ``model`` cannot take removed, with a warning: the
    default menu (``rot-mixed-blocks``) runs unrotated on an architecture whose norms a rotation cannot cross (Gemma-2/3,
    LayerNorm models, ...). A transform written in a spec by hand (``rot+gptq:3/g64``) is kept, and refused later."""
    refused: dict[str, str] = {}
    for name in {t for e in encodings if e.optional for t in e.transforms}:
        try:
            get_transform(name).check(model)
        except QRecoverError as err:
            refused[name] = str(err)
    if not refused:
        return encodings
    for name, why in sorted(refused.items()):
        warnings.warn(f"qrecover: {why.rstrip('.')}; the preset's candidates run without {name}+ on this model", stacklevel=2)
    out: list[Encoding] = []
    for e in encodings:
        if e.optional and set(e.transforms) & set(refused):
            label = e.label
            for name in refused:
                label = label.replace(f"{name}+", "", 1)
            e = dataclasses.replace(e, transforms=tuple(t for t in e.transforms if t not in refused), label=label)
        if e not in out:
            out.append(e)
    return out


def resolve_device(spec: str) -> torch.device:
    """``--device`` -> a torch device: 'auto' is CUDA when available, else the CPU."""
    if spec == "auto":
        return local_device(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise QRecoverError(f"--device {spec}: CUDA is not available here; use --device cpu or auto")
    return local_device(torch.device(spec))  # under torchrun: cuda:LOCAL_RANK


def check_linears(model: nn.Module, linears: dict[str, nn.Module]) -> None:
    """Refuse a model whose decoder layers hold no ``nn.Linear`` (GPT-2's ``Conv1D``, say): nothing to quantize."""
    if not linears:
        kinds = sorted({type(m).__name__ for layer in decoder_layers(model)[:1] for m in layer.modules()
                        if any(p.dim() >= 2 for p in m.parameters(recurse=False))})
        raise QRecoverError(f"{type(model).__name__}'s decoder layers have no nn.Linear layers to quantize (their "
                            f"matrices live in {kinds}); qrecover quantizes nn.Linear projections: convert the model "
                            "to one whose projections are nn.Linear")


def check_shapes(lin: list[Encoding], shapes: dict[str, tuple[int, int]]) -> None:
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


def infeasible(cfg: CompressConfig, lo: float, hi: float, unquantized: dict[str, list[int]] | None = None) -> QRecoverError:
    choices = f"--encodings {cfg.encodings}" if cfg.encodings else f"--bits {','.join(map(str, cfg.bits))}"
    emb = f"--embedding-encodings {cfg.embedding_encodings}" if cfg.embedding_encodings else f"--embedding-bits {cfg.embedding_bits}"
    why = (f" ({unquantized_note(unquantized)}; --scope linear budgets the quantized layers alone)"
           if unquantized and cfg.scope == "model" else "")
    return QRecoverError(
        f"--bpw {cfg.bpw} is below what these choices can reach: with {choices}, "
        f"{emb} and --scope {cfg.scope} the smallest is {lo:.3f} bpw and the "
        f"largest {hi:.3f} bpw{why}; raise --bpw or allow lower --bits"
    )


def unquantized_note(unquantized: dict[str, list[int]]) -> str:
    n = sum(math.prod(s) for s in unquantized.values())
    names = ", ".join(f"{k} {tuple(v)}" for k, v in list(unquantized.items())[:2])
    return (f"{len(unquantized)} matrices of the decoder layers ({n:,} parameters, e.g. {names}) are not nn.Linear "
            "weights qrecover can quantize (fused experts of a layout qrecover.moe does not convert, convolutions) "
            "and stay in 16 bits, counted in the bpw")


def meta_model(cfg: CompressConfig):
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


def check_budget_early(cfg: CompressConfig, lin_encs: list[Encoding], emb_encs: list[Encoding]) -> None:
    """Refuse what shapes alone can refuse, before minutes of calibration: an encoding that does not fit a
    layer, a transform the architecture has no mapping for, an impossible budget."""
    model = meta_model(cfg)
    if model is None:
        return
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    lin = {f"{prefix}.{i}.{n}": m for i, l in enumerate(layers) for n, m in linear_layers(l).items()}
    check_linears(model, lin)
    check_shapes(lin_encs, {n: tuple(m.weight.shape) for n, m in lin.items()})
    for t in transforms_of(lin_encs + emb_encs):
        get_transform(t).check(model)
    if cfg.bpw is None:
        return
    emb = model.get_input_embeddings()
    emb_cands = [c for c in emb_encs if fits(c, tuple(emb.weight.shape))]
    if not emb_cands:
        raise QRecoverError(f"no embedding encoding of {[e.label for e in emb_encs]} fits shape {tuple(emb.weight.shape)}; "
                            "allow others with --embedding-encodings")
    sizes = [[c.quantizer.nbytes(tuple(m.weight.shape), c.bits) for c in lin_encs if fits(c, tuple(m.weight.shape))]
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
        raise infeasible(cfg, bpw(lo, denom), bpw(sum(max(s) for s in sizes) + fixed, denom),
                          unquantized_matrices(model, {f"{n}.weight" for n in lin})[0])

"""compressed-tensors export (vLLM, transformers), written with the ``compressed-tensors`` library's own
``pack-quantized`` compressor.

An integer layer ``w = s * (q - zp)`` (codes ``q`` in ``[0, 2**b)``) is compressed-tensors' signed integer
quantization with the same scales: ``q' = q - 2**(b-1)``, ``zp' = zp - 2**(b-1)`` (symmetric: no zero point),
``w = s * (q' - zp')``. Blocks of ``B`` inputs are the ``group`` strategy with ``group_size = B``; one block
per row is the ``channel`` strategy. Layers with different bits or groups go to different ``config_groups``,
each with its layers' names as ``targets`` (mixed precision). The library quantizes the dequantized weight
(float32) with the given scale and zero point, which reproduces the codes exactly (``w / s`` is an integer),
and packs them. Scales are fp16 as in the checkpoint; norms stay fp16. The embedding is written dense in
float32 (exact values): transformers cannot load a quantized ``nn.Embedding`` from compressed-tensors; a tied
head stays tied.

Asymmetric layers are written as the format specifies (zero points packed along the output dimension), but
transformers 5.24 with compressed-tensors 0.19/0.20 cannot load them (its loader's meta-device compression
leaves the zero point unpacked: a shape mismatch, the zero points re-initialised); they are checked here with
the library's own decompressor instead. Symmetric layers round-trip through transformers.

Palettized layers (look-up tables) have no compressed-tensors type: refused, or re-quantized with
``--requantize intB/gG`` from the stored weights, the measured relative error reported per layer.

Online rotations (``r4+``, ``rot+`` on a tied head; the manifest's ``transforms.online``) are carried for vLLM:

- R4, ``down_proj``'s input ``x R4``: compressed-tensors' transform config (``quantization_config.transform_config``),
  one ``random-hadamard`` scheme ``R4`` whose ``input`` location is online and whose ``weight_input`` location
  (inverse) records the half already fused into the weights. The matrix is stored once, as llm-compressor stores a
  shared transform, under ``<first down_proj>.R4_input.weight``: ``R4 * sqrt(n)`` (entries +-1, exact in fp16), which
  vLLM and compressed-tensors divide by ``sqrt(n)`` (vLLM's dense transform path; its Hadamard kernel serves only
  the non-random ``hadamard`` type).
- R1 on a tied head (the final norm run un-rotated, ``norm(x R1^T) R1``): the head is untied instead,
  ``lm_head = E R1^T diag(g) R1`` (``E`` the stored rotated embedding, ``g`` the final norm's scale, which becomes the
  identity), written dense in fp16: nothing runs online, and the file holds a second vocabulary matrix (reported).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from ..errors import QRecoverError
from ..models import decoder_layers
from ..transforms.hadamard import rotation
from ..transforms.rotate import SUPPORTED
from .common import Checkpoint, integer_layout, layout_dequantize, to_int_groups, untied_head

WEIGHTS_FILE = "model.safetensors"


def plan(ckpt: Checkpoint, spec: tuple[int, int] | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """``({layer: IntegerLayout}, {layer: report})``: every layer as integers, re-quantized only where allowed."""
    layouts, report = {}, {}
    refused = []
    for name, qw in ckpt.layers.items():
        lay = integer_layout(qw)
        if lay is not None:
            layouts[name] = lay
            report[name] = {"exact": True, "rel_error": 0.0, "scheme": f"int{lay.bits}/" + (
                "channel" if lay.block == qw.shape[1] else f"g{lay.block}") + ("" if lay.symmetric else " asym")}
            continue
        if spec is None:
            refused.append(name)
            continue
        new, rel = to_int_groups(qw, *spec)
        layouts[name] = integer_layout(new)
        report[name] = {"exact": False, "rel_error": rel, "scheme": f"int{spec[0]}/g{spec[1]}",
                        "note": f"{qw.scheme} {qw.bits}-bit re-quantized to int{spec[0]}/g{spec[1]}"}
    if refused:
        shown = ", ".join(refused[:3]) + (f" and {len(refused) - 3} more" if len(refused) > 3 else "")
        kinds = sorted({"palettized" if "lut" in ckpt.layers[n].tensors else ckpt.layers[n].scheme for n in refused})
        raise QRecoverError(f"compressed-tensors has no type for {len(refused)} {'/'.join(kinds)} layer(s) ({shown}); "
                            "pass --requantize int4/g64 to re-quantize them (the loss is measured and reported), or use "
                            "--format gguf")
    return layouts, report


def export_compressed_tensors(ckpt: Checkpoint, tmp: Path, spec: tuple[int, int] | None, log) -> dict[str, Any]:
    """Write a transformers model directory with a compressed-tensors ``quantization_config`` into ``tmp``."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, apply_quantization_config
    from transformers import AutoTokenizer, GenerationConfig

    t0 = time.time()
    layouts, report = plan(ckpt, spec)
    # transformers cannot load a compressed-tensors quantized nn.Embedding: the embedding is written dense, in
    # float32 (an 8-bit value scale * int needs up to 18 significant bits: fp16 would round it); a tied output
    # projection stays tied to it
    targets = {n: lay for n, lay in layouts.items() if ckpt.kind(n) != "embedding"}
    untie, inputs = online_transforms(ckpt)
    model, dense = _dense_model(ckpt, layouts, targets, report, untie)
    schemes = _config_groups(ckpt, targets)
    qconfig = QuantizationConfig(config_groups=schemes, format="pack-quantized",
                                 quantization_status=QuantizationStatus.FROZEN)
    apply_quantization_config(model, qconfig, show_progress=False)
    _set_scales(model, targets)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="pack-quantized")
    compressor.compress_model(model)
    compressor.remove_decompression_hook(model)
    model.half()  # scales are fp16 numbers and the remaining tensors were stored in fp16: exact
    for p, ref in zip(dense, [layout_dequantize(layouts[n]) for n in layouts if n not in targets]):
        p.data = ref
    model.config.dtype = torch.float16
    transforms = _attach_transforms(model, inputs, compressor) if inputs else None
    model.save_pretrained(tmp)
    compressor.update_config(str(tmp))
    AutoTokenizer.from_pretrained(ckpt.path).save_pretrained(tmp)
    if (ckpt.path / "generation_config.json").is_file():
        GenerationConfig.from_pretrained(ckpt.path).save_pretrained(tmp)
    for name, r in report.items():
        log(f"  {name:<44} {r['scheme']:<16} {'exact' if r['exact'] else 'rel. error %.2e' % r['rel_error']}")
    for key, t in (transforms or {}).items():
        log(f"  online {key}: {t['type']} {t['size']}x{t['size']} on the input of {t['modules']} module(s) "
            f"(transform_config; stored once as {t['stored']})")
    if untie:
        log(f"  the tied head's final-norm rotation folded into an untied head ({model.get_output_embeddings().weight.numel():,} "
            "values, fp16): nothing runs online")
    files = sorted(p.name for p in tmp.glob("*.safetensors"))
    return {"file": files[0] if len(files) == 1 else WEIGHTS_FILE, "layers": report,
            "exact_layers": sum(r["exact"] for r in report.values()), "total_layers": len(report),
            "total_rel_error": _total_rel_error(ckpt, report),
            "config_groups": {k: {"targets": len(v.targets), "weights": v.weights.model_dump(exclude_none=True)}
                              for k, v in schemes.items()},
            **({"transforms": transforms} if transforms else {}),
            **({"untied_head": {"from": next(iter(untie)), "values": int(model.get_output_embeddings().weight.numel()),
                                "dtype": "float16"}} if untie else {}),
            "seconds": round(time.time() - t0, 1)}


def online_transforms(ckpt: Checkpoint) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(untie, inputs)`` from the manifest's online rotations: the tied head's final-norm rotation (``{norm: spec}``,
    written as an untied head) and the online input rotations (``{module: spec}``, r4: a transform config)."""
    online = ckpt.manifest.get("transforms", {}).get("online", {})
    untie = {n: s for n, s in online.items() if s.get("side") != "input"}
    inputs = {n: s for n, s in online.items() if s.get("side") == "input"}
    for name, spec in inputs.items():
        if spec["kind"] not in ("fwht", "hadamard", "block") or name not in ckpt.layers:
            raise QRecoverError(f"the online rotation at {name} ({spec['kind']}) has no compressed-tensors transform here; "
                                "compress without r4+ in --encodings")
    return untie, inputs


def _attach_transforms(model: Any, inputs: dict[str, Any], compressor: Any) -> dict[str, Any]:
    """Put the online input rotations in the compressor's transform config (one ``random-hadamard`` scheme per distinct
    rotation) and their matrices (times ``sqrt(n)``) in the model, once each, as the ``weight`` of a ``<key>_input``
    child of the scheme's first module, where compressed-tensors and vLLM name a transform's weight."""
    from compressed_tensors.transform import TransformArgs, TransformConfig, TransformScheme

    groups: dict[tuple, list[str]] = {}
    for name, spec in inputs.items():
        groups.setdefault((int(spec["size"]), spec["kind"], int(spec["seed"])), []).append(name)
    schemes, report = {}, {}
    for i, ((size, kind, seed), names) in enumerate(sorted(groups.items())):
        key = "R4" if i == 0 else f"R4_{i}"
        schemes[key] = TransformScheme(type="random-hadamard", apply=[
            TransformArgs(targets=names, location="input"),                      # online: x R4
            TransformArgs(targets=names, location="weight_input", inverse=True)  # fused already: W R4
        ])
        m = rotation(size, kind, seed) * size ** 0.5
        exact = bool(torch.equal(m.half().double(), m))
        holder = torch.nn.Module()
        holder.register_buffer("weight", (m.half() if exact else m.float()).contiguous())
        model.get_submodule(names[0]).add_module(f"{key}_input", holder)
        report[key] = {"type": "random-hadamard", "size": size, "kind": kind, "modules": len(names),
                       "stored": f"{names[0]}.{key}_input.weight", "dtype": "float16" if exact else "float32"}
    compressor.transform_config = TransformConfig(config_groups=schemes)
    return report


def _dense_model(ckpt: Checkpoint, layouts: dict[str, Any], targets: dict[str, Any], report: dict[str, dict],
                 untie: dict[str, Any] | None = None) -> tuple[Any, list[torch.Tensor]]:
    """The transformers model of ``ckpt`` in float32 with every weight dequantized from its layout; returns it and
    the weights of the layers written dense (not in ``targets``: the embedding), marked so in ``report``. ``untie``
    (``{final norm: rotation spec}``): the tied head's online final-norm rotation folded into an untied head."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(ckpt.path)
    if untie:
        config.tie_word_embeddings = False
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty made new parameters
    state = {k: v.float() for k, v in ckpt.remainder.items()}
    for name, lay in layouts.items():
        state[f"{name}.weight"] = layout_dequantize(lay)
        if name not in targets:
            report[name].update(scheme="dense float32", note="embedding written dense (exact values)")
    if untie:
        names = {m: n for n, m in model.named_modules()}
        emb, head = names[model.get_input_embeddings()], names[model.get_output_embeddings()]
        offset = SUPPORTED[type(decoder_layers(model)[0]).__name__]  # Gemma's norms multiply by 1 + w
        norm, w_head, w_norm = untied_head(ckpt, offset, state[f"{emb}.weight"])
        state[f"{head}.weight"], state[f"{norm}.weight"] = w_head, w_norm
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("rotary_emb.inv_freq")
               and not (ckpt.tied and not untie and k.endswith("lm_head.weight"))]
    if missing or unexpected:
        raise QRecoverError(f"checkpoint {str(ckpt.path)!r} does not match its config: missing {missing[:3]}, "
                            f"unexpected {unexpected[:3]}")
    model.model.rotary_emb.__init__(config)  # its non-persistent buffer is not in the state dict
    return model, [m.weight for n, m in model.named_modules() if n in layouts and n not in targets]


def _config_groups(ckpt: Checkpoint, targets: dict[str, Any]) -> dict[str, Any]:
    """compressed-tensors' ``config_groups``: one ``QuantizationScheme`` per (bits, group size, symmetry) in use."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    groups: dict[tuple, list[str]] = {}
    for name, lay in targets.items():
        # one scale per row: the channel strategy (any row length); else groups of the block's size
        channel = lay.block == lay.codes.shape[1] and ckpt.layers[name].params.get("block_size", 0) is None
        groups.setdefault((lay.bits, 0 if channel else lay.block, lay.symmetric), []).append(name)
    schemes = {}
    for i, ((bits, block, sym), names) in enumerate(sorted(groups.items())):
        args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy="channel" if block == 0 else "group",
                                group_size=None if block == 0 else block)
        schemes[f"group_{i}"] = QuantizationScheme(targets=sorted(names), weights=args)
    return schemes


def _set_scales(model: Any, targets: dict[str, Any]) -> None:
    """Copy each target layer's scales (and zero points, as compressed-tensors' signed ones) into the modules that
    ``apply_quantization_config`` prepared."""
    modules = dict(model.named_modules())
    with torch.no_grad():
        for name, lay in targets.items():
            mod = modules[name]
            if not hasattr(mod, "weight_scale"):
                raise QRecoverError(f"internal error: compressed-tensors did not initialise {name}")
            half = 2 ** (lay.bits - 1)
            mod.weight_scale.data = lay.scale.float().reshape(mod.weight_scale.shape).clone()
            if hasattr(mod, "weight_zero_point"):
                zp = (lay.zero_point.to(torch.int16) - half) if not lay.symmetric else torch.zeros_like(lay.zero_point, dtype=torch.int16)
                mod.weight_zero_point.data = zp.to(mod.weight_zero_point.dtype).reshape(mod.weight_zero_point.shape).clone()


def _total_rel_error(ckpt: Checkpoint, report: dict[str, dict]) -> float:
    """The relative error of the converted layers together (each layer's weighted by its squared norm); 0 if all
    are exact."""
    num = sum(r["rel_error"] ** 2 * ckpt.layers[n].dequantize().double().pow(2).sum().item()
              for n, r in report.items() if not r["exact"] and n in ckpt.layers)
    den = sum(ckpt.layers[n].dequantize().double().pow(2).sum().item() for n, r in report.items()
              if not r["exact"] and n in ckpt.layers)
    return (num / den) ** 0.5 if den else 0.0

"""Core ML export (an ``.mlpackage``, ML program, iOS 18), written with coremltools 9.0 on Linux.

The model is traced with its dense weights (a palettized layer's values are fp16 table entries, so the fp16
program holds them exactly) and converted; then every palettized layer is palettized by coremltools'
``palettize_weights`` in ``custom`` mode, ``per_grouped_channel`` granularity, groups of the layer's
``group_size`` output channels, with a ``lut_function`` that hands back qrecover's own table and indices for
each group: no k-means, no re-quantization, the tables and indices are the checkpoint's (3-bit included).
Look-up tables shared by a block of input columns (``block_size`` set) are not a Core ML granularity and are
refused. Integer layers and the embedding are left as coremltools expresses float weights: fp16 constants (an
8-bit ``scale * int`` is rounded to fp16; the measured error is reported). A ``rot+`` checkpoint with a tied head
(its final norm run un-rotated at load) is written with an untied fp16 head, ``E R1^T diag(g) R1``, and an identity
final norm (:func:`.common.untied_head`), as for GGUF.

What cannot be checked without an Apple device: running the model (Core ML's runtime exists only on macOS/iOS),
its outputs against ``qrecover.load``, speed and memory on the Neural Engine. What is checked here: the
package's look-up tables and indices, read back from the saved file, equal the checkpoint's.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import QRecoverError
from ..models import decoder_layers
from ..packing import unpack
from ..transforms.rotate import SUPPORTED
from .common import Checkpoint, relative_error, untied_head

PACKAGE = "model.mlpackage"


class _Logits(torch.nn.Module):
    """``input_ids (1, seq) -> logits (1, seq, vocab)`` with a constant additive causal mask ``(1, 1, seq, seq)``:
    given a 4-D mask transformers uses it as is instead of building one from ops coremltools cannot convert."""

    def __init__(self, model: torch.nn.Module, seq: int):
        super().__init__()
        self.model = model
        self.register_buffer("mask", torch.full((seq, seq), -1e4).triu(1).view(1, 1, seq, seq))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=self.mask, use_cache=False).logits


def _numpy2_int_cast() -> None:
    """coremltools 9.0 converts ``int(tensor)`` of a constant 1-element array with ``int(array)``, which numpy 2
    refuses for arrays of rank > 0; convert it from the array's single element instead (same result)."""
    from coremltools.converters.mil import Builder as mb
    from coremltools.converters.mil.frontend.torch import ops
    from coremltools.converters.mil.frontend.torch.torch_op_registry import register_torch_op

    def int_(context, node):
        x = ops._get_inputs(context, node, expected=1)[0]
        if x.can_be_folded_to_const() and np.size(x.val) == 1 and np.ndim(x.val) > 0:
            context.add(mb.const(val=int(np.asarray(x.val).reshape(-1)[0]), name=node.name), node.name)
        else:
            ops._int(context, node)

    int_.__name__ = "int"
    register_torch_op(int_, override=True)


def palettized_groups(qw) -> tuple[int, np.ndarray, np.ndarray]:
    """``(group_size, tables (O/G, 2**bits) fp16, codes (O, I) uint8)`` of a palettized layer with whole-row tables."""
    out_f, in_f = qw.shape
    g, c = qw.params["group_size"], qw.params.get("block_size") or in_f
    if c != in_f:
        raise QRecoverError(f"palettized tables over blocks of {c} input columns are not a Core ML granularity (it groups "
                            "output channels only); compress with whole-row tables for --format coreml (--encodings afm, not the "
                            "default mixed-blocks, afm-blocks or a /bN palettize spec)")
    codes = unpack(qw.tensors["qdata"], qw.bits, out_f * in_f).view(out_f, in_f).numpy()
    return g, qw.tensors["lut"].reshape(out_f // g, 2**qw.bits).numpy().astype(np.float16), codes


def export_coreml(ckpt: Checkpoint, tmp: Path, log) -> dict[str, Any]:
    import coremltools as ct
    import coremltools.optimize.coreml as cto
    from transformers import AutoConfig, AutoModelForCausalLM

    t0 = time.time()
    _numpy2_int_cast()
    config = AutoConfig.from_pretrained(ckpt.path)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="eager")
    state = {k: v.float() for k, v in ckpt.remainder.items()}
    for name, qw in ckpt.layers.items():
        state[f"{name}.weight"] = qw.dequantize(torch.float32)
    untied = untied_head(ckpt, SUPPORTED.get(type(decoder_layers(model)[0]).__name__, 0.0))  # Gemma's norms: 1 + w
    if untied is not None:  # rot+ on a tied head: no online final-norm rotation in Core ML, so the head is untied
        norm, head, w_norm = untied
        state[f"{norm}.weight"] = w_norm
        model.config.tie_word_embeddings = False
        model.get_output_embeddings().weight = torch.nn.Parameter(head)
        log(f"  the tied head's final-norm rotation folded into an untied head ({head.numel():,} values, fp16)")
    model.load_state_dict(state, strict=False)
    model.eval()
    seq = min(64, config.max_position_embeddings)
    with torch.no_grad():
        traced = torch.jit.trace(_Logits(model, seq), torch.zeros(1, seq, dtype=torch.long), check_trace=False)
    mlmodel = ct.convert(traced, inputs=[ct.TensorType("input_ids", shape=(1, seq), dtype=np.int32)],
                         outputs=[ct.TensorType("logits")], convert_to="mlprogram",
                         minimum_deployment_target=ct.target.iOS18, compute_precision=ct.precision.FLOAT16)

    # the palettized layers' fp16 weights, group by group -> (table, indices)
    by_group: dict[bytes, tuple[np.ndarray, np.ndarray]] = {}
    pal = {n: qw for n, qw in ckpt.layers.items() if "lut" in qw.tensors}
    weights = {}
    for name, qw in pal.items():
        g, tables, codes = palettized_groups(qw)
        dense = qw.dequantize(torch.float16).numpy()
        weights[name] = (g, dense)
        for k in range(tables.shape[0]):
            by_group[np.ascontiguousarray(dense[k * g:(k + 1) * g]).tobytes()] = (tables[k], codes[k * g:(k + 1) * g].reshape(-1))

    def lut_function(val: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        key = np.ascontiguousarray(val.astype(np.float16)).tobytes()
        if key not in by_group:
            raise QRecoverError("internal error: a palettized weight group of the converted program is not in the checkpoint")
        lut, idx = by_group[key]
        return lut.reshape(-1).astype(val.dtype), idx.astype(np.uint8)

    meta = cto.get_weights_metadata(mlmodel, weight_threshold=1)
    op_configs, found = {}, {}
    for op_name, m in meta.items():
        val = np.asarray(m.val)
        for name, (g, dense) in weights.items():
            if val.shape == dense.shape and np.array_equal(val.astype(np.float16), dense):
                op_configs[op_name] = cto.OpPalettizerConfig(mode="custom", lut_function=lut_function,
                                                              granularity="per_grouped_channel", group_size=g,
                                                              channel_axis=0, weight_threshold=1)
                found[name] = op_name
    if missing := sorted(set(weights) - set(found)):
        raise QRecoverError(f"internal error: the converted program has no weight for palettized layers {missing[:3]}")
    if op_configs:
        mlmodel = cto.palettize_weights(mlmodel, cto.OptimizationConfig(op_name_configs=op_configs))
    mlmodel.save(str(tmp / PACKAGE))

    layers = {}
    for name, qw in ckpt.layers.items():
        if name in found:
            layers[name] = {"type": f"lut{qw.bits} per_grouped_channel g{qw.params['group_size']}", "exact": True,
                            "rel_error": 0.0, "coreml": found[name]}
        else:
            ref = qw.dequantize(torch.float32)
            rel = relative_error(ref.half().float(), ref)
            layers[name] = {"type": "fp16", "exact": rel == 0.0, "rel_error": rel,
                            "note": f"{qw.scheme} {qw.bits}-bit written as fp16 weights"}
        log(f"  {name:<44} {layers[name]['type']:<28} {'exact' if layers[name]['exact'] else 'rel. error %.2e' % layers[name]['rel_error']}")
    num = sum(v["rel_error"] ** 2 * float(ckpt.layers[n].dequantize().double().pow(2).sum()) for n, v in layers.items())
    den = sum(float(ckpt.layers[n].dequantize().double().pow(2).sum()) for n in layers)
    return {"file": PACKAGE, "layers": layers, "exact_layers": sum(v["exact"] for v in layers.values()),
            "total_layers": len(layers), "total_rel_error": (num / den) ** 0.5 if den else 0.0, "sequence_length": seq,
            **({"untied_head": {"from": untied[0], "values": untied[1].numel(), "dtype": "float16"}} if untied is not None else {}),
            "seconds": round(time.time() - t0, 1),
            "not_checked": "running the package (Core ML runs only on Apple devices): its outputs, speed, memory"}


def read_tables(package: Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{constexpr op name: (lut, indices)}`` of every ``constexpr_lut_to_dense`` in a saved package."""
    import coremltools as ct
    from coremltools.converters.mil.frontend.milproto import load as milproto_load
    from coremltools.models import utils as model_utils

    mlmodel = ct.models.MLModel(str(package), skip_model_load=True)
    prog = model_utils._convert_model_spec_to_pymil_prog(mlmodel, mlmodel.get_spec().specificationVersion, milproto_load.load)
    out = {}
    for f in prog.functions.values():
        for op in f.find_ops(op_type="constexpr_lut_to_dense"):
            out[op.name] = (np.asarray(op.lut.val), np.asarray(op.indices.val))
    return out

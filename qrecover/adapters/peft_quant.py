"""PEFT's LoRA layer for :class:`~qrecover.qlinear.QuantLinear`, with a merge that re-quantizes.

PEFT's own ``lora.Linear`` merges by adding the delta to ``base_layer.weight`` in place. A ``QuantLinear``'s
``weight`` is a dequantized copy of its packed buffers, so that merge is silently lost (or lands only in the
dense cache): ``merge_and_unload()`` returned the base model. :class:`QuantLoraLinear` is the LoRA layer PEFT
builds for a ``QuantLinear`` instead, registered through PEFT's custom-module extension point
(``LoraConfig._register_custom_module``, the same dispatch mechanism as its HQQ/torchao backends):
:func:`register_quant_lora` on a config makes ``get_peft_model`` and ``PeftModel.from_pretrained(...,
config=...)`` use it. :func:`~qrecover.adapters.lora.attach_lora`, :func:`~qrecover.adapters.lora.load_adapter`
and ``qrecover.load(..., adapter=...)`` do this for you; a config of your own needs the call.

Training and the unmerged forward are PEFT's ``lora.Linear`` unchanged: ``base(x) + scaling * B(A(x))``,
the base frozen.

Merging needs the calibration statistics the scheme quantizes with (palettize: ``input_sq`` and ``hessian``): without
them the re-quantization is blind to the outlier input channels and destroys the model (measured on SmolLM2-135M at
3.7 bpw: perplexity 36.5 -> 2.5 million). :func:`merge_and_unload` collects them from the adapted model's own layer
inputs on a few calibration windows, then merges; a bare ``peft_model.merge_and_unload()`` on such a scheme raises.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
import torch.nn as nn
from peft.tuners.lora import LoraConfig
from peft.tuners.lora.layer import Linear as LoraLinear
from peft.tuners.tuners_utils import check_adapters_to_merge

from ..calibrate import input_moments
from ..errors import QRecoverError
from ..qlinear import QuantLinear
from ..schemes import QuantizedWeight, get_quantizer

logger = logging.getLogger(__name__)

#: the warning ``merge`` gives (once per process: the text does not vary)
MERGE_WARNING = (
    "merging a LoRA adapter into qrecover's packed weights re-quantizes each layer: the merged model differs from "
    "the unmerged adapter by that re-quantization error, of the size of the quantization error the adapter corrects "
    "(see qrecover.adapters.peft_quant.QuantLoraLinear). Keep the adapter unmerged for exact outputs; per-layer "
    "errors are logged at INFO by qrecover.adapters.peft_quant"
)


def requantize(qw: QuantizedWeight, weight: torch.Tensor, stats: dict[str, torch.Tensor] | None = None) -> QuantizedWeight:
    """``weight (out, in)`` quantized with ``qw``'s own encoding: the same scheme, parameters and bit width.

    ``stats``: calibration statistics for the scheme (names from ``qrecover.schemes.base.STAT_NAMES``). Every
    statistic the scheme ``needs`` must be there (:class:`QRecoverError` otherwise): quantizing blind to them is
    what compression avoids, and the result is not usable. Computed on the CPU in float32.
    """
    if tuple(weight.shape) != tuple(qw.shape):
        raise QRecoverError(f"cannot re-quantize a weight of shape {tuple(weight.shape)} into a layer of shape {tuple(qw.shape)}")
    quantizer = get_quantizer(qw.scheme, **qw.params)
    stats = {k: v.detach().float().cpu() for k, v in (stats or {}).items()}
    missing = sorted(set(quantizer.needs) - set(stats))
    if missing:
        raise QRecoverError(
            f"scheme {qw.scheme!r} re-quantizes a merged weight with the calibration statistics {missing}, which were "
            "not given (without them a 3.7 bpw SmolLM2-135M went from perplexity 36 to millions); merge with "
            "qrecover.adapters.peft_quant.merge_and_unload(peft_model, windows), which collects them, or keep the "
            "adapter unmerged (the PeftModel computes base + adapter exactly)")
    try:
        return quantizer.quantize(weight.detach().float().cpu(), qw.bits, stats)
    except KeyError as e:  # a scheme that reads a statistic it does not declare in `needs`
        raise QRecoverError(
            f"scheme {qw.scheme!r} cannot re-quantize a merged weight without the calibration statistic {e}; keep the "
            "adapter unmerged, or pass the statistic in the layer's merge_stats") from None


class QuantLoraLinear(LoraLinear):
    """PEFT LoRA on a :class:`~qrecover.qlinear.QuantLinear` whose ``merge`` changes the packed weights.

    Forward and training are PEFT's ``lora.Linear``: ``QuantLinear(x) + scaling * B(A(x))``; only A and B train.

    ``merge`` dequantizes the packed weight ``W (out, in)``, adds the adapters' deltas (``scaling * B @ A``, or a
    PEFT variant's own merge, e.g. DoRA) and re-quantizes ``W + delta`` with the layer's own scheme, parameters
    and bit width (:func:`requantize`), then swaps the packed buffers (``QuantLinear.set_packed``): the model keeps
    its size and format. The scheme's calibration statistics come from ``merge_stats`` (``{"input_sq": (in,),
    "hessian": (in, in)}``, set by :func:`collect_merge_stats`); a scheme that needs them and has none raises.

    Cost: re-quantization makes a fresh error of the size of the original quantization error, so the merged model
    is NOT the unmerged adapter, and an adapter that corrects the quantization error (a recovery adapter) mostly
    does not survive the merge. Measured (KL to the unquantized model per token; base / unmerged / merged), SVD-init
    rank-16 adapter, tiny test Llama at 5 bpw (4-bit palettize): uncalibrated merge 3.3e-4 / 2.0e-4 / 3.1e-4,
    calibrated (:func:`merge_and_unload`) 3.3e-4 / 2.0e-4 / 2.9e-4 (27% of the adapter's gain kept); SmolLM2-135M at
    3.7 bpw: see :func:`merge_and_unload`. Each merge logs the per-layer relative errors at INFO
    and warns once (:data:`MERGE_WARNING`); ``merge_error`` holds the last merge's numbers: ``requant_rel``
    = ``||Q(W+d) - (W+d)||_F / ||W+d||_F`` and ``requant_vs_delta`` = ``||Q(W+d) - (W+d)||_F / ||d||_F``.
    A layer whose re-quantization would be further from ``W + d`` than its current packed weight (output error
    ``tr(E H E^T)`` on the calibration inputs, Frobenius without a Hessian) keeps its packed weight
    (``merge_error["kept_original"]``): merging never makes a layer worse than not merging, by that measure.

    ``unmerge`` restores the packed weight from before the first merge bit-exactly (it is kept while merged).
    """

    def __init__(self, base_layer: QuantLinear, adapter_name: str, config: LoraConfig, **kwargs: Any) -> None:
        if config.lora_bias:
            raise QRecoverError("lora_bias=True is not supported on qrecover's quantized layers; use lora_bias=False")
        super().__init__(base_layer, adapter_name, config=config, **kwargs)
        self.merge_stats: dict[str, torch.Tensor] | None = None
        self.merge_error: dict[str, float] | None = None
        self._unmerged_packed: QuantizedWeight | None = None

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        """Add the active (or the named) adapters into the packed weight, re-quantizing once for all of them."""
        adapter_names = [a for a in (check_adapters_to_merge(self, adapter_names) or []) if a in self.lora_A]
        if not adapter_names:
            return
        base = self.get_base_layer()
        before = base.packed
        weight = base._quantizer.dequantize(before, torch.float32)  # from the packed buffers, never the cache
        merged = weight
        for name in adapter_names:
            if name in self.lora_variant:
                merged = self.lora_variant[name].merge_safe(self, name, merged)
            else:
                merged = merged + self.get_delta_weight(name).to(merged)
        if not torch.isfinite(merged).all():
            raise QRecoverError(f"merging adapter(s) {adapter_names} gives non-finite weights: the adapter is broken; "
                                "do not merge it")
        qw = requantize(before, merged, self.merge_stats)
        with torch.no_grad():
            target = merged.cpu()
            new_err = get_quantizer(qw.scheme, **qw.params).dequantize(qw, torch.float32) - target
            old_err = weight.cpu() - target
            hessian = (self.merge_stats or {}).get("hessian")
            # the output error on the calibration inputs, tr(E H E^T) (Frobenius without a Hessian)
            cost = (lambda e: float(torch.einsum("oi,ij,oj->", e.double(), hessian.double(), e.double()))) \
                if hessian is not None else (lambda e: float(e.double().square().sum()))
            kept = cost(old_err) <= cost(new_err)  # re-quantizing would move the layer further from W + delta
            if kept:
                qw, new_err = before, old_err
            self.merge_error = {"requant_rel": float(new_err.norm() / target.norm().clamp_min(1e-30)),
                                "requant_vs_delta": float(new_err.norm() / old_err.norm()) if old_err.norm() > 0 else float("inf"),
                                "kept_original": kept}
        warnings.warn(MERGE_WARNING, stacklevel=2)
        logger.info("merged %s into %s (%s %d bits): re-quantization error %.4g of the weight, %.3g x the adapter's delta%s",
                    adapter_names, tuple(before.shape), before.scheme, before.bits, self.merge_error["requant_rel"],
                    self.merge_error["requant_vs_delta"],
                    "; kept the original packed weight (re-quantizing was further from W + delta)" if kept else "")
        if self._unmerged_packed is None:
            self._unmerged_packed = QuantizedWeight(before.scheme, before.bits, before.shape, before.params,
                                                    {k: v.clone() for k, v in before.tensors.items()})
        base.set_packed(qw)
        self.merged_adapters.extend(adapter_names)

    def unmerge(self) -> None:
        """Restore the packed weight from before the first merge, bit-exactly."""
        if not self.merged:
            warnings.warn("Already unmerged. Nothing to do.", stacklevel=2)
            return
        self.get_base_layer().set_packed(self._unmerged_packed)
        self._unmerged_packed = None
        self.merged_adapters.clear()


def collect_merge_stats(peft_model: nn.Module, windows: torch.Tensor) -> int:
    """Set every :class:`QuantLoraLinear`'s ``merge_stats`` to its input statistics on ``windows`` ``(n, seq_len)``
    token ids, run through ``peft_model`` as it is (adapters active): ``input_sq (in,)`` = mean of ``x_j^2`` and
    ``hessian (in, in)`` = mean of ``x x^T``, over every token (accumulated in float64). Returns the layer count."""
    layers = [m for m in peft_model.modules() if isinstance(m, QuantLoraLinear)]
    moments = input_moments(peft_model, {str(i): m for i, m in enumerate(layers)}, windows)
    for i, m in enumerate(layers):
        h = moments[str(i)].float()
        m.merge_stats = {"hessian": h, "input_sq": h.diagonal().clone()}
    return len(layers)


def merge_and_unload(peft_model: nn.Module, windows: torch.Tensor) -> nn.Module:
    """``peft_model.merge_and_unload()`` with each layer re-quantized using calibration statistics collected on
    ``windows`` ``(n, seq_len)`` (:func:`collect_merge_stats`; e.g. ``qrecover.data.corpus.token_windows(tokenizer,
    "python-docs", "calib", 8, 512)``, the checkpoint's calibration text). Returns the base model, its packed
    weights replaced. Costs a forward pass over ``windows`` plus a quantization of every adapted layer.

    Measured on SmolLM2-135M at 3.7 bpw (8 python-docs eval windows of 256 tokens; KL to the unquantized model per
    token / perplexity; unquantized ppl 18.3), SVD-init rank-16 adapter: base 0.790 / 36.5, unmerged adapter
    0.486 / 27.3; merged without statistics 11.9 / 2.5e6, with statistics but re-quantizing every layer 2.78 / 280,
    as here (a layer keeps its packed weight when re-quantizing is worse) 0.790 / 36.5: the recovery adapter does not
    survive a merge at this width (145 s on one CPU thread). Warns when most layers kept their weights.
    """
    collect_merge_stats(peft_model, windows)
    layers = [m for m in peft_model.modules() if isinstance(m, QuantLoraLinear)]
    model = peft_model.merge_and_unload()
    kept = sum(bool(m.merge_error and m.merge_error["kept_original"]) for m in layers)
    if layers and kept * 2 > len(layers):
        warnings.warn(f"{kept} of {len(layers)} layers kept their packed weights: re-quantizing them with the adapter "
                      "merged was further from base + adapter than not merging, so the merged model is close to the base "
                      "model; keep the adapter unmerged (or quantize the unquantized model + adapter at more bits)",
                      stacklevel=2)
    return model


def register_quant_lora(config: LoraConfig) -> LoraConfig:
    """Make PEFT build :class:`QuantLoraLinear` for every targeted ``QuantLinear`` under ``config`` (in place;
    returns it). Call it on a ``LoraConfig`` before ``get_peft_model``, or on
    ``LoraConfig.from_pretrained(DIR)`` passed as ``config=`` to ``PeftModel.from_pretrained``."""
    if not isinstance(config, LoraConfig):
        raise QRecoverError(f"{type(config).__name__} is not a LoRA config: qrecover's quantized layers take LoRA adapters")
    config._register_custom_module({QuantLinear: QuantLoraLinear})
    return config


__all__ = ["QuantLoraLinear", "collect_merge_stats", "merge_and_unload", "register_quant_lora", "requantize", "MERGE_WARNING"]

"""``--merge-adapter``: a recovery adapter merged into the checkpoint's packed weights, with the measured cost.

The checkpoint is loaded with its adapter (``qrecover.load(checkpoint, adapter=...)``), merged by
:func:`qrecover.adapters.peft_quant.merge_and_unload` (every adapted layer re-quantized with its own encoding;
palettize needs calibration statistics, collected on :func:`calibration_windows`: the checkpoint's own calibration
text, ``n`` windows of its calibration length), and the merged packed layers replace the checkpoint's in the
:class:`~qrecover.export.common.Checkpoint` handed to the format writer.

Merging re-quantizes, so the merged model is not the unmerged adapter. The cost is measured, never assumed: on
``eval_windows`` held-out windows of 512 tokens (:data:`qrecover.evaluate.perplexity.PPL_PROTOCOL`) the perplexity of the
checkpoint without the adapter (``base``), with the adapter unmerged (``unmerged``) and merged (``merged``), and
the mean per-token KL to the unquantized model when it is available (the manifest's source, same weights hash).
``kept`` is the fraction of the adapter's gain the merge keeps, ``(base - merged) / (base - unmerged)`` on KL
(perplexity without a reference). Measured on SmolLM2-135M at 3.7 bpw with an SVD-init rank-16 recovery adapter:
KL 0.790 / 0.486 / 0.790: the merge keeps nothing; serve the adapter unmerged.
"""

from __future__ import annotations

import math
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from ..adapters.lora import lora_modules
from ..adapters.peft_quant import merge_and_unload
from ..checkpoint import source_model_spec
from ..data.mix import calibration_windows as source_windows
from ..errors import QRecoverError
from ..evaluate.agreement import KLProbe
from ..evaluate.perplexity import perplexity
from ..loading import load
from ..models import load_model
from ..qlinear import QuantLinear
from .common import Checkpoint

COST_SEQ_LEN = 512


def calibration_windows(ckpt: Checkpoint, tokenizer: Any, n: int) -> torch.Tensor:
    """``(n, seq_len)`` token windows of the checkpoint's own calibration text (``manifest["calibration"]``: its
    source, split ``calib`` and window length), where the merge collects the re-quantization statistics."""
    if n < 1:
        raise QRecoverError(f"--merge-windows {n}: the merge needs at least 1 calibration window (default 8)")
    cal = ckpt.manifest.get("calibration") or {}
    return source_windows(tokenizer, cal.get("source", "python-docs"), n, int(cal.get("seq_len", 512)),
                          model=source_model_spec(ckpt.manifest))


def reference_model(ckpt: Checkpoint) -> tuple[nn.Module | None, str]:
    """The unquantized model the checkpoint was compressed from, when it is here with the same weights hash:
    ``(model, why)``; ``(None, why not)`` otherwise (the cost is then perplexity only)."""
    src = ckpt.manifest.get("source") or {}
    path = src.get("path")
    if src.get("kind") != "default" and (not path or not Path(path).exists()):
        return None, f"the unquantized source {path!r} is not here: KL not measured"
    model, _, source = load_model(None if src.get("kind") == "default" else path)
    if source.weights_sha256 != src.get("weights_sha256"):
        return None, f"the unquantized source {path!r} changed since compression (weights hash): KL not measured"
    return model, f"{src.get('name') or path} (weights sha256 {source.weights_sha256[:12]}...)"


def _measure(model: nn.Module, tokenizer: Any, reference: nn.Module | None, windows: int) -> dict[str, Any]:
    probe = KLProbe(model, reference) if reference is not None else model
    r = perplexity(probe, tokenizer, windows=windows, seq_len=COST_SEQ_LEN, show_progress=False)
    out = {"ppl": r["ppl"], "nll": r["nll"]}
    if reference is not None:
        kl = probe.result()
        out.update(kl=kl["kl"], kl_stderr=kl["stderr"])
    return out


def merged_checkpoint(ckpt: Checkpoint, adapter: str | Path, merge_windows: int = 8, eval_windows: int = 8,
                      log: Callable[[str], None] = lambda s: None) -> tuple[Checkpoint, dict[str, Any]]:
    """``(the checkpoint with the adapter merged into its packed layers, the merge report)``.

    The report: ``cost`` (``base`` / ``unmerged`` / ``merged``: ``ppl``, ``nll`` and, with the unquantized model
    here, ``kl``; ``kept``: the fraction of the adapter's gain that survives), ``layers`` (per merged layer:
    ``requant_rel``, ``requant_vs_delta``, ``kept_original`` from :class:`~qrecover.adapters.peft_quant.QuantLoraLinear`),
    and the windows used. The adapter must have been checked against ``ckpt`` already.
    """
    from transformers import AutoTokenizer

    if eval_windows < 1:
        raise QRecoverError(f"--cost-windows {eval_windows}: the merge cost needs at least 1 held-out window (default 8)")
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(ckpt.path)
    calib = calibration_windows(ckpt, tok, merge_windows)
    model = load(ckpt.path, adapter=adapter, cache=True)  # dense copies for the evaluations (set_packed drops a merged layer's)
    reference, ref_note = reference_model(ckpt)
    log(f"measuring the merge cost on {eval_windows} held-out windows x {COST_SEQ_LEN} tokens"
        + (f" (KL to {ref_note})" if reference is not None else f" ({ref_note})"))
    with torch.no_grad():
        with model.disable_adapter():
            base = _measure(model, tok, reference, eval_windows)
        unmerged = _measure(model, tok, reference, eval_windows)
        adapted = lora_modules(model)
        with warnings.catch_warnings():  # the merge's warnings are this report's subject: measured below instead
            warnings.simplefilter("ignore", UserWarning)
            merged_model = merge_and_unload(model, calib)
        merged = _measure(merged_model, tok, reference, eval_windows)
    del reference
    layers_out = {}
    for name, mod in merged_model.named_modules():
        if isinstance(mod, QuantLinear) and name in ckpt.layers:
            layers_out[name] = mod.packed
    missing = sorted(set(adapted) - set(layers_out))
    if missing:
        raise QRecoverError(f"internal error: merged layers {missing[:3]} are not packed layers of {str(ckpt.path)!r}")
    layers = {n: layers_out.get(n, qw) for n, qw in ckpt.layers.items()}
    metric = "kl" if "kl" in base else "nll"
    gain = base[metric] - unmerged[metric]
    kept = (base[metric] - merged[metric]) / gain if gain > 0 else None
    per_layer = {n: dict(m.merge_error or {}) for n, m in adapted.items()}
    report = {
        "adapter": str(Path(adapter).resolve()),
        "cost": {"base": base, "unmerged": unmerged, "merged": merged, "kept": kept, "kept_on": metric,
                 "reference": ref_note if metric == "kl" else None},
        "eval": {"split": "eval", "source": "python-docs", "windows": eval_windows, "seq_len": COST_SEQ_LEN},
        "calibration": {"split": "calib", "windows": int(calib.shape[0]), "seq_len": int(calib.shape[1]),
                        "source": (ckpt.manifest.get("calibration") or {}).get("source", "python-docs")},
        "layers": per_layer,
        "layers_kept_original": sum(bool(v.get("kept_original")) for v in per_layer.values()),
        "seconds": round(time.time() - t0, 1),
    }
    return Checkpoint(ckpt.path, ckpt.manifest, layers, ckpt.remainder), report


def cost_lines(merge: dict[str, Any]) -> list[str]:
    """The merge cost as printed lines (the CLI prints them prominently)."""
    c = merge["cost"]

    def row(key: str) -> str:
        return " / ".join(f"{c[k][key]:.4g}" for k in ("base", "unmerged", "merged"))

    lines = [f"MERGE COST (held-out, {merge['eval']['windows']} windows x {merge['eval']['seq_len']} tokens; "
             "checkpoint without adapter / adapter unmerged / adapter merged):",
             f"  perplexity {row('ppl')}"]
    if "kl" in c["base"]:
        lines.append(f"  KL to the unquantized model {row('kl')} nats/token")
    kept = c["kept"]
    n = len(merge["layers"])
    if kept is None or math.isnan(kept):
        lines.append(f"  the adapter does not lower {c['kept_on']} on these windows: no gain for the merge to keep")
    else:
        lines.append(f"  the merge keeps {100 * kept:.0f}% of the adapter's gain ({c['kept_on']})")
    lines.append(f"  {merge['layers_kept_original']}/{n} adapted layers kept their packed weights (re-quantizing "
                 "them was further from base + adapter than not merging)")
    if kept is None or kept < 0.9:
        lines.append("  -> prefer exporting the adapter unmerged: --adapter without --merge-adapter")
    return lines

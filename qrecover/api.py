"""One entry point per stage. The CLI only parses arguments and calls these.

``prepare`` and ``compress``: the compress stages (:mod:`qrecover.stages`); ``load`` / ``load_any``
(:mod:`qrecover.loading`): a checkpoint (with an optional recovery adapter) or an original model; ``perplexity``
(:mod:`qrecover.evaluate.perplexity`): the held-out protocol."""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Any

from .config import CompressConfig
from .errors import QRecoverError
from .evaluate.perplexity import PPL_PROTOCOL, perplexity  # noqa: F401  (re-exported: qrecover.api is the facade)
from .loading import load, load_any  # noqa: F401  (re-exported: qrecover.api is the facade)
from .models import unquantized_matrices
from .stages.allocation import choose_units
from .stages.candidates import Prepared, check_reusable, prepare
from .stages.checks import check_budget_early, encodings_of, resolve_device, unquantized_note
from .stages.finalize import finalize_units
from .stages.write import build_manifest, pack, write_shared

__all__ = ["PPL_PROTOCOL", "Prepared", "compress", "load", "load_any", "perplexity", "prepare", "resolve_device"]


# --- compress -------------------------------------------------------------------------------------------


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
    lin_encs, emb_encs = encodings_of(cfg)  # a bad --encodings is named before anything about the output
    if out is not None and out.exists() and not overwrite:
        raise QRecoverError(f"output directory {str(out)!r} already exists; pass --overwrite to replace it")
    owned = prepared is None  # no caller keeps this Prepared for another budget: its candidates may be dropped
    if prepared is None:
        check_budget_early(cfg, lin_encs, emb_encs)
        prepared = prepare(cfg, show_progress, lazy=lazy)
    p = prepared
    lin_encs, emb_encs = encodings_of(cfg, p.model)  # as prepare resolved them on the model it loaded
    emb_want = check_reusable(p, cfg, lin_encs, emb_encs)

    # stage allocate: one candidate per unit within the budget
    unquantized, routers = unquantized_matrices(p.model, {f"{n}.weight" for n, u in p.units.items() if u.kind == "linear"})
    chosen = choose_units(p, cfg, lin_encs, emb_want, unquantized)
    if unquantized:
        warnings.warn(f"qrecover: {unquantized_note(unquantized)}", stacklevel=2)
    enc_of = {n: u.cands[chosen[n]] for n, u in p.units.items()}
    qws = {n: u.result(chosen[n])[0] for n, u in p.units.items()}
    damage = {n: u.result(chosen[n])[1] for n, u in p.units.items()}
    damage_table = {n: u.damages() for n, u in p.units.items()}
    # stage finalize: re-quantize each chosen linear on the outputs of the quantized layers before it
    finfo: dict[str, Any] = {"enabled": bool(cfg.finalize)}
    if cfg.finalize:
        finfo.update(finalize_units(p, enc_of, qws, cfg.finalize_groups, cfg.device, owned, show_progress,
                                     cfg.finalize_precision))

    # stage write
    tensors, layers = pack(p, chosen, qws, damage, enc_of)
    manifest = build_manifest(p, cfg, layers, damage_table, lin_encs, emb_want, unquantized, routers, finfo)
    if out is None:
        return manifest
    return write_shared(out, tensors, manifest, p.model, p.tokenizer, overwrite,
                        extra={"seconds": round(time.time() - t0, 1),  # this call; includes preparing unless given
                               "prepare_seconds": round(p.seconds, 1)})

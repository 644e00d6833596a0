"""``qrecover export``: a checkpoint (and its recovery adapter) in a serving runtime's format.

One file per format: :mod:`.gguf_format` (llama.cpp), :mod:`.compressed_tensors` (vLLM, transformers),
:mod:`.coreml` (Core ML).
Each is written with the format's own library into a temporary directory moved into place at the end
(:func:`qrecover.io_utils.atomic_dir`). See docs/export.md for what maps exactly and what is lossy.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from ..errors import QRecoverError
from ..io_utils import atomic_dir
from .common import Checkpoint, check_adapter, parse_requantize, read_checkpoint, write_binding, write_meta
from .compressed_tensors import export_compressed_tensors, plan
from .coreml import export_coreml  # coremltools itself is imported where used
from .gguf_format import arch_of, export_gguf, export_gguf_adapter
from .merge import cost_lines, merged_checkpoint

FORMATS = ("gguf", "compressed-tensors", "coreml")
ADAPTER_DIR = "adapter"
_EXTRAS = {"compressed-tensors": ("compressed_tensors", "export-ct"), "coreml": ("coremltools", "export-coreml")}


def _require(fmt: str) -> None:
    if fmt in _EXTRAS:
        module, extra = _EXTRAS[fmt]
        if importlib.util.find_spec(module) is None:
            raise QRecoverError(f"--format {fmt} needs the {module.replace('_', '-')} library: "
                                f"pip install 'qrecover[{extra}]'")


def export(checkpoint: str | Path, fmt: str, out: str | Path, adapter: str | Path | None = None,
           merge_adapter: bool = False, requantize: str | None = None, overwrite: bool = False,
           log: Callable[[str], None] = lambda s: None, merge_windows: int = 8, cost_windows: int = 8) -> dict[str, Any]:
    """Export ``checkpoint`` to ``fmt`` in the directory ``out``; return the report (also written as
    ``qrecover_export.json`` in ``out``). ``adapter``: a recovery adapter of this checkpoint, exported beside the
    base under ``out/adapter``; with ``merge_adapter`` merged into the weights instead (each layer re-quantized with
    its own encoding, statistics from ``merge_windows`` calibration windows), the measured cost on ``cost_windows``
    held-out windows in ``report["merge"]`` (:mod:`.merge`). ``requantize`` (``'int4/g64'``): compressed-tensors
    only, converts layers the format cannot hold, reporting the measured loss."""
    t0 = time.time()
    if fmt not in FORMATS:
        raise QRecoverError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    checkpoint, out = Path(checkpoint), Path(out)
    _check_options(fmt, out, overwrite, adapter, merge_adapter, requantize, merge_windows, cost_windows)
    spec = parse_requantize(requantize)
    adapter_meta = check_adapter(adapter, checkpoint) if adapter is not None else None
    if fmt == "coreml" and adapter is not None and not merge_adapter:
        raise QRecoverError("--adapter with --format coreml is not supported (Core ML has no separate LoRA file); "
                            "export the adapter with --format gguf or compressed-tensors, or merge it with --merge-adapter")
    ckpt = read_checkpoint(checkpoint)
    _check_exportable(ckpt, checkpoint, fmt, adapter)  # what the format cannot hold, before its library is asked for
    _require(fmt)
    merge = None
    if merge_adapter:
        if fmt == "compressed-tensors" and spec is None:
            plan(ckpt, None)  # refuses palettized layers before the merge (merged layers keep their encoding)
        if fmt == "gguf":
            arch_of(ckpt)  # refuses an unsupported architecture before the merge
        ckpt, merge = merged_checkpoint(ckpt, adapter, merge_windows, cost_windows, log)
        adapter = None  # in the weights now: not also exported beside them
    with atomic_dir(out, overwrite=overwrite) as tmp:
        report, base_file = _write_format(fmt, ckpt, tmp, spec, adapter, out, log)
        if adapter is not None:
            report["adapter"]["binding"] = write_binding(tmp / ADAPTER_DIR, Path(adapter), adapter_meta, base_file, checkpoint)
        if merge is not None:
            report["merge"] = merge
        report.update({"format": fmt, "checkpoint": str(checkpoint.resolve()),
                       "bytes": sum(p.stat().st_size for p in tmp.rglob("*") if p.is_file())})
        base_bytes = sum(p.stat().st_size for p in base_file.rglob("*") if p.is_file()) if base_file.is_dir() else base_file.stat().st_size
        report["bpw"] = 8.0 * base_bytes / ckpt.manifest["parameters"]["model"]
        report["seconds"] = round(time.time() - t0, 1)
        write_meta(tmp, report)
    return report


def _check_options(fmt: str, out: Path, overwrite: bool, adapter: str | Path | None, merge_adapter: bool,
                   requantize: str | None, merge_windows: int, cost_windows: int) -> None:
    """Refuse a request whose options contradict each other or the output directory, before any work."""
    if out.exists() and not overwrite:
        raise QRecoverError(f"output directory {str(out)!r} already exists; pass --overwrite to replace it")
    if merge_adapter and adapter is None:
        raise QRecoverError("--merge-adapter needs --adapter DIR (the recovery adapter to merge into the weights)")
    if merge_adapter and (merge_windows < 1 or cost_windows < 1):
        raise QRecoverError(f"--merge-windows {merge_windows} / --cost-windows {cost_windows}: both must be 1 or more "
                            "(defaults 8 and 8)")
    if requantize is not None and fmt != "compressed-tensors":
        raise QRecoverError(f"--requantize applies to --format compressed-tensors; --format {fmt} converts the layers it "
                            "cannot hold by itself and reports the loss")


def _check_exportable(ckpt: Checkpoint, checkpoint: Path, fmt: str, adapter: str | Path | None = None) -> None:
    """Refuse what ``fmt`` cannot hold: an online input rotation (``r4+``: only compressed-tensors carries one, without
    an adapter), an adapter on the head of a checkpoint whose tied head's final-norm rotation the export folds into an
    untied head (``rot+``, :func:`.common.untied_head`), or experts quantized one by one."""
    online = ckpt.manifest.get("transforms", {}).get("online", {})
    inputs = [n for n, spec in online.items() if spec.get("side") == "input"]
    where = ", ".join(inputs[:2]) + (f" and {len(inputs) - 2} more" if len(inputs) > 2 else "")
    if inputs and fmt != "compressed-tensors":
        raise QRecoverError(f"{str(checkpoint)!r} runs an online rotation at {where} (r4+: the input of down_proj rotated "
                            f"at run time); --format {fmt} cannot hold it: compress without r4+ in --encodings, or export it "
                            "with --format compressed-tensors (vLLM), or load it with qrecover.load")
    if inputs and adapter is not None:
        raise QRecoverError(f"{str(checkpoint)!r} runs an online rotation at {where}; exporting an adapter with it is not "
                            "supported yet: export the base alone, or compress without r4+ in --encodings")
    if len(online) > len(inputs) and adapter is not None and _adapts_head(Path(adapter)):
        raise QRecoverError(f"adapter {str(adapter)!r} adapts the head of a rot+ checkpoint whose export unties the head "
                            "(its final-norm rotation folded in); retrain it with --head-rank 0, or load it with qrecover.load")
    if ckpt.manifest.get("moe", {}).get("unfused"):
        raise QRecoverError(f"{str(checkpoint)!r} is a mixture-of-experts checkpoint (its experts quantized one by one, "
                            f"e.g. {ckpt.manifest['moe']['unfused'][0]}.0.gate_up_proj); export of MoE checkpoints to "
                            f"{fmt} is not supported yet: load it with qrecover.load")


def _adapts_head(adapter: Path) -> bool:
    """Whether a PEFT adapter holds a LoRA on the output head."""
    from safetensors import safe_open

    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        return any(".lm_head." in k for k in f.keys())


def _write_format(fmt: str, ckpt: Checkpoint, tmp: Path, spec: tuple[int, int] | None, adapter: str | Path | None, out: Path,
                  log: Callable[[str], None]) -> tuple[dict[str, Any], Path]:
    """Write the base in ``fmt`` into ``tmp`` (and the adapter beside it, where the format has one); return the
    format's report and the base's file (or directory)."""
    if fmt == "gguf":
        report = export_gguf(ckpt, tmp, log)
        base_file = tmp / report["file"]
        if adapter is not None:
            (tmp / ADAPTER_DIR).mkdir()
            report["adapter"] = export_gguf_adapter(Path(adapter), ckpt, tmp / ADAPTER_DIR)
    elif fmt == "coreml":
        report = export_coreml(ckpt, tmp, log)
        base_file = tmp / report["file"]
    else:
        report = export_compressed_tensors(ckpt, tmp, spec, log)
        base_file = tmp / report["file"]
        if adapter is not None:
            shutil.copytree(adapter, tmp / ADAPTER_DIR)
            cfg_path = tmp / ADAPTER_DIR / "adapter_config.json"
            acfg = json.loads(cfg_path.read_text())
            acfg["base_model_name_or_path"] = str(out.resolve())  # the exported base, where it will be
            cfg_path.write_text(json.dumps(acfg, indent=2) + "\n")
            report["adapter"] = {"dir": ADAPTER_DIR, "layout": "PEFT (adapter_config.json + adapter_model.safetensors)"}
    return report, base_file


__all__ = ["FORMATS", "cost_lines", "export"]

"""coremltools k-means palettization as a peer baseline for the benchmark.

Runs ``coremltools.optimize.torch.palettization.PostTrainingPalettizer`` (post-training,
data-free, 1-D k-means per group, coremltools defaults otherwise) on every ``nn.Linear``
inside the decoder layers of a Hugging Face causal LM. Embeddings and ``lm_head`` are left
untouched. Groups are formed along coremltools' default ``channel_axis=0``, i.e. each run
of ``group_size`` output rows of ``weight`` (shape ``[out, in]``) shares one LUT of
``2**n_bits`` centroids.

The palettizer writes the de-palettized weights (``lut[indices]``, fp32) straight into
``module.weight.data`` and registers ``_COREML_/...`` metadata buffers (LUT, compression
type, version) for its Core ML export path. We drop those buffers, so the result is a
plain transformers model whose ``state_dict`` has its usual keys.

Requires ``pip install coremltools==9.0`` (on Linux only the torch-side optimizer is
usable; the "Failed to load _MLModelProxy" / "torch version not tested" messages on
import are harmless and are silenced here).
"""
from __future__ import annotations

import logging
import os
import time

import torch
from torch import nn

_META_PREFIX = "_COREML_"  # coremltools' STATE_DICT_METADATA_BUFFER_PREFIX


def _import_palettizer():
    cml_logger = logging.getLogger("coremltools")
    level = cml_logger.level
    cml_logger.setLevel(logging.ERROR)  # silence the import-time warnings described above
    try:
        import coremltools
        from coremltools.optimize.torch.palettization import (
            ModulePostTrainingPalettizerConfig,
            PostTrainingPalettizer,
            PostTrainingPalettizerConfig,
        )
    except ImportError as e:
        raise ImportError(
            "benchmarks.coreml_peer needs coremltools: pip install coremltools==9.0 "
            f"(keep torch pinned: pip install coremltools==9.0 -c <(echo torch=={torch.__version__.split('+')[0]}))"
        ) from e
    finally:
        cml_logger.setLevel(level)
    # coremltools.optimize.torch logs every tensor at INFO unless the user asked otherwise
    if "COREMLTOOLS_OPTIMIZE_TORCH_LOG_LEVEL" not in os.environ:
        logging.getLogger("coremltools.optimize.torch").setLevel(logging.WARNING)
    return coremltools.__version__, ModulePostTrainingPalettizerConfig, PostTrainingPalettizer, PostTrainingPalettizerConfig


def _decoder_layers(model: nn.Module) -> nn.ModuleList:
    n = model.config.num_hidden_layers
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == n:
            return module
    raise ValueError(f"no nn.ModuleList of length num_hidden_layers={n} found in {type(model).__name__}")


def coreml_palettize(model: torch.nn.Module, n_bits: int = 4, group_size: int = 16, *, num_workers: int = 1) -> dict:
    """Palettize every nn.Linear inside the decoder layers of a HF causal LM in place with coremltools
    (weights replaced by their palettized values, fp32), return {"linear_bpw": float, "seconds": float,
    "coremltools_version": str}. linear_bpw counts codes (n_bits per weight) + the fp16 LUT entries
    (2**n_bits per group of group_size rows/channels) over the linear weights' parameter count.

    The model must be on CPU in fp32 (coremltools runs k-means on ``weight.numpy()``); each group is
    ``group_size`` consecutive output rows (coremltools' ``channel_axis=0``). ``num_workers > 1`` uses
    coremltools' ParallelKMeans (spawned processes, identical result; callers need a ``__main__`` guard)."""
    version, ModuleCfg, Palettizer, Cfg = _import_palettizer()
    layers = _decoder_layers(model)
    linears = {name: m for name, m in layers.named_modules() if isinstance(m, nn.Linear)}
    if not linears:
        raise ValueError("no nn.Linear found inside the decoder layers")
    for name, m in linears.items():
        if m.weight.device.type != "cpu" or m.weight.dtype != torch.float32:
            raise ValueError(f"{name}: expected a CPU fp32 weight, got {m.weight.dtype} on {m.weight.device}")
        if m.weight.shape[0] % group_size:
            # coremltools would silently skip such a layer; refuse instead of reporting a wrong bpw
            raise ValueError(f"{name}: out_features={m.weight.shape[0]} not divisible by group_size={group_size}")

    module_cfg = ModuleCfg(n_bits=n_bits, granularity="per_grouped_channel", group_size=group_size)
    # Only the decoder layers are handed to coremltools, so embeddings / lm_head are never seen.
    config = Cfg(module_type_configs={nn.Linear: module_cfg})
    env_key = "COREMLTOOLS_OPTIMIZE_TORCH_LOG_LEVEL"  # read by spawned k-means workers
    env_set = env_key not in os.environ
    if env_set:
        os.environ[env_key] = "warning"
    t0 = time.perf_counter()
    try:
        with torch.no_grad():
            Palettizer(layers, config).compress(num_kmeans_workers=num_workers, inplace=True)
    finally:
        if env_set:
            del os.environ[env_key]
    seconds = time.perf_counter() - t0

    # Every linear must carry coremltools' LUT buffer; then strip all its metadata buffers.
    missing = [name for name, m in linears.items() if f"{_META_PREFIX}/weight/lut" not in m._buffers]
    if missing:
        raise RuntimeError(f"coremltools did not palettize: {missing}")
    for mod in layers.modules():
        for key in [k for k in mod._buffers if k.startswith(_META_PREFIX)]:
            del mod._buffers[key]

    n_weights = sum(m.weight.numel() for m in linears.values())
    lut_bits = sum((m.weight.shape[0] // group_size) * 2**n_bits * 16 for m in linears.values())
    return {
        "linear_bpw": (n_weights * n_bits + lut_bits) / n_weights,
        "seconds": seconds,
        "coremltools_version": version,
    }

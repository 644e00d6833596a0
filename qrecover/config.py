"""Configs as dataclasses that round-trip to JSON; every field says what it does where it is declared."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from .errors import QRecoverError
from .fields import DictConfig, doc_field

#: The menu of ``qrecover compress`` when no ``--encodings``, ``--scheme`` or ``--bits`` is given, a preset of
#: :data:`qrecover.stages.specs.PRESETS` (until 2026-11-24: ``afm``, which configurations written then name explicitly
#: as ``scheme``/``bits``; then ``afm-blocks`` for a day, then ``mixed-blocks`` until 2026-11-27).
DEFAULT_ENCODINGS = "rot-mixed-blocks"
#: Calibration windows when ``calib_samples`` is not given: 64 (32 until 2026-11-28, fourth session), and 32 for the
#: ``quick`` preset, whose point is the quick start's time (64 windows cost it 7 min 0 s against 4 min 21 s).
CALIB_SAMPLES = 64
QUICK_CALIB_SAMPLES = 32


@dataclass
class CompressConfig(DictConfig):
    what = "compress config"

    # the CLI's options are these fields (qrecover.cli.config_options) but bpw, bits and scheme_params, which it takes in
    # forms of its own (--bpw/--uniform, --bits 2,4, --group-size/--block-size/--scheme-param), and seed; the help
    # texts are the CLI's, details for configs in the comments

    # None = the built-in default model (qrecover.models.DEFAULT_MODEL)
    model: str | None = doc_field(None, "Hugging Face causal-LM directory or .gguf file (default: the built-in SmolLM2-135M-Instruct)",
                                  short="-m")
    bpw: float | None = doc_field(3.7, "bits-per-weight budget, measured from packed bytes; None = uniform at the single width in `bits`")
    # 'model': every weight, embedding included; 'linear': the decoder linear layers only
    scope: str = doc_field("model", "what --bpw counts: 'model' (every weight) or 'linear' (decoder linear layers)")
    bits: list[int] = doc_field(None, "candidate bit widths for the decoder linear layers (with `scheme`; None: 2, 3, 4)", )
    # None: palettize
    scheme: str = doc_field(None, "quantizer for the linear layers, a registered scheme (palettize, blockwise, ...; palettize with "
                                  "--bits alone); with --bits, shorthand for --encodings SCHEME:B1,SCHEME:B2,...")
    scheme_params: dict[str, Any] = doc_field(None, "parameters of that scheme, e.g. {'group_size': 16}")
    # 'auto': the allocator picks among them; '4' and '8' as strings
    embedding_bits: str = doc_field("auto", "shorthand for --embedding-encodings: 'auto' (4-bit row-wise blocks of 128/64/32, 8-bit "
                                            "per-channel, 3/2-bit blocks of 32, 4/3-bit per-row tables, 4/3-bit GPTQ groups of 32), "
                                            "'legacy' (the first four), 4 or 8")
    # grammar: qrecover.stages.specs; None = `scheme` at every width of `bits` with `scheme_params`, or, when neither is
    # given, the default menu (DEFAULT_ENCODINGS, 'rot-mixed-blocks')
    encodings: str | None = doc_field(None, "candidate encodings of the linear layers as specs, e.g. "
                                            "palettize:2,palettize:3,gptq:4/g64,blockwise:8/pc, or a preset: rot-mixed-blocks (the default), "
                                            "quick, mixed-blocks, afm, afm-blocks, mixed, mixed-awq (overrides --scheme/--bits)")
    # the embedding's and an untied output matrix's; None = from `embedding_bits`
    embedding_encodings: str | None = doc_field(None, "candidate encodings of the embedding as specs, e.g. blockwise:4/b32/asym,palettize:3/g1 "
                                                      "(overrides --embedding-bits)")
    # before it: GPTQ's sequential mode
    finalize: bool = doc_field(True, "re-quantize each layer with its chosen encoding on the outputs of the already quantized layers "
                                     "(default on)", flag="--finalize/--no-finalize")
    # 'input': each group's statistics taken with the earlier groups quantized; 'layer': one statistics pass for the
    # whole layer, as llm-compressor's GPTQ: about 2 layer forwards per window instead of 3.3, measured in
    # benchmarks/schemes.py
    finalize_groups: str = doc_field("input", "'input': true-sequential (q/k/v, o, gate/up, down each calibrated after the ones before "
                                              "are quantized); 'layer': one pass per layer (faster)")
    device: str = doc_field("auto", "where calibration, quantization and finalize run: cpu, cuda, cuda:N or auto (CUDA when available), "
                                    "one decoder layer at a time")
    # 'position': lower widths spread evenly by position
    allocation: str = doc_field("sensitivity", "'sensitivity' (knapsack on estimated damage) or 'position' (baseline)")
    calib_data: str = doc_field("python-docs", "text: 'python-docs' (built in), or a directory, file or glob of text files; or a data-mix "
                                               "recipe: 'calib-mix' (shipped: the docs' calib split + the model's own general chats) or a "
                                               ".toml file")
    # None = 64 (CALIB_SAMPLES), or 32 with the quick menu (QUICK_CALIB_SAMPLES), resolved in __post_init__: 64 windows
    # scored better than 32 on every domain at 3.7 bpw (docs 1.175x vs 1.215x, worst held-out 1.389x vs 1.427x) for
    # 1.27x the full menu's compress time; the quick start keeps 32 to fit in 6 minutes (docs/compress.md)
    calib_samples: int | None = doc_field(None, "calibration windows (default: 64; 32 with --encodings quick, the quick start's "
                                                "menu)")
    seq_len: int = doc_field(512, "tokens per calibration window")
    grad_samples: int | None = doc_field(None, "windows of the gradient pass (the damage estimates' weights): the first N of the "
                                               "calibration windows (default: all)")
    grad_precision: str = doc_field("fp32", "the calibration's gradient pass (the damage estimates' weights): 'fp32', 'bf16' "
                                    "(autocast: about 2x faster where the device computes bf16 natively) or 'auto' (bf16 there, "
                                    "else fp32)")
    finalize_precision: str = doc_field("fp32", "finalize's statistics passes (its linear forwards and x^T x) on the CPU: 'fp32', "
                                        "'bf16' (float32 tensors whose matmul inputs oneDNN rounds to bf16, with float32 sums: "
                                        "2-4x faster matmuls with AMX or AVX512-BF16) or 'auto' (bf16 there, else fp32); the "
                                        "quantization itself and any GPU stay fp32")
    seed: int = doc_field(0, "random seed (the pipeline is deterministic; recorded for provenance)")

    def __post_init__(self) -> None:
        if self.encodings is None and self.scheme is None and self.bits is None:
            self.encodings = DEFAULT_ENCODINGS
        if self.scheme is None:
            self.scheme = "palettize"
        if self.bits is None:
            self.bits = [2, 3, 4]
        if self.scheme_params is None:
            self.scheme_params = {}
        if self.calib_samples is None:
            quick = (self.encodings or "").strip() == "quick"
            self.calib_samples = QUICK_CALIB_SAMPLES if quick else CALIB_SAMPLES
        self.validate()

    def validate(self) -> None:
        if self.bpw is not None and not (self.bpw > 0 and math.isfinite(self.bpw)):
            raise QRecoverError(f"--bpw {self.bpw} must be positive and finite, e.g. --bpw 3.7")
        if self.finalize_groups not in ("input", "layer"):
            raise QRecoverError(f"--finalize-groups {self.finalize_groups!r} must be 'input' (true-sequential) or 'layer'")
        if self.scope not in ("model", "linear"):
            raise QRecoverError(f"--scope {self.scope!r} must be 'model' or 'linear'")
        if not self.bits:
            raise QRecoverError("--bits must name at least one bit width, e.g. --bits 2,4")
        if self.bpw is None and len(self.bits) != 1 and not self.encodings:
            raise QRecoverError(f"without --bpw, --bits must be a single width (uniform model), got {self.bits}")
        if self.embedding_bits not in ("auto", "legacy", "4", "8"):
            raise QRecoverError(f"--embedding-bits {self.embedding_bits!r} must be auto, legacy, 4 or 8")
        if not (self.device in ("auto", "cpu", "cuda") or (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise QRecoverError(f"--device {self.device!r} must be cpu, cuda, cuda:N or auto")
        if self.allocation not in ("sensitivity", "position"):
            raise QRecoverError(f"--allocation {self.allocation!r} must be 'sensitivity' or 'position'")
        if self.grad_precision not in ("fp32", "bf16", "auto"):
            raise QRecoverError(f"--grad-precision {self.grad_precision!r} must be fp32, bf16 or auto")
        if self.finalize_precision not in ("fp32", "bf16", "auto"):
            raise QRecoverError(f"--finalize-precision {self.finalize_precision!r} must be fp32, bf16 or auto")
        for name, example in (("calib_samples", 32), ("seq_len", 512)):
            if getattr(self, name) <= 0:
                flag = "--" + name.replace("_", "-")
                raise QRecoverError(f"{flag} {getattr(self, name)} must be positive, e.g. {flag} {example}")
        if self.grad_samples is not None and not 1 <= self.grad_samples <= self.calib_samples:
            raise QRecoverError(f"--grad-samples {self.grad_samples} must be between 1 and --calib-samples ({self.calib_samples})")


__all__ = ["CALIB_SAMPLES", "QUICK_CALIB_SAMPLES", "CompressConfig", "DEFAULT_ENCODINGS"]

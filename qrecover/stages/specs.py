"""Encodings as specs: how a layer may be stored, written as text. The one place the grammar lives.

Grammar (spaces ignored; a list is comma-separated)::

    LIST      := ENCODING ("," ENCODING)*
    ENCODING  := (TRANSFORM "+")* SCHEME ":" BITS ("/" OPTION)*
    OPTION    := "g" INT          group_size=INT   (palettize: rows per table; gptq: columns per scale)
               | "b" INT          block_size=INT   (blockwise: elements per scale; palettize: columns per table)
               | "pc"             block_size=None  (one scale / table per whole row: per channel)
               | "sym" | "asym"   symmetric=True / False
               | KEY "=" VALUE    any field of the scheme's config; VALUE is an int, a float, true/false,
                                  none, or text

Examples: ``palettize:3``, ``palettize:4/g1`` (a table per row), ``blockwise:4/b32/asym``,
``blockwise:8/pc``, ``gptq:4/g64/sym``, ``awq+gptq:3/g128``, ``palettize:2/iters=50``.

``TRANSFORM`` names a registered function-preserving transform (:mod:`qrecover.transforms`). Transforms are
model-level: they are applied once, before calibration, and then *every* candidate quantizes the transformed
weights (``awq+gptq:4`` and ``gptq:4`` in one list are the same encoding of the transformed model; the
manifest says so).

Options the spec does not give come from ``defaults`` (``--scheme-param``) where the scheme has that field,
then from the scheme's own defaults. :func:`parse_encodings` checks scheme names, option names, bits and
transforms, and fails with one line naming the bad spec and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any

from ..config import DEFAULT_ENCODINGS  # noqa: F401  (re-exported: the default menu is declared with the config)
from ..errors import QRecoverError
from ..schemes import get_quantizer, quantizer_names
from ..schemes.base import _REGISTRY
from ..transforms import transform_names

GRAMMAR = ("[TRANSFORM+]SCHEME:BITS[/OPTION...] with OPTION gN, bN, pc, sym, asym or key=value, e.g. gptq:4/g64/sym, "
           "or a preset name (afm, afm-blocks, mixed, mixed-awq, mixed-blocks, rot-mixed-blocks, quick)")

#: Named menus for the decoder linear layers (``--encodings mixed``), each measured on the default model at
#: ``--bpw 3.7`` (``benchmarks/schemes.py``, ``benchmarks/heldout.py``): ``afm`` is AFM's palettization (whole-row tables;
#: the default until 2026-11, and the only palettization Core ML export takes);
#: ``mixed`` adds GPTQ integer layers (every architecture; measured before GPTQ's act order became its default);
#: ``mixed-awq`` also AWQ-scaled 3-bit GPTQ layers (architectures with an AWQ mapping): low perplexity on the
#: calibration domain, but AWQ's scales fit that domain and it is worse than ``mixed`` on the held-out ones. ``afm-blocks``:
#: palettization only, whole-row tables and tables per block of about 192 input columns (``block_fit=nearest``: 192 on
#: the default model's 576 and 1536, 256 on 2048 or 4096, 224 on 14336; a layer with no multiple of 32 within a factor
#: 2 chooses among the whole-row ones), each with two least-squares table refits: the best palettization-only
#: menu. ``mixed-blocks``: ``afm-blocks`` + GPTQ at 3 and 4 bits (g64, act order) with GPTQ's range search
#: (``mse=true``): the best measured menu without an online transform, on the calibration domain and on every held-out
#: one (python-docs 1.279x, held-out worst 1.890x; without the range search 1.343x / 2.049x, ``afm-blocks`` 1.351x /
#: 2.12x), on every architecture: the default until 2026-11-27 (fifth session), when its rotated form became it. The
#: range search became part of it on 2026-11-27 (docs/rotations.md, "GPTQ's range search").
PRESETS = {
    "afm": "palettize:2,palettize:3,palettize:4",
    "mixed": "palettize:2,palettize:3,palettize:4,gptq:3/g64,gptq:4/g64",
    "mixed-awq": "awq+gptq:3/g64,palettize:2,palettize:3,palettize:4,gptq:4/g64",
    "afm-blocks": "palettize:2/refit=2,palettize:3/refit=2,palettize:4/refit=2,palettize:2/b192/block_fit=nearest/refit=2,"
                  "palettize:3/b192/block_fit=nearest/refit=2,palettize:4/b192/block_fit=nearest/refit=2",
}
PRESETS["mixed-blocks"] = PRESETS["afm-blocks"] + ",gptq:3/g64/mse=true,gptq:4/g64/mse=true"
#: ``rot-mixed-blocks``: ``mixed-blocks`` on the rotated model (``rot+`` on every spec: R1 + R2 Hadamard rotations fused
#: into the weights, docs/rotations.md), the default (:data:`DEFAULT_ENCODINGS`) since 2026-11-27. Measured at
#: ``--bpw 3.7`` on the default model (``benchmarks/heldout.py``, same windows as reports/schemes-heldout.md):
#: python-docs 1.215x, held-out shakespeare / gsm8k / mmlu 1.427x / 1.362x / 1.393x (worst 1.427x) against
#: ``mixed-blocks``' 1.279x / 1.890x / 1.592x / 1.661x (worst 1.890x); without GPTQ's range search 1.222x, worst 1.457x
#: (the same day). Every export takes it: GGUF and Core ML write the tied head untied (docs/export.md).
PRESETS["rot-mixed-blocks"] = ",".join(f"rot+{spec}" for spec in PRESETS["mixed-blocks"].split(","))
#: ``quick``: the default menu without the table refits (k-means tables, codes by error feedback) and without GPTQ's
#: range search, the candidates' most costly parts (each refit is a least-squares solve per table and a second
#: error-feedback pass; the search tries 80 grids per group); the quick start's menu. Until 2026-11-27 (fifth session)
#: it was ``mixed-blocks`` without them, unrotated (held-out worst 1.968x; README).
PRESETS["quick"] = PRESETS["rot-mixed-blocks"].replace("/refit=2", "").replace("/mse=true", "")

# DEFAULT_ENCODINGS (the menu when no --encodings, --scheme or --bits is given) is declared in qrecover.config.

_SHORT = {"pc": ("block_size", None), "sym": ("symmetric", True), "asym": ("symmetric", False)}
_SPEC_RE = re.compile(r"^(?:(?P<tf>[A-Za-z_][\w-]*(?:\+[A-Za-z_][\w-]*)*)\+)?(?P<scheme>[A-Za-z_][\w-]*):(?P<bits>[^/]*)(?P<opts>(?:/[^/]*)*)$")


@dataclass(frozen=True)
class Encoding:
    """One way to store one matrix: ``label`` (the spec as written), the scheme, all its parameters (defaults
    resolved), the bits, and the model-level transforms the spec names. Equality and hashing ignore ``label``."""

    label: str = field(compare=False)
    scheme: str
    params_json: str  # every config field, JSON with sorted keys (hashable)
    bits: int
    transforms: tuple[str, ...] = ()
    optional: bool = field(default=False, compare=False)  # from a preset: dropped silently where it fits no layer

    @property
    def params(self) -> dict[str, Any]:
        return json.loads(self.params_json)

    @property
    def quantizer(self):
        return get_quantizer(self.scheme, **self.params)

    @property
    def key(self) -> str:
        """Encodings with the same key share one ``quantize_many`` call (same scheme and parameters)."""
        return json.dumps([self.scheme, self.params_json])


def make_encoding(scheme: str, bits: int, params: dict[str, Any] | None = None, transforms: tuple[str, ...] = (),
                  label: str | None = None) -> Encoding:
    full = get_quantizer(scheme, **dict(params or {})).params  # every field resolved: equal storage, equal encoding
    enc = Encoding(label or "", scheme, json.dumps(full, sort_keys=True), int(bits), tuple(transforms))
    return dataclasses.replace(enc, label=label or format_encoding(enc))


def _value(text: str) -> Any:
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return text


def parse_encoding(text: str, defaults: dict[str, Any] | None = None, what: str = "--encodings") -> Encoding:
    """One spec (see the module docstring) -> :class:`Encoding`, validated against the registries."""
    spec = "".join(text.split())
    m = _SPEC_RE.match(spec)
    if not m:
        raise QRecoverError(f"{what}: {text!r} is not an encoding spec; write {GRAMMAR}")
    scheme = m["scheme"]
    if scheme not in _REGISTRY:
        raise QRecoverError(f"{what}: {text!r} names unknown scheme {scheme!r}; registered schemes: {quantizer_names()}")
    transforms = tuple(m["tf"].split("+")) if m["tf"] else ()
    for t in transforms:
        if t not in transform_names():
            raise QRecoverError(f"{what}: {text!r} names unknown transform {t!r}; registered transforms: {transform_names()}")
    if not re.fullmatch(r"\d+", m["bits"]):
        raise QRecoverError(f"{what}: {text!r} has bits {m['bits']!r}; write an integer width after the colon, e.g. {scheme}:4")
    bits = int(m["bits"])
    cls = _REGISTRY[scheme]
    fields = {f.name for f in dataclasses.fields(cls.Config)}
    params = {k: v for k, v in (defaults or {}).items() if k in fields}
    for opt in (m["opts"] or "").split("/")[1:]:
        if opt in _SHORT:
            key, val = _SHORT[opt]
        elif re.fullmatch(r"[gb]\d+", opt):
            key, val = {"g": "group_size", "b": "block_size"}[opt[0]], int(opt[1:])
        elif "=" in opt and opt.split("=", 1)[0]:
            key, raw = opt.split("=", 1)
            val = _value(raw)
        else:
            raise QRecoverError(f"{what}: {text!r} has option {opt!r}; options are gN, bN, pc, sym, asym or key=value")
        if key not in fields:
            raise QRecoverError(f"{what}: {text!r} sets {key!r}, which scheme {scheme!r} does not have; it takes {sorted(fields)}")
        params[key] = val
    try:
        q = get_quantizer(scheme, **params)
    except TypeError as e:  # a value the config rejects
        raise QRecoverError(f"{what}: {text!r}: {e}") from None
    if bits not in q.supported_bits:
        raise QRecoverError(f"{what}: {text!r}: scheme {scheme!r} does not support bits={bits}; choose from {list(q.supported_bits)}")
    return make_encoding(scheme, bits, params, transforms, label=spec)


def parse_params(items: list[str], what: str = "--scheme-param") -> dict[str, Any]:
    """``["key=value", ...]`` -> ``{key: value}`` (values as in specs: int, float, true/false, none, text)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip() or not raw.strip():
            raise QRecoverError(f"{what} {item!r} must be KEY=VALUE, e.g. {what} group_size=8")
        out[key.strip()] = _value(raw.strip())
    return out


def parse_encodings(text: str, defaults: dict[str, Any] | None = None, what: str = "--encodings") -> list[Encoding]:
    """A comma-separated list of specs or :data:`PRESETS` names -> encodings (duplicates dropped, order kept). ``defaults``: parameters
    applied to every spec whose scheme has that field (``--scheme-param``); a default no spec can take is an error."""
    parts = [(q, p.strip() in PRESETS) for p in text.split(",") if p.strip() for q in PRESETS.get(p.strip(), p).split(",")]
    if not parts:
        raise QRecoverError(f"{what} {text!r} names no encoding; write {GRAMMAR}")
    out: list[Encoding] = []
    for p, preset in parts:
        e = dataclasses.replace(parse_encoding(p, defaults, what), optional=preset)
        if e not in out:
            out.append(e)
    for k in defaults or {}:
        if not any(k in {f.name for f in dataclasses.fields(_REGISTRY[e.scheme].Config)} for e in out):
            raise QRecoverError(f"--scheme-param {k}: none of {what} {text!r} has a parameter {k!r}; drop it or pick a scheme that takes it")
    return out


def format_encoding(enc: Encoding) -> str:
    """The canonical spec of ``enc``: ``parse_encoding(format_encoding(e)) == e``."""
    opts = []
    for k, v in sorted(enc.params.items()):
        if k == "block_size" and v is None:
            opts.append("pc")
        elif k == "symmetric" and isinstance(v, bool):
            opts.append("sym" if v else "asym")
        elif k in ("group_size", "block_size") and isinstance(v, int) and not isinstance(v, bool):
            opts.append(f"{k[0]}{v}")
        else:
            opts.append(f"{k}={'none' if v is None else str(v).lower() if isinstance(v, bool) else v}")
    head = "".join(f"{t}+" for t in enc.transforms) + f"{enc.scheme}:{enc.bits}"
    return "/".join([head, *opts])


# --- the shorthands ------------------------------------------------------------------------------------------

#: ``--embedding-bits 4|8`` and the first part of ``auto``: the row-wise integer blocks and AFM's int8 that
#: qrecover has always offered. Every label is a spec that parses back to its encoding (tested).
LEGACY_EMBEDDING = [
    make_encoding("blockwise", 4, {"block_size": 128, "symmetric": False}, label="blockwise:4/b128/asym"),
    make_encoding("blockwise", 4, {"block_size": 64, "symmetric": False}, label="blockwise:4/b64/asym"),
    make_encoding("blockwise", 4, {"block_size": 32, "symmetric": False}, label="blockwise:4/b32/asym"),
    make_encoding("blockwise", 8, {"block_size": None, "symmetric": True}, label="blockwise:8/pc"),
]

#: added to ``auto``: lower widths for models whose embedding is a large share of the weights, per-row look-up
#: tables (one table per token row, so unrelated tokens never share one), and GPTQ on the matrix (with the output
#: head's Hessian when it is tied: measured on the default model, the embedding alone at 4-bit g32 gave held-out
#: perplexity 11.70 with GPTQ against 12.67 rounded to nearest, the original's 11.56; ``reports/embedding.md``).
EXTRA_EMBEDDING = [
    make_encoding("blockwise", 3, {"block_size": 32, "symmetric": False}, label="blockwise:3/b32/asym"),
    make_encoding("blockwise", 2, {"block_size": 32, "symmetric": False}, label="blockwise:2/b32/asym"),
    make_encoding("palettize", 4, {"group_size": 1, "error_feedback": False}, label="palettize:4/g1/error_feedback=false"),
    make_encoding("palettize", 3, {"group_size": 1, "error_feedback": False}, label="palettize:3/g1/error_feedback=false"),
    make_encoding("gptq", 4, {"group_size": 32, "symmetric": False, "act_order": False}, label="gptq:4/g32/act_order=false"),
    make_encoding("gptq", 3, {"group_size": 32, "symmetric": False, "act_order": False}, label="gptq:3/g32/act_order=false"),
]


def linear_encodings(scheme: str, bits: list[int], params: dict[str, Any], encodings: str | None) -> list[Encoding]:
    """The decoder linear layers' candidates: ``encodings`` (a spec list) if given, else ``scheme`` at every
    width of ``bits`` with ``params`` (``--scheme/--bits`` shorthand; labels ``scheme:bits`` as before)."""
    if encodings:
        return parse_encodings(encodings, params)
    q = get_quantizer(scheme, **params)  # unknown scheme / parameter: its own one-line error
    if bad := [b for b in bits if b not in q.supported_bits]:
        raise QRecoverError(f"--bits {','.join(map(str, bits))}: scheme {scheme!r} does not support {bad}; choose from {list(q.supported_bits)}")
    return [make_encoding(scheme, b, params, label=f"{scheme}:{b}") for b in sorted(bits)]


def embedding_encodings(mode: str, encodings: str | None, budgeted: bool) -> list[Encoding]:
    """The embedding's (and an untied output matrix's) candidates. ``encodings`` (a spec list) wins;
    else ``mode``: 'auto' = every legacy and extra encoding when the embedding is inside a budget (else
    AFM's int8: nothing to trade it against), '4' = the 4-bit blocks, '8' = int8 per channel,
    'legacy' = the four encodings of qrecover <= 0.x's auto."""
    if encodings:
        return parse_encodings(encodings, what="--embedding-encodings")
    if mode == "auto" and not budgeted:
        mode = "8"
    if mode == "auto":
        return LEGACY_EMBEDDING + EXTRA_EMBEDDING
    if mode == "legacy":
        return list(LEGACY_EMBEDDING)
    return [e for e in LEGACY_EMBEDDING if e.bits == int(mode)]


__all__ = ["Encoding", "GRAMMAR", "PRESETS", "parse_params", "LEGACY_EMBEDDING", "EXTRA_EMBEDDING", "embedding_encodings", "format_encoding",
           "linear_encodings", "make_encoding", "parse_encoding", "parse_encodings"]

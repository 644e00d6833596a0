"""GGUF export (llama.cpp), written with the ``gguf`` library's :class:`gguf.GGUFWriter` and ``gguf.quants``.

Which GGUF type holds which qrecover layer (blocks of 32 inputs; ``B`` the layer's block, a multiple of 32;
a per-channel layer is one block of ``I``):

- integer 4-bit symmetric, ``w = s * (q - 8)``: **Q4_0** is ``d * (q - 8)`` -- exact (``d = s``, the same codes).
- integer 4-bit asymmetric, ``w = s * (q - zp)``: **Q4_1** is ``d * q + m`` with fp16 ``d``, ``m``: ``d = s``,
  the same codes, ``m = -s * zp``. Exact for a block iff ``-s * zp`` is an fp16 number (it needs up to 15
  significant bits, fp16 has 11); otherwise ``m`` is rounded to fp16, an error of at most half an fp16 ulp of
  ``|m|`` on every weight of the block. The count of exact blocks and the measured error are reported.
- integer 8-bit symmetric, ``w = s * (q - 128)``: **Q8_0** is ``d * int8`` -- exact (``d = s`` repeated in
  every block of 32 of the row, ``int8 = q - 128``).
- everything else (palettized look-up tables, 2/3-bit and 8-bit asymmetric integers, blocks not a multiple of
  32): dequantized and re-quantized by ``gguf.quants`` to the smallest of Q4_1 / Q5_1 / Q8_0 with at least the
  layer's bits (a palettized layer: one bit more, since a uniform grid needs more levels than a learned
  table). The measured relative error of every such layer and the total are reported.

The exact types' blocks are assembled from qrecover's own codes and scales (``gguf.quants`` quantizes only
from floats, which would re-round); each is checked after writing against ``gguf.quants.dequantize``.
Norms and other 16-bit tensors (biases) are written as F32 (exact). A tied output projection is not written
(llama.cpp and transformers use ``token_embd``). A ``rot+`` checkpoint with a tied head, whose final norm runs
un-rotated at load (an online transform GGUF cannot hold), is written untied: ``output.weight = E R1^T diag(g) R1``
quantized by ``gguf.quants`` to Q8_0 (:data:`HEAD_TYPE`), the final norm the identity (:func:`.common.untied_head`;
a second vocabulary matrix, its bytes and error reported as ``untied_head``).

Architectures (:data:`ARCHS`): Llama and Mistral as llama.cpp's ``llama`` (q/k rows and biases permuted as
llama.cpp's converter does, transformers' GGUF loader undoes it); Qwen2 as ``qwen2`` (q/k/v biases, NeoX rotary:
no permutation); Gemma-2 / Gemma-3 text as ``gemma2`` / ``gemma3``: their RMSNorms compute ``x * (1 + w)`` and
llama.cpp multiplies by the stored weight, so every ``*norm.weight`` (q/k norms included) is written as
``1 + w`` in float32 (as llama.cpp's converter does; transformers' loader subtracts 1), head size as
``attention.key_length``, the sliding window, and Gemma-2's attention / final logit soft-capping. Other
architectures are refused by name.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import QRecoverError
from .common import Checkpoint, integer_layout, relative_error, untied_head

GGUF_FILE = "model.gguf"
ADAPTER_GGUF = "adapter.gguf"
_QK = 32


@dataclass(frozen=True)
class GGUFArch:
    """How one transformers architecture is written as a llama.cpp architecture.

    ``gguf``: llama.cpp's architecture name (``general.architecture``, the key prefix); ``model_arch``: the
    ``gguf.MODEL_ARCH`` member whose tensor-name map names the tensors; ``permute_qk``: q/k rows (and biases)
    reordered for llama.cpp's interleaved rotary embedding (Llama's converter does it, the NeoX-rotary
    families do not); ``norm_plus_one``: RMSNorm weights stored as ``1 + w`` (Gemma's ``x * (1 + w)`` norms:
    llama.cpp multiplies by the stored weight); ``softcap``: writes Gemma-2's attention/final logit soft-capping.
    """

    gguf: str
    model_arch: str
    permute_qk: bool = False
    norm_plus_one: bool = False
    softcap: bool = False


#: transformers architecture -> GGUF. Mistral is llama.cpp's ``llama`` architecture (as its converter writes it).
ARCHS = {
    "LlamaForCausalLM": GGUFArch("llama", "LLAMA", permute_qk=True),
    "MistralForCausalLM": GGUFArch("llama", "LLAMA", permute_qk=True),
    "Qwen2ForCausalLM": GGUFArch("qwen2", "QWEN2"),
    "Gemma2ForCausalLM": GGUFArch("gemma2", "GEMMA2", norm_plus_one=True, softcap=True),
    "Gemma3ForCausalLM": GGUFArch("gemma3", "GEMMA3", norm_plus_one=True),
}
SUPPORTED_ARCH = {k: v.gguf for k, v in ARCHS.items()}


def _gguf():
    import gguf  # a core dependency; imported here to keep `import qrecover` light

    return gguf


def row_permutation(name: str, out_f: int, n_head: int, n_kv: int) -> np.ndarray | None:
    """llama.cpp's q/k row order for Llama (rotary halves interleaved): an index array ``(out_f,)`` or None.
    ``name``: the layer's name (or its bias's: ``...q_proj.bias``)."""
    name = name.removesuffix(".bias").removesuffix(".weight")
    if name.endswith("self_attn.q_proj"):
        h = n_head
    elif name.endswith("self_attn.k_proj"):
        h = n_kv
    else:
        return None
    idx = np.arange(out_f)
    return idx.reshape(h, 2, out_f // h // 2).swapaxes(1, 2).reshape(out_f)


def encode_q4(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> np.ndarray:
    """Q4_0 (``m`` None) or Q4_1 blocks from 4-bit codes ``(O, I)`` and per-32 fp16 ``d``, ``m`` ``(O, I/32)``.

    Block bytes: ``d`` fp16, [``m`` fp16,] 16 bytes with code ``j`` in the low and ``j + 16`` in the high nibble.
    Returns uint8 ``(O, I / 32 * type_size)``.
    """
    o, i = codes.shape
    q = codes.numpy().astype(np.uint8).reshape(o, i // _QK, _QK)
    qs = q[..., :16] | (q[..., 16:] << np.uint8(4))
    parts = [d.numpy().astype(np.float16).view(np.uint8).reshape(o, i // _QK, 2)]
    if m is not None:
        parts.append(m.numpy().astype(np.float16).view(np.uint8).reshape(o, i // _QK, 2))
    return np.concatenate([*parts, qs], axis=-1).reshape(o, -1)


def encode_q8_0(values: torch.Tensor, d: torch.Tensor) -> np.ndarray:
    """Q8_0 blocks from int8 values ``(O, I)`` and per-32 fp16 ``d`` ``(O, I/32)``: uint8 ``(O, I / 32 * 34)``."""
    o, i = values.shape
    x = values.numpy().astype(np.int8).view(np.uint8).reshape(o, i // _QK, _QK)
    dd = d.numpy().astype(np.float16).view(np.uint8).reshape(o, i // _QK, 2)
    return np.concatenate([dd, x], axis=-1).reshape(o, -1)


def lossy_type(qw, layout) -> Any:
    """The GGUF type a layer is re-quantized to: the smallest of Q4_1/Q5_1/Q8_0 with enough bits."""
    t = _gguf().GGMLQuantizationType
    need = qw.bits + (1 if layout is None and "lut" in qw.tensors else 0)
    for bits, qt in ((4, t.Q4_1), (5, t.Q5_1), (8, t.Q8_0)):
        if need <= bits:
            return qt
    return t.Q8_0


def map_layer(qw) -> dict[str, Any]:
    """How one layer is written: ``{type, exact, data (O, row bytes) uint8, rel_error, note, exact_blocks}``."""
    gguf = _gguf()
    t = gguf.GGMLQuantizationType
    lay = integer_layout(qw)
    if lay is not None and lay.block % _QK == 0:
        rep = lay.block // _QK
        s = lay.scale.repeat_interleave(rep, dim=1)
        zp = lay.zero_point.repeat_interleave(rep, dim=1)
        if lay.bits == 4 and lay.symmetric:
            return {"type": t.Q4_0, "exact": True, "data": encode_q4(lay.codes, s, None), "rel_error": 0.0,
                    "note": "integer 4-bit symmetric = Q4_0 (same codes and scales)"}
        if lay.bits == 8 and lay.symmetric:
            vals = lay.codes.to(torch.int16) - 128
            return {"type": t.Q8_0, "exact": True, "data": encode_q8_0(vals, s), "rel_error": 0.0,
                    "note": "integer 8-bit symmetric = Q8_0 (row scale repeated per block of 32)"}
        if lay.bits == 4:
            # two encodings hold the same values: (d, q, m) = (s, q, -s*zp) or (-s, 15 - q, s*(15 - zp)); per
            # block the one whose m is an fp16 number is exact (m needs up to 15 significant bits)
            sf, zf = s.float(), zp.float()
            m_a, m_b = -(sf * zf), sf * (15.0 - zf)  # exact in float32
            ok_a, ok_b = m_a.half().float() == m_a, m_b.half().float() == m_b
            flip = ~ok_a & ok_b
            d = torch.where(flip, -sf, sf).half()
            m16 = torch.where(flip, m_b, m_a).half()
            codes = torch.where(flip.repeat_interleave(_QK, dim=1), 15 - lay.codes, lay.codes)
            exact_blocks, n_blocks = int((ok_a | ok_b).sum()), m_a.numel()
            return {"type": t.Q4_1, "exact": exact_blocks == n_blocks, "data": encode_q4(codes, d, m16),
                    "exact_blocks": [exact_blocks, n_blocks],
                    "note": f"integer 4-bit asymmetric -> Q4_1 (same codes and scales; m = -scale*zp, or the mirrored "
                            f"codes with m = scale*(15-zp)): {exact_blocks}/{n_blocks} blocks exact, the rest with m "
                            "rounded to fp16"}
    dense = qw.dequantize(torch.float32)
    qt = lossy_type(qw, lay)
    data = gguf.quants.quantize(dense.numpy(), qt)
    what = "palettized" if "lut" in qw.tensors else f"{qw.scheme} {qw.bits}-bit"
    return {"type": qt, "exact": False, "data": data, "note": f"{what} has no exact GGUF type: re-quantized to {qt.name}"}


def _rope_theta(cfg) -> float:
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    return float(theta)


def _source_pre(ckpt: Checkpoint) -> str:
    """``tokenizer.ggml.pre`` of the GGUF the checkpoint was compressed from, when it came from one; else 'default'."""
    gguf = _gguf()
    src = Path(ckpt.manifest.get("source", {}).get("path") or "")
    cands = [src] if src.suffix == ".gguf" else []
    if (src / "SOURCE.json").is_file():
        cands.append(Path(json.loads((src / "SOURCE.json").read_text()).get("gguf", "")))
    for c in cands:
        if c.is_file():
            field = gguf.GGUFReader(str(c)).fields.get("tokenizer.ggml.pre")
            if field is not None:
                return str(field.contents())
    return "default"


def is_byte_level_bpe(tokenizer_json: dict[str, Any]) -> bool:
    """True for a GPT-2 style tokenizer.json: a BPE model behind a ByteLevel pre-tokenizer (alone or in a
    Sequence). A SentencePiece-style BPE (Metaspace '▁', byte fallback) is a BPE too, but llama.cpp reads it
    as another vocabulary type ('llama'): written as 'gpt2' it would tokenize wrongly."""
    if tokenizer_json.get("model", {}).get("type") != "BPE":
        return False
    pre = tokenizer_json.get("pre_tokenizer") or {}
    parts = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    return any(p.get("type") == "ByteLevel" for p in parts if isinstance(p, dict))


def add_tokenizer(writer, ckpt: Checkpoint, vocab_size: int) -> dict[str, Any]:
    """Tokens, types, merges, special ids and chat template, as llama.cpp's converter writes a GPT-2 BPE vocabulary."""
    gguf = _gguf()
    from transformers import AutoTokenizer

    tj = ckpt.path / "tokenizer.json"
    if not tj.is_file() or not is_byte_level_bpe(json.loads(tj.read_text())):
        raise QRecoverError(f"{ckpt.path} has no byte-level BPE tokenizer.json: GGUF export writes GPT-2 style BPE "
                            "vocabularies only (SentencePiece-style tokenizers, e.g. Mistral's and Gemma's, with a "
                            "'▁' Metaspace, are not supported yet); use --format compressed-tensors")
    tok = AutoTokenizer.from_pretrained(ckpt.path)
    added = {i: a for i, a in tok.added_tokens_decoder.items()}
    tokens, types = [], []
    for i in range(vocab_size):
        if i < len(tok):
            tokens.append(tok.convert_ids_to_tokens(i))
            types.append(gguf.TokenType.CONTROL if i in added and added[i].special else
                         gguf.TokenType.USER_DEFINED if i in added else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    pre = _source_pre(ckpt)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = gguf.SpecialVocab(ckpt.path, load_merges=True, n_vocab=vocab_size)
    special.add_to_gguf(writer, quiet=True)
    template = special.chat_template
    if template is None and getattr(tok, "chat_template", None):
        template = tok.chat_template
        writer.add_chat_template(template)
    return {"tokens": len(tokens), "merges": len(special.merges), "pre": pre, "chat_template": template is not None}


def arch_of(ckpt: Checkpoint) -> GGUFArch:
    """The checkpoint's :class:`GGUFArch`; a one-line error naming the supported architectures otherwise."""
    arch = ckpt.manifest.get("architecture")
    if arch not in ARCHS:
        raise QRecoverError(f"GGUF export supports {', '.join(ARCHS)}; {str(ckpt.path)!r} is {arch!r}. "
                            "Use --format compressed-tensors")
    return ARCHS[arch]


def _arch_config(ckpt: Checkpoint):
    from transformers import AutoConfig

    return arch_of(ckpt), AutoConfig.from_pretrained(ckpt.path)


def _heads(cfg) -> tuple[int, int, int]:
    n_head = cfg.num_attention_heads
    n_kv = getattr(cfg, "num_key_value_heads", None) or n_head
    return n_head, n_kv, getattr(cfg, "head_dim", None) or cfg.hidden_size // n_head


def remainder_tensor(name: str, value: torch.Tensor, arch: GGUFArch, n_head: int, n_kv: int) -> np.ndarray:
    """A 16-bit tensor (norm, bias) as the F32 array llama.cpp expects: Gemma's norms as ``1 + w``, q/k biases in
    the permuted row order of a ``permute_qk`` architecture."""
    v = value.float()
    if arch.norm_plus_one and name.endswith("norm.weight"):
        v = v + 1.0  # float32: within float32 rounding of 1 + w (w was fp16)
    if arch.permute_qk and name.endswith(".bias") and (perm := row_permutation(name, v.shape[0], n_head, n_kv)) is not None:
        v = v[torch.from_numpy(perm)]
    return v.numpy()


def _add_model_keys(writer: Any, gguf: Any, ckpt: Checkpoint, arch: GGUFArch, cfg: Any) -> None:
    """The model's metadata keys llama.cpp reads: its name, shape, attention heads, RoPE, norm epsilon, sliding
    window and soft-capping (where the architecture has them), vocabulary size."""
    n_head, n_kv, head_dim = _heads(cfg)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(Path(ckpt.manifest.get("source", {}).get("name") or ckpt.path.name).name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_freq_base(_rope_theta(cfg))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    if head_dim != cfg.hidden_size // n_head or arch.norm_plus_one:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    if getattr(cfg, "sliding_window", None) and arch.gguf != "llama":
        writer.add_sliding_window(cfg.sliding_window)
    if arch.softcap:
        if cfg.attn_logit_softcapping is not None:
            writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        if cfg.final_logit_softcapping is not None:
            writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    writer.add_vocab_size(cfg.vocab_size)


def export_gguf(ckpt: Checkpoint, tmp: Path, log) -> dict[str, Any]:
    """Write ``tmp/model.gguf``; return the per-layer report."""
    gguf = _gguf()
    t0 = time.time()
    arch, cfg = _arch_config(ckpt)
    n_head, n_kv, _ = _heads(cfg)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.model_arch), cfg.num_hidden_layers)

    def gname(hf: str) -> str:
        base, _, suffix = hf.rpartition(".")
        mapped = names.get_name(base)
        if mapped is None:
            raise QRecoverError(f"tensor {hf!r} has no GGUF name for a {arch.gguf} model; this checkpoint cannot be "
                                "exported to GGUF")
        return f"{mapped}.{suffix}"

    writer = gguf.GGUFWriter(str(tmp / GGUF_FILE), arch.gguf)
    _add_model_keys(writer, gguf, ckpt, arch, cfg)
    tokenizer = add_tokenizer(writer, ckpt, cfg.vocab_size)

    layers: dict[str, Any] = {}
    counts: dict[str, int] = {}
    err_num = err_den = 0.0
    for name, qw in ckpt.layers.items():
        m = map_layer(qw)
        data = m["data"]
        perm = row_permutation(name, qw.shape[0], n_head, n_kv) if arch.permute_qk else None
        if perm is not None:
            data = data[perm]
        gn = gname(f"{name}.weight")
        writer.add_tensor(gn, np.ascontiguousarray(data), raw_dtype=m["type"])
        # what a reader gets back, in the checkpoint's row order, against the checkpoint's weight
        back = torch.from_numpy(gguf.quants.dequantize(m["data"], m["type"]).copy())
        ref = qw.dequantize(torch.float32)
        rel = relative_error(back, ref)
        if m["exact"] and not torch.equal(back, ref):
            raise QRecoverError(f"internal error: {name} was mapped exactly to {m['type'].name} but does not read back equal")
        err_num += float((back.double() - ref.double()).pow(2).sum())
        err_den += float(ref.double().pow(2).sum())
        counts[m["type"].name] = counts.get(m["type"].name, 0) + qw.numel
        layers[name] = {"gguf": gn, "type": m["type"].name, "exact": m["exact"], "rel_error": rel, "note": m["note"],
                        **({"exact_blocks": m["exact_blocks"]} if "exact_blocks" in m else {})}
        blocks = f" ({m['exact_blocks'][0]}/{m['exact_blocks'][1]} blocks exact)" if "exact_blocks" in m else ""
        log(f"  {name:<40} -> {gn:<26} {m['type'].name:<5} {'exact' if m['exact'] else f'rel. error {rel:.2e}'}{blocks}")
    remainder, untied = dict(ckpt.remainder), _untied_head(ckpt, gguf, arch)
    if untied is not None:
        data, info, norm, w_norm = untied
        writer.add_tensor(gname("lm_head.weight"), data, raw_dtype=getattr(gguf.GGMLQuantizationType, info["type"]))
        counts[info["type"]] = counts.get(info["type"], 0) + info["values"]
        remainder[f"{norm}.weight"] = w_norm
        log(f"  the tied head's final-norm rotation folded into an untied head: {info['values']:,} values as "
            f"{info['type']} ({info['bytes']:,} bytes), rel. error {info['rel_error']:.2e}")
    for k, v in remainder.items():
        writer.add_tensor(gname(k), remainder_tensor(k, v, arch, n_head, n_kv))
    main = max(counts, key=counts.get)
    ftype = {"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0, "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
             "Q5_1": gguf.LlamaFileType.MOSTLY_Q5_1, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[main]
    writer.add_file_type(ftype)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    total = (err_num / err_den) ** 0.5 if err_den else 0.0
    return {"file": GGUF_FILE, "layers": layers, "types": counts, "tokenizer": tokenizer,
            "exact_layers": sum(v["exact"] for v in layers.values()), "total_layers": len(layers),
            "total_rel_error": total, **({"untied_head": untied[1]} if untied is not None else {}),
            "seconds": round(time.time() - t0, 1)}


#: the GGUF type of a ``rot+`` checkpoint's untied head. llama.cpp's own quantizer keeps ``output.weight`` at Q6_K or
#: above; ``gguf.quants`` has no K-quant quantizer, so Q8_0. Measured on the default 3.7 bpw checkpoint (16 x 512 tokens
#: of python-docs, transformers' GGUF loader): checkpoint 15.12, GGUF with a Q8_0 head 16.30 in a 7.14 bpw file, with
#: the embedding's Q4_1 16.88 in 6.41 bpw (the rest of the gap: the re-quantized palettized and GPTQ layers).
HEAD_TYPE = "Q8_0"


def _untied_head(ckpt: Checkpoint, gguf: Any, arch: GGUFArch):
    """``(GGUF blocks, report, final norm, its new weight)`` of the untied head of a ``rot+`` checkpoint with a tied
    head (None for any other), in :data:`HEAD_TYPE`."""
    folded = untied_head(ckpt, 1.0 if arch.norm_plus_one else 0.0)
    if folded is None:
        return None
    norm, head, w_norm = folded
    qtype = getattr(gguf.GGMLQuantizationType, HEAD_TYPE)
    data = gguf.quants.quantize(head.numpy(), qtype)
    back = torch.from_numpy(gguf.quants.dequantize(data, qtype).copy())
    info = {"from": norm, "values": head.numel(), "type": qtype.name, "bytes": int(data.nbytes),
            "rel_error": relative_error(back, head)}
    return data, info, norm, w_norm


def export_gguf_adapter(adapter: Path, ckpt: Checkpoint, tmp: Path) -> dict[str, Any]:
    """A llama.cpp LoRA GGUF (``general.type = adapter``) of a PEFT adapter: ``<base tensor>.lora_a/.lora_b``."""
    gguf = _gguf()
    from safetensors import safe_open

    arch, cfg = _arch_config(ckpt)
    acfg = json.loads((adapter / "adapter_config.json").read_text())
    if acfg.get("use_rslora") or acfg.get("use_dora"):
        raise QRecoverError(f"adapter {str(adapter)!r} uses rsLoRA/DoRA, which llama.cpp's LoRA GGUF cannot express")
    n_head, n_kv, _ = _heads(cfg)
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.model_arch), cfg.num_hidden_layers)
    writer = gguf.GGUFWriter(str(tmp / ADAPTER_GGUF), arch.gguf)
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(acfg["lora_alpha"]))
    n = 0
    with safe_open(str(adapter / "adapter_model.safetensors"), framework="pt") as f:
        for k in sorted(f.keys()):
            layer = k.removeprefix("base_model.model.")
            for part, suffix in ((".lora_A.weight", "lora_a"), (".lora_B.weight", "lora_b")):
                if layer.endswith(part):
                    mod = layer[: -len(part)]
                    mapped = names.get_name(mod)
                    if mapped is None:
                        raise QRecoverError(f"adapter tensor {k!r} targets {mod!r}, which has no GGUF name")
                    t = f.get_tensor(k).float()
                    if suffix == "lora_b" and arch.permute_qk and (perm := row_permutation(mod, t.shape[0], n_head, n_kv)) is not None:
                        t = t[torch.from_numpy(perm)]
                    writer.add_tensor(f"{mapped}.weight.{suffix}", t.numpy().astype(np.float32))
                    n += 1
                    break
            else:
                raise QRecoverError(f"adapter tensor {k!r} is not a LoRA A/B matrix; llama.cpp LoRA GGUF holds only those")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"file": ADAPTER_GGUF, "tensors": n, "alpha": float(acfg["lora_alpha"]), "rank": int(acfg["r"])}

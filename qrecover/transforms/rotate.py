"""Rotations fused into the weights (QuaRot / SpinQuant's R1 and R2, with fixed randomised Hadamard matrices).

Row-vector convention (``y = x W^T``); ``R1 (H, H)`` and ``R2 (d, d)`` orthogonal (:mod:`.hadamard`).

R1 rotates the residual stream: every hidden state becomes ``x R1``. RMSNorm commutes with it
(``rms(x R1) = rms(x)``) once its scale ``g`` has left it, so:

- every RMSNorm's scale is folded into the weights that read it and the norm's weight becomes the identity
  (``1``; Gemma's ``(1 + w)`` norms: ``0``);
- readers of a norm (q/k/v or a fused qkv, gate/up or a fused gate_up, MoE routers and experts, a shared
  expert and its gate): ``W <- W diag(g) R1``;
- writers to the residual stream (``o_proj``, ``down_proj``, experts' ``down_proj``): ``W <- R1^T W``, a bias
  ``b <- R1^T b``;
- the embedding's rows: ``E <- E R1`` (a scalar embedding scale such as Gemma's ``sqrt(hidden)`` commutes);
- an untied head reads the final norm like any reader: ``W <- W diag(g) R1``, the final norm becomes the
  identity. A *tied* head is the embedding matrix ``E R1`` and cannot also hold ``diag(g)``: the final norm
  keeps its weight and runs un-rotated, ``norm(x R1^T) R1`` (two ``H x H`` products per token at the last
  position of the stack, registered as forward hooks on the final norm; ``qrecover.load`` re-attaches them from
  the manifest's ``online`` entry). The reference implementations untie the head instead, which stores a
  second vocabulary matrix (on the default model 28M parameters, 21% of the model).

R2 rotates each attention head's values: ``v_proj``'s rows of every key/value head ``W_v <- R2^T W_v`` (and its
bias), ``o_proj``'s columns of every query head ``W_o <- W_o R2``. Attention mixes value vectors across
positions, never across a head's channels, so grouped-query attention shares one ``R2`` per layer. q/k norms
(Qwen3) sit on queries and keys only: R2 never crosses them (R3, which would, is not built).

Architectures: pre-norm decoder layers with RMSNorm (:data:`SUPPORTED`). Refused with one line before any
work: LayerNorm (mean subtraction does not commute with a rotation), norms after the attention/MLP output
(Gemma-2/3, OLMo-2: the norm's scale sits between a writer and the residual stream), and anything else not
listed. The transform needs no calibration data.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.nn as nn

from ..errors import QRecoverError
from ..models import decoder_layers, resident
from .base import Transform, register_transform
from .hadamard import factors, rotation
from .online_r4 import OnlineInputRotation

#: decoder-layer class -> the norm's weight offset (Gemma's RMSNorm multiplies by ``1 + w``)
SUPPORTED = {c: 0.0 for c in ("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer",
                              "SmolLM3DecoderLayer", "GraniteDecoderLayer", "Phi3DecoderLayer", "MixtralDecoderLayer",
                              "Qwen2MoeDecoderLayer", "Qwen3MoeDecoderLayer")} | {"GemmaDecoderLayer": 1.0}
WHY_NOT = {"Gemma2DecoderLayer": "norms after the attention and MLP outputs", "Gemma3DecoderLayer": "norms after the attention and MLP outputs",
           "Olmo2DecoderLayer": "norms after the attention and MLP outputs", "CohereDecoderLayer": "LayerNorm (mean subtraction)",
           "PhiDecoderLayer": "LayerNorm with bias", "StableLmDecoderLayer": "LayerNorm with bias",
           "GPTNeoXLayer": "LayerNorm with bias", "Starcoder2DecoderLayer": "LayerNorm with bias"}
WRITERS = ("o_proj", "down_proj")  # modules (or fused expert tensors) whose output is added to the residual stream
_SEED_R1, _SEED_R2 = 0, 1000


def _check_norm(name: str, norm: nn.Module) -> None:
    params = dict(norm.named_parameters())
    if "RMSNorm" not in type(norm).__name__ or set(params) != {"weight"}:
        raise QRecoverError(f"rot cannot fold {name} ({type(norm).__name__}): only RMSNorm without bias commutes with a "
                            "rotation; drop rot+ from --encodings")


def check_model(model: nn.Module) -> None:
    """QRecoverError (one line) unless every decoder layer, the final norm and the embedding can take R1/R2."""
    for layer in decoder_layers(model):
        cls = type(layer).__name__
        if cls not in SUPPORTED:
            why = f" ({WHY_NOT[cls]} do not commute with a rotation)" if cls in WHY_NOT else ""
            raise QRecoverError(f"rot cannot fold {cls}{why}; supported: {sorted(SUPPORTED)}; drop rot+ from --encodings")
        for n in ("input_layernorm", "post_attention_layernorm"):
            _check_norm(n, getattr(layer, n))
    _check_norm("the final norm", final_norm(model))
    if not isinstance(model.get_input_embeddings(), nn.Embedding):
        raise QRecoverError(f"rot cannot rotate {type(model.get_input_embeddings()).__name__} (not an nn.Embedding); "
                            "drop rot+ from --encodings")


def final_norm(model: nn.Module) -> nn.Module:
    norm = getattr(model.get_decoder(), "norm", None)
    if not isinstance(norm, nn.Module):
        raise QRecoverError(f"rot cannot find the final norm of {type(model).__name__} (get_decoder().norm); drop rot+ from --encodings")
    return norm


def _set(p: torch.Tensor, value: torch.Tensor) -> None:
    p.data.copy_(value.to(p.dtype))


def fold_r1_layer(layer: nn.Module, r1: torch.Tensor, offset: float) -> dict[str, list[str]]:
    """R1 in one decoder layer (norm scales folded); ``r1 (H, H)`` float64. Returns the parameters changed."""
    H = r1.shape[0]
    r1 = r1.to(layer.input_layernorm.weight.device)
    done: dict[str, list[str]] = {"readers": [], "writers": []}
    for norm_name, block in (("input_layernorm", layer.self_attn), ("post_attention_layernorm", layer.mlp)):
        norm = getattr(layer, norm_name)
        g = norm.weight.detach().double() + offset
        block_name = "self_attn" if block is layer.self_attn else "mlp"
        for name, p in block.named_parameters():
            full = f"{block_name}.{name}"
            if name.removesuffix(".weight").removesuffix(".bias").rpartition(".")[2] in WRITERS:
                # weight (H, X), fused experts (E, H, I) or bias (H,): the output side
                _set(p, r1.T @ p.detach().double())
                done["writers"].append(full)
            elif p.dim() >= 2 and p.shape[-1] == H:  # reads the norm: (O, H) or fused experts (E, 2I, H)
                _set(p, (p.detach().double() * g) @ r1)
                done["readers"].append(full)
        norm.weight.data.fill_(1.0 - offset)
    return done


def fold_r2_layer(layer: nn.Module, r2: torch.Tensor, n_kv: int) -> dict[str, Any]:
    """R2 between ``v_proj`` (or a fused qkv's last rows) and ``o_proj``; ``r2 (d, d)`` float64, ``n_kv``
    key/value heads."""
    attn, d = layer.self_attn, r2.shape[0]
    o = attn.o_proj
    if o.in_features % d:
        return {"skipped": f"o_proj has {o.in_features} inputs, not a multiple of head_dim {d}"}
    r2 = r2.to(o.weight.device)
    v = attn.v_proj if hasattr(attn, "v_proj") else attn.qkv_proj
    rows = slice(v.out_features - n_kv * d, v.out_features)  # v_proj: all rows; fused qkv: the last n_kv heads
    wv = v.weight.detach().double()[rows].view(n_kv, d, -1)
    v.weight.data[rows] = (r2.T @ wv).reshape(n_kv * d, -1).to(v.weight.dtype)
    if v.bias is not None:
        v.bias.data[rows] = (v.bias.detach().double()[rows].view(n_kv, d) @ r2).reshape(-1).to(v.bias.dtype)
    wo = o.weight.detach().double().view(o.out_features, -1, d)
    _set(o.weight, (wo @ r2).reshape(o.out_features, -1))
    return {"v": "v_proj" if hasattr(attn, "v_proj") else "qkv_proj (last rows)", "heads": o.in_features // d, "kv_heads": n_kv}


def head_dim(layer: nn.Module, config) -> int:
    return int(getattr(layer.self_attn, "head_dim", None) or config.hidden_size // config.num_attention_heads)


class OnlineRotation:
    """``module(x R^T) R`` as forward hooks on ``module`` (a tied head's final norm); ``r (H, H)``."""

    def __init__(self, module: nn.Module, r: torch.Tensor):
        self.r = r.to(torch.float32)
        self._copies: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self.handles = [module.register_forward_pre_hook(self._pre), module.register_forward_hook(self._post)]

    def _on(self, x: torch.Tensor) -> torch.Tensor:
        """``r`` on ``x``'s device in its dtype, copied once: no host-to-device copy per token (and none inside a
        captured CUDA graph after the first call)."""
        key = (x.device, x.dtype)
        if key not in self._copies:
            self._copies[key] = self.r.to(x.device, x.dtype)
        return self._copies[key]

    def _pre(self, _m, args):
        x = args[0]
        return (x @ self._on(x).T, *args[1:])

    def _post(self, _m, _args, y):
        return y @ self._on(y)


def attach_online(model: nn.Module, online: dict[str, Any] | None) -> None:
    """Re-attach a checkpoint's online rotations (the manifest's ``transforms.online``) to a loaded model: a module's
    input (``side: input``, r4's :class:`~.online_r4.OnlineInputRotation`) or both sides (:class:`OnlineRotation`)."""
    for module_name, spec in (online or {}).items():
        module = model.get_submodule(module_name)
        if spec.get("side") == "input":
            OnlineInputRotation(module, spec)
        else:
            OnlineRotation(module, rotation(spec["size"], spec["kind"], spec["seed"]))


class Rotate(Transform):
    """R1 (and R2 when ``r2``) with rotations of ``kind`` (:mod:`.hadamard`); see the module docstring."""

    model_level = True
    kind: ClassVar[str] = "hadamard"
    r1: ClassVar[bool] = True
    r2: ClassVar[bool] = True

    def check(self, model: nn.Module) -> None:
        check_model(model)
        if self.kind == "hadamard":  # the sizes a Hadamard matrix is built for (block and random take any size)
            sizes = ([model.get_input_embeddings().weight.shape[1]] if self.r1 else []) + \
                ([head_dim(decoder_layers(model)[0], model.config)] if self.r2 else [])
            for n in sizes:
                if factors(n) is None:
                    raise QRecoverError(f"{self.name} needs a Hadamard matrix of order {n}, which cannot be built here (orders: "
                                        "1, 2, a power of two times Paley orders); use rot-block+ or rot-random+ in --encodings")

    @torch.no_grad()
    def apply_model(self, model: nn.Module, device: torch.device | str) -> dict[str, Any]:
        check_model(model)
        H = model.get_input_embeddings().weight.shape[1]
        r1 = rotation(H, self.kind, _SEED_R1)
        layers, summary, cfg = decoder_layers(model), [], model.config
        for i, layer in enumerate(layers):
            with resident(model, layer, device, keep=True):
                entry: dict[str, Any] = fold_r1_layer(layer, r1, SUPPORTED[type(layer).__name__]) if self.r1 else {}
                if self.r2:
                    n_kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
                    entry["r2"] = fold_r2_layer(layer, rotation(head_dim(layer, cfg), self.kind, _SEED_R2 + i), n_kv)
                summary.append(entry)
        ends = self._rotate_ends(model, r1, SUPPORTED[type(layers[0]).__name__]) if self.r1 else {"tied_head": None, "online": {}}
        return {"kind": self.kind, "r1": H if self.r1 else None, "r2": head_dim(layers[0], cfg) if self.r2 else None,
                **ends, "layers": summary}

    def _rotate_ends(self, model: nn.Module, r1: torch.Tensor, offset: float) -> dict[str, Any]:
        """R1 on the embedding's rows and the head's input (the final norm folded, or run online for a tied head)."""
        emb, head, norm = model.get_input_embeddings(), model.get_output_embeddings(), final_norm(model)
        tied = head is not None and head.weight is emb.weight
        _set(emb.weight, emb.weight.detach().double() @ r1.to(emb.weight.device))
        online: dict[str, Any] = {}
        if tied:
            OnlineRotation(norm, r1)
            online[next(n for n, m in model.named_modules() if m is norm)] = {
                "size": r1.shape[0], "kind": self.kind, "seed": _SEED_R1, "why": "tied head: the final norm runs un-rotated"}
        elif head is not None:
            g = norm.weight.detach().double() + offset
            _set(head.weight, (head.weight.detach().double() * g) @ r1.to(head.weight.device))
            norm.weight.data.fill_(1.0 - offset)
        return {"tied_head": tied, "online": online}


@register_transform
class RotHadamard(Rotate):
    """``rot``: R1 + R2, randomised Hadamard matrices (Kronecker products of Sylvester and Paley orders)."""

    name = "rot"


@register_transform
class RotBlock(Rotate):
    """``rot-block``: R1 + R2, block-diagonal randomised Hadamard (blocks of the largest power of two dividing the size)."""

    name, kind = "rot-block", "block"


@register_transform
class RotRandom(Rotate):
    """``rot-random``: R1 + R2, seeded random orthogonal matrices."""

    name, kind = "rot-random", "random"


@register_transform
class RotR1(Rotate):
    """``rot1``: R1 only (randomised Hadamard), to measure what R2 adds."""

    name, r2 = "rot1", False


@register_transform
class RotR2(Rotate):
    """``rot2``: R2 only (randomised Hadamard per head): the residual stream and the norms are left as they are."""

    name, r1 = "rot2", False


__all__ = ["OnlineRotation", "Rotate", "SUPPORTED", "attach_online", "check_model", "fold_r1_layer", "fold_r2_layer"]

"""Mixture-of-experts models: fused expert tensors become one ``nn.Linear`` pair per expert.

transformers 5 stores a MoE block's experts as two 3-D parameters, ``gate_up_proj (E, 2I, H)`` and
``down_proj (E, H, I)``, read by index in the experts module's forward. qrecover quantizes ``nn.Linear``
layers, so :func:`unfuse_experts` replaces such a module by :class:`UnfusedExperts`: the same call
(``hidden_states, top_k_index, top_k_weights``), the same arithmetic (the reference loop of transformers'
Mixtral experts: gate and up from one product, split in halves, ``act_fn(gate) * up``, down, weighted by the
router and summed in the same order), with the weights in ``experts.<e>.gate_up_proj`` / ``.down_proj``
linears. Every stage then treats an expert like any projection: calibration sees each expert's own routed
tokens (its own Hessian, as llm-compressor's MoE calibration and GPTQModel do), GPTQ/palettize/AWQ-free
schemes quantize it, the allocator gives it a width, LoRA adapters can target it.

Only modules whose forward this reproduces are converted: the two 3-D parameters and nothing else (no
biases, no interleaved gate/up as in GPT-OSS, no transposed layout as in Llama-4), and with real weights the
outputs of both modules are compared on random tokens routed to every expert (:func:`unfuse_experts`'s
``verify``): a module that does not match is left fused, and its tensors stay in 16 bits (reported by
``compress``). The model is unchanged as a function; a qrecover checkpoint records the converted modules
(manifest ``moe.unfused``) and :func:`qrecover.load` converts the same modules before it installs the
packed layers.

Routers (``mlp.gate``) are not experts: they stay in 16 bits (:func:`qrecover.models.is_router`).
"""

from __future__ import annotations

import re

import torch
from torch import nn

from .errors import QRecoverError

FUSED = ("down_proj", "gate_up_proj")
EXPERT = re.compile(r"^(?P<block>(?:.*\.)?experts)\.(?P<e>\d+)\.(?P<leaf>gate_up_proj|down_proj)$")


def is_fused_experts(module: nn.Module) -> bool:
    """True for a module holding exactly 3-D ``gate_up_proj (E, 2I, H)`` and ``down_proj (E, H, I)``
    parameters and an ``act_fn`` (transformers 5's fused experts layout), of consistent shapes."""
    params = dict(module.named_parameters(recurse=False))
    if tuple(sorted(params)) != FUSED or not hasattr(module, "act_fn"):
        return False
    gu, d = params["gate_up_proj"], params["down_proj"]
    return (gu.dim() == d.dim() == 3 and gu.shape[0] == d.shape[0] and gu.shape[1] == 2 * d.shape[2]
            and gu.shape[2] == d.shape[1])


class Expert(nn.Module):
    """One expert: ``gate_up_proj (2I, H)`` and ``down_proj (H, I)`` linears."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        super().__init__()
        self.gate_up_proj = nn.Linear(gate_up.shape[1], gate_up.shape[0], bias=False, device=gate_up.device, dtype=gate_up.dtype)
        self.down_proj = nn.Linear(down.shape[1], down.shape[0], bias=False, device=down.device, dtype=down.dtype)
        self.gate_up_proj.weight = nn.Parameter(gate_up.detach().clone(), requires_grad=gate_up.requires_grad)
        self.down_proj.weight = nn.Parameter(down.detach().clone(), requires_grad=down.requires_grad)


class UnfusedExperts(nn.Module):
    """The experts of one MoE block as ``nn.Linear`` pairs (children ``"0"`` ... ``"E-1"``); the forward of
    transformers' fused experts modules (Mixtral's reference loop)."""

    def __init__(self, fused: nn.Module):
        super().__init__()
        self.num_experts = fused.gate_up_proj.shape[0]
        self.act_fn = fused.act_fn
        for e in range(self.num_experts):
            self.add_module(str(e), Expert(fused.gate_up_proj[e], fused.down_proj[e]))

    def expert(self, e: int) -> Expert:
        return self._modules[str(e)]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden_states)
        for e in range(self.num_experts):
            top_k_pos, token_idx = torch.where(top_k_index.T == e)  # the fused loop's order: by rank, then token
            if token_idx.numel() == 0:
                continue
            expert = self.expert(e)
            gate, up = expert.gate_up_proj(hidden_states[token_idx]).chunk(2, dim=-1)
            h = expert.down_proj(self.act_fn(gate) * up) * top_k_weights[token_idx, top_k_pos, None]
            out.index_add_(0, token_idx, h.to(out.dtype))
        return out


@torch.no_grad()
def _same_function(fused: nn.Module, unfused: UnfusedExperts, seed: int = 0) -> bool:
    """Both modules on the same random tokens, every expert routed to: equal outputs (to float rounding)."""
    e, _, h = fused.gate_up_proj.shape
    gen = torch.Generator().manual_seed(seed)
    n, k = 2 * e, min(2, e)
    x = torch.randn(n, h, generator=gen).to(fused.gate_up_proj)
    idx = torch.stack([torch.arange(n) % e, (torch.arange(n) + 1) % e], 1)[:, :k].to(x.device)
    w = torch.rand(n, k, generator=gen).to(x)
    try:
        want = fused(x, idx, w)
    except Exception:  # another calling convention: not the layout this module reproduces
        return False
    got = unfused(x, idx, w)
    return bool(torch.isfinite(want).all()) and torch.allclose(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


def unfuse_experts(model: nn.Module, verify: bool = True, only: list[str] | None = None) -> list[str]:
    """Replace every fused experts module of ``model`` (or those named in ``only``) by :class:`UnfusedExperts`,
    in place; returns the converted modules' names. ``verify``: compare the two modules' outputs first and
    leave a module that differs fused (skipped on the meta device and for ``only``, a checkpoint's record)."""
    done = []
    for name, module in list(model.named_modules()):
        if (only is not None and name not in only) or not is_fused_experts(module):
            continue
        unfused = UnfusedExperts(module)
        if verify and only is None and module.gate_up_proj.device.type != "meta" and not _same_function(module, unfused):
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, unfused)
        done.append(name)
    missing = sorted(set(only or ()) - set(done))
    if missing:
        raise QRecoverError(f"the checkpoint's experts modules {missing[:3]} are not fused experts in this model's "
                            "architecture (another transformers version?); load it with the one it was compressed with")
    return done


def expert_key(name: str) -> tuple[str, str] | None:
    """``(experts block, leaf)`` of an expert linear's name (``...mlp.experts.3.down_proj`` ->
    ``("...mlp.experts", "down_proj")``), None for any other name."""
    m = EXPERT.match(name)
    return (m["block"], m["leaf"]) if m else None


__all__ = ["Expert", "UnfusedExperts", "expert_key", "is_fused_experts", "unfuse_experts"]

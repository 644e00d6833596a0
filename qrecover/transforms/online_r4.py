"""``r4``: QuaRot/SpinQuant's R4, an orthogonal rotation of every ``down_proj``'s input, half fused and half online.

``down_proj``'s weight ``W (H, I)`` becomes ``W R4`` (fused: the quantizers see rotated rows, whose outliers the
rotation spreads out), and its input ``x (..., I)`` becomes ``x R4`` at run time (online: a forward pre-hook), so
``(x R4)(W R4)^T = x W^T``: the model's function is unchanged. The activation between ``act(gate) * up`` and
``down_proj`` has no norm or residual to fold a rotation into, hence the online half. ``R4`` is the ``fwht`` kind
of :mod:`.hadamard` (a randomised Hadamard of order ``I`` built as ``H_p (x) H_b``, 1536 = 12 x 128), applied by
:func:`~.hadamard.rotate` in ``O(I (log b + p))`` per token: the torch reference, on CPU and CUDA (a fused
Triton kernel is not built yet).

It composes with ``rot`` (R1/R2 act on the hidden size and the heads, R4 on the MLP's intermediate size):
``rot+r4+gptq:3/g64``, or alone: ``r4+gptq:3/g64``. The checkpoint records it under the manifest's
``transforms.online`` (``side: input``), and :func:`qrecover.load` re-attaches it; it holds no weights and is
counted in no bpw. Export formats cannot carry it and refuse it (``qrecover export``). Models whose MLP has no
plain ``mlp.down_proj`` linear (mixtures of experts, fused MLPs) are refused before any work.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..errors import QRecoverError
from ..models import decoder_layers, module_name, resident
from .base import Transform, register_transform
from .hadamard import fast_factors, rotate

SEED_R4 = 2000


class OnlineInputRotation:
    """``module(x R)``: a forward pre-hook rotating ``module``'s first input by ``rotation(size, kind, seed)``."""

    def __init__(self, module: nn.Module, spec: dict[str, Any]):
        self.args = (int(spec["size"]), spec["kind"], int(spec["seed"]))
        self.handle = module.register_forward_pre_hook(self._pre)

    def _pre(self, _m, args):
        return (rotate(args[0], *self.args), *args[1:])


def _down_projs(model: nn.Module) -> list[nn.Module]:
    out = []
    for layer in decoder_layers(model):
        down = getattr(getattr(layer, "mlp", None), "down_proj", None)
        if not isinstance(down, nn.Linear):
            raise QRecoverError(f"r4 rotates the input of each decoder layer's mlp.down_proj online; {type(layer).__name__} has "
                                f"{'no mlp.down_proj' if down is None else type(down).__name__ + ' there'} (experts or a fused MLP): "
                                "drop r4+ from --encodings")
        out.append(down)
    return out


@register_transform
class R4(Transform):
    """``r4``: see the module docstring."""

    name = "r4"
    model_level = True
    kind = "fwht"

    def check(self, model: nn.Module) -> None:
        for down in _down_projs(model):
            fast_factors(down.in_features)

    @torch.no_grad()
    def apply_model(self, model: nn.Module, device: torch.device | str) -> dict[str, Any]:
        downs = _down_projs(model)
        size = downs[0].in_features
        spec = {"size": size, "kind": self.kind, "seed": SEED_R4, "side": "input", "why": "r4: down_proj's input"}
        online = {}
        for layer, down in zip(decoder_layers(model), downs):
            with resident(model, layer, device, keep=True):
                if down.in_features != size:
                    raise QRecoverError(f"r4 needs one intermediate size; {module_name(model, down)} has {down.in_features}, "
                                        f"the first layer {size}: drop r4+ from --encodings")
                down.weight.data.copy_(rotate(down.weight.detach().double(), size, self.kind, SEED_R4).to(down.weight.dtype))
            OnlineInputRotation(down, spec)
            online[module_name(model, down)] = dict(spec)
        return {"kind": self.kind, "r4": size, "online": online, "layers": len(downs)}


__all__ = ["R4", "OnlineInputRotation", "SEED_R4"]

"""Function-preserving model transforms applied before quantization (e.g. AWQ's activation-aware scaling).

A transform rescales a decoder layer's weights so that the model computes the same function but its
linear layers quantize with less damage. It is one class registered by name, like a quantizer:

- ``name``: how specs and the manifest refer to it (``awq`` in ``awq+gptq:4/g128``);
- ``check(model)``: raise :class:`~qrecover.errors.QRecoverError` naming the architecture and the supported
  ones when the transform cannot be applied (before any expensive work);
- ``apply_layer(layer, inputs, kwargs, quantize_fn)``: search and fold in place for one decoder layer,
  given that layer's calibration inputs (``inputs``: list of hidden states ``(1, seq, hidden)``, ``kwargs``:
  the matching keyword arguments the decoder layer is called with) and ``quantize_fn(name, weight) ->
  dequantized weight`` (the fake-quantization the search optimises for, supplied by the compress
  pipeline; ``name`` is the linear's name inside the layer). Returns a JSON-able summary for the manifest.

The compress pipeline calls ``apply_layer`` layer by layer, before it collects that layer's statistics, so
each layer is searched on inputs produced by the already transformed layers before it.

A transform with ``model_level = True`` (a rotation of the residual stream, which every layer reads and
writes) implements ``apply_model(model, device)`` instead: it needs no calibration data, runs before every
layer-wise transform, and returns the manifest's summary (including anything :func:`qrecover.load` must
re-attach, under ``"online"``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn as nn

from ..registry import Registry

QuantizeFn = Callable[[str, torch.Tensor], torch.Tensor]


class Transform:
    """Base class of function-preserving transforms; see the module docstring for the contract."""

    name: ClassVar[str]
    model_level: ClassVar[bool] = False

    def check(self, model: nn.Module) -> None:
        """Raise QRecoverError if this transform cannot be applied to ``model``."""

    def apply_layer(self, layer: nn.Module, inputs: list[torch.Tensor], kwargs: list[dict[str, Any]],
                    quantize_fn: QuantizeFn) -> dict[str, Any]:
        raise NotImplementedError

    def apply_model(self, model: nn.Module, device: torch.device | str) -> dict[str, Any]:
        raise NotImplementedError


_TRANSFORMS = Registry("transform", "transform")


def register_transform(cls: type[Transform]) -> type[Transform]:
    """Class decorator: make a transform available by its ``name``."""
    return _TRANSFORMS.register(cls)


def transform_names() -> list[str]:
    return _TRANSFORMS.names()


def get_transform(name: str, **params: Any) -> Transform:
    """The registered transform ``name`` built with ``params``."""
    return _TRANSFORMS.lookup(name)(**params)


__all__ = ["QuantizeFn", "Transform", "get_transform", "register_transform", "transform_names"]

"""Modules that hold packed weights: ``QuantLinear``, ``QuantEmbedding`` and the tied ``QuantLMHead``.

Their forward is the reference path: dequantize the packed weight, then a dense matmul (or lookup).
With ``cache=True`` a module keeps its dequantized weight after the first forward (fast repeated
evaluation on CPU, at the memory cost of a dense weight); the packed buffers stay the source of truth.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .errors import QRecoverError
from .schemes import QuantizedWeight, get_quantizer


class _Packed(nn.Module):
    """Common part: the packed tensors as buffers plus what is needed to dequantize them."""

    def __init__(self, qw: QuantizedWeight, cache: bool = False):
        nn.Module.__init__(self)  # not nn.Linear.__init__: there is no dense weight Parameter to allocate
        self.scheme, self.bits, self.shape, self.params = qw.scheme, qw.bits, tuple(qw.shape), dict(qw.params)
        self._quantizer = get_quantizer(qw.scheme, **qw.params)
        for name, t in qw.tensors.items():
            self.register_buffer(name, t)
        self._tensor_names = tuple(qw.tensors)
        self.cache = cache
        self._dense: torch.Tensor | None = None

    @property
    def packed(self) -> QuantizedWeight:
        """The packed weight as a :class:`QuantizedWeight` (named `packed`, not `qweight`: PEFT reads a
        `qweight` attribute as a GPTQ tensor)."""
        tensors = {n: getattr(self, n) for n in self._tensor_names}
        return QuantizedWeight(self.scheme, self.bits, self.shape, self.params, tensors)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self._dense is not None and self._dense.dtype == dtype:
            return self._dense
        with torch.no_grad():
            dense = self._quantizer.dequantize(self.packed, dtype)
        if self.cache:
            self._dense = dense
        return dense

    def extra_repr(self) -> str:
        return f"shape={self.shape}, scheme={self.scheme}, bits={self.bits}, params={self.params}"


class QuantLinear(_Packed, nn.Linear):
    """A linear layer ``y = x W^T + b`` whose ``W (out_features, in_features)`` is stored packed.

    It is an ``nn.Linear`` to the outside world (``isinstance`` holds, ``in_features``/``out_features``/
    ``weight``/``bias`` are there), so libraries that wrap linear layers by type accept it as a base
    layer: PEFT's LoRA wraps it with its own ``lora.Linear`` and calls this forward for the frozen part.
    ``weight`` is a read-only dequantized tensor, not a Parameter: nothing can train or merge into it.
    """

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, cache: bool = False):
        super().__init__(qw, cache)
        self.out_features, self.in_features = self.shape
        self.bias = nn.Parameter(bias.detach().clone(), requires_grad=False) if bias is not None else None

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight (read-only view for code that inspects ``.weight``)."""
        return self.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize(x.dtype), None if self.bias is None else self.bias.to(x.dtype))

    def set_packed(self, qw: QuantizedWeight) -> None:
        """Replace the packed weight by ``qw`` (same shape ``(out_features, in_features)``; scheme and bits may
        differ): its tensors become the buffers, on this layer's device, and the dense cache is dropped.
        Used by the PEFT merge (:mod:`qrecover.recovery.peft_quant`)."""
        if tuple(qw.shape) != self.shape:
            raise QRecoverError(f"packed weight of shape {tuple(qw.shape)} cannot replace this layer's {self.shape}; "
                                "quantize a weight of the layer's own shape")
        device = getattr(self, self._tensor_names[0]).device
        for name in self._tensor_names:
            delattr(self, name)
        self.scheme, self.bits, self.params = qw.scheme, qw.bits, dict(qw.params)
        self._quantizer = get_quantizer(qw.scheme, **qw.params)
        for name, t in qw.tensors.items():
            self.register_buffer(name, t.to(device))
        self._tensor_names = tuple(qw.tensors)
        self._dense = None


class QuantEmbedding(_Packed):
    """An embedding table ``(num_embeddings, embedding_dim)`` stored packed."""

    def __init__(self, qw: QuantizedWeight, padding_idx: int | None = None, cache: bool = True):
        super().__init__(qw, cache)
        self.num_embeddings, self.embedding_dim = self.shape
        self.padding_idx = padding_idx

    @property
    def weight(self) -> torch.Tensor:
        return self.dequantize()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.dequantize(), self.padding_idx)


class QuantLMHead(nn.Module):
    """The output projection tied to a :class:`QuantEmbedding`: the packed matrix is stored once."""

    def __init__(self, embedding: QuantEmbedding):
        super().__init__()
        object.__setattr__(self, "embedding", embedding)  # a reference, not a submodule: no duplicate state
        self.in_features, self.out_features = embedding.embedding_dim, embedding.num_embeddings

    @property
    def weight(self) -> torch.Tensor:
        return self.embedding.dequantize()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.embedding.dequantize(x.dtype))

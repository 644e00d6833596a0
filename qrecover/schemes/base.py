"""The quantizer plug-in contract: one small base class, one registry, one weight container.

A quantizer is a class with a ``name``, a config dataclass, the bit widths it supports, the calibration
statistics it needs, and ``quantize(weight, bits, stats) -> QuantizedWeight``. It is registered by the
:func:`register_quantizer` decorator; the CLI and the manifest refer to it by name only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ..errors import QRecoverError
from ..fields import doc_field  # noqa: F401  (re-exported: schemes declare their config fields with it)
from ..registry import Registry

#: statistics a quantizer may ask calibration for (per linear layer, over calibration tokens)
#: - ``input_sq``: ``(in_features,)`` mean of x_j**2, the per-input-channel importance
#: - ``hessian``: ``(in_features, in_features)`` mean of x x^T (GPTQ's H, up to a factor 2)
#: - ``element_sq``: ``(out_features, in_features)`` per-weight importance (diagonal Fisher); given for
#:   the embedding, whose "input" is a token id
#: - ``out_grad_sq``: ``(out_features,)`` mean squared gradient of the loss w.r.t. the layer's outputs
#:   (collected by the backward calibration pass; with ``input_sq`` it gives a per-element Fisher weight)
#: Derived, optional (not collected by calibration, never in ``needs``): ``hessian_inv_chol`` ``(in, in)``,
#: the upper Cholesky factor of the damped inverse Hessian from :func:`qrecover.schemes.gptq.hessian_factor`
#: (same ``damp`` and ``act_order`` as the quantizer), computed once and shared by the layers that read the
#: same inputs (q/k/v, gate/up); a quantizer that gets it skips its own factorisation.
STAT_NAMES = ("input_sq", "hessian", "element_sq", "out_grad_sq")


@dataclass
class QuantizedWeight:
    """A quantized 2-D weight ``(out_features, in_features)`` and everything needed to rebuild it.

    ``tensors`` holds the stored tensors under the project-wide names:
    ``qdata`` (uint8, bit-packed codes, see :mod:`qrecover.packing`), ``lut`` (fp16 look-up tables),
    ``scale`` (fp16) and ``zero_point`` (uint8, bit-packed). Each scheme documents their shapes.
    """

    scheme: str
    bits: int
    shape: tuple[int, int]
    params: dict[str, Any]
    tensors: dict[str, torch.Tensor]

    @property
    def nbytes(self) -> int:
        """Exact bytes of every stored tensor."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @property
    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return get_quantizer(self.scheme, **self.params).dequantize(self, dtype)


class Quantizer:
    """Base class. Subclasses set the class attributes and implement the three methods."""

    name: ClassVar[str]
    supported_bits: ClassVar[tuple[int, ...]]
    #: the calibration statistics (names from STAT_NAMES) ``quantize`` reads; calibration computes only
    #: what the chosen quantizers need. A subclass whose needs depend on its config overrides this with a
    #: property (read it on an instance: ``get_quantizer(name, **params).needs``).
    needs: ClassVar[frozenset[str]] = frozenset()
    Config: ClassVar[type]

    def __init__(self, config: Any = None, **params: Any):
        self.config = config if config is not None else self.Config(**params)

    @property
    def params(self) -> dict[str, Any]:
        return dataclasses.asdict(self.config)

    def check(self, shape: tuple[int, int], bits: int) -> None:
        """Raise QRecoverError if this quantizer cannot quantize ``shape`` at ``bits``."""
        if bits not in self.supported_bits:
            raise QRecoverError(
                f"scheme {self.name!r} does not support {bits=}; choose from {list(self.supported_bits)}"
            )

    def nbytes(self, shape: tuple[int, int], bits: int) -> int:
        """Exact stored bytes of a weight of ``shape`` at ``bits``, without quantizing it."""
        raise NotImplementedError

    def quantize(self, weight: torch.Tensor, bits: int, stats: dict[str, torch.Tensor]) -> QuantizedWeight:
        raise NotImplementedError

    def quantize_many(self, weight: torch.Tensor, bits_list: list[int], stats: dict[str, torch.Tensor]) -> list[QuantizedWeight]:
        """One :class:`QuantizedWeight` per width; schemes override it to share work across widths."""
        return [self.quantize(weight, b, stats) for b in bits_list]

    def dequantize(self, qw: QuantizedWeight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        raise NotImplementedError

    def decode(self, qw: QuantizedWeight, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense weight ``(O, I)`` that ``codes (O, I)`` give under ``qw``'s continuous tensors (tables, or scales and
        zero points), differentiable in them; ``dequantize`` is ``decode`` of the stored codes. For schemes whose codes
        can be re-assigned (``qrecover tune --params codes``)."""
        raise QRecoverError(f"scheme {self.name!r} cannot re-assign its codes (no decode); leave 'codes' out of --params")

    def encode(self, qw: QuantizedWeight, weight: torch.Tensor) -> torch.Tensor:
        """Each element of ``weight (O, I)``'s nearest code under ``qw``'s continuous tensors, long ``(O, I)``; codes
        re-assigned after the weight or the tables/scales moved. ``decode(qw, encode(qw, qw.dequantize()))`` is
        ``qw.dequantize()`` exactly."""
        raise QRecoverError(f"scheme {self.name!r} cannot re-assign its codes (no encode); leave 'codes' out of --params")

    def rows(self, qw: QuantizedWeight, ids: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """``dequantize(qw, dtype)[ids]`` for ``ids`` (1-D long), decoding only those rows: an embedding lookup reads
        a few rows of a large table, and need not dequantize (or keep) the whole of it. The same values as the whole
        dequantization's rows. None where the scheme has no row access (the caller then dequantizes it all)."""
        return None

    def _pack(self, bits: int, shape: tuple[int, int], tensors: dict[str, torch.Tensor]) -> QuantizedWeight:
        return QuantizedWeight(self.name, bits, tuple(shape), self.params, tensors)


_REGISTRY = Registry("scheme", "quantizer")


def register_quantizer(cls: type[Quantizer]) -> type[Quantizer]:
    """Class decorator: make a quantizer available by its ``name``."""
    return _REGISTRY.register(cls)


def quantizer_names() -> list[str]:
    return _REGISTRY.names()


def get_quantizer(name: str, **params: Any) -> Quantizer:
    """The registered quantizer ``name`` built with ``params`` (its config fields)."""
    cls = _REGISTRY.lookup(name)
    known = {f.name for f in dataclasses.fields(cls.Config)}
    unknown = set(params) - known
    if unknown:
        raise QRecoverError(f"scheme {name!r} has no parameter(s) {sorted(unknown)}; it takes {sorted(known)}")
    return cls(cls.Config(**params))

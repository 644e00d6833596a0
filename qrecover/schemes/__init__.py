"""Quantizer plug-ins: one file each, registered by name. Importing this package registers them."""

from . import blockwise, gptq, palettize  # noqa: F401  (registration side effect)
from .base import QuantizedWeight, Quantizer, get_quantizer, quantizer_names, register_quantizer

__all__ = ["QuantizedWeight", "Quantizer", "get_quantizer", "quantizer_names", "register_quantizer"]

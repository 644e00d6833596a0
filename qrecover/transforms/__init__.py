"""Function-preserving transforms applied before quantization (the contract is in :mod:`.base`). Importing
this package registers them."""

from . import awq, online_r4, rotate  # noqa: F401  (registration side effect)
from .base import QuantizeFn, Transform, get_transform, register_transform, transform_names

__all__ = ["QuantizeFn", "Transform", "get_transform", "register_transform", "transform_names"]

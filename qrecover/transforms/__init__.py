"""Function-preserving transforms applied before quantization (the contract is in :mod:`.base`). Importing
this package registers them."""

from . import awq, online_r4, rotate  # noqa: F401  (registration side effect)
from .base import QuantizeFn, Transform, get_transform, register_transform, transform_names


def model_level_names(manifest: dict) -> list[str]:
    """A checkpoint's model-level transforms (``rot+``, ``r4+``) in the order applied: what an unquantized model replays
    to hold, layer by layer, the weights and inputs that the checkpoint's layers quantized."""
    return [n for n in manifest.get("transforms", {}).get("names", []) if get_transform(n).model_level]


__all__ = ["QuantizeFn", "Transform", "get_transform", "model_level_names", "register_transform", "transform_names"]

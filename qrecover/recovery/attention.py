"""Attention during training: torch's SDPA with ``is_causal`` and no mask, built without reading the device.

Recovery trains on packed windows, each one causal sequence with no padding. transformers' ``sdpa`` mask builder
finds that out at every forward by reading the position ids back from the device (its packed-sequence check,
``masking_utils.find_packed_sequence_indices``: one host synchronisation per forward, student and teacher).
The training loop knows it already, so it registers transformers' own SDPA attention under another name
(:data:`CAUSAL_SDPA`, through ``AttentionInterface.register``, the library's extension point) for which no mask is
built: every layer then calls ``scaled_dot_product_attention(..., is_causal=True)`` with no mask, which lets torch
pick its flash or memory-efficient kernel. Only for models that already use ``sdpa`` and whose every layer is
plain causal attention over the window (no sliding window shorter than it); others keep what they had.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

CAUSAL_SDPA = "qrecover_causal_sdpa"
AttentionInterface.register(CAUSAL_SDPA, sdpa_attention_forward)


def _text_config(model: nn.Module):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def plain_causal(model: nn.Module, seq_len: int) -> bool:
    """Whether every attention layer of ``model`` (a transformers model) is causal attention over a whole window
    of ``seq_len`` tokens: no sliding window shorter than it, no layer of another kind."""
    config = _text_config(model)
    types = getattr(config, "layer_types", None)
    if types is not None:
        if not set(types) <= {"full_attention", "sliding_attention"}:
            return False
        if "sliding_attention" not in set(types):
            return True
    window = getattr(config, "sliding_window", None)
    return window is None or window >= seq_len


@contextlib.contextmanager
def causal_sdpa(model: nn.Module, seq_len: int, enable: bool = True) -> Iterator[str]:
    """Within the block, ``model`` (transformers, unwrapped) attends with :data:`CAUSAL_SDPA` when it uses ``sdpa``
    and :func:`plain_causal` holds (windows of ``seq_len`` tokens, no padding); restored after. Yields the attention
    implementation in use. ``enable=False``: changes nothing."""
    before = getattr(model.config, "_attn_implementation", None)
    if not enable or before != "sdpa" or not plain_causal(model, seq_len) or not hasattr(model, "set_attn_implementation"):
        yield str(before)
        return
    model.set_attn_implementation(CAUSAL_SDPA)
    try:
        yield CAUSAL_SDPA
    finally:
        model.set_attn_implementation(before)

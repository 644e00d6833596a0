"""A LoRA on the output head, the one layer that projection adapters never reach.

A compressed checkpoint with tied embeddings (the default SmolLM2 model) stores the embedding matrix ``E (vocab,
hidden)`` once, packed, and computes logits with :class:`~qrecover.qlinear.QuantLMHead`: ``h Q(E)^T``. The
quantization error of ``E`` then reaches every logit, and no adapter on the attention/MLP projections sits on that
path. :class:`QuantLoraHead` is PEFT's ``lora.Linear`` on the ``QuantLMHead``::

    logits = h Q(E)^T + scaling * (h A^T) B^T        A (r, hidden), B (vocab, r)

**Logits only, not the embedding lookup.** The correction is added where the tied matrix is used as the output
projection; the input lookup keeps ``Q(E)``. Why: (1) it is exactly PEFT's LoRA on ``lm_head``, so the adapter
directory stays a plain PEFT adapter (``base_model.model.lm_head.lora_A/B``; ``PeftModel.from_pretrained`` on the
unquantized model wraps its ``nn.Linear`` head the same way), while a correction of the lookup would need PEFT's
embedding LoRA (``lora_embedding_A (r, vocab)``) on a module that is not an ``nn.Embedding``; (2) the logits are
what the distillation loss and perplexity read directly, and a per-token error of the input row is the first thing
the (adapted) decoder layers can absorb, while nothing after the head can correct the head. (3) The svd init applies
unchanged: ``init_error_svd`` sees a LoRA layer whose base weight is ``Q(E)`` and whose teacher is the unquantized
``lm_head`` (``E``), weighted by the final hidden states' second moment.

Bytes: ``2 * r * (hidden + vocab)``; on SmolLM2-135M (576, 49152) rank 16 is 1.59 MB, +0.095 bpw.

Merging is refused: the packed matrix is shared with the input embedding, so folding the head's correction into it
would change the lookup too (or untie the two and store the vocabulary matrix twice). Keep it unmerged.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch.nn as nn
from peft.tuners.lora import LoraConfig
from peft.tuners.lora.layer import Linear as LoraLinear

from ..errors import QRecoverError
from ..qlinear import QuantLMHead

HEAD = "lm_head"  # the output head's module name in transformers' causal LMs


class QuantLoraHead(LoraLinear):
    """PEFT LoRA on a tied :class:`~qrecover.qlinear.QuantLMHead`: ``head(h) + scaling * B(A(h))``; never merged."""

    def __init__(self, base_layer: QuantLMHead, adapter_name: str, config: LoraConfig, **kwargs: Any) -> None:
        if config.lora_bias:
            raise QRecoverError("lora_bias=True is not supported on the tied output head; use lora_bias=False")
        with warnings.catch_warnings():  # PEFT warns of any class it does not know; this one it is made for
            warnings.filterwarnings("ignore", message=r"Unsupported layer type .*QuantLMHead", category=UserWarning)
            super().__init__(base_layer, adapter_name, config=config, **kwargs)

    def merge(self, safe_merge: bool = False, adapter_names: list[str] | None = None) -> None:
        raise QRecoverError("the output head's adapter cannot be merged: the tied head shares its packed matrix with the "
                            "input embedding, so merging would change the embedding lookup too; keep the adapter "
                            "unmerged (PeftModel computes head + adapter exactly), or train without --head-rank")


def output_head_name(model: nn.Module) -> str | None:
    """``"lm_head"`` when ``model``'s output head is a tied :class:`QuantLMHead` (what :class:`QuantLoraHead` wraps),
    else None (an untied head is a QuantLinear that the projection adapters already reach, or not quantized)."""
    head = dict(model.named_modules()).get(HEAD)
    return HEAD if isinstance(head, QuantLMHead) else None


def register_head_lora(config: LoraConfig) -> LoraConfig:
    """Make PEFT build :class:`QuantLoraHead` for a targeted ``QuantLMHead`` under ``config`` (in place; returns it)."""
    config._register_custom_module({QuantLMHead: QuantLoraHead})
    return config


def head_config(model: nn.Module, head_rank: int) -> tuple[list[str], dict[str, int]]:
    """``([target names], rank_pattern)`` that add the head adapter of rank ``head_rank`` to a LoRA config (PEFT
    matches a rank_pattern key against the end of a module's dotted name: ``lm_head`` only matches the head)."""
    if head_rank <= 0:
        return [], {}
    name = output_head_name(model)
    if name is None:
        raise QRecoverError(f"--head-rank {head_rank}: the model's output head is not a tied packed head (QuantLMHead); "
                            "an untied quantized head is a projection the rank-r adapters already cover. Leave --head-rank at 0")
    return [name], {name: head_rank}


__all__ = ["HEAD", "QuantLoraHead", "head_config", "output_head_name", "register_head_lora"]

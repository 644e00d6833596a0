"""Helpers shared by the benchmarks that build models from a config on a machine without the default model."""

from __future__ import annotations

from pathlib import Path


def save_byte_level_tokenizer(d: Path) -> None:
    """A GPT-2 style byte-level tokenizer (256 byte symbols, no merges, ``<eos>``) saved into ``d``: nothing to
    download, and any text tokenizes (one token per byte)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {c: i for i, c in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(d)

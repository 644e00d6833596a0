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


def domain_windows(tokenizer, n_heldout: int = 8) -> dict:
    """Token windows to score a model on, tokenized once: ``python-docs`` (the README protocol: 32 x 512 tokens of the
    eval split, the calibration domain) and each held-out domain of :data:`qrecover.evaluate.heldout.HELD_OUT`
    (``n_heldout`` x 512 tokens)."""
    from qrecover.data.corpus import token_windows
    from qrecover.evaluate.heldout import HELD_OUT, heldout_windows

    return {"python-docs": token_windows(tokenizer, "python-docs", "eval", 32, 512),
            **{d: heldout_windows(tokenizer, d, n_heldout, 512) for d in HELD_OUT}}


def domain_ppl(model, windows: dict) -> dict[str, float]:
    """Perplexity of ``model`` on each of :func:`domain_windows`' texts (each window scored on its own, as
    :func:`qrecover.evaluate.perplexity.perplexity`)."""
    from qrecover.evaluate.heldout import windows_perplexity

    return {name: windows_perplexity(model, w)["ppl"] for name, w in windows.items()}

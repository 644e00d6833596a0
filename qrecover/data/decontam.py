"""Decontamination: drop training documents that overlap the evaluation sets (phi-4, Appendix B, Algorithm 1).

The rule, per training document, in phi-4's order:

1. **13-gram match.** If any 13-gram of the document is a 13-gram of some evaluation item (and is not an
   *allowed* 13-gram, see below), the document is ``contaminated`` (rule ``"13-gram"``).
2. **7-gram ratio.** Otherwise, for every evaluation item ``t``::

       ratio(t) = |F7(doc) & F7(t)| / min(|F7(doc)|, |F7(t)|)

   with ``F7`` the set of distinct 7-grams. With ``r = max_t ratio(t)``: ``r >= contaminated_7gram``
   -> ``contaminated`` (rule ``"7-gram"``); ``info_7gram < r < contaminated_7gram`` -> ``partial`` (kept,
   reported: phi-4's "partial contamination (7-gram info match)"); otherwise ``clean``.

phi-4 gives the rule but not the two threshold values; ours are ``info_7gram = 0.2`` and
``contaminated_7gram = 0.5`` (the paper's worked example, a rephrased test question, has ratio 0.39 and was
caught by its 13-gram). ``min(...)`` in the denominator makes a short item that a long document quotes
whole score 1.0, and a long document that shares a few stock phrases with a long item score near 0.

**Allowed 13-grams.** phi-4 keeps a list of 13-grams common in Wikipedia and its training set
(``'a i only b ii only c iii only d ii and iii'``...) that must not trigger a drop. Offline we have no
Wikipedia; the equivalent we can compute is *benchmark boilerplate*: a 13-gram that occurs in at least
``allowed_min_items`` distinct evaluation items (answer-option patterns, instruction templates) is
allowed. ``extra_allowed`` adds phrases by hand.

**Unit.** phi-4's training documents are web pages and Q&A items. A document of at most
``passage_chars`` characters (every chat, every short text) is judged whole and dropped whole. A longer
one (a 300 KB manual page) is judged per *passage*: consecutive paragraphs grouped up to
``passage_chars`` (a paragraph longer than that is its own passage), and only contaminated passages are
cut out. Measured on the built-in corpus: 85 of its 406 train files share a 13-gram with a held-out
file; dropping them whole would remove 48% of the training text, cutting passages of <= 4000 characters
removes 7.8%.

**Normalisation** (as in phi-4's examples, ``'1.8 kg'`` -> ``'1 8 kg'``): lowercase, every run of
non-alphanumeric characters (punctuation, underscore, whitespace) becomes one space, split into words.

**Cost.** Each word is hashed once (blake2b, 64 bits, memoised); an n-gram hash is a polynomial over its
word hashes (numpy, wrapping uint64); the index is sorted ``uint64`` arrays probed with
``np.searchsorted``. For all five default sets (~1.7 M words) it takes a few seconds to build and ~40 MB;
it is cached in ``cache_dir()/decontam/`` keyed by the sha256 of the evaluation files and the settings.

Evaluation sets (located by file path, never imported): GSM8K test (question + solution), IFEval prompts,
AlpacaEval instructions, MMLU (question + options) and the held-out ``eval`` split of the built-in text.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..benchdata import data_file
from ..errors import QRecoverError
from ..io_utils import atomic_file, cache_dir, sha256_file
from .chat import chat_text
from .documents import split_files

INDEX_VERSION = 1
_NON_WORD = re.compile(r"[\W_]+")
_MULT = np.uint64(0x9E3779B97F4A7C15)  # odd 64-bit multiplier of the polynomial n-gram hash
_WORD_HASH: dict[str, int] = {}


def normalize(text: str) -> list[str]:
    """Lowercase words with punctuation and whitespace removed: ``"1.8 kg, who"`` -> ``["1", "8", "kg", "who"]``."""
    return _NON_WORD.sub(" ", text.lower()).split()


def _word_hashes(words: list[str]) -> np.ndarray:
    """``(len(words),)`` uint64, a stable 64-bit hash per word (memoised)."""
    if len(_WORD_HASH) > 2_000_000:
        _WORD_HASH.clear()
    out = np.empty(len(words), dtype=np.uint64)
    for i, w in enumerate(words):
        h = _WORD_HASH.get(w)
        if h is None:
            h = _WORD_HASH[w] = int.from_bytes(hashlib.blake2b(w.encode(), digest_size=8).digest(), "little")
        out[i] = h
    return out


def ngram_hashes(words: list[str] | np.ndarray, n: int) -> np.ndarray:
    """``(max(len(words) - n + 1, 0),)`` uint64: the hash of the n-gram starting at each word position."""
    wh = words if isinstance(words, np.ndarray) else _word_hashes(words)
    m = len(wh) - n + 1
    if m <= 0:
        return np.empty(0, dtype=np.uint64)
    h = np.zeros(m, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for j in range(n):
            h = h * _MULT + wh[j : j + m]
    return h


# --- evaluation sets ------------------------------------------------------------------------------------


@dataclass
class EvalSet:
    """One evaluation set: ``items()`` yields ``(item_id, text)``; ``files`` are hashed for the cache key."""

    name: str
    files: list[Path]
    items: Callable[[], Iterator[tuple[str, str]]]


PURPOSE = "decontamination (pass sets=[...] to check against fewer sets)"


def _jsonl(path: Path) -> Iterator[tuple[int, dict]]:
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f):
            if line.strip():
                yield i, json.loads(line)


def gsm8k_test() -> EvalSet:
    p = data_file("gsm8k", PURPOSE)
    return EvalSet("gsm8k", [p], lambda: ((f"test:{i}", r["question"] + "\n" + r["answer"]) for i, r in _jsonl(p)))


def ifeval() -> EvalSet:
    p = data_file("ifeval", PURPOSE)
    return EvalSet("ifeval", [p], lambda: ((f"key:{r['key']}", r["prompt"]) for _, r in _jsonl(p)))


def alpaca_eval() -> EvalSet:
    p = data_file("alpaca_eval", PURPOSE)

    def items() -> Iterator[tuple[str, str]]:
        for i, r in enumerate(json.loads(p.read_text(encoding="utf-8"))):
            yield f"{i}", r["instruction"]

    return EvalSet("alpaca_eval", [p], items)


def mmlu() -> EvalSet:
    p = data_file("mmlu", PURPOSE)

    def items() -> Iterator[tuple[str, str]]:
        for i, r in _jsonl(p):
            opts = " ".join(f"{k[-1].upper()} {r[k]}" for k in ("answer_a", "answer_b", "answer_c", "answer_d") if k in r)
            yield f"line:{i}", f"{r['question']} {opts}"

    return EvalSet("mmlu", [p], items)


def text_eval_split(source: str = "python-docs") -> EvalSet:
    """The held-out ``eval`` split of a text source (the built-in Python docs by default)."""

    files = split_files(source, "eval")

    def items() -> Iterator[tuple[str, str]]:
        for rel, path in files:
            yield rel, path.read_text(errors="replace")

    return EvalSet(f"{source}:eval", [p for _, p in files], items)


EVAL_SETS: dict[str, Callable[[], EvalSet]] = {
    "gsm8k": gsm8k_test, "ifeval": ifeval, "alpaca_eval": alpaca_eval, "mmlu": mmlu, "python-docs:eval": text_eval_split,
}


# --- the index ------------------------------------------------------------------------------------------


@dataclass
class DecontamSettings:
    """The n-gram rule; every field enters the index's cache key."""

    n_large: int = field(default=13, metadata={"help": "n of the exact-match n-gram (phi-4: 13)"})
    n_small: int = field(default=7, metadata={"help": "n of the ratio n-gram (phi-4: 7)"})
    info_7gram: float = field(default=0.2, metadata={"help": "7-gram ratio above which a document is reported as 'partial' (kept)"})
    contaminated_7gram: float = field(default=0.5, metadata={"help": "7-gram ratio at or above which a document is dropped"})
    allowed_min_items: int = field(default=10, metadata={"help": "a 13-gram found in this many distinct eval items is boilerplate, allowed"})
    passage_chars: int = field(default=4000, metadata={"help": "documents longer than this are judged (and cut) per passage of at most this many "
                                                               "characters"})
    extra_allowed: tuple[str, ...] = field(default=(), metadata={"help": "more allowed 13-grams (any text; normalised)"})

    def __post_init__(self) -> None:
        if not (1 <= self.n_small <= self.n_large):
            raise QRecoverError(f"n-gram sizes n_small={self.n_small} n_large={self.n_large} need 1 <= n_small <= n_large")
        if not (0.0 <= self.info_7gram <= self.contaminated_7gram <= 1.0):
            raise QRecoverError(f"thresholds info_7gram={self.info_7gram} contaminated_7gram={self.contaminated_7gram} "
                                "need 0 <= info <= contaminated <= 1")
        if self.passage_chars < 100:
            raise QRecoverError(f"passage_chars={self.passage_chars} must be >= 100")
        if self.allowed_min_items < 2:
            raise QRecoverError(f"allowed_min_items={self.allowed_min_items} must be >= 2 (1 would allow every 13-gram)")
        self.extra_allowed = tuple(self.extra_allowed)


@dataclass
class Verdict:
    """The decision for one training document (JSON-able with ``dataclasses.asdict``).

    ``status``: ``"clean"`` | ``"partial"`` (kept, reported) | ``"contaminated"`` (dropped). ``rule``:
    ``"13-gram"`` | ``"7-gram"`` | None. ``eval_set``/``item_id``: the evaluation item it overlaps.
    ``ngram``: the first overlapping 13-gram (rule 13-gram) or 7-gram, as normalised words of the document.
    ``ratio``: the 7-gram ratio of the closest item (None when the 13-gram rule fired). ``overlaps``: up to
    10 overlapping 7-grams with that item.
    """

    status: str
    rule: str | None = None
    eval_set: str | None = None
    item_id: str | None = None
    ngram: str | None = None
    ratio: float | None = None
    overlaps: list[str] = field(default_factory=list)

    @property
    def dropped(self) -> bool:
        return self.status == "contaminated"


class DecontamIndex:
    """Hashed n-grams of the evaluation sets. Build with :func:`build_index`; query with :meth:`check`.

    Arrays: ``large (M13,)`` sorted unique uint64 13-gram hashes (allowed ones removed), ``large_item (M13,)``
    the first item holding each; ``small (M7,)`` sorted uint64 7-gram hashes, one entry per (hash, item),
    ``small_item (M7,)``; ``item_n_small (I,)`` distinct 7-grams per item; ``item_set (I,)`` index into
    ``set_names``; ``item_ids (I,)``.
    """

    def __init__(self, arrays: dict[str, np.ndarray], settings: DecontamSettings, set_names: list[str], fingerprint: str):
        self.large, self.large_item = arrays["large"], arrays["large_item"]
        self.small, self.small_item = arrays["small"], arrays["small_item"]
        self.item_n_small, self.item_set, self.item_ids = arrays["item_n_small"], arrays["item_set"], arrays["item_ids"]
        self.n_allowed = int(arrays["n_allowed"])
        self.settings, self.set_names, self.fingerprint = settings, set_names, fingerprint

    def _item(self, i: int) -> tuple[str, str]:
        return self.set_names[int(self.item_set[i])], str(self.item_ids[i])

    def check(self, text: str) -> Verdict:
        """Algorithm 1 of phi-4 on one training document."""
        s = self.settings
        words = normalize(text)
        wh = _word_hashes(words)
        # step 1: any 13-gram of the document in the benchmark 13-grams (allowed ones were removed) -> drop
        h13 = ngram_hashes(wh, s.n_large)
        if len(h13) and len(self.large):
            pos = np.searchsorted(self.large, h13).clip(max=len(self.large) - 1)
            hit = np.flatnonzero(self.large[pos] == h13)
            if len(hit):
                at = int(hit[0])
                eval_set, item_id = self._item(int(self.large_item[pos[at]]))
                return Verdict("contaminated", "13-gram", eval_set, item_id, " ".join(words[at : at + s.n_large]))
        # step 2: 7-gram overlap counts per evaluation item
        h7_all = ngram_hashes(wh, s.n_small)
        if not len(h7_all) or not len(self.small):
            return Verdict("clean")
        h7, first = np.unique(h7_all, return_index=True)
        lo, hi = np.searchsorted(self.small, h7, "left"), np.searchsorted(self.small, h7, "right")
        counts = hi - lo
        if not counts.sum():
            return Verdict("clean")
        # every (doc 7-gram, item) pair: the ranges lo[k]:hi[k] of the sorted index, flattened
        which = np.repeat(np.arange(len(h7)), counts)
        starts = np.repeat(lo - np.concatenate(([0], np.cumsum(counts)[:-1])), counts)
        items = self.small_item[starts + np.arange(len(which))]
        uniq, overlap = np.unique(items, return_counts=True)
        # step 3: ratio = overlap / min(|F7(doc)|, |F7(item)|), the closest item
        ratio = overlap / np.minimum(len(h7), self.item_n_small[uniq])
        best = int(np.argmax(ratio))
        r, item = float(ratio[best]), int(uniq[best])
        if r <= s.info_7gram and r < s.contaminated_7gram:
            return Verdict("clean")
        # step 4: contaminated or partial; name the overlapping 7-grams, in document order
        shared = np.sort(first[which[items == item]])
        grams = [" ".join(words[p : p + s.n_small]) for p in shared[:10]]
        eval_set, item_id = self._item(item)
        status = "contaminated" if r >= s.contaminated_7gram else "partial"
        return Verdict(status, "7-gram" if status == "contaminated" else None, eval_set, item_id, grams[0], round(r, 4), grams)

    def describe(self) -> dict[str, Any]:
        """JSON-able summary: sets, items per set, settings, n-gram counts."""
        counts = np.bincount(self.item_set.astype(np.int64), minlength=len(self.set_names))
        return {"fingerprint": self.fingerprint, "settings": dataclasses.asdict(self.settings),
                "sets": {n: int(c) for n, c in zip(self.set_names, counts)},
                "large_ngrams": int(len(self.large)), "small_ngrams": int(len(self.small)),
                "allowed_large_ngrams": self.n_allowed}


def _index_key(sets: list[EvalSet], settings: DecontamSettings) -> str:
    h = hashlib.sha256(json.dumps({"v": INDEX_VERSION, "settings": dataclasses.asdict(settings)}, sort_keys=True).encode())
    for es in sets:
        h.update(es.name.encode())
        for f in es.files:
            h.update(sha256_file(f).encode())
    return h.hexdigest()


def build_index(sets: Iterable[str | EvalSet] | None = None, settings: DecontamSettings | None = None,
                use_cache: bool = True) -> DecontamIndex:
    """The n-gram index of the evaluation sets (default: all of :data:`EVAL_SETS`), cached by their sha256.

    ``sets``: names from :data:`EVAL_SETS` or :class:`EvalSet` objects (e.g. your own held-out data).
    """
    settings = settings or DecontamSettings()
    chosen: list[EvalSet] = []
    for s in (list(EVAL_SETS) if sets is None else sets):
        if isinstance(s, EvalSet):
            chosen.append(s)
        elif s in EVAL_SETS:
            chosen.append(EVAL_SETS[s]())
        else:
            raise QRecoverError(f"unknown evaluation set {s!r}; choose from {sorted(EVAL_SETS)} or pass an EvalSet")
    names = [es.name for es in chosen]
    if len(set(names)) != len(names):
        raise QRecoverError(f"evaluation sets named twice: {names}")
    key = _index_key(chosen, settings)
    path = cache_dir() / "decontam" / f"index-{key[:24]}.npz"
    if use_cache and path.is_file():
        with np.load(path, allow_pickle=False) as z:
            return DecontamIndex({k: z[k] for k in z.files}, settings, names, key)

    large_h, large_i, small_h, small_i, n_small, item_set, item_ids = [], [], [], [], [], [], []
    item = 0
    for si, es in enumerate(chosen):
        for item_id, text in es.items():
            wh = _word_hashes(normalize(text))
            h13 = np.unique(ngram_hashes(wh, settings.n_large))
            h7 = np.unique(ngram_hashes(wh, settings.n_small))
            large_h.append(h13), large_i.append(np.full(len(h13), item, np.int32))
            small_h.append(h7), small_i.append(np.full(len(h7), item, np.int32))
            n_small.append(len(h7)), item_set.append(si), item_ids.append(item_id)
            item += 1
    if not item:
        raise QRecoverError(f"the evaluation sets {names} hold no items")
    cat = lambda xs, dt: np.concatenate(xs).astype(dt) if xs else np.empty(0, dt)  # noqa: E731
    lh, li = cat(large_h, np.uint64), cat(large_i, np.int32)
    order = np.argsort(lh, kind="stable")
    lh, li = lh[order], li[order]
    # boilerplate: a 13-gram in >= allowed_min_items distinct items (each item contributed it once)
    uh, first, n_items = np.unique(lh, return_index=True, return_counts=True)
    allowed = uh[n_items >= settings.allowed_min_items]
    if settings.extra_allowed:
        extra = np.concatenate([ngram_hashes(normalize(t), settings.n_large) for t in settings.extra_allowed])
        allowed = np.union1d(allowed, extra)
    keep = ~np.isin(uh, allowed)
    sh, si_ = cat(small_h, np.uint64), cat(small_i, np.int32)
    order = np.argsort(sh, kind="stable")
    arrays = {"large": uh[keep], "large_item": li[first][keep], "small": sh[order], "small_item": si_[order],
              "item_n_small": np.asarray(n_small, np.int32), "item_set": np.asarray(item_set, np.int16),
              "item_ids": np.asarray(item_ids, dtype=str), "n_allowed": np.asarray(len(allowed))}
    if use_cache:
        with atomic_file(path, suffix=".npz") as tmp:  # np.savez appends .npz to other names
            np.savez(tmp, **arrays)
    return DecontamIndex(arrays, settings, names, key)


# --- applying it to training documents -----------------------------------------------------------------


def passages(text: str, max_chars: int) -> list[tuple[int, int]]:
    """``[(start, end)]`` character spans that tile ``text``, cut after blank lines, each at most ``max_chars``
    long unless a single paragraph is longer."""
    if len(text) <= max_chars:
        return [(0, len(text))]
    bounds = [m.end() for m in re.finditer(r"\n\s*\n", text)] + [len(text)]
    spans, start, last = [], 0, 0
    for b in bounds:
        if b - start > max_chars and last > start:
            spans.append((start, last))
            start = last
        last = b
    spans.append((start, len(text)))
    return spans


def check_document(index: DecontamIndex, doc: Any) -> list[tuple[tuple[int, int] | None, Verdict]]:
    """The non-clean units of one training document: ``[(span, verdict)]``, ``span`` the passage's character
    range in a text, None for a chat (judged whole on all its messages' text)."""
    if not isinstance(doc, str):

        v = index.check(chat_text(doc))
        return [] if v.status == "clean" else [(None, v)]
    found = []
    for start, end in passages(doc, index.settings.passage_chars):
        v = index.check(doc[start:end])
        if v.status != "clean":
            found.append(((start, end), v))
    return found


def remove(doc: Any, findings: list[tuple[tuple[int, int] | None, Verdict]]) -> Any:
    """``doc`` without its contaminated units; None when nothing (or only whitespace) is left."""
    cuts = [span for span, v in findings if v.dropped]
    if not cuts:
        return doc
    if not isinstance(doc, str) or None in cuts:
        return None
    pieces, at = [], 0
    for start, end in sorted(cuts):
        pieces.append(doc[at:start])
        at = end
    pieces.append(doc[at:])
    kept = "".join(pieces)
    return kept if kept.strip() else None


@dataclass
class SourceReport:
    """What decontamination did to one training source (JSON-able with :meth:`to_dict`).

    ``removed``: one row per dropped unit, ``{"doc", "span", "whole_document", **Verdict}`` (``span``: the
    passage's character range in the document, None for a chat); ``partial``: rows of kept units whose
    7-gram ratio passed the info threshold.
    """

    source: str
    scanned: int = 0
    chars_scanned: int = 0
    chars_dropped: int = 0
    documents_dropped: int = 0
    removed: list[dict[str, Any]] = field(default_factory=list)
    partial: list[dict[str, Any]] = field(default_factory=list)

    def add(self, doc_id: str, doc: Any, findings: list[tuple[tuple[int, int] | None, Verdict]], kept: Any) -> None:
        n = len(doc) if isinstance(doc, str) else len(chat_text_of(doc))
        self.scanned += 1
        self.chars_scanned += n
        self.documents_dropped += kept is None
        for span, v in findings:
            row = {"doc": doc_id, "span": list(span) if span else None, "whole_document": kept is None, **dataclasses.asdict(v)}
            if v.dropped:
                self.removed.append(row)
                self.chars_dropped += (span[1] - span[0]) if span else n
            else:
                self.partial.append(row)

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "scanned": self.scanned, "documents_dropped": self.documents_dropped,
                "passages_dropped": len(self.removed), "chars_scanned": self.chars_scanned,
                "chars_dropped": self.chars_dropped, "partial": len(self.partial),
                "removed": self.removed, "partial_matches": self.partial}


def chat_text_of(doc: Any) -> str:

    return chat_text(doc)


def scan(documents: Iterable[tuple[str, Any]], index: DecontamIndex, source: str = "data") -> SourceReport:
    """Check ``(doc_id, text or messages)`` pairs one by one (streaming); report what would be removed and why."""
    report = SourceReport(source)
    for doc_id, doc in documents:
        findings = check_document(index, doc)
        report.add(doc_id, doc, findings, remove(doc, findings))
    return report


__all__ = ["normalize", "ngram_hashes", "EvalSet", "EVAL_SETS", "DecontamSettings", "Verdict", "DecontamIndex",
           "build_index", "passages", "check_document", "remove", "SourceReport", "scan", "gsm8k_test", "ifeval", "alpaca_eval", "mmlu",
           "text_eval_split"]

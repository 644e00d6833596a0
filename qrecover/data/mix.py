"""The training data mixture: a streaming loader that packs a recipe's weighted sources into sequences.

**Recipe** (TOML, :class:`.mix_recipe.Mix`): a list of ``[[source]]`` tables, each a name, a kind (a registered
class of :mod:`.sources`) and a token weight, normalised to fractions of the run's token budget.

**Loader** (:class:`MixLoader`): yields ``{"input_ids": (seq_len,) int64, "labels": (seq_len,) int64, "source":
name}``. Every sequence is ``seq_len`` tokens of *one* source, packed from consecutive documents (EOS after
each text document; a chat document is closed by its template's end-of-turn token). ``labels`` equal
``input_ids`` (the trainer shifts), ``-100`` where no loss is taken (non-assistant chat tokens).

* **Exact shares.** The run has ``N = total_tokens // seq_len`` sequences; source ``i`` gets ``t_i`` of them,
  ``t_i`` the largest-remainder rounding of ``N * fraction_i`` (so ``sum t_i = N`` and each ``t_i`` is within
  one sequence of its exact share). The next sequence comes from the source furthest below its target
  line, ``argmax_i t_i * (k + 1) - c_i * N`` in integers (ties: recipe order); a source at its target is
  never picked, so at the end ``c_i = t_i`` exactly, and at every step ``|c_i - t_i k / N| < 1``.
* **Epochs.** A source that runs out of documents starts its next epoch, documents reshuffled by a
  generator seeded with ``(seed, source name, epoch)`` (parquet: row groups shuffled, then rows inside
  each, so each row group is read once per epoch).
* **Plan** (:meth:`MixLoader.plan`): per source, unique tokens (one streaming pass, cached in
  ``cache_dir()/mix-plan`` by content hash + tokenizer + decontamination index), target tokens and
  ``epochs = target / unique``: the arithmetic of phi-4's Table 5.
* **Resume.** :meth:`MixLoader.state_dict` is the exact data position: per source the epoch, the position in
  that epoch's order, the token offset inside the current document, and the counters. The shuffles are
  functions of ``(seed, name, epoch)``, so there is no hidden RNG state; a loader restored with
  :meth:`MixLoader.load_state_dict` yields exactly the sequences an uninterrupted one would.
* **Decontamination** (``exclude=`` an index, or ``decontaminate=True``): documents that overlap the
  evaluation sets are dropped (long texts: only their contaminated passages); :meth:`plan` scans every
  document *before* training and the report lists each removal with the evaluation item and the
  overlapping n-gram (see :mod:`.decontam`).

Nothing loads a whole corpus: documents are read one at a time through small indexes (file lists, line
offsets of jsonl files, paragraph offsets of a single text file, parquet row groups, a streaming dataset).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import QRecoverError
from ..io_utils import cache_dir, sha256_file, write_text_atomic
from ..progress import steps
from ..recipes import shipped_names, shipped_path
from .chat import IGNORE, encode_chat
from .corpus import token_windows
from .decontam import SourceReport, Verdict, build_index, check_document, remove
from .documents import Docs, StreamDocs
from .mix_recipe import Mix, load_mix
from .source import OpenContext, Source

PLAN_VERSION = 1
STATE_VERSION = 1


# --- tokenization ---------------------------------------------------------------------------------------


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """sha256 of the tokenizer's vocabulary/merges, chat template and EOS."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())
    h.update(str(tokenizer.eos_token_id).encode())
    return h.hexdigest()


def encode_document(tokenizer: Any, doc: Any, where: str = "document") -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one document: a text -> its tokens + EOS, all labelled; a chat -> its
    template render, labelled on assistant tokens (:func:`.chat.encode_chat`). Empty text -> ``([], [])``."""
    if isinstance(doc, str):
        if not doc.strip():
            return [], []
        ids = list(tokenizer(doc, add_special_tokens=False, verbose=False)["input_ids"]) + [tokenizer.eos_token_id]
        return ids, list(ids)
    return encode_chat(tokenizer, doc, where)




def _name_seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little")


# --- the loader -----------------------------------------------------------------------------------------


class _Cursor:
    """The read position of one source: epoch, position in the epoch's order, token offset in that document."""

    def __init__(self, loader: MixLoader, src: Source):
        self.loader, self.src = loader, src
        self.seed = _name_seed(loader.seed, src.name)
        self.epoch = self.pos = self.offset = 0
        self.sequences = self.tokens = self.loss_tokens = self.documents = 0
        self._docs: Docs | StreamDocs | None = None
        self._order: tuple[int, np.ndarray] | None = None
        self._hf_iter: tuple[int, int, Iterator] | None = None  # (epoch, next position, iterator)
        self._cur: tuple[list[int], list[int]] | None = None
        self.live_report = None  # decontamination verdicts of streamed (hf) documents

    @property
    def docs(self) -> Docs | StreamDocs:
        if self._docs is None:
            self._docs = self.loader._open_docs(self.src)
        return self._docs

    def state(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("epoch", "pos", "offset", "sequences", "tokens", "loss_tokens", "documents")}

    def restore(self, st: dict[str, int]) -> None:
        for k, v in st.items():
            setattr(self, k, int(v))
        self._cur, self._hf_iter = None, None

    def _doc_at(self, epoch: int, pos: int) -> tuple[Any, Any] | None:
        """``(base index or id, document)`` at ``pos`` of ``epoch``'s order, None past the end."""
        docs = self.docs
        if isinstance(docs, StreamDocs):
            if self._hf_iter is None or self._hf_iter[:2] != (epoch, pos):
                self._hf_iter = (epoch, pos, docs.epoch(epoch, self.seed, pos))
            doc = next(self._hf_iter[2], None)
            self._hf_iter = (epoch, pos + 1, self._hf_iter[2])
            return None if doc is None else (f"epoch{epoch}:{pos}", doc)
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, docs.order(epoch, self.seed))
        order = self._order[1]
        if pos >= len(order):
            return None
        i = int(order[pos])
        return i, docs.get(i)

    def _load(self) -> None:
        """Make ``_cur`` the tokens of the document at (epoch, pos), skipping empty and dropped documents."""
        wraps = 0
        while True:
            item = self._doc_at(self.epoch, self.pos)
            if item is None:
                wraps += 1
                if wraps > 1 or (self.pos == 0 and self.epoch == 0):
                    raise QRecoverError(f"source {self.src.name!r} has no usable documents (empty, or all dropped by "
                                        "decontamination); remove it from the mix or give it weight 0")
                self.epoch, self.pos, self.offset = self.epoch + 1, 0, 0
                continue
            key, doc = item
            doc = self.loader._decontaminated(self, key, doc)
            if doc is None:
                self.pos, self.offset = self.pos + 1, 0
                continue
            ids, labels = encode_document(self.loader.tokenizer, doc, f"source {self.src.name!r} document {key}")
            if not ids:
                self.pos, self.offset = self.pos + 1, 0
                continue
            if self.offset == 0:
                self.documents += 1
            self._cur = (ids, labels)
            return

    def take(self, n: int) -> tuple[list[int], list[int]]:
        """The next ``n`` tokens of this source's stream (documents back to back), and their labels."""
        ids: list[int] = []
        labels: list[int] = []
        while len(ids) < n:
            if self._cur is None:
                self._load()
            cur_ids, cur_labels = self._cur
            end = min(len(cur_ids), self.offset + n - len(ids))
            ids += cur_ids[self.offset : end]
            labels += cur_labels[self.offset : end]
            self.offset = end
            if self.offset >= len(cur_ids):  # document finished: the canonical state points at the next one
                self._cur, self.pos, self.offset = None, self.pos + 1, 0
        return ids, labels


def apportion(n: int, fractions: list[float]) -> list[int]:
    """Integers summing to ``n`` closest to ``n * fractions`` (largest remainder; ties to the earlier one)."""
    exact = [n * f for f in fractions]
    out = [math.floor(x) for x in exact]
    rest = n - sum(out)
    for i in sorted(range(len(exact)), key=lambda i: (-(exact[i] - out[i]), i))[:rest]:
        out[i] += 1
    return out


class MixLoader:
    """Packed training sequences from a :class:`Mix`; see the module docstring.

    ``mix``: a Mix or a recipe path. ``tokenizer``: the training model's (fast) tokenizer. ``seq_len``:
    tokens per sequence. ``total_tokens``: the run's token budget (``total_tokens // seq_len`` sequences).
    ``seed``: shuffling seed. ``exclude``: a :class:`.decontam.DecontamIndex` whose overlapping documents
    are dropped; ``decontaminate=True`` builds the default one (every evaluation set). ``model``: the
    unquantized instruct model (a spec or an ``nn.Module``) for ``selfgen`` sources that name none.
    """

    def __init__(self, mix: Mix | str | os.PathLike, tokenizer: Any, seq_len: int, total_tokens: int, seed: int = 0,
                 exclude: Any = None, *, decontaminate: bool = False, model: Any = None, show_progress: bool = True):
        self.mix = load_mix(mix)
        for name, v in (("seq_len", seq_len), ("total_tokens", total_tokens)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise QRecoverError(f"{name}={v!r} must be a positive integer")
        if total_tokens < seq_len:
            raise QRecoverError(f"total_tokens={total_tokens} is less than one sequence (seq_len={seq_len}); raise the token budget")
        if tokenizer.eos_token_id is None:
            raise QRecoverError("the tokenizer has no eos_token, needed between packed documents; set tokenizer.eos_token")
        if exclude is not None and decontaminate:
            raise QRecoverError("pass either exclude=INDEX or decontaminate=True, not both")
        self.tokenizer, self.seq_len, self.seed = tokenizer, seq_len, seed
        self.num_sequences = total_tokens // seq_len
        self.total_tokens = self.num_sequences * seq_len
        self.targets = dict(zip([s.name for s in self.mix.sources],
                                apportion(self.num_sequences, list(self.mix.fractions().values()))))
        self.model, self.show_progress = model, show_progress
        self._exclude, self._decontaminate = exclude, decontaminate
        self._cursors = {s.name: _Cursor(self, s) for s in self.mix.sources}
        self._k = 0
        self._plan: dict[str, dict[str, Any]] | None = None
        self._tok_fp: str | None = None

    # --- decontamination --------------------------------------------------------------------------------

    @property
    def index(self) -> Any:
        """The decontamination index in use (built on first use with ``decontaminate=True``), or None."""
        if self._exclude is None and self._decontaminate:

            self._exclude = build_index()
        return self._exclude

    def _decontaminated(self, cursor: _Cursor, key: Any, doc: Any) -> Any:
        """``doc`` without its contaminated passages (None: dropped whole), by the plan's verdicts."""
        if self.index is None:
            return doc

        if isinstance(cursor.docs, StreamDocs):  # no stable ids: check as it streams
            findings = check_document(self.index, doc)
            kept = remove(doc, findings)
            if cursor.epoch == 0:
                cursor.live_report = cursor.live_report or SourceReport(cursor.src.name)
                cursor.live_report.add(str(key), doc, findings, kept)
            return kept
        self.plan()
        cuts = self._plan[cursor.src.name]["_cuts"].get(key, [])
        if cuts is None:
            return None
        return remove(doc, [((a, b), Verdict("contaminated")) for a, b in cuts]) if cuts else doc

    # --- sources ----------------------------------------------------------------------------------------

    def _open_docs(self, src: Source) -> Docs | StreamDocs:
        return src.open(OpenContext(self.mix.base_dir, self.tokenizer, self.model, self.show_progress))

    # --- plan -------------------------------------------------------------------------------------------

    def _scan_key(self, src: Source, docs: Docs) -> str:
        if self._tok_fp is None:
            self._tok_fp = tokenizer_fingerprint(self.tokenizer)
        h = hashlib.sha256(json.dumps({"v": PLAN_VERSION, **src.plan_key(), "n": len(docs)}, sort_keys=True).encode())
        for f in docs.files:
            h.update(str(f.name).encode())
            h.update(sha256_file(f).encode())
        h.update(self._tok_fp.encode())
        h.update(str(self.index.fingerprint if self.index is not None else None).encode())
        return h.hexdigest()

    def _scan(self, src: Source) -> dict[str, Any]:
        """One streaming pass over a source: documents, unique tokens (= one epoch), decontamination verdicts."""
        docs = self._cursors[src.name].docs
        if isinstance(docs, StreamDocs) and not src.max_documents:
            return {"documents": None, "unique_tokens": None, "unique_loss_tokens": None, "decontamination": None,
                    "_cuts": {}, "note": "streaming dataset without max_documents: not counted; decontaminated as it streams"}

        key = None
        if not isinstance(docs, StreamDocs):
            key = self._scan_key(src, docs)
            path = cache_dir() / "mix-plan" / f"{key[:32]}.json"
            if path.is_file():
                info = json.loads(path.read_text())
                info["_cuts"] = {int(k): v for k, v in info.pop("cuts").items()}
                if info["decontamination"] is not None:
                    info["decontamination"]["source"] = src.name
                return info
        report = SourceReport(src.name) if self.index is not None else None
        n_docs = tokens = loss = 0
        cuts: dict[int, list[list[int]] | None] = {}
        items = docs.scan() if isinstance(docs, StreamDocs) else ((i, docs.get(i)) for i in range(len(docs)))
        with steps(self.show_progress, f"scan {src.name}", None if isinstance(docs, StreamDocs) else len(docs)) as advance:
            for i, doc in items:
                doc_id = i if isinstance(docs, StreamDocs) else docs.doc_id(i)
                if report is not None:
                    findings = check_document(self.index, doc)
                    kept = remove(doc, findings)
                    report.add(doc_id, doc, findings, kept)
                    if kept is None or kept is not doc:
                        cuts[i] = None if kept is None else [list(span) for span, v in findings if v.dropped]
                    if kept is None:
                        advance()
                        continue
                    doc = kept
                ids, labels = encode_document(self.tokenizer, doc, f"source {src.name!r} document {doc_id}")
                n_docs += bool(ids)
                tokens += len(ids)
                loss += sum(t != IGNORE for t in labels)
                advance()
        info = {"documents": n_docs, "unique_tokens": tokens, "unique_loss_tokens": loss,
                "decontamination": report.to_dict() if report is not None else None}
        if key is not None:
            write_text_atomic(path, json.dumps({**info, "cuts": cuts}))
        return {**info, "_cuts": cuts}

    def plan(self) -> list[dict[str, Any]]:
        """Per source (recipe order): fraction, target sequences/tokens, documents, unique tokens (one epoch,
        after decontamination), epochs = target / unique, documents dropped. Scans each source once (cached)."""
        if self._plan is None:
            self._plan = {}
            for s in self.mix.sources:
                if self.targets[s.name] == 0:
                    self._plan[s.name] = {"documents": None, "unique_tokens": None, "unique_loss_tokens": None,
                                          "decontamination": None, "_cuts": {}, "note": "no tokens allocated: not scanned"}
                else:
                    self._plan[s.name] = self._scan(s)
        fr = self.mix.fractions()
        rows = []
        for s in self.mix.sources:
            info = self._plan[s.name]
            target = self.targets[s.name] * self.seq_len
            unique = info["unique_tokens"]
            d = info["decontamination"]
            rows.append({"source": s.name, "kind": s.kind, "fraction": fr[s.name], "target_sequences": self.targets[s.name],
                         "target_tokens": target, "documents": info["documents"], "unique_tokens": unique,
                         "unique_loss_tokens": info["unique_loss_tokens"],
                         "epochs": target / unique if unique else None,
                         "dropped_documents": d["documents_dropped"] if d else 0,
                         "dropped_passages": d["passages_dropped"] if d else 0,
                         "dropped_chars": d["chars_dropped"] if d else 0, **({"note": info["note"]} if "note" in info else {})})
        return rows

    def format_plan(self) -> str:
        """The plan as a text table (phi-4 Table 5: fraction of training, unique tokens, epochs)."""
        head = f"{'source':<16} {'kind':<8} {'fraction':>8} {'target tok':>12} {'unique tok':>12} {'epochs':>7} {'cut':>5}"
        lines = [head, "-" * len(head)]
        for r in self.plan():
            unique = f"{r['unique_tokens']:,}" if r["unique_tokens"] is not None else "?"
            epochs = f"{r['epochs']:.2f}" if r["epochs"] is not None else "?"
            lines.append(f"{r['source']:<16} {r['kind']:<8} {r['fraction']:>8.1%} {r['target_tokens']:>12,} {unique:>12} "
                         f"{epochs:>7} {r['dropped_passages']:>5}")
        return "\n".join(lines)

    # --- iteration --------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_sequences

    def _pick(self) -> str:
        k, n = self._k, self.num_sequences
        best, best_def = None, None
        for name, t in self.targets.items():
            c = self._cursors[name].sequences
            if c >= t:
                continue
            deficit = t * (k + 1) - c * n
            if best_def is None or deficit > best_def:
                best, best_def = name, deficit
        assert best is not None, (self.targets, k)
        return best

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The remaining sequences. State advances before each yield, so ``state_dict()`` taken after
        receiving a sequence resumes at the next one."""
        if self.index is not None:
            self.plan()  # decontaminate every source before the first training step
        while self._k < self.num_sequences:
            name = self._pick()
            cur = self._cursors[name]
            ids, labels = cur.take(self.seq_len)
            cur.sequences += 1
            cur.tokens += len(ids)
            cur.loss_tokens += sum(t != IGNORE for t in labels)
            self._k += 1
            yield {"input_ids": torch.tensor(ids, dtype=torch.long), "labels": torch.tensor(labels, dtype=torch.long),
                   "source": name}

    # --- resume and reporting ---------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        index = self.index if (self._exclude is not None or self._decontaminate) else None
        return {"mix": self.mix.to_dict(), "seq_len": self.seq_len, "total_tokens": self.total_tokens, "seed": self.seed,
                "decontamination": index.fingerprint if index is not None else None}

    def state_dict(self) -> dict[str, Any]:
        """The exact data position (JSON-able): restore it into a loader built with the same settings."""
        return {"version": STATE_VERSION, "config": self._config(), "sequences": self._k,
                "sources": {n: c.state() for n, c in self._cursors.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise QRecoverError(f"data-loader state version {state.get('version')!r} is not {STATE_VERSION}; it comes from "
                                "another qrecover version: restart the run")
        mine = self._config()
        diff = {k: (state["config"].get(k), v) for k, v in mine.items() if state["config"].get(k) != v}
        if diff:
            raise QRecoverError(f"cannot resume the data position: the loader was built with different settings "
                                f"{ {k: f'{a!r} -> {b!r}'[:200] for k, (a, b) in diff.items()} } (saved -> now); "
                                "rebuild it with the saved mix, seq_len, total_tokens, seed and decontamination")
        self._k = int(state["sequences"])
        for name, st in state["sources"].items():
            self._cursors[name].restore(st)

    def report(self) -> dict[str, Any]:
        """JSON-able: per source the target and consumed sequences/tokens, loss tokens, documents read, the
        current epoch, epochs so far (if planned), and the decontamination report."""
        sources = {}
        for s in self.mix.sources:
            c = self._cursors[s.name]
            info = (self._plan or {}).get(s.name, {})
            unique = info.get("unique_tokens")
            sources[s.name] = {"kind": s.kind, "fraction": self.mix.fractions()[s.name],
                               "target_sequences": self.targets[s.name], "target_tokens": self.targets[s.name] * self.seq_len,
                               "sequences": c.sequences, "tokens": c.tokens, "loss_tokens": c.loss_tokens,
                               "documents_read": c.documents, "epoch": c.epoch, "unique_tokens": unique,
                               "epochs": c.tokens / unique if unique else None}
        out: dict[str, Any] = {"seq_len": self.seq_len, "total_tokens": self.total_tokens, "num_sequences": self.num_sequences,
                               "sequences": self._k, "seed": self.seed, "mix": self.mix.to_dict(), "sources": sources,
                               "decontamination": None}
        if self.index is not None:
            per = {}
            for s in self.mix.sources:
                d = (self._plan or {}).get(s.name, {}).get("decontamination")
                live = self._cursors[s.name].live_report
                per[s.name] = d if d is not None else (live.to_dict() if live is not None else None)
            out["decontamination"] = {"index": self.index.describe(), "sources": per}
        return out

    def close(self) -> None:
        for c in self._cursors.values():
            if isinstance(c._docs, Docs):
                c._docs.close()


def is_mix(source: str) -> bool:
    """Whether a calibration source names a data-mix recipe (a ``.toml`` file, or a shipped recipe such as
    ``calib-mix``) rather than text."""
    if str(source).endswith(".toml"):
        return True
    if Path(source).exists():
        return False
    return str(source).endswith("-mix") and str(source) in shipped_names()


def calibration_windows(tokenizer, source: str, n: int, seq_len: int, model: Any = None,
                        show_progress: bool = False) -> torch.Tensor:
    """``(n, seq_len)`` calibration windows of ``source``: a text source's ``calib`` split
    (:func:`qrecover.data.corpus.token_windows`), or the first ``n`` packed sequences of a data-mix recipe
    (this module's :class:`MixLoader`: each source in its token share, chats with their template, decontaminated
    against the evaluation sets). ``model``: the unquantized model (spec or module) that writes a recipe's
    ``selfgen`` chats (cached by its weights; None = the built-in default)."""
    if not is_mix(source):
        return token_windows(tokenizer, source, "calib", n, seq_len)
    recipe = source if str(source).endswith(".toml") else shipped_path(source)
    loader = MixLoader(recipe, tokenizer, seq_len, n * seq_len, decontaminate=True, model=model, show_progress=show_progress)
    return torch.stack([s["input_ids"] for s in loader])


__all__ = ["MixLoader", "apportion",
           "encode_document", "tokenizer_fingerprint", "is_mix", "calibration_windows"]

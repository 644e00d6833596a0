"""``qrecover data prepare``: tokenize every source of a mix once, in parallel, into the shards of :mod:`.shards`.

Documents come from the mix loader's own readers (:meth:`.mix.MixLoader._open_docs`: text, jsonl and parquet
files or directories of them, the built-in docs, self-generated chats, streamed Hugging Face datasets), are
decontaminated by the mix loader's rule and index (:func:`.decontam.check_document` / :func:`.decontam.remove`
with :attr:`.mix.MixLoader.index`, reported per source with :class:`.decontam.SourceReport`) and tokenized by
:func:`.mix.encode_document`, so a prepared source holds exactly the tokens and labels the on-the-fly loader
would produce.

**Parallelism.** Worker processes (forked, so they share the parent's tokenizer, document indexes and
decontamination index without copying them) each take chunks of :data:`CHUNK_DOCS` consecutive documents;
the parent writes their results in document order, at most ``4 x workers`` chunks ahead. Shards are cut by
token count alone, so the output is byte-identical for any number of workers.

**Atomicity.** Everything is written into a temporary directory beside ``--out`` that is renamed into place
at the end (:func:`qrecover.io_utils.atomic_dir`); an error or Ctrl-C removes it. Every input (the mix, the
tokenizer, each source's files, a reachable dataset) is checked before anything is written.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from .._version import __version__
from ..checkpoint import read_manifest as read_checkpoint_manifest
from ..errors import QRecoverError
from ..io_utils import atomic_dir, sha256_file, write_text_atomic
from ..models import resolve
from ..progress import steps
from .decontam import SourceReport, check_document, remove
from .documents import StreamDocs
from .mix import MixLoader, encode_document, tokenizer_fingerprint
from .mix_recipe import Mix, load_mix
from .shards import FORMAT, FORMAT_VERSION, MANIFEST, data_id, source_dir_name

DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB of uint16 ids per shard
CHUNK_DOCS = 32  # documents per worker task
_WORKER: dict[str, Any] = {}  # what forked workers inherit: tokenizer, documents per source, index


def default_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 8))


def load_tokenizer(model: str | None) -> tuple[Any, Any]:
    """``(tokenizer, generator)`` for ``--model``: the tokenizer of a model directory, .gguf file or qrecover
    checkpoint (None: the built-in default), and the model self-generated chats come from (a checkpoint's
    unquantized source)."""
    from transformers import AutoTokenizer

    path, kind = resolve(model)
    if kind == "gguf":
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        tok = AutoTokenizer.from_pretrained(path)
    generator: Any = None if kind == "default" else str(path)
    if kind == "qrecover":
        src = read_checkpoint_manifest(path)["source"]
        generator = None if src["kind"] == "default" else src["path"]
    return tok, generator


def _init_worker() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it terminates the pool


def _encode_chunk(task: tuple[int, int, int, list | None]) -> dict[str, Any]:
    """Tokenize one chunk of a source: ``ids`` (all documents back to back), ``loss`` (bool, same length),
    ``lengths`` (tokens per document, 0 for an empty or dropped one), ``chars`` (characters scanned per
    document) and ``reports`` ({position in chunk: SourceReport of that document} where decontamination
    found something)."""
    si, start, stop, items = task
    tok, index = _WORKER["tokenizer"], _WORKER["index"]
    name, docs = _WORKER["sources"][si]
    if items is None:
        items = [(docs.doc_id(i), docs.get(i)) for i in range(start, stop)]
    ids, loss, lengths, chars, reports = [], [], [], [], {}
    for k, (doc_id, doc) in enumerate(items):
        if index is not None:
            findings = check_document(index, doc)
            kept = remove(doc, findings)
            one = SourceReport(name)
            one.add(doc_id, doc, findings, kept)
            chars.append(one.chars_scanned)
            if findings:
                reports[k] = one
            doc = kept
        if doc is None:
            lengths.append(0)
            continue
        d_ids, d_labels = encode_document(tok, doc, f"source {name!r} document {doc_id}")
        lengths.append(len(d_ids))
        ids += d_ids
        loss += [lab != -100 for lab in d_labels]
    return {"ids": np.asarray(ids, np.int64), "loss": np.asarray(loss, bool), "lengths": lengths, "chars": chars,
            "reports": reports}


def _tasks(si: int, docs: Any) -> Iterator[tuple[int, int, int, list | None]]:
    if isinstance(docs, StreamDocs):  # no random access: the parent streams, workers tokenize
        batch: list = []
        for doc_id, doc in docs.scan():
            batch.append((doc_id, doc))
            if len(batch) == CHUNK_DOCS:
                yield si, 0, 0, batch
                batch = []
        if batch:
            yield si, 0, 0, batch
        return
    for a in range(0, len(docs), CHUNK_DOCS):
        yield si, a, min(a + CHUNK_DOCS, len(docs)), None


def _ordered(pool: Any, tasks: Iterator, ahead: int) -> Iterator[dict[str, Any]]:
    """Results of :func:`_encode_chunk` in task order, at most ``ahead`` tasks in flight."""
    if pool is None:
        yield from map(_encode_chunk, tasks)
        return
    pending: deque = deque()
    for t in tasks:
        pending.append(pool.apply_async(_encode_chunk, (t,)))
        if len(pending) >= ahead:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _file_entry(root: Path, rel: str) -> dict[str, Any]:
    return {"path": rel, "bytes": (root / rel).stat().st_size, "sha256": sha256_file(root / rel)}


class _ShardWriter:
    """One source's stream cut into shards of ``shard_tokens`` tokens, with document offsets."""

    def __init__(self, root: Path, rel: str, dtype: np.dtype, shard_tokens: int):
        self.root, self.rel, self.dtype, self.shard_tokens = root, rel, dtype, shard_tokens
        (root / rel).mkdir(parents=True)
        self.ids: list[np.ndarray] = []
        self.loss: list[np.ndarray] = []
        self.n = 0  # tokens in the open shard
        self.total = self.flushed = self.loss_tokens = 0
        self.offsets = [0]
        self.shards: list[dict[str, Any]] = []

    def add(self, ids: np.ndarray, loss: np.ndarray) -> None:
        if len(ids) and int(ids.max()) > np.iinfo(self.dtype).max:
            raise QRecoverError(f"token id {int(ids.max())} does not fit {self.dtype.name}; the tokenizer's length is wrong")
        pos = 0
        while pos < len(ids):
            k = min(len(ids) - pos, self.shard_tokens - self.n)
            self.ids.append(ids[pos : pos + k].astype(self.dtype))
            self.loss.append(loss[pos : pos + k])
            self.n, pos = self.n + k, pos + k
            if self.n == self.shard_tokens:
                self._flush()
        self.total += len(ids)
        self.loss_tokens += int(loss.sum())
        self.offsets.append(self.total)

    def _flush(self) -> None:
        i = len(self.shards)
        tok, mask = f"{self.rel}/tokens-{i:05d}.npy", f"{self.rel}/mask-{i:05d}.npy"
        np.save(self.root / tok, np.concatenate(self.ids))
        np.save(self.root / mask, np.packbits(np.concatenate(self.loss), bitorder="little"))
        self.shards.append({"n_tokens": self.n, "start": self.flushed, "tokens": _file_entry(self.root, tok),
                            "mask": _file_entry(self.root, mask)})
        self.flushed += self.n
        self.ids, self.loss, self.n = [], [], 0

    def close(self) -> dict[str, Any]:
        if self.n:
            self._flush()
        np.save(self.root / f"{self.rel}/documents.npy", np.asarray(self.offsets, np.int64))
        return {"shards": self.shards, "documents_file": _file_entry(self.root, f"{self.rel}/documents.npy")}


def _open_sources(mix: Mix, loader: MixLoader, tokens: int | None) -> dict[int, Any]:
    """Every source with a positive weight opened (file indexes built, self-generated chats made, datasets
    reached), before anything is written."""
    opened = {}
    for si, src in enumerate(mix.sources):
        if src.weight <= 0:
            continue
        docs = loader._open_docs(src)
        if isinstance(docs, StreamDocs):
            if not src.max_documents and tokens is None:
                raise QRecoverError(f"source {src.name!r} (kind 'hf') streams {src.dataset!r} without an end; pass --tokens N "
                                    "(each source's share of N) or set max_documents in the source")
            try:
                docs.open()
            except QRecoverError as e:
                raise QRecoverError(" ".join(str(e).split())) from None  # one line
        opened[si] = docs
    return opened


def prepare_data(mix: str | os.PathLike | Mix, out: str | os.PathLike, model: str | None = None, workers: int | None = None,
                 tokens: int | None = None, shard_tokens: int = DEFAULT_SHARD_TOKENS, overwrite: bool = False,
                 decontaminate: bool = True, exclude: Any = None, tokenizer: Any = None,
                 show_progress: bool = True) -> dict[str, Any]:
    """Tokenize ``mix`` into ``out`` (see the module docstring); returns the manifest.

    ``model``: whose tokenizer (and, for self-generated sources, whose generations); None = the built-in
    default; ``tokenizer`` overrides the tokenizer. ``workers``: processes (default min(cores, 8)).
    ``tokens``: stop each source once it holds its share (``weight / sum of weights``) of this many tokens
    (whole documents; None = every document). ``exclude``: a decontamination index (default: the mix loader's
    index of every evaluation set when ``decontaminate``).
    """
    t0 = time.time()
    out = Path(out).expanduser()
    for name, v in (("--workers", workers), ("--tokens", tokens), ("--shard-tokens", shard_tokens)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise QRecoverError(f"{name} {v!r} must be a positive integer")
    if out.exists() and not overwrite:
        raise QRecoverError(f"output directory {str(out)!r} already exists; pass --overwrite to replace it")
    workers = workers or default_workers()
    if "fork" not in multiprocessing.get_all_start_methods():  # workers inherit the parent's indexes by fork
        workers = 1
    mix = load_mix(mix)
    generator = None
    if tokenizer is None:
        tokenizer, generator = load_tokenizer(model)
    if tokenizer.eos_token_id is None:
        raise QRecoverError("the tokenizer has no eos_token, needed between packed documents; set tokenizer.eos_token")
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else None
    dtype = np.dtype(np.uint16 if size is not None and size <= 1 << 16 else np.uint32)
    loader = MixLoader(mix, tokenizer, seq_len=1, total_tokens=1, exclude=exclude,
                       decontaminate=decontaminate and exclude is None, model=generator, show_progress=show_progress)
    opened = _open_sources(mix, loader, tokens)
    index = loader.index
    fractions = mix.fractions()
    caps = {si: math.ceil(fractions[mix.sources[si].name] * tokens) if tokens else None for si in opened}
    for docs in opened.values():
        if hasattr(docs, "close"):
            docs.close()  # open file handles must not be shared by forked workers
    _WORKER.update(tokenizer=tokenizer, index=index, sources={si: (mix.sources[si].name, d) for si, d in opened.items()})
    ctx = multiprocessing.get_context("fork")
    rows: list[dict[str, Any]] = []
    try:
        with atomic_dir(out, overwrite=overwrite) as tmp, \
                (ctx.Pool(workers, initializer=_init_worker) if workers > 1 else _NoPool()) as pool:
            for si, src in enumerate(mix.sources):
                row: dict[str, Any] = {"name": src.name, "kind": src.kind, "weight": src.weight, "fraction": fractions[src.name]}
                if si not in opened:
                    rows.append({**row, "dir": None, "documents": 0, "documents_read": 0, "tokens": 0, "loss_tokens": 0,
                                 "complete": False, "shards": [], "documents_file": None, "decontamination": None,
                                 "note": "weight 0: not prepared"})
                    continue
                row.update(_prepare_source(tmp, si, src.name, opened[si], pool, workers, dtype, shard_tokens, caps[si],
                                           index, show_progress))
                rows.append(row)
            manifest = {
                "format": FORMAT, "version": FORMAT_VERSION, "qrecover_version": __version__,
                "tokenizer": {"fingerprint": tokenizer_fingerprint(tokenizer), "name": str(getattr(tokenizer, "name_or_path", "")),
                              "vocab_size": size, "eos_token_id": tokenizer.eos_token_id},
                "dtype": dtype.name, "shard_tokens": shard_tokens, "tokens_cap": tokens, "mix": mix.to_dict(),
                "decontamination": {"index": index.describe(), "sources": {r["name"]: r["decontamination"] for r in rows}}
                if index is not None else None,
                "sources": rows,
                "totals": {k: sum(r[k] for r in rows) for k in ("documents", "tokens", "loss_tokens")},
            }
            manifest["data_id"] = data_id(manifest)
            manifest["stats"] = {"workers": workers, "seconds": round(time.time() - t0, 2),
                                 "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
            write_text_atomic(tmp / MANIFEST, _dumps(manifest))
    finally:
        _WORKER.clear()
        loader.close()
    return manifest


def _dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1) + "\n"


class _NoPool:
    """Stands for a pool with one worker: tasks run in this process."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _prepare_source(root: Path, si: int, name: str, docs: Any, pool: Any, workers: int, dtype: np.dtype, shard_tokens: int,
                    cap: int | None, index: Any, show_progress: bool) -> dict[str, Any]:
    rel = source_dir_name(si, name)
    writer = _ShardWriter(root, rel, dtype, shard_tokens)
    report = SourceReport(name) if index is not None else None
    read = docs_kept = 0
    stopped = False  # by the token cap, with documents left
    total = None if isinstance(docs, StreamDocs) else len(docs)
    with steps(show_progress, f"tokenize {name}", total) as advance:
        results = _ordered(pool, _tasks(si, docs), 4 * workers)
        for res in results:
            at = 0
            for k, n in enumerate(res["lengths"]):
                if cap is not None and writer.total >= cap:
                    stopped = True
                    break
                if report is not None:
                    one = res["reports"].get(k)
                    if one is None:
                        report.scanned += 1
                        report.chars_scanned += res["chars"][k]
                    else:
                        _merge(report, one)
                if n:
                    writer.add(res["ids"][at : at + n], res["loss"][at : at + n])
                docs_kept += n > 0
                read += 1
                at += n
            advance(len(res["lengths"]))
            if stopped:
                break
        results.close()
    if writer.total == 0:
        raise QRecoverError(f"source {name!r} has no usable documents (empty, or all dropped by decontamination); remove it "
                            "from the mix or give it weight 0")
    files = writer.close()
    return {"dir": rel, "documents": docs_kept, "documents_read": read, "tokens": writer.total,
            "loss_tokens": writer.loss_tokens, "complete": not stopped, **files,
            "decontamination": report.to_dict() if report is not None else None}


def _merge(report: SourceReport, one: SourceReport) -> None:
    report.scanned += one.scanned
    report.chars_scanned += one.chars_scanned
    report.chars_dropped += one.chars_dropped
    report.documents_dropped += one.documents_dropped
    report.removed += one.removed
    report.partial += one.partial


__all__ = ["prepare_data", "load_tokenizer", "default_workers", "DEFAULT_SHARD_TOKENS", "CHUNK_DOCS"]

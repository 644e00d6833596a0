"""Documents of a data source, read one at a time in a fixed order: text files (one document per file, or
per paragraph of a single file), JSONL and Parquet rows (text or chat messages), streamed Hugging Face
datasets. Shared by the data mix (:mod:`.mix`), decontamination (:mod:`.decontam`) and self-generated data
(:mod:`.selfgen`); it imports none of them, only the :class:`.source.Source` base whose keys it reads.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import QRecoverError
from .corpus import SPLITS, _bucket, source_files
from .source import Source


def resolve_path(path: str, base_dir: str | None) -> str:
    p = os.path.expanduser(path)
    return p if os.path.isabs(p) or base_dir is None else os.path.join(base_dir, p)


def list_files(src: Source, base_dir: str | None) -> list[Path]:
    """The files of a text/jsonl/parquet source (sorted), or a QRecoverError when the path matches nothing."""
    where = f"source {src.name!r}: path {src.path!r}"
    p = Path(resolve_path(src.path, base_dir))
    if src.kind == "text":  # the same file listing (and so the same splits) as --calib-data
        try:
            files = source_files(str(p))[1]
        except QRecoverError:
            files = []
        if not files:
            raise QRecoverError(f"{where} matches no files (resolved to {str(p)!r}); pass an existing file, directory or glob")
        return files
    ext = {"jsonl": ".jsonl", "parquet": ".parquet"}.get(src.kind)
    if p.is_dir():
        files = sorted(f for f in p.rglob("*") if f.is_file() and not any(x.startswith(".") for x in f.relative_to(p).parts))
        if ext:
            files = [f for f in files if f.name.endswith(ext)]
        if not files:
            raise QRecoverError(f"{where} is a directory with no {ext or ''} files".replace("  ", " ") + "; point it at your data")
        return files
    if p.is_file():
        return [p]
    files = sorted(Path(f) for f in glob.glob(str(p), recursive=True) if Path(f).is_file())
    if not files:
        raise QRecoverError(f"{where} matches no files (resolved to {str(p)!r}); pass an existing file, directory or glob")
    return files


class Docs:
    """Documents of one source in a fixed base order, read one at a time.

    ``len``: number of documents; ``get(i)``: the i-th (a text or a messages list); ``doc_id(i)``: a stable
    name for reports; ``files``: what the content hash covers; ``order(epoch, seed)``: the epoch's order.
    """

    files: list[Path] = []

    def __len__(self) -> int:
        raise NotImplementedError

    def get(self, i: int) -> Any:
        raise NotImplementedError

    def doc_id(self, i: int) -> str:
        return str(i)

    def order(self, epoch: int, seed: int) -> np.ndarray:
        return np.random.default_rng([seed, epoch]).permutation(len(self))

    def close(self) -> None:
        pass


class _FileDocs(Docs):
    """One document per file."""

    def __init__(self, files: list[tuple[str, Path]]):
        self.items = files
        self.files = [p for _, p in files]

    def __len__(self) -> int:
        return len(self.items)

    def get(self, i: int) -> str:
        return self.items[i][1].read_text(errors="replace")

    def doc_id(self, i: int) -> str:
        return self.items[i][0]


class _ParagraphDocs(Docs):
    """One document per blank-line-separated paragraph of one file (as :func:`qrecover.data.corpus.documents`),
    found by a streaming pass that keeps only byte offsets."""

    def __init__(self, path: Path, split: str | None):
        self.path, self.files = path, [path]
        starts, ends, keys = [], [], []
        n = 0
        for start, end, text in self._paragraphs(path):
            if not text.strip():
                continue
            if split is not None:
                b, h = _bucket(f"{n}:{text[:64]}")
                n += 1
                if b not in SPLITS[split]:
                    continue
                keys.append(h)
            starts.append(start), ends.append(end)
        order = np.argsort(np.asarray(keys), kind="stable") if split is not None else np.arange(len(starts))
        self.spans = np.stack([np.asarray(starts, np.int64), np.asarray(ends, np.int64)], 1)[order] if starts else np.zeros((0, 2), np.int64)

    @staticmethod
    def _paragraphs(path: Path, chunk: int = 1 << 20) -> Iterator[tuple[int, int, str]]:
        with open(path, "rb") as f:
            buf, base = b"", 0
            while True:
                block = f.read(chunk)
                buf += block
                parts = buf.split(b"\n\n")
                done = parts if not block else parts[:-1]
                for part in done:
                    yield base, base + len(part), part.decode("utf-8", errors="replace")
                    base += len(part) + 2
                if not block:
                    return
                buf = parts[-1]

    def __len__(self) -> int:
        return len(self.spans)

    def get(self, i: int) -> str:
        start, end = (int(x) for x in self.spans[i])
        with open(self.path, "rb") as f:
            f.seek(start)
            return f.read(end - start).decode("utf-8", errors="replace")

    def doc_id(self, i: int) -> str:
        return f"{self.path.name}@{int(self.spans[i][0])}"


def _row_doc(row: dict, src: Source, where: str) -> Any:
    if src.messages_field in row and row[src.messages_field] is not None:
        return row[src.messages_field] if isinstance(row[src.messages_field], list) else list(row[src.messages_field])
    if src.field in row and isinstance(row[src.field], str):
        return row[src.field]
    raise QRecoverError(f"{where} has neither a text field {src.field!r} nor a chat field {src.messages_field!r} "
                        f"(its fields: {sorted(row)[:12]}); set field = / messages_field = in the source")


class JsonlDocs(Docs):
    """One document per non-empty line; the index is the byte offset of each line."""

    def __init__(self, files: list[Path], src: Source):
        self.files, self.src = files, src
        fidx, offs = [], []
        for k, path in enumerate(files):
            pos = 0
            with open(path, "rb") as f:
                for line in f:
                    if line.strip():
                        fidx.append(k), offs.append(pos)
                    pos += len(line)
        self.fidx, self.offs = np.asarray(fidx, np.int32), np.asarray(offs, np.int64)
        self._handles: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.offs)

    def get(self, i: int) -> Any:
        k = int(self.fidx[i])
        f = self._handles.get(k) or self._handles.setdefault(k, open(self.files[k], "rb"))
        f.seek(int(self.offs[i]))
        line = f.readline()
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise QRecoverError(f"{self.doc_id(i)} is not valid JSON ({e}); fix or remove that line") from None
        if not isinstance(row, dict):
            raise QRecoverError(f"{self.doc_id(i)} must be a JSON object with a {self.src.field!r} or "
                                f"{self.src.messages_field!r} field, got {type(row).__name__}")
        return _row_doc(row, self.src, self.doc_id(i))

    def doc_id(self, i: int) -> str:
        k, off = int(self.fidx[i]), int(self.offs[i])
        return f"{self.files[k].name}@{off}"

    def close(self) -> None:
        for f in self._handles.values():
            f.close()
        self._handles.clear()


class ParquetDocs(Docs):
    """One document per row; read a row group at a time (the epoch order shuffles row groups, then rows)."""

    def __init__(self, files: list[Path], src: Source):
        import pyarrow.parquet as pq

        self.files, self.src = files, src
        groups, self.column = [], None
        for k, path in enumerate(files):
            pf = pq.ParquetFile(path)
            names = pf.schema_arrow.names
            col = src.messages_field if src.messages_field in names else src.field if src.field in names else None
            if col is None:
                raise QRecoverError(f"source {src.name!r}: {path.name} has neither a column {src.field!r} nor "
                                    f"{src.messages_field!r} (columns: {names[:12]}); set field = / messages_field =")
            if self.column not in (None, col):
                raise QRecoverError(f"source {src.name!r}: files mix text and chat columns; use one kind per source")
            self.column = col
            in_file = 0
            for g in range(pf.metadata.num_row_groups):
                rows = pf.metadata.row_group(g).num_rows
                groups.append((k, g, rows, in_file))  # file, row group, rows, first row's number in the file
                in_file += rows
        self.groups = groups
        self.starts = np.cumsum([0] + [g[2] for g in groups])
        self._cache: tuple[int, list] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _group(self, gi: int) -> list:
        if self._cache is None or self._cache[0] != gi:
            import pyarrow.parquet as pq

            k, g, _, _ = self.groups[gi]
            self._cache = (gi, pq.ParquetFile(self.files[k]).read_row_group(g, columns=[self.column]).column(0).to_pylist())
        return self._cache[1]

    def get(self, i: int) -> Any:
        gi = int(np.searchsorted(self.starts, i, side="right")) - 1
        value = self._group(gi)[i - int(self.starts[gi])]
        return _row_doc({self.column: value}, self.src, self.doc_id(i))

    def doc_id(self, i: int) -> str:
        gi = int(np.searchsorted(self.starts, i, side="right")) - 1
        k, _, _, in_file = self.groups[gi]
        return f"{self.files[k].name}#{in_file + i - int(self.starts[gi])}"

    def order(self, epoch: int, seed: int) -> np.ndarray:
        rng = np.random.default_rng([seed, epoch])
        parts = [int(self.starts[g]) + rng.permutation(int(self.starts[g + 1] - self.starts[g]))
                 for g in rng.permutation(len(self.groups))]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)


class Limited(Docs):
    """The first ``n`` documents of another source."""

    def __init__(self, inner: Docs, n: int):
        self.inner, self.n, self.files = inner, min(n, len(inner)), inner.files

    def __len__(self) -> int:
        return self.n

    def get(self, i: int) -> Any:
        return self.inner.get(i)

    def doc_id(self, i: int) -> str:
        return self.inner.doc_id(i)

    def close(self) -> None:
        self.inner.close()


def split_files(source: str, split: str) -> list[tuple[str, Path]]:
    """``[(relative path, path)]`` of one split of a multi-file text source, in hash order (as qrecover.data.corpus)."""
    root, files = source_files(source)
    keyed = [(_bucket(str(f.relative_to(root))), str(f.relative_to(root)), f) for f in files]
    keyed.sort(key=lambda k: k[0][1])  # by the path's hash alone, as qrecover.data.corpus.documents
    return [(rel, f) for (b, _), rel, f in keyed if b in SPLITS[split]]


def text_docs(source: str, split: str | None = None) -> Docs:
    """Documents of a text source (``python-docs``, a directory, file or glob), optionally one split of it:
    one per file, or one per paragraph when the source is a single file."""
    if split is not None and split not in SPLITS:
        raise QRecoverError(f"unknown split {split!r}; choose from {list(SPLITS)}")
    root, files = source_files(source)
    if len(files) == 1 and source != "python-docs":
        return _ParagraphDocs(files[0], split)
    if split is None:
        return _FileDocs([(str(f.relative_to(root)), f) for f in files])
    return _FileDocs(split_files(source, split))


class StreamDocs:
    """A streaming Hugging Face dataset: no random access; an epoch is ``shuffle(seed).set_epoch(epoch).skip(pos)``."""

    def __init__(self, src: Source):
        self.src = src
        self._ds = None

    def open(self):
        if self._ds is None:
            src = self.src
            try:
                import datasets
            except ImportError:
                raise QRecoverError(f"source {src.name!r} (kind 'hf') needs `pip install datasets`") from None
            try:
                ds = datasets.load_dataset(src.dataset, src.config, split=src.split or "train", data_files=src.data_files,
                                           revision=src.revision, streaming=True)
            except Exception as e:  # the Hub client raises ConnectionError, OSError, ValueError, ...
                raise QRecoverError(
                    f"source {src.name!r}: cannot open the Hugging Face dataset {src.dataset!r} (config={src.config!r}, "
                    f"split={src.split or 'train'!r}): {type(e).__name__}: {str(e)[:300]}. If the Hub is unreachable from "
                    "this machine, download the data elsewhere and use kind = \"jsonl\" or \"parquet\" with a local path") from e
            self._ds = ds.take(src.max_documents) if src.max_documents else ds
        return self._ds

    def epoch(self, epoch: int, seed: int, start: int) -> Iterator[Any]:
        ds = self.open().shuffle(seed=seed, buffer_size=self.src.shuffle_buffer)
        ds.set_epoch(epoch)
        for pos, row in enumerate(ds.skip(start) if start else ds, start):
            yield _row_doc(row, self.src, f"source {self.src.name!r} row {pos} of epoch {epoch}")

    def scan(self) -> Iterator[tuple[str, Any]]:
        for pos, row in enumerate(self.open()):
            yield str(pos), _row_doc(row, self.src, f"source {self.src.name!r} row {pos}")



"""Prepared training data: a mix tokenized once into memory-mapped shards, and the loader that reads them.

``qrecover data prepare MIX.toml --out DIR`` (:func:`.prepare.prepare_data`) writes::

    DIR/manifest.json                          what is below, with sizes and sha256 of every file
    DIR/sources/NN-NAME/tokens-00000.npy       (n,) uint16 (uint32 when the vocabulary has > 65536 ids)
    DIR/sources/NN-NAME/mask-00000.npy         (ceil(n / 8),) uint8: the loss mask bit-packed, little bit order
                                               (bit k = token k carries loss: every text token, the assistant
                                               tokens of a chat, exactly :func:`.mix.encode_document`'s labels)
    DIR/sources/NN-NAME/documents.npy          (D + 1,) int64: token offset of each document in the source's
                                               stream (document d = tokens [docs[d], docs[d + 1]))

A source's *stream* is its documents (after decontamination) in the source's base order, each tokenized as
the mix loader does (text + EOS; a chat rendered by its template), back to back; shards cut the stream every
``shard_tokens`` tokens (a document may continue in the next shard).

**Reading** (:class:`ShardLoader`). ``N = total_tokens // seq_len`` sequences; source ``s`` gets ``t_s`` of
them by the mix weights (largest remainder, as :class:`.mix.MixLoader`). The **global order**: source ``s``'s
``j``-th sequence is due at ``(j + 1/2) / t_s``, sequences sorted by due time (ties: recipe order), so every
prefix holds each source's share to within one sequence. Source-local sequence ``j``: epoch ``e = j // W_s``
with ``W_s = T_s // seq_len`` windows in a source of ``T_s`` tokens; window ``perm_e[j % W_s]`` starting at
token ``off_e + w * seq_len``, where ``perm_e`` (a permutation of the windows) and ``off_e`` (in
``[0, T_s - W_s * seq_len]``, so the few tokens left over move between epochs) come from a generator seeded
with ``(seed, source name, e)``. A sequence may span documents (EOS between them, as the mix loader packs) and
a shard boundary (read from both). ``labels = input_ids`` where the mask is set, else ``-100``.

**Ranks** (:meth:`ShardLoader.batches`): micro-batch ``k`` is global sequences ``[p, p + B * world)``, ``p``
the position; rank ``r`` takes the ``r``-th, ``(r + world)``-th, ... of them (``i % world == r`` when ``p``
is a multiple of ``world``, as it always is at step boundaries) and reads only those from the memory maps.
The state is the one global position, so a run resumes at the exact sequence on any number of processes
with the same global batch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import QRecoverError
from ..io_utils import sha256_file
from .chat import IGNORE
from .mix import _name_seed, apportion, tokenizer_fingerprint

FORMAT = "qrecover-shards"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
STATE_VERSION = 1
VERIFY = ("size", "sha256")


def is_prepared(path: str | os.PathLike | None) -> bool:
    """True when ``path`` is a directory written by ``qrecover data prepare`` (it has ``manifest.json``)."""
    return path is not None and (Path(path).expanduser() / MANIFEST).is_file()


def source_dir_name(i: int, name: str) -> str:
    """``sources/NN-NAME`` with the name reduced to safe characters (names are free text in a recipe)."""
    return f"sources/{i:02d}-{re.sub(r'[^A-Za-z0-9._-]+', '_', name)[:60]}"


def data_id(manifest: dict[str, Any]) -> str:
    """A content id of prepared data: the tokenizer, the mix and every file's sha256 (not times or worker counts)."""
    h = hashlib.sha256(json.dumps({"tokenizer": manifest["tokenizer"]["fingerprint"], "mix": manifest["mix"],
                                   "dtype": manifest["dtype"]}, sort_keys=True).encode())
    for s in manifest["sources"]:
        files = [s["documents_file"]] + [f for sh in s["shards"] for f in (sh["tokens"], sh["mask"])] if s["shards"] else []
        for f in files:
            h.update(f["sha256"].encode())
    return h.hexdigest()


def read_data_manifest(data_dir: str | os.PathLike) -> dict[str, Any]:
    """The manifest of a prepared directory, format and version checked; QRecoverError naming the fix otherwise."""
    d = Path(data_dir).expanduser()
    path = d / MANIFEST
    if not path.is_file():
        raise QRecoverError(f"{str(d)!r} is not prepared data (no {MANIFEST}); make it with `qrecover data prepare MIX.toml --out {d}`")
    try:
        m = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QRecoverError(f"{str(path)!r} is not valid JSON ({e}); prepare the data again with --overwrite") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise QRecoverError(f"{str(path)!r} is not a qrecover data manifest (format {m.get('format') if isinstance(m, dict) else None!r}); "
                            "prepare the data with `qrecover data prepare`")
    if m.get("version") != FORMAT_VERSION:
        raise QRecoverError(f"{str(d)!r} has data format version {m.get('version')!r}, this qrecover reads {FORMAT_VERSION}; "
                            "prepare the data again with this version (`qrecover data prepare ... --overwrite`)")
    return m


def check_tokenizer(manifest: dict[str, Any], tokenizer: Any, data_dir: str | os.PathLike) -> None:
    """Refuse data tokenized by another tokenizer (one line: both fingerprints and the fix)."""
    mine = tokenizer_fingerprint(tokenizer)
    theirs = manifest["tokenizer"]["fingerprint"]
    if mine != theirs:
        raise QRecoverError(f"prepared data {str(data_dir)!r} was tokenized by another tokenizer (fingerprint {theirs[:16]}, "
                            f"from {manifest['tokenizer'].get('name')!r}) than this model's ({mine[:16]}); prepare it again with "
                            "this model's tokenizer: `qrecover data prepare MIX.toml --model MODEL --out DIR`")


def _verify_file(d: Path, f: dict[str, Any], verify: str) -> Path:
    path = d / f["path"]
    size = path.stat().st_size if path.is_file() else None
    if size != f["bytes"]:
        raise QRecoverError(f"prepared data file {str(path)!r} is {'missing' if size is None else f'{size:,} bytes'}, the manifest "
                            f"says {f['bytes']:,}: truncated or replaced; prepare the data again with --overwrite")
    if verify == "sha256":
        if sha256_file(path) != f["sha256"]:
            raise QRecoverError(f"prepared data file {str(path)!r} does not match its sha256 in the manifest: corrupted; "
                                "prepare the data again with --overwrite")
    return path


class _Stream:
    """One source's token stream over its shards: ``read(a, n)`` -> ``(ids (n,) int64, loss (n,) bool)``."""

    def __init__(self, d: Path, info: dict[str, Any], verify: str):
        self.name, self.tokens = info["name"], int(info["tokens"])
        self.tok, self.mask = [], []
        starts = [0]
        for sh in info["shards"]:
            self.tok.append(np.load(_verify_file(d, sh["tokens"], verify), mmap_mode="r"))
            self.mask.append(np.load(_verify_file(d, sh["mask"], verify), mmap_mode="r"))
            if len(self.tok[-1]) != sh["n_tokens"] or len(self.mask[-1]) != (sh["n_tokens"] + 7) // 8:
                raise QRecoverError(f"shard {sh['tokens']['path']!r} of {str(d)!r} holds {len(self.tok[-1])} tokens, the manifest "
                                    f"says {sh['n_tokens']}; prepare the data again with --overwrite")
            starts.append(starts[-1] + sh["n_tokens"])
        if starts[-1] != self.tokens:
            raise QRecoverError(f"source {self.name!r} of {str(d)!r}: its shards hold {starts[-1]} tokens, the manifest says "
                                f"{self.tokens}; prepare the data again with --overwrite")
        _verify_file(d, info["documents_file"], verify)
        self.starts = np.asarray(starts, np.int64)

    def read(self, a: int, n: int) -> tuple[np.ndarray, np.ndarray]:
        ids, loss = np.empty(n, np.int64), np.empty(n, bool)
        k, done = int(np.searchsorted(self.starts, a, side="right")) - 1, 0
        while done < n:
            lo = a + done - int(self.starts[k])
            hi = min(lo + n - done, int(self.starts[k + 1] - self.starts[k]))
            ids[done : done + hi - lo] = self.tok[k][lo:hi]
            bits = np.unpackbits(self.mask[k][lo // 8 : (hi + 7) // 8], bitorder="little")
            loss[done : done + hi - lo] = bits[lo % 8 : lo % 8 + hi - lo]
            done += hi - lo
            k += 1
        return ids, loss


class ShardLoader:
    """Packed training sequences read from prepared shards (see the module docstring for the order).

    The :class:`.mix.MixLoader` interface the trainer uses (iterable of ``{"input_ids", "labels", "source"}``
    ``(seq_len,)`` int64 sequences, ``state_dict()/load_state_dict()``, ``report()``) plus :meth:`batches`
    for data parallelism and :meth:`sequence` for random access. ``tokenizer``: when given, data prepared
    with another tokenizer is refused. ``verify``: ``"size"`` (every file's size against the manifest, at
    once) or ``"sha256"`` (also every file's hash: reads everything once).
    """

    def __init__(self, data_dir: str | os.PathLike, tokenizer: Any = None, seq_len: int = 512, total_tokens: int | None = None,
                 seed: int = 0, verify: str = "size"):
        self.data_dir = Path(data_dir).expanduser()
        self.manifest = read_data_manifest(self.data_dir)
        if tokenizer is not None:
            check_tokenizer(self.manifest, tokenizer, self.data_dir)
        if verify not in VERIFY:
            raise QRecoverError(f"verify={verify!r} must be one of {VERIFY}")
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise QRecoverError(f"seq_len={seq_len!r} must be a positive integer")
        live = [s for s in self.manifest["sources"] if s["weight"] > 0]
        short = [f"{s['name']!r} ({s['tokens']} tokens)" for s in live if s["tokens"] < seq_len]
        if short:
            raise QRecoverError(f"prepared data {str(self.data_dir)!r}: source(s) {', '.join(short)} hold fewer tokens than one "
                                f"sequence of seq_len={seq_len}; lower --seq-len or give them more documents")
        if total_tokens is None:  # one pass over the data
            total_tokens = sum(s["tokens"] // seq_len for s in live) * seq_len
        if isinstance(total_tokens, bool) or not isinstance(total_tokens, int) or total_tokens < seq_len:
            raise QRecoverError(f"total_tokens={total_tokens!r} must be an integer of at least one sequence (seq_len={seq_len})")
        self.seq_len, self.seed = seq_len, seed
        self.num_sequences = total_tokens // seq_len
        self.total_tokens = self.num_sequences * seq_len
        self.id = data_id(self.manifest)
        self.sources = self.manifest["sources"]
        weights = np.asarray([s["weight"] for s in self.sources], np.float64)
        self.fractions = weights / weights.sum()
        self.targets = apportion(self.num_sequences, self.fractions.tolist())
        self._streams = {i: _Stream(self.data_dir, s, verify) for i, s in enumerate(self.sources) if self.targets[i]}
        # the global order: (source, source-local index) of every sequence
        src = np.concatenate([np.full(t, i, np.int16) for i, t in enumerate(self.targets)])
        local = np.concatenate([np.arange(t, dtype=np.int64) for t in self.targets])
        due = np.concatenate([(np.arange(t) + 0.5) / t for t in self.targets])
        order = np.lexsort((src, due))
        self._src, self._local = src[order], local[order]
        self._next = 0
        self._perm: dict[int, tuple[int, np.ndarray, int]] = {}

    # --- random access ----------------------------------------------------------------------------------

    def _window(self, s: int, j: int) -> int:
        """Token offset of source ``s``'s ``j``-th sequence in its stream."""
        windows = self._streams[s].tokens // self.seq_len
        epoch, w = divmod(j, windows)
        cached = self._perm.get(s)
        if cached is None or cached[0] != epoch:
            rng = np.random.default_rng([_name_seed(self.seed, self.sources[s]["name"]), epoch])
            perm = rng.permutation(windows)
            off = int(rng.integers(0, self._streams[s].tokens - windows * self.seq_len + 1))
            cached = self._perm[s] = (epoch, perm, off)
        return cached[2] + int(cached[1][w]) * self.seq_len

    def sequence(self, i: int) -> tuple[np.ndarray, np.ndarray, str]:
        """Global sequence ``i``: ``(input_ids (seq_len,) int64, labels (seq_len,) int64, source name)``."""
        if not 0 <= i < self.num_sequences:
            raise IndexError(f"sequence {i} outside [0, {self.num_sequences})")
        s = int(self._src[i])
        ids, loss = self._streams[s].read(self._window(s, int(self._local[i])), self.seq_len)
        return ids, np.where(loss, ids, IGNORE), self.sources[s]["name"]

    def __len__(self) -> int:
        return self.num_sequences

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """The remaining sequences in the global order; the position advances before each yield."""
        while self._next < self.num_sequences:
            ids, labels, name = self.sequence(self._next)
            self._next += 1
            yield {"input_ids": torch.from_numpy(ids), "labels": torch.from_numpy(labels), "source": name}

    def batches(self, batch_size: int, rank: int = 0, world: int = 1) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's micro-batches ``(input_ids, labels)``, each ``(batch_size, seq_len)`` int64, from the position on.

        Micro-batch ``k`` covers the ``batch_size * world`` global sequences from the position ``p``; rank ``r``
        reads only the ``r``-th, ``(r + world)``-th, ... of them. The position advances by ``batch_size * world``
        before each yield, so ``state_dict()`` after a micro-batch resumes at the next one on any ``world``
        with the same global batch. Ends when fewer than ``batch_size * world`` sequences remain.
        """
        for name, v in (("batch_size", batch_size), ("world", world)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise QRecoverError(f"{name}={v!r} must be a positive integer")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
            raise QRecoverError(f"rank={rank!r} must be an integer in [0, world={world})")
        step = batch_size * world
        while self._next + step <= self.num_sequences:
            p = self._next
            ids = np.empty((batch_size, self.seq_len), np.int64)
            labels = np.empty((batch_size, self.seq_len), np.int64)
            for b, i in enumerate(range(p + rank, p + step, world)):
                ids[b], labels[b], _ = self.sequence(i)
            self._next = p + step
            yield torch.from_numpy(ids), torch.from_numpy(labels)

    # --- resume and reporting ---------------------------------------------------------------------------

    def _config(self) -> dict[str, Any]:
        return {"data": self.id, "seq_len": self.seq_len, "total_tokens": self.total_tokens, "seed": self.seed}

    def state_dict(self) -> dict[str, Any]:
        """The exact data position (JSON-able): the next global sequence, whatever the number of processes."""
        return {"version": STATE_VERSION, "kind": "shards", "config": self._config(), "sequences": self._next}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "shards":
            raise QRecoverError("cannot resume: the saved data position is the on-the-fly mix loader's, not prepared data's; "
                                "resume with the same --mix the run started with")
        if state.get("version") != STATE_VERSION:
            raise QRecoverError(f"data-loader state version {state.get('version')!r} is not {STATE_VERSION}; it comes from another "
                                "qrecover version: restart the run")
        mine = self._config()
        diff = {k: f"{state['config'].get(k)!r} -> {v!r}" for k, v in mine.items() if state["config"].get(k) != v}
        if diff:
            raise QRecoverError(f"cannot resume the data position: the loader was built with different settings {diff} (saved -> "
                                "now); rebuild it with the saved prepared data, seq_len, total_tokens and seed")
        n = int(state["sequences"])
        if not 0 <= n <= self.num_sequences:
            raise QRecoverError(f"saved data position {n} is outside [0, {self.num_sequences}]")
        self._next = n

    def report(self) -> dict[str, Any]:
        """JSON-able: per source the target and consumed sequences/tokens (all ranks), unique tokens, epochs; the
        decontamination record of the prepared data."""
        done = np.bincount(self._src[: self._next].astype(np.int64), minlength=len(self.sources))
        sources = {}
        for i, s in enumerate(self.sources):
            seqs = int(done[i])
            sources[s["name"]] = {"kind": s["kind"], "fraction": float(self.fractions[i]), "target_sequences": self.targets[i],
                                  "target_tokens": self.targets[i] * self.seq_len, "sequences": seqs,
                                  "tokens": seqs * self.seq_len, "documents": s["documents"], "unique_tokens": s["tokens"],
                                  "unique_loss_tokens": s["loss_tokens"],
                                  "epochs": seqs * self.seq_len / s["tokens"] if s["tokens"] else None}
        return {"kind": "shards", "data": str(self.data_dir), "data_id": self.id, "seq_len": self.seq_len,
                "total_tokens": self.total_tokens, "num_sequences": self.num_sequences, "sequences": self._next,
                "seed": self.seed, "mix": self.manifest["mix"], "sources": sources,
                "decontamination": self.manifest["decontamination"]}

    def close(self) -> None:
        self._streams.clear()


__all__ = ["ShardLoader", "is_prepared", "read_data_manifest", "check_tokenizer", "data_id", "FORMAT", "FORMAT_VERSION", "MANIFEST"]

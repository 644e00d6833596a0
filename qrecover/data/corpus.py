"""Real human-written text, obtained offline, split into parts that never overlap.

The built-in corpus is the Python 3.11 documentation sources (reST, ~11 MB), installed by the Debian
package ``python3.11-doc`` (the set-up script installs it). Each document goes to exactly one split,
decided by a hash of its path: ``eval`` (10%), ``calib`` (10%), ``train`` (80%). Documents within a
split are ordered by that hash too, so any prefix is a deterministic, topic-diverse sample.

A source can also be a directory, a file or a glob of text files (``--calib-data``); those are split
the same way. Calibration can also read a data-mix recipe (:func:`qrecover.data.mix.calibration_windows`).
"""

from __future__ import annotations

import glob
import hashlib
from pathlib import Path

import torch

from ..errors import QRecoverError

PYTHON_DOCS = Path("/usr/share/doc/python3.11/html/_sources")
SPLITS = {"eval": range(0, 10), "calib": range(10, 20), "train": range(20, 100)}


def _bucket(rel: str) -> tuple[int, str]:
    h = hashlib.sha256(rel.encode()).hexdigest()
    return int(h[:8], 16) % 100, h


def source_files(source: str = "python-docs") -> tuple[Path, list[Path]]:
    """``(root, files)`` for a source name, directory, file or glob."""
    if source == "python-docs":
        if not PYTHON_DOCS.is_dir():
            raise QRecoverError(
                f"the built-in text corpus is missing ({PYTHON_DOCS}); install it with "
                "`apt-get install python3.11-doc`, or pass --calib-data PATH_OR_GLOB with your own text files"
            )
        return PYTHON_DOCS, sorted(PYTHON_DOCS.rglob("*.txt"))
    p = Path(source).expanduser()
    if p.is_dir():
        return p, sorted(f for f in p.rglob("*") if f.is_file())
    if p.is_file():
        return p.parent, [p]
    files = sorted(Path(f) for f in glob.glob(source, recursive=True) if Path(f).is_file())
    if not files:
        raise QRecoverError(f"text source {source!r} matches no files; pass a directory, a file or a glob")
    return Path("/"), files


def documents(source: str = "python-docs", split: str = "calib") -> list[str]:
    """The texts of one split, in hash order. A single-file source is split by paragraphs instead."""
    if split not in SPLITS:
        raise QRecoverError(f"unknown split {split!r}; choose from {list(SPLITS)}")
    root, files = source_files(source)
    if len(files) == 1:  # one file: split its paragraphs the same way
        paras = [p for p in files[0].read_text(errors="replace").split("\n\n") if p.strip()]
        keyed = [(_bucket(f"{i}:{p[:64]}"), p) for i, p in enumerate(paras)]
    else:
        keyed = [(_bucket(str(f.relative_to(root))), f) for f in files]
    chosen = sorted((h, x) for (b, h), x in keyed if b in SPLITS[split])
    texts = [x if isinstance(x, str) else x.read_text(errors="replace") for _, x in chosen]
    return [t for t in texts if t.strip()]


def token_stream(tokenizer, texts: list[str], n_tokens: int) -> torch.Tensor:
    """The first ``n_tokens`` tokens of the texts joined by EOS, ``(n_tokens,)`` int64."""
    eos = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    ids: list[int] = []
    for t in texts:
        ids.extend(tokenizer(t, add_special_tokens=False)["input_ids"])
        ids.append(eos)
        if len(ids) >= n_tokens:
            return torch.tensor(ids[:n_tokens], dtype=torch.long)
    raise QRecoverError(f"the text gives only {len(ids)} tokens, fewer than the {n_tokens} needed; use fewer samples or more text")


def adds_bos(tokenizer) -> bool:
    """Whether the tokenizer itself puts its BOS token in front of a text (Gemma's, Llama-2's do; SmolLM2's
    does not). Models trained that way expect every sequence to start with BOS."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return False
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    return len(with_special) > len(plain) and with_special[0] == bos


def token_windows(tokenizer, source: str, split: str, n: int, seq_len: int) -> torch.Tensor:
    """``(n, seq_len)`` non-overlapping windows from the start of a split's token stream.

    For a tokenizer that adds BOS (:func:`adds_bos`), every window is BOS followed by the next
    ``seq_len - 1`` stream tokens, as the model sees text at inference; otherwise the windows are the
    stream cut in ``seq_len`` pieces, nothing added.
    """
    if not adds_bos(tokenizer):
        return token_stream(tokenizer, documents(source, split), n * seq_len).view(n, seq_len)
    if seq_len < 2:
        raise QRecoverError(f"seq_len={seq_len}: windows that start with BOS need at least 2 tokens")
    body = token_stream(tokenizer, documents(source, split), n * (seq_len - 1)).view(n, seq_len - 1)
    return torch.cat([torch.full((n, 1), tokenizer.bos_token_id, dtype=torch.long), body], dim=1)

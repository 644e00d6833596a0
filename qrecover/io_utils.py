"""Small file helpers: hashing, atomic directory writes, the user cache."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .errors import QRecoverError


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_files(paths: list[Path]) -> str:
    """One hash over several files (names and contents), order-independent."""
    h = hashlib.sha256()
    for p in sorted(paths, key=lambda p: p.name):
        h.update(p.name.encode())
        h.update(sha256_file(p).encode())
    return h.hexdigest()


def cache_dir() -> Path:
    """``$QRECOVER_CACHE``, else ``$XDG_CACHE_HOME/qrecover``, else ``~/.cache/qrecover``."""
    if env := os.environ.get("QRECOVER_CACHE"):
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "qrecover"


@contextlib.contextmanager
def atomic_dir(final: Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary directory next to ``final``; move it into place only if the block succeeds.

    A crash or Ctrl-C inside the block removes the temporary directory, so ``final`` is either absent,
    untouched, or complete.
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise QRecoverError(f"output directory {str(final)!r} already exists; pass --overwrite to replace it")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

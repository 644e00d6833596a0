"""Small file helpers: hashing, atomic directory writes, the user cache, reading and writing JSON/TOML."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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
        with signals_held():
            shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back for the block (cleanup after a first error): a second signal, such as torchrun's
    SIGTERM arriving just after a peer's failure broke a collective, is re-raised when the block ends instead of
    cutting the removal of a temporary file short. Python-level handlers, not a signal mask: the mask is per thread,
    and torch's worker threads would take the signal. A no-op off the main thread (no handler can be set there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    old = {s: signal.signal(s, lambda n, _f: held.append(n)) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, signal.SIG_DFL if h is None else h)
        for n in held:
            signal.raise_signal(n)


def read_json(path: str | os.PathLike, what: str, missing: str) -> Any:
    """Parse a JSON file; a missing or malformed file is a QRecoverError: '{what} PATH does not exist{missing}'."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise QRecoverError(f"{what} {str(path)!r} does not exist{missing}")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise QRecoverError(f"{what} {str(path)!r} is not valid JSON: {e}") from None


def read_toml(path: str | os.PathLike, what: str, missing: str) -> dict[str, Any]:
    """Parse a TOML file, as :func:`read_json`."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    path = Path(path).expanduser()
    if not path.is_file():
        raise QRecoverError(f"{what} {str(path)!r} does not exist{missing}")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise QRecoverError(f"{what} {str(path)!r} is not valid TOML: {e}") from None


def toml_value(v: Any) -> str:
    """One value as TOML: strings, numbers, booleans, lists and inline tables."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(str(k))} = {toml_value(x)}" for k, x in v.items()) + "}"
    raise QRecoverError(f"cannot write {v!r} to TOML (types: string, number, boolean, list, table)")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path`` (ending in ``suffix``, for writers that pick the format by it);
    rename it onto ``path`` only if the block succeeds. A crash or Ctrl-C removes it: ``path`` is absent,
    untouched, or complete, never half-written. Concurrent writers of the same ``path`` do not collide."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".tmp{suffix}", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with signals_held():
            tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (:func:`atomic_file`)."""
    with atomic_file(path) as tmp:
        tmp.write_text(text)
    return Path(path)


def write_bytes_atomic(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` to ``path`` atomically (:func:`atomic_file`)."""
    with atomic_file(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)

"""Recipes shipped with qrecover, read as package data (``importlib.resources``), so a wheel install has them.

* ``default-mix.toml``: the recovery data mix ``qrecover recover`` uses when ``--mix`` is omitted.
* ``table10.toml``: the pipeline recipe of the reference report (``qrecover pipeline table10``).

A shipped recipe is named by its file stem (``table10``); :func:`shipped_path` gives its file. Relative paths
inside a *shipped* recipe resolve against the working directory (the package directory is no place for
outputs); a recipe passed as a path resolves them against its own directory.
"""

from __future__ import annotations

import atexit
import contextlib
from importlib.resources import as_file, files
from pathlib import Path

from ..errors import QRecoverError

DEFAULT_MIX = "default-mix"
_SUFFIX = ".toml"
_extracted = contextlib.ExitStack()  # files extracted from a zipped install live until the process ends
atexit.register(_extracted.close)


def shipped_names() -> list[str]:
    """The stems of every shipped recipe, sorted (``['default-mix', 'table10']``)."""
    return sorted(r.name[: -len(_SUFFIX)] for r in files(__name__).iterdir() if r.name.endswith(_SUFFIX))


def shipped_path(name: str) -> Path:
    """The file of shipped recipe ``name`` (stem, or the file name with ``.toml``) on the file system."""
    stem = name[: -len(_SUFFIX)] if name.endswith(_SUFFIX) else name
    resource = files(__name__).joinpath(stem + _SUFFIX)
    if "/" in stem or "\\" in stem or not resource.is_file():
        raise QRecoverError(f"{name!r} is not a shipped recipe; shipped: {', '.join(shipped_names())} "
                            "(or pass the path of a TOML file)")
    return _extracted.enter_context(as_file(resource))


def is_shipped(path: str | Path) -> bool:
    """Whether ``path`` is one of the shipped recipe files (as installed)."""
    p = Path(path).expanduser().resolve()
    return p.suffix == _SUFFIX and p.is_file() and any(
        p == shipped_path(n).resolve() for n in shipped_names())


__all__ = ["DEFAULT_MIX", "shipped_names", "shipped_path", "is_shipped"]

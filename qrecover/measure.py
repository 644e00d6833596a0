"""Peak memory of a ``qrecover`` command run in a fresh child process, as the benchmarks and tests measure it.

The child writes its own high-water mark (``VmHWM`` of /proc/self/status; Linux) to a file at exit. Not
``os.wait4``'s ``ru_maxrss``: Linux keeps that across fork + execve, so a child of a large parent (a pytest
process late in a suite) would report at least the parent's peak.
"""

from __future__ import annotations

import sys
from pathlib import Path

_CHILD = """
import atexit, functools, sys
report, lazy = sys.argv[1], sys.argv[2] == "1"
def _hwm():
    with open("/proc/self/status") as f:
        kb = next(line.split()[1] for line in f if line.startswith("VmHWM:"))
    with open(report, "w") as out:
        out.write(kb)
atexit.register(_hwm)
import qrecover.api as a
if not lazy:
    a.compress = functools.partial(a.compress, lazy=False)
from qrecover.cli import main
sys.argv = ["qrecover"] + sys.argv[3:]
main()
"""


def peak_rss_command(report: str | Path, args: list[str], lazy: bool = True) -> list[str]:
    """The argv of a child running ``qrecover ARGS`` that writes its peak resident set (kB) to ``report`` at exit.
    ``lazy=False``: ``compress`` holds the whole model in memory (the non-lazy path, for comparison)."""
    return [sys.executable, "-c", _CHILD, str(report), "1" if lazy else "0", *map(str, args)]


def read_peak_rss(report: str | Path) -> int | None:
    """Bytes written by a :func:`peak_rss_command` child, or None if it wrote nothing (it died before exit)."""
    path = Path(report)
    return int(path.read_text()) * 1024 if path.exists() else None

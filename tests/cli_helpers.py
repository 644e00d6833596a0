"""In-process CLI runner shared by the CLI tests (not a test module)."""

from __future__ import annotations

from qrecover.cli import main


def run(argv, capsys):
    """``(exit code, stdout, stderr)`` of one in-process CLI call."""
    try:
        main([str(a) for a in argv])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    out, err = capsys.readouterr()
    return code, out, err

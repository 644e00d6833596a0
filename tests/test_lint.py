"""The repository passes ``ruff check`` with the configuration in pyproject.toml (what .ci/run runs).

Checks: ``python -m ruff check <repo root>`` exits 0 (its findings are the failure message); and that
configuration is the one in effect: through stdin, a 151-character line and an unused import are reported
(E501, F401) while a 150-character line passes. Skipped, with the reason, when ruff is not installed
(it is in the ``test`` extra).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("ruff") is None,
                                reason="ruff is not installed; install the test extra: pip install -e '.[test]'")


def _ruff(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", *args], cwd=ROOT, input=stdin,
                          capture_output=True, text=True, timeout=300)


def test_repository_passes_ruff():
    r = _ruff(str(ROOT))
    assert r.returncode == 0, f"ruff check found problems (fix them; see [tool.ruff] in pyproject.toml):\n{r.stdout}{r.stderr}"


def test_configuration_is_in_effect():
    ok = "x = '" + "a" * 144 + "'\n"  # 150 characters
    assert len(ok) - 1 == 150
    assert _ruff("--stdin-filename", "qrecover/_lint_probe.py", "-", stdin=ok).returncode == 0
    bad = "import os\n\nx = '" + "a" * 145 + "'\n"  # an unused import and a 151-character line
    r = _ruff("--stdin-filename", "qrecover/_lint_probe.py", "--output-format", "concise", "-", stdin=bad)
    assert r.returncode == 1
    assert "F401" in r.stdout and "E501" in r.stdout and "Line too long (151 > 150)" in r.stdout, r.stdout

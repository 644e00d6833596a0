"""``qrecover.reports`` and the ``report`` / ``gate`` commands run with torch, transformers and peft unimportable.

A fresh interpreter installs a meta-path finder that raises ImportError for those three packages, then imports
every module under ``qrecover.reports``; a second one also runs ``qrecover report`` and ``qrecover gate`` on
hand-made results files (``tests/test_reports.py``'s): exit codes 0 and the files written. That one is skipped,
naming the import, while ``import qrecover.cli`` itself still needs torch (a command module importing a torch
module at its top). A control run checks that the blocker does block.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_reports import BASE, Q37, R37

import qrecover

BLOCKER = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers", "peft"):
            raise ImportError(f"{name} is blocked: qrecover.reports must not need it")
sys.meta_path.insert(0, Blocked())
"""

IMPORTS = BLOCKER + """
import importlib, pkgutil
import qrecover.reports
names = [m.name for m in pkgutil.walk_packages(qrecover.reports.__path__, "qrecover.reports.")]
for name in names:
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "peft"))
assert not bad, bad
print("imported", ",".join(names))
"""

SCRIPT = BLOCKER + """
from qrecover.cli import main
d = sys.argv[1]
for argv in (["report", d + "/q.json", d + "/r.json", "--baseline", d + "/base.json", "--out", d + "/rep", "--json"],
             ["gate", d + "/rep/report.json", "--min-ratio", "0.5", "--json"]):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code in (0, None), (argv, e.code)
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "peft"))
assert not bad, bad
"""


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(Path(qrecover.__file__).resolve().parents[1])}
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120)


def test_every_reports_module_imports_without_torch():
    p = _python(IMPORTS)
    assert p.returncode == 0, p.stderr[-3000:]
    imported = p.stdout.split("imported ", 1)[1].split()[0].split(",")
    assert {"qrecover.reports.results", "qrecover.reports.table", "qrecover.reports.render", "qrecover.reports.gate"} <= set(imported)


def test_report_and_gate_commands_run_without_torch(tmp_path):
    cli = _python(BLOCKER + "import qrecover.cli")
    if cli.returncode != 0:
        pytest.skip("import qrecover.cli needs torch: " + " <- ".join(line.strip() for line in cli.stderr.splitlines() if "qrecover/" in line)[-300:])
    for name, d in (("base.json", BASE), ("q.json", Q37), ("r.json", R37)):
        (tmp_path / name).write_text(json.dumps(d))
    p = _python(SCRIPT, str(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "rep" / "report.json").is_file() and (tmp_path / "rep" / "report.html").is_file()


def test_the_blocker_blocks():
    p = _python(BLOCKER + "import qrecover.evaluate.agreement")
    assert p.returncode != 0 and "torch is blocked" in p.stderr

"""The CLI answers ``--help`` and refuses bad input without importing torch, transformers or peft.

Each case runs in a fresh interpreter (the test process has long imported torch) and reports which heavy
modules ``sys.modules`` holds after ``qrecover.cli.main`` returns: deterministic, not timed. Also checks the
exit code and the message, so a command that stopped parsing (and so imported nothing) cannot pass.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "peft")
PROBE = """
import json, sys
from qrecover.cli import main
code = 0
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
print(json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}), file=sys.stderr)
""" % (HEAVY,)


def probe(*argv: str) -> tuple[dict, str, str]:
    """Run ``qrecover ARGV`` in a fresh interpreter; ``({code, heavy}, stdout, stderr without the report)``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "1000"}
    p = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    *err, last = p.stderr.rstrip("\n").split("\n")
    return json.loads(last), p.stdout, "\n".join(err)


def test_import_qrecover_is_light():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    code = f"import sys, qrecover; print([m for m in {HEAVY!r} if m in sys.modules]); print(qrecover.__version__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True).stdout.split("\n")
    assert out[0] == "[]"
    assert out[1]


@pytest.mark.parametrize("argv", [["--help"], ["compress", "--help"], ["recover", "--help"], ["finetune", "--help"],
                                  ["eval", "--help"], ["export", "--help"], ["tune", "--help"],
                                  ["data", "prepare", "--help"]])
def test_help_imports_no_heavy_module(argv):
    report, out, _ = probe(*argv)
    assert report == {"code": 0, "heavy": []}, (argv, report)
    assert "Usage: qrecover" in out and "--help" in out


@pytest.mark.parametrize("argv,message", [
    (["compress", "--bpw", "0"], "error: --bpw 0.0 must be positive and finite, e.g. --bpw 3.7"),
    (["compress", "--bits", "2,3", "--uniform"], "error: without --bpw, --bits must be a single width (uniform model), got [2, 3]"),
    (["recover", "ckpt", "--rank", "0"], "error: --rank 0 must be a positive integer, e.g. --rank 16"),
    (["recover", "ckpt", "--overwrite", "--resume"], "error: --overwrite and --resume contradict each other; pick one"),
    (["ppl", "--windows", "0"], "error: --windows 0 and --seq-len 512 must be positive (seq-len at least 2)"),
])
def test_refusal_imports_no_heavy_module(argv, message):
    report, out, err = probe(*argv)
    assert report == {"code": 2, "heavy": []}, (argv, report, err)
    assert err.strip() == message and "Traceback" not in err and out == ""


def test_public_api_is_imported_on_first_use():
    """``qrecover.load`` / ``compress`` / ``recover`` still resolve (PEP 562), to the defining modules' objects."""
    import qrecover
    from qrecover import api, loading
    from qrecover.recovery import api as recovery_api

    assert qrecover.load is loading.load and qrecover.compress is api.compress and qrecover.recover is recovery_api.recover
    assert set(qrecover.__all__) <= set(dir(qrecover))
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        qrecover.nope  # noqa: B018

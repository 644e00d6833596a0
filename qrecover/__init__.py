"""qrecover: compress language models below 4 bits per weight, recover accuracy, gate releases."""

import importlib

from ._version import __version__

__all__ = ["compress", "load", "perplexity", "recover", "finetune", "evaluate", "register_quantizer", "__version__"]

# the public functions, each imported on first use (torch, transformers, peft, lm-eval load only then), so that
# ``import qrecover.reports`` and the CLI's --help stay light
_LAZY = {"compress": ".api", "load": ".api", "perplexity": ".api", "register_quantizer": ".schemes",
         "recover": ".recovery.api", "finetune": ".recovery.api"}


def __getattr__(name: str):
    """``qrecover.compress`` / ``load`` / ``perplexity`` / ``register_quantizer`` / ``recover`` / ``finetune`` /
    ``evaluate``, imported on first use."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    if name == "evaluate":  # the package qrecover.evaluate, callable as the function evaluate() was
        return importlib.import_module(".evaluate", __name__)
    raise AttributeError(f"module 'qrecover' has no attribute {name!r}")

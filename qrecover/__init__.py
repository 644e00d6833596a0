"""qrecover: compress language models below 4 bits per weight, recover accuracy, gate releases.

The public functions are imported on first use (PEP 562), so ``import qrecover``, ``import qrecover.reports``
and the CLI's ``--help`` and input checks load none of torch, transformers or peft.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from ._version import __version__

if TYPE_CHECKING:  # for type checkers and IDEs; at run time __getattr__ imports them on first use
    from . import evaluate
    from .api import compress
    from .evaluate.perplexity import perplexity
    from .loading import load
    from .recovery.api import finetune, recover
    from .schemes import register_quantizer

__all__ = ["compress", "load", "perplexity", "recover", "finetune", "evaluate", "register_quantizer", "__version__"]

_LAZY = {  # public name -> the module that defines it (imported on first attribute access)
    "compress": "qrecover.api",
    "perplexity": "qrecover.evaluate.perplexity",
    "load": "qrecover.loading",
    "recover": "qrecover.recovery.api",
    "finetune": "qrecover.recovery.api",
    "register_quantizer": "qrecover.schemes",
}


def __getattr__(name: str):
    """``qrecover.compress`` etc.: imports the defining module (torch, transformers, peft, lm-eval) on first use."""
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later accesses skip __getattr__
        return value
    if name == "evaluate":  # the package qrecover.evaluate, callable as the function evaluate() was
        return importlib.import_module(".evaluate", __name__)
    raise AttributeError(f"module 'qrecover' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

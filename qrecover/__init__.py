"""qrecover: compress language models below 4 bits per weight, recover accuracy, gate releases."""

__version__ = "0.1.0"

from .schemes import register_quantizer  # noqa: E402
from .api import compress, load, perplexity  # noqa: E402

__all__ = ["compress", "load", "perplexity", "register_quantizer", "__version__"]

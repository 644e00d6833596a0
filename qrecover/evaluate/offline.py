"""Evaluation leaves the process as it found it: offline hub/datasets flags, lm-eval's IFEval globals and the
global random states, each set inside a ``with`` block and restored after it, also on an exception."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import os
import random
import sys
from collections.abc import Iterator
from typing import Any

from . import ifeval_offline

OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
# the module flags read from that environment when the module is imported: (module, flags)
OFFLINE_FLAGS = (("huggingface_hub.constants", ("HF_HUB_OFFLINE",)),
                 ("datasets.config", ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")))
# what datasets / huggingface_hub raise when a hub dataset is not in the local cache and the network is off:
# ConnectionError("Couldn't reach '...' on the Hub (OfflineModeIsEnabled)") and its subclass
# OfflineModeIsEnabled; FileNotFoundError and its subclasses DatasetNotFoundError and LocalEntryNotFoundError
OFFLINE_DATA_ERRORS = (ConnectionError, FileNotFoundError)
_MISSING = object()


@contextlib.contextmanager
def restored_attrs(obj: Any, *names: str) -> Iterator[None]:
    """Put ``obj``'s own attributes ``names`` back as they were on exit (deleted if it had none), also on an
    exception: ``with restored_attrs(module, "flag"): module.flag = True``."""
    saved = {n: vars(obj).get(n, _MISSING) for n in names}
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is not _MISSING:
                setattr(obj, n, v)
            elif n in vars(obj):
                delattr(obj, n)


@contextlib.contextmanager
def restored_environ(*keys: str) -> Iterator[None]:
    """Put the environment variables ``keys`` back as they were on exit (unset if they were), also on an exception."""
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def offline() -> Iterator[None]:
    """Hub and datasets libraries offline inside the block, as found after it (also after an exception).

    Sets :data:`OFFLINE_ENV` (for modules imported inside the block) and the flags of :data:`OFFLINE_FLAGS`
    (which those libraries read from the environment once, at import; imported here first, so that their
    values before the block are known and restored exactly); ``TOKENIZERS_PARALLELISM`` is ``false`` unless set.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(restored_environ(*OFFLINE_ENV, "TOKENIZERS_PARALLELISM"))
        os.environ.update(OFFLINE_ENV)
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        for module, flags in OFFLINE_FLAGS:
            if importlib.util.find_spec(module.split(".")[0]) is None:
                continue
            m = importlib.import_module(module)
            present = [f for f in flags if hasattr(m, f)]
            stack.enter_context(restored_attrs(m, *present))
            for f in present:
                setattr(m, f, True)
        yield


@contextlib.contextmanager
def ifeval_patched() -> Iterator[Any]:
    """:func:`.ifeval_offline.install` inside the block; lm-eval's ``instructions_util`` globals and langdetect's
    seed as found after it. Yields the patched module."""
    import langdetect
    import nltk

    if ifeval_offline._MODULE not in sys.modules:  # import it unpatched first, so its own globals are known
        with restored_attrs(nltk, "download"), contextlib.redirect_stdout(io.StringIO()):
            nltk.download = ifeval_offline._no_download  # its import-time download must not run
            importlib.import_module(ifeval_offline._MODULE)
    util = sys.modules[ifeval_offline._MODULE]
    with restored_attrs(util, "_get_sentence_tokenizer", "nltk"), restored_attrs(langdetect.DetectorFactory, "seed"):
        yield ifeval_offline.install()


@contextlib.contextmanager
def rng_restored() -> Iterator[None]:
    """Python's, numpy's and torch's global random states as found after the block (lm-eval seeds them)."""
    import numpy as np
    import torch

    py, npy = random.getstate(), np.random.get_state()
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)


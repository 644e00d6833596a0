"""lm-eval's IFEval checkers without NLTK downloads.

lm-eval's ``lm_eval.tasks.ifeval.instructions_util`` calls ``nltk.download("punkt_tab")`` when it is
imported, and two checkers need trained Punkt data:

* ``count_sentences`` (``length_constraints:number_sentences``) loads ``tokenizers/punkt/english.pickle``;
* ``CapitalWordFrequencyChecker`` (``change_case:capital_word_frequency``) calls ``nltk.word_tokenize``,
  which sentence-splits with ``punkt_tab`` first.

:func:`install` makes both work offline, deterministically and identically on every machine (a local
``punkt`` is not used even where one is installed, so scores do not depend on what a machine happens to
have downloaded):

* sentences are counted by an *untrained* ``nltk.tokenize.PunktSentenceTokenizer()``: it splits after
  every ``.``, ``!`` or ``?`` that ends a token, including after abbreviations trained Punkt knows
  (``Dr.``, ``Mr.``, ``U.S.``, ``e.g.``), so a response using them counts more sentences than lm-eval
  with trained Punkt would (see ``tests/test_ifeval_offline.py`` for the items);
* words are ``word_tokenize(text, preserve_line=True)``: the Treebank tokenizer on the whole text, with
  no sentence split first. It differs from the original only in leaving a sentence-final period attached
  to its word (``"HERE."`` rather than ``"HERE", "."``), which never changes ``str.isupper()``, so
  capital-word counts are the same.

langdetect (the language and English-case checkers) samples at random unless seeded; :func:`install` sets
``langdetect.DetectorFactory.seed = 0`` so two runs give the same verdicts.

Nothing here downloads anything: ``nltk.download`` is replaced by a function that refuses while lm-eval's
module is imported.
"""

from __future__ import annotations

import contextlib
import functools
import io
import sys
import types
from typing import Any

SENTENCE_TOKENIZER = "nltk PunktSentenceTokenizer() untrained"
WORD_TOKENIZER = "nltk word_tokenize(preserve_line=True)"
LANGDETECT_SEED = 0
SETTINGS = {"sentence_tokenizer": SENTENCE_TOKENIZER, "word_tokenizer": WORD_TOKENIZER, "langdetect_seed": LANGDETECT_SEED}

_MODULE = "lm_eval.tasks.ifeval.instructions_util"


def _no_download(*args: Any, **kwargs: Any) -> bool:
    """Stands in for ``nltk.download`` during lm-eval's import: fetches nothing."""
    return False


def word_tokenize(text: str, language: str = "english", preserve_line: bool = True) -> list[str]:
    """``nltk.word_tokenize`` without the Punkt sentence split (which needs the ``punkt_tab`` download)."""
    import nltk

    return nltk.word_tokenize(text, language=language, preserve_line=True)


@functools.lru_cache(maxsize=None)
def sentence_tokenizer():
    """An untrained Punkt sentence splitter (no data files)."""
    import nltk

    return nltk.tokenize.PunktSentenceTokenizer()


class _NltkProxy(types.ModuleType):
    """``nltk`` as lm-eval's instructions modules see it: ``word_tokenize`` replaced, the rest forwarded."""

    def __init__(self, real: types.ModuleType) -> None:
        super().__init__("nltk")
        self._real = real
        self.word_tokenize = word_tokenize

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def install() -> types.ModuleType:
    """Import lm-eval's IFEval utilities with the offline tokenizers in place; return the patched module.

    Idempotent. Safe whether or not ``instructions_util`` was imported before (if it was, the import-time
    download already ran or failed then; the tokenizers are replaced either way).
    """
    import langdetect
    import nltk

    if _MODULE not in sys.modules:
        real_download = nltk.download
        nltk.download = _no_download  # its import-time download_nltk_resources() must not reach the network
        try:  # ... and its "Downloaded punkt_tab" print must not reach stdout (`qrecover eval --json`)
            with contextlib.redirect_stdout(io.StringIO()):
                import lm_eval.tasks.ifeval.instructions_util  # noqa: F401
        finally:
            nltk.download = real_download
    util = sys.modules[_MODULE]
    # count_sentences() looks _get_sentence_tokenizer up in the module's globals at call time
    util._get_sentence_tokenizer = sentence_tokenizer
    if not isinstance(util.nltk, _NltkProxy):
        # count_words() uses util's global ``nltk``; instructions.py calls instructions_util.nltk.word_tokenize
        util.nltk = _NltkProxy(nltk)
    langdetect.DetectorFactory.seed = LANGDETECT_SEED
    return util

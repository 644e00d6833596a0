"""The source kinds of a data mix, one registered class each: its TOML keys (declared once, with their help
text), their checks, and ``open()``, which returns the documents (:mod:`.documents`).

=========  ==================================================================================================
kind       documents
=========  ==================================================================================================
text       text files: one document per file (the path-hash splits of :mod:`.corpus`), or per paragraph of one file
jsonl      rows of JSONL files: a text field or a chat (``messages``)
parquet    rows of Parquet files, the same fields
hf         a streamed Hugging Face dataset
builtin    the built-in corpus (the Python documentation), one of its splits
selfgen    chats the unquantized instruct model writes (:mod:`.selfgen`), cached as JSONL
selftext   text the unquantized model writes with no prompt, from a random first token (LLM-QAT's data-free data)
=========  ==================================================================================================
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import QRecoverError
from ..fields import doc_field
from .corpus import SPLITS, source_files
from .documents import JsonlDocs, Limited, ParquetDocs, StreamDocs, list_files, resolve_path, text_docs
from .selfgen import generate_chat_data, generate_free_text
from .source import OpenContext, Source, register_source

_MAX_DOCUMENTS = "use only the first N documents (in the source's fixed order)"
_FIELD = "the field holding a document's text"
_MESSAGES_FIELD = "the field holding a chat (list of {role, content}); it wins over `field` when present"


def _limited(docs: Any, n: int | None) -> Any:
    return Limited(docs, n) if n else docs


def _check_split(where: str, split: str | None, default: str) -> None:
    if split is not None and split not in SPLITS:
        raise QRecoverError(f"{where}: split = {split!r} must be one of {list(SPLITS)} (or left out for {default})")


class _FileSource(Source):
    """A kind whose documents come from files under ``path`` (relative to the recipe)."""

    def require_path(self, where: str) -> None:
        if not self.path:
            raise QRecoverError(f"{where} (kind {self.kind!r}) needs a path: a file, a directory or a glob")

    def validate(self, where: str, given: dict[str, Any]) -> None:
        self.require_path(where)
        super().validate(where, given)

    def check(self, base_dir: str | None) -> None:
        list_files(self, base_dir)


@register_source
@dataclass
class TextSource(_FileSource):
    kind: str = doc_field("text", "text files: one document per file, or per blank-line-separated paragraph of a single file")
    path: str | None = doc_field(None, "a file, a directory or a glob (relative to the recipe file)")
    split: str | None = doc_field(None, "one of eval/calib/train (the path-hash split of qrecover.data.corpus; None = every file)")
    max_documents: int | None = doc_field(None, _MAX_DOCUMENTS)

    def validate(self, where: str, given: dict[str, Any]) -> None:
        self.require_path(where)
        _check_split(where, self.split, "every file")
        Source.validate(self, where, given)

    def open(self, ctx: OpenContext) -> Any:
        list_files(self, ctx.base_dir)
        return _limited(text_docs(resolve_path(self.path, ctx.base_dir), self.split), self.max_documents)


@register_source
@dataclass
class JsonlSource(_FileSource):
    kind: str = doc_field("jsonl", "JSONL files: one document per row")
    path: str | None = doc_field(None, "a file, a directory or a glob (relative to the recipe file)")
    field: str = doc_field("text", _FIELD)
    messages_field: str = doc_field("messages", _MESSAGES_FIELD)
    max_documents: int | None = doc_field(None, _MAX_DOCUMENTS)

    def open(self, ctx: OpenContext) -> Any:
        return _limited(JsonlDocs(list_files(self, ctx.base_dir), self), self.max_documents)


@register_source
@dataclass
class ParquetSource(JsonlSource):
    kind: str = doc_field("parquet", "Parquet files: one document per row (row groups read one at a time)")

    def open(self, ctx: OpenContext) -> Any:
        return _limited(ParquetDocs(list_files(self, ctx.base_dir), self), self.max_documents)


@register_source
@dataclass
class HFSource(Source):
    kind: str = doc_field("hf", "a Hugging Face dataset, streamed (`pip install datasets`)")
    dataset: str | None = doc_field(None, "dataset name on the Hub (or a local builder such as 'json' with data_files)")
    config: str | None = doc_field(None, "dataset configuration name")
    split: str | None = doc_field(None, "the dataset split (default 'train')")
    data_files: str | None = doc_field(None, "data files for a builder dataset ('json', 'parquet', ...)")
    revision: str | None = doc_field(None, "dataset revision (pin it for reproducible runs)")
    field: str = doc_field("text", _FIELD)
    messages_field: str = doc_field("messages", _MESSAGES_FIELD)
    max_documents: int | None = doc_field(None, _MAX_DOCUMENTS + " (without it the stream is not counted by the plan)")
    shuffle_buffer: int = doc_field(10_000, "shuffle buffer of the streaming dataset")

    def validate(self, where: str, given: dict[str, Any]) -> None:
        if not self.dataset:
            raise QRecoverError(f"{where} (kind 'hf') needs dataset = \"owner/name\" (and optionally config, split, revision)")
        super().validate(where, given)

    def open(self, ctx: OpenContext) -> Any:
        return StreamDocs(self)  # takes max_documents itself (a stream has no length to cut)


@register_source
@dataclass
class BuiltinSource(Source):
    kind: str = doc_field("builtin", "the built-in corpus (the Python documentation sources)")
    split: str | None = doc_field(None, "one of eval/calib/train (the path-hash split of qrecover.data.corpus; default 'train')")
    max_documents: int | None = doc_field(None, _MAX_DOCUMENTS)

    def validate(self, where: str, given: dict[str, Any]) -> None:
        _check_split(where, self.split, "the train split")
        super().validate(where, given)

    def check(self, base_dir: str | None) -> None:
        source_files("python-docs")

    def open(self, ctx: OpenContext) -> Any:
        return _limited(text_docs("python-docs", self.split or "train"), self.max_documents)


class GeneratedSource(Source):
    """A source the unquantized model writes, cached as JSONL; its kinds declare ``model`` (None = the loader's model)
    and the sampling settings ``temperature`` and ``top_p``."""

    def validate(self, where: str, given: dict[str, Any]) -> None:
        super().validate(where, given)
        if not (self.temperature >= 0 and 0 < self.top_p <= 1):
            raise QRecoverError(f"{where}: temperature = {self.temperature} must be >= 0 and top_p = {self.top_p} in (0, 1]")

    def check(self, base_dir: str | None) -> None:
        if self.model is not None and not Path(self.model).expanduser().exists():
            raise QRecoverError(f"source {self.name!r}: model = {self.model!r} does not exist; name an HF model "
                                "directory or a .gguf file, or leave model out for the unquantized model")

    def generate(self, model: Any, tokenizer: Any, show_progress: bool) -> Path:
        raise NotImplementedError

    def open(self, ctx: OpenContext) -> Any:
        model = self.model or ctx.model
        tokenizer = ctx.tokenizer if model is not None and not isinstance(model, (str, os.PathLike)) else None
        path = self.generate(model, tokenizer, ctx.show_progress)
        return JsonlDocs([path], JsonlSource(name=self.name, weight=self.weight, path=str(path)))


@register_source
@dataclass
class SelfgenSource(GeneratedSource):
    kind: str = doc_field("selfgen", "chats the unquantized instruct model writes (qrecover.data.selfgen), cached as JSONL")
    samples: int = doc_field(256, "conversations to generate")
    max_new_tokens: int = doc_field(192, "answer length cap (answers cut there are marked truncated)")
    temperature: float = doc_field(0.0, "0 = greedy decoding; > 0 = seeded sampling")
    top_p: float = doc_field(1.0, "nucleus sampling mass (with temperature > 0)")
    seed: int = doc_field(0, "seed of the topic order and of sampling")
    model: str | None = doc_field(None, "the instruct model that writes the data (None = the loader's `model`, else the built-in default)")
    batch_size: int = doc_field(16, "prompts generated together")
    prompt_mode: str = doc_field("template", "'template' (instruction templates filled with topics) or 'model' (the model writes the requests)")
    topics: str = doc_field("python-docs", "where request topics come from: a text source's train-split section titles ('python-docs' = the "
                                           "built-in docs), or 'general' = built-in everyday subjects with writing tasks (stories, poems, ...)")

    def validate(self, where: str, given: dict[str, Any]) -> None:
        super().validate(where, given)
        if self.prompt_mode not in ("template", "model"):
            raise QRecoverError(f"{where}: prompt_mode = {self.prompt_mode!r} must be 'template' or 'model'")

    def check(self, base_dir: str | None) -> None:
        super().check(base_dir)
        if self.topics != "general":
            try:
                source_files(self.topics)
            except QRecoverError as e:
                raise QRecoverError(f"source {self.name!r}: topics = {self.topics!r}: {e}; or topics = "
                                    "\"general\" for the built-in everyday subjects") from None

    def generate(self, model: Any, tokenizer: Any, show_progress: bool) -> Path:
        return generate_chat_data(model, tokenizer, n=self.samples, seed=self.seed, max_new_tokens=self.max_new_tokens,
                                  temperature=self.temperature, top_p=self.top_p, batch_size=self.batch_size,
                                  prompt_mode=self.prompt_mode, topics_source=self.topics, show_progress=show_progress)


@register_source
@dataclass
class SelftextSource(GeneratedSource):
    kind: str = doc_field("selftext", "text the unquantized model writes with no prompt, each document from one random first "
                                      "token (LLM-QAT's data-free data; qrecover.data.selfgen), cached as JSONL")
    samples: int = doc_field(256, "documents to generate")
    max_new_tokens: int = doc_field(512, "length cap of a document in tokens (it ends earlier at an end-of-sequence token)")
    temperature: float = doc_field(1.0, "sampling temperature (0 = greedy from the random first token)")
    top_p: float = doc_field(1.0, "nucleus sampling mass")
    seed: int = doc_field(0, "seed of the first tokens and of sampling")
    model: str | None = doc_field(None, "the model that writes the text (None = the loader's `model`, else the built-in default)")
    batch_size: int = doc_field(32, "documents generated together")

    def validate(self, where: str, given: dict[str, Any]) -> None:
        super().validate(where, given)
        for k in ("samples", "max_new_tokens", "batch_size"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise QRecoverError(f"{where}: {k} = {v!r} must be a positive integer")

    def generate(self, model: Any, tokenizer: Any, show_progress: bool) -> Path:
        return generate_free_text(model, tokenizer, n=self.samples, seed=self.seed, max_new_tokens=self.max_new_tokens,
                                  temperature=self.temperature, top_p=self.top_p, batch_size=self.batch_size,
                                  show_progress=show_progress)


__all__ = ["TextSource", "JsonlSource", "ParquetSource", "HFSource", "BuiltinSource", "SelfgenSource", "SelftextSource",
           "GeneratedSource"]

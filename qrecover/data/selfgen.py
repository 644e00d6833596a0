"""Self-generated post-training data: conversations written by the unquantized instruct model itself.

Where no chat data is given, the recovery mix still needs post-training data (AFM trains its recovery
adapters on the same pre-training *and* post-training data). We let the unquantized model produce it, so
the adapter learns to answer the way the model did before quantization:

1. **Seed topics** come from section titles of the built-in text's ``train`` split (never ``eval`` or
   ``calib``, never an evaluation set), qualified by their page title ("Proxy Objects (multiprocessing)").
2. **Instruction types**: a short fixed list (:data:`INSTRUCTION_TYPES`: explain, example, how-to, compare,
   debug, summary, list, length-constrained, quiz, email). Topic ``i`` of a seeded shuffle is paired with
   type ``i mod 10``.
3. **Prompt**: ``prompt_mode="template"`` (default) fills the type's request template with the topic
   ("Summarize Proxy Objects (multiprocessing) in exactly three sentences."). ``prompt_mode="model"`` has
   the model write the request from a meta-prompt instead, falling back to the template when what it
   writes is unusable (fewer than 4 words); ``prompt_source`` records which. Measured on
   SmolLM2-135M-Instruct, model-written requests are mostly unusable ("Here's a sample response:", "I'm
   ready to assist you. What's your request?"), hence the default; larger instruct models can use "model".
4. **Answer**: the model answers the prompt in its own chat format. An answer cut at ``max_new_tokens``
   is kept and marked ``"truncated": true`` on the assistant message (its end-of-turn token is then not
   trained on, see :mod:`.chat`).

Generation is batched with a KV cache (``model.generate``), prompts sorted by length so a batch pads
little. Decoding is greedy by default (``temperature=0``); ``temperature > 0`` samples with a torch seed
derived from ``seed`` and the batch number (the caller's RNG state is left untouched). The metadata file
records which.

Output (cached, written atomically): ``cache_dir()/selfgen/<weights sha[:16]>-<settings sha[:16]>.jsonl``, one
``{"messages": [user, assistant], "topic", "instruction_type", "prompt_source", "id"}`` per line, and a
``.json`` sidecar with the model, the settings, the decoding and counts. Same model + settings -> the same
file, found in the cache without loading the model.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import torch

from ..errors import QRecoverError
from ..io_utils import cache_dir, write_text_atomic
from ..models import DEFAULT_MODEL, load_model, resolve, weights_sha256
from ..progress import steps
from .documents import text_docs

SELFGEN_VERSION = 1

# (type, what the user's message should be, a direct request used when the model's own prompt is unusable)
INSTRUCTION_TYPES: tuple[tuple[str, str, str], ...] = (
    ("explain", "a request to explain {topic} to a beginner", "Explain {topic} to a beginner."),
    ("example", "a request for a short code example that uses {topic}", "Show me a short Python example that uses {topic}, and explain it."),
    ("howto", "a 'how do I' question about a practical task involving {topic}", "How do I use {topic} in practice? Give step-by-step instructions."),
    ("compare", "a request to compare {topic} with an alternative", "Compare {topic} with an alternative. When should I use each?"),
    ("debug", "a request for help with an error someone hit while using {topic}",
     "I get an error when I use {topic}. What are the common causes and fixes?"),
    ("summary", "a request to summarize {topic} in exactly three sentences", "Summarize {topic} in exactly three sentences."),
    ("list", "a request for a bulleted list of tips about {topic}", "Give me a bulleted list of five tips about {topic}."),
    ("short", "a question about {topic} that asks for an answer of fewer than 50 words", "In fewer than 50 words, what is {topic} for?"),
    ("quiz", "a request for a multiple-choice quiz question about {topic}, with its answer",
     "Write one multiple-choice quiz question about {topic}, with the answer."),
    ("email", "a request to write a short email to a colleague about {topic}", "Write a short email to a colleague recommending {topic}."),
)
# The built-in 'general' prompt set: everyday English subjects with writing tasks (stories, poems, letters, ...), so
# that recovery also sees the teacher's prose far from the technical text of the docs. Fixed lists written for
# qrecover (never taken from an evaluation set); decontamination still checks what the model writes.
GENERAL_TOPICS: tuple[str, ...] = (
    "the sea", "a lighthouse keeper", "a small market town", "winter in the mountains", "an old friendship",
    "a long journey by train", "the history of bread", "honey bees", "a ruined castle", "a summer storm", "courage",
    "a village baker", "the night sky", "a lost letter", "rivers", "a stubborn goat", "the first day at a new school",
    "a family dinner", "autumn leaves", "an inventor", "a desert caravan", "music", "a rainy afternoon in the city",
    "the moon", "gardening", "a sailor returning home", "kindness to strangers", "an ancient forest", "a chess game",
    "the invention of printing", "a wedding", "foxes", "a busy harbour", "learning to swim", "a painter", "trust",
    "the farmer's year", "a snowy village", "an old clock", "a fisherman", "the Roman roads", "volcanoes",
    "a quarrel between brothers", "a travelling circus", "the library", "a mountain climber", "a queen's decision",
    "spring flowers", "a thunderstorm at sea", "the post office", "a grandmother's recipe", "a haunted house", "whales",
    "an election in a small town", "a blacksmith", "the wind", "a shipwreck", "hope", "a street musician",
    "a journey across the ocean", "a horse race", "a river at dawn",
)
GENERAL_TYPES: tuple[tuple[str, str, str], ...] = (
    ("story", "a request for a short story about {topic}", "Write a short story about {topic}."),
    ("poem", "a request for a poem about {topic}", "Write a poem about {topic}."),
    ("letter", "a request for a letter to a friend about {topic}", "Write a letter to a friend about {topic}."),
    ("dialogue", "a request for a dialogue about {topic}", "Write a dialogue between two people about {topic}."),
    ("describe", "a request to describe {topic} vividly", "Describe {topic} in vivid detail."),
    ("history", "a question about the history of {topic}", "Tell me about the history of {topic}."),
    ("child", "a request to explain {topic} to a child", "Explain {topic} to a curious child."),
    ("opinion", "a question asking for an opinion on {topic}", "What do you think about {topic}? Give your reasons."),
    ("speech", "a request for a short speech about {topic}", "Write a short speech about {topic}."),
    ("diary", "a request for a diary entry about {topic}", "Write a diary entry about {topic}."),
)
GENERAL = "general"

META_PROMPT = ("Write one message that a user could send to an AI assistant: {description}.\n"
               "Reply with the user's message only.")

_UNDERLINE = re.compile(r"^([=\-~^\"*#+`:.'_])\1{2,}\s*$")
_ROLE = re.compile(r":[\w:-]+:`~?!?([^`<]*?)\s*(?:<[^>]*>)?`")
_GENERIC = {"examples", "example", "notes", "note", "footnotes", "see also", "contents", "introduction", "overview",
            "others", "other", "reference", "restrictions", "summary", "changes", "deprecated", "removed", "new features",
            "acknowledgements", "glossary", "index", "usage", "improved modules", "new modules", "porting to python"}


def _clean_title(line: str) -> str:
    t = _ROLE.sub(r"\1", line.strip())
    t = t.replace("---", "—").replace("``", "").replace("`", "").replace("**", "").replace("*", "")
    return re.sub(r"\s+", " ", t).strip(" :")


def seed_topics(source: str = "python-docs") -> list[str]:
    """Section titles of the ``train`` split of a text source, qualified by their page title, deduplicated, in
    document (hash) order. Only ``train`` documents are read."""

    docs = text_docs(source, "train")
    topics, seen = [], set()
    for i in range(len(docs)):
        lines = docs.get(i).splitlines()
        page = None
        for a, b in zip(lines, lines[1:]):
            if a.strip() and _UNDERLINE.match(b) and len(b.strip()) >= len(a.strip()) and not _UNDERLINE.match(a):
                title = _clean_title(a)
                if len(title) < 3 or title.lower() in _GENERIC or title.lower().startswith(("what's new", "changes in")):
                    page = page or title
                    continue
                if page is None:
                    page = title
                    topic = title
                else:
                    short = page.split(" — ")[0]
                    if short.lower().startswith("what's new in "):  # "http (Python 3.3)", not "(What's New In Python 3.3)"
                        short = short[len("what's new in "):]
                    topic = title if short.lower() in title.lower() else f"{title} ({short})"
                if topic.lower() not in seen:
                    seen.add(topic.lower())
                    topics.append(topic)
    if not topics:
        raise QRecoverError(f"no section titles found in the train split of {source!r}; cannot seed self-generated prompts")
    return topics


def _weights_sha(model: Any) -> tuple[str, str]:
    """``(weights sha256, name)`` of a model spec (as :func:`qrecover.models.load_model` hashes it) or module."""
    if isinstance(model, torch.nn.Module):
        h = hashlib.sha256()
        for name, t in sorted(model.state_dict().items()):
            h.update(name.encode())
            h.update(str(t.dtype).encode())
            h.update(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return h.hexdigest(), type(model).__name__

    path, kind = resolve(None if model is None else str(model))
    if kind == "qrecover":
        raise QRecoverError(f"{str(path)!r} is a compressed checkpoint; self-generated data must come from the "
                            "unquantized instruct model: pass the original model")
    return weights_sha256(path, kind), (path.stem if kind == "gguf" else DEFAULT_MODEL if kind == "default" else path.name)


def _clean_prompt(text: str) -> str:
    t = text.strip().split("\n\n")[0].strip()
    t = re.sub(r"^(user|message|user's message|request)\s*:\s*", "", t, flags=re.I).strip()
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "\"'":
        t = t[1:-1].strip()
    return t[:600]


def _eos_ids(model: torch.nn.Module, tokenizer: Any) -> set[int]:
    """The tokens that end a generation: the tokenizer's and the model's generation config's end-of-sequence ids."""
    eos = {tokenizer.eos_token_id}
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos |= set(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
    eos.discard(None)
    return eos


def _cache_path(out_dir: str | os.PathLike | None, weights_sha: str, settings: dict[str, Any], tag: str) -> Path:
    """Where the data of this model and these settings lives: ``<out_dir or cache_dir()/selfgen>/<weights>-<tag><settings>.jsonl``."""
    settings_sha = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()
    folder = Path(out_dir) if out_dir is not None else cache_dir() / "selfgen"
    return folder / f"{weights_sha[:16]}-{tag}{settings_sha[:16]}.jsonl"


def _store(path: Path, meta: dict[str, Any], rows: list[dict[str, Any]]) -> Path:
    """The sidecar ``.json``, then the jsonl (written last and atomically: its presence means complete)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    for target, text in ((path.with_suffix(".json"), json.dumps(meta, indent=1)),
                         (path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))):
        write_text_atomic(target, text)
    return path


def _load_for_generation(model_spec_or_model: Any, tokenizer: Any) -> tuple[torch.nn.Module, Any]:
    if isinstance(model_spec_or_model, torch.nn.Module):
        return model_spec_or_model, tokenizer
    model, loaded_tok, _ = load_model(None if model_spec_or_model is None else str(model_spec_or_model))
    return model, tokenizer or loaded_tok


def _generate(model: torch.nn.Module, tokenizer: Any, conversations: list[list[dict]], max_new_tokens: int,
              temperature: float, top_p: float, seed: int, batch_size: int, advance) -> list[tuple[str, bool]]:
    """``(answer text, finished)`` per conversation: greedy or seeded sampling, batched, KV cache."""
    from transformers import GenerationConfig

    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    eos = _eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sample = temperature > 0
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature if sample else None,
                           top_p=top_p if sample else None, top_k=None, pad_token_id=pad, eos_token_id=sorted(eos),
                           use_cache=True)
    device = next(model.parameters()).device
    order = sorted(range(len(texts)), key=lambda i: (len(texts[i]), i))  # similar lengths together: little padding
    out: list[tuple[str, bool] | None] = [None] * len(texts)
    side, pad_token = tokenizer.padding_side, tokenizer.pad_token
    tokenizer.padding_side = "left"
    if pad_token is None:  # batched prompts need padding; the tokenizer refuses to pad without a pad token
        tokenizer.pad_token = tokenizer.eos_token
    try:
        for b in range(0, len(order), batch_size):
            idx = order[b : b + batch_size]
            enc = tokenizer([texts[i] for i in idx], return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {k: v.to(device) for k, v in enc.items()}
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
                torch.manual_seed(seed * 1_000_003 + b)
                seqs = model.generate(**enc, generation_config=cfg)
            for j, i in enumerate(idx):
                new = seqs[j, enc["input_ids"].shape[1] :].tolist()
                stop = next((k for k, t in enumerate(new) if t in eos), None)
                finished = stop is not None
                text = tokenizer.decode(new[:stop] if finished else new, skip_special_tokens=True).strip()
                out[i] = (text, finished)
            advance(len(idx))
    finally:
        tokenizer.padding_side = side
        if pad_token is None:
            tokenizer.pad_token = None
    return out  # type: ignore[return-value]


def _plan(topics: list[str], types: Any, n: int) -> list[tuple[str, str, str, str]]:
    """``n`` requests ``(topic, kind, description, request)``: instruction types and topics in turn."""
    plan = []
    for i in range(n):
        kind, description, template = types[i % len(types)]
        topic = topics[i % len(topics)]
        plan.append((topic, kind, description.format(topic=topic), template.format(topic=topic)))
    return plan


def _converse(model: Any, tokenizer: Any, plan: list[tuple[str, str, str, str]], prompt_mode: str, prompt_max_new_tokens: int,
              max_new_tokens: int, temperature: float, top_p: float, seed: int, batch_size: int, show_progress: bool,
              model_name: str) -> tuple[list[str], list[str], list[tuple[str, bool]]]:
    """The requests (templates, or written by the model in 'model' mode) and the model's answers to them:
    ``(prompts, prompt sources, [(answer, finished)])``, one per ``plan`` entry ``(topic, kind, description, template)``."""
    n = len(plan)
    with steps(show_progress, f"self-generate {n} chats ({model_name})", n * (2 if prompt_mode == "model" else 1)) as advance:
        prompts, sources = [template for *_, template in plan], ["template"] * n
        if prompt_mode == "model":
            metas = [[{"role": "user", "content": META_PROMPT.format(description=d)}] for _, _, d, _ in plan]
            written = _generate(model, tokenizer, metas, prompt_max_new_tokens, temperature, top_p, seed, batch_size, advance)
            for i, (text, _) in enumerate(written):
                p = _clean_prompt(text)
                if len(p.split()) >= 4:
                    prompts[i], sources[i] = p, "model"
        answers = _generate(model, tokenizer, [[{"role": "user", "content": p}] for p in prompts], max_new_tokens,
                            temperature, top_p, seed + 1, batch_size, advance)
    return prompts, sources, answers


def _rows(plan: list[tuple[str, str, str, str]], prompts: list[str], sources: list[str],
          answers: list[tuple[str, bool]]) -> list[dict[str, Any]]:
    """The jsonl rows: one user/assistant chat each (an answer cut at the cap marked ``truncated``)."""
    rows = []
    for i, ((topic, kind, _, _), prompt, src, (answer, finished)) in enumerate(zip(plan, prompts, sources, answers)):
        reply: dict[str, Any] = {"role": "assistant", "content": answer}
        if not finished:
            reply["truncated"] = True
        rows.append({"messages": [{"role": "user", "content": prompt}, reply], "topic": topic,
                     "instruction_type": kind, "prompt_source": src, "id": i})
    return rows


def generate_chat_data(model_spec_or_model: Any = None, tokenizer: Any = None, n: int = 256, seed: int = 0,
                       max_new_tokens: int = 192, temperature: float = 0.0, top_p: float = 1.0, batch_size: int = 16,
                       prompt_max_new_tokens: int = 64, prompt_mode: str = "template", topics_source: str = "python-docs",
                       show_progress: bool = True,
                       out_dir: str | os.PathLike | None = None) -> Path:
    """Generate (or find in the cache) ``n`` conversations by the unquantized instruct model; returns the jsonl path.

    ``model_spec_or_model``: a model spec for :func:`qrecover.models.load_model` (None = the built-in default)
    or a loaded ``nn.Module`` (then ``tokenizer`` is required). ``max_new_tokens``: answer cap;
    ``prompt_mode``: "template" (requests = instruction templates filled with topics) or "model" (the model
    writes them; ``prompt_max_new_tokens`` caps them). ``temperature=0``: greedy.
    ``out_dir``: where the cache lives (default ``cache_dir()/selfgen``). ``topics_source``: a text source whose
    train-split section titles seed the requests (with :data:`INSTRUCTION_TYPES`), or ``"general"``: the built-in
    everyday subjects :data:`GENERAL_TOPICS` with the writing tasks :data:`GENERAL_TYPES`.
    """
    for name, v in (("n", n), ("max_new_tokens", max_new_tokens), ("batch_size", batch_size),
                    ("prompt_max_new_tokens", prompt_max_new_tokens)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise QRecoverError(f"{name}={v!r} must be a positive integer")
    if prompt_mode not in ("template", "model"):
        raise QRecoverError(f"prompt_mode={prompt_mode!r} must be 'template' or 'model'")
    if not (temperature >= 0 and 0 < top_p <= 1):
        raise QRecoverError(f"temperature={temperature} must be >= 0 and top_p={top_p} in (0, 1]")
    is_module = isinstance(model_spec_or_model, torch.nn.Module)
    if is_module and tokenizer is None:
        raise QRecoverError("generate_chat_data got a model object without its tokenizer; pass tokenizer=")

    if topics_source == GENERAL:
        topics, types = list(GENERAL_TOPICS), GENERAL_TYPES
    else:
        topics, types = seed_topics(topics_source), INSTRUCTION_TYPES
    rng = random.Random(seed)
    rng.shuffle(topics)
    weights_sha, model_name = _weights_sha(model_spec_or_model)
    decoding: Any = "greedy" if temperature == 0 else {"sampling": {"temperature": temperature, "top_p": top_p, "seed": seed}}
    settings = {"version": SELFGEN_VERSION, "n": n, "seed": seed, "max_new_tokens": max_new_tokens,
                "prompt_mode": prompt_mode, "temperature": temperature, "top_p": top_p,
                **({"prompt_max_new_tokens": prompt_max_new_tokens, "meta_prompt": META_PROMPT} if prompt_mode == "model" else {}),
                "batch_size": batch_size, "topics_source": topics_source,
                "topics_sha256": hashlib.sha256("\n".join(topics).encode()).hexdigest(),
                "instruction_types": [list(t) for t in types],
                "chat_template_sha256": (hashlib.sha256(str(getattr(tokenizer, "chat_template", None)).encode()).hexdigest()
                                         if tokenizer is not None else None)}
    path = _cache_path(out_dir, weights_sha, settings, "")
    if path.is_file():
        return path

    # --- load the model only on a cache miss ----------------------------------------------------------
    t0 = time.time()
    model, tokenizer = _load_for_generation(model_spec_or_model, tokenizer)
    if getattr(tokenizer, "chat_template", None) is None:
        raise QRecoverError(f"the tokenizer of {model_name!r} has no chat template; self-generated chat data needs an instruct model")
    was_training = model.training
    model.eval()

    plan = _plan(topics, types, n)
    prompts, sources, answers = _converse(model, tokenizer, plan, prompt_mode, prompt_max_new_tokens, max_new_tokens,
                                          temperature, top_p, seed, batch_size, show_progress, model_name)
    model.train(was_training)
    rows = _rows(plan, prompts, sources, answers)
    meta = {"model": {"name": model_name, "weights_sha256": weights_sha,
                      "spec": None if is_module or model_spec_or_model is None else str(model_spec_or_model)},
            "settings": settings, "decoding": decoding, "rows": len(rows),
            "truncated": sum(1 for r in rows if r["messages"][1].get("truncated")),
            "prompt_source": {k: sources.count(k) for k in ("model", "template")},
            "seconds": round(time.time() - t0, 1), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return _store(path, meta, rows)


FREE_VERSION = 1


def generate_free_text(model_spec_or_model: Any = None, tokenizer: Any = None, n: int = 256, seed: int = 0,
                       max_new_tokens: int = 512, temperature: float = 1.0, top_p: float = 1.0, batch_size: int = 32,
                       show_progress: bool = True, out_dir: str | os.PathLike | None = None) -> Path:
    """Generate (or find in the cache) ``n`` documents the unquantized model writes with no prompt at all, each from
    one random first token; returns the jsonl path (one ``{"text", "first_token", "finished", "id"}`` per line).

    This is LLM-QAT's data-free distillation data (Liu et al. 2023): text drawn from the model's own distribution,
    not from any domain the user picked, so recovery that distils on it follows the teacher wherever it is likely
    to go. The first token is drawn uniformly (seeded) from the vocabulary without its special tokens; generation
    then samples (``temperature``, ``top_p``; ``temperature=0``: greedy) up to ``max_new_tokens`` or an
    end-of-sequence token. No chat template is applied, so a base model works as well as an instruct one. Cached
    like :func:`generate_chat_data`: same model and settings, the same file, found without loading the model.
    """
    for name, v in (("n", n), ("max_new_tokens", max_new_tokens), ("batch_size", batch_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise QRecoverError(f"{name}={v!r} must be a positive integer")
    if not (temperature >= 0 and 0 < top_p <= 1):
        raise QRecoverError(f"temperature={temperature} must be >= 0 and top_p={top_p} in (0, 1]")
    if isinstance(model_spec_or_model, torch.nn.Module) and tokenizer is None:
        raise QRecoverError("generate_free_text got a model object without its tokenizer; pass tokenizer=")
    weights_sha, model_name = _weights_sha(model_spec_or_model)
    settings = {"version": FREE_VERSION, "kind": "free", "n": n, "seed": seed, "max_new_tokens": max_new_tokens,
                "temperature": temperature, "top_p": top_p, "batch_size": batch_size}
    path = _cache_path(out_dir, weights_sha, settings, "free-")
    if path.is_file():
        return path

    t0 = time.time()
    model, tokenizer = _load_for_generation(model_spec_or_model, tokenizer)
    from transformers import GenerationConfig

    special = set(tokenizer.all_special_ids)
    ordinary = torch.tensor([i for i in range(len(tokenizer)) if i not in special and i < model.config.vocab_size])
    g = torch.Generator().manual_seed(seed)
    first = ordinary[torch.randint(len(ordinary), (n,), generator=g)]
    eos = _eos_ids(model, tokenizer)
    sample = temperature > 0
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature if sample else None,
                           top_p=top_p if sample else None, top_k=None, eos_token_id=sorted(eos),
                           pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos), use_cache=True)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    rows = []
    try:
        with steps(show_progress, f"self-generate {n} free texts ({model_name})", n) as advance:
            for b in range(0, n, batch_size):
                ids = first[b : b + batch_size, None].to(device)  # one token each: no padding
                with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
                    torch.manual_seed(seed * 1_000_003 + b)
                    seqs = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=cfg)
                for j, seq in enumerate(seqs.tolist()):
                    new = seq[1:]
                    stop = next((k for k, t in enumerate(new) if t in eos), None)
                    text = tokenizer.decode(seq[:1] + (new[:stop] if stop is not None else new), skip_special_tokens=True)
                    rows.append({"text": text, "first_token": seq[0], "finished": stop is not None, "id": b + j})
                advance(len(seqs))
    finally:
        model.train(was_training)
    meta = {"model": {"name": model_name, "weights_sha256": weights_sha,
                      "spec": None if isinstance(model_spec_or_model, torch.nn.Module) or model_spec_or_model is None
                      else str(model_spec_or_model)},
            "settings": settings, "rows": len(rows), "finished": sum(r["finished"] for r in rows),
            "seconds": round(time.time() - t0, 1), "created": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return _store(path, meta, rows)


__all__ = ["INSTRUCTION_TYPES", "GENERAL_TOPICS", "GENERAL_TYPES", "META_PROMPT", "seed_topics", "generate_chat_data",
           "generate_free_text"]

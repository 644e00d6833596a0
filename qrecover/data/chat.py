"""Chat documents: render ``messages`` with the tokenizer's own chat template, loss on assistant tokens only.

``encode_chat(tokenizer, messages) -> (input_ids, labels)``; ``labels`` is ``input_ids`` with ``-100`` on every
token that carries no loss (the trainer shifts). Which tokens carry loss:

* **Template with generation markers** (``{% generation %}`` ... ``{% endgeneration %}``): exactly the tokens
  the template marks (transformers' ``return_assistant_tokens_mask``); the template decides about its
  end-of-turn token.
* **Otherwise, prefix-diff** (e.g. SmolLM2, whose ChatML template has no markers): for each assistant
  message ``i`` the renders of ``messages[:i]`` + generation prompt and of ``messages[:i+1]`` differ by
  exactly that turn; inside the difference we label the message's content and the **end-of-turn token**
  that closes it (``<|im_end|>`` for ChatML: the model must learn to stop, which is how the instruct model
  ends every answer). Not labelled: the system prompt, user turns, the ``<|im_start|>assistant\\n`` header
  (at inference it comes from ``add_generation_prompt``), and whatever the template puts after the
  end-of-turn token (ChatML's ``\\n``).

Character spans are mapped to tokens through the fast tokenizer's offsets of the *full* render, so the
token ids are exactly ``apply_chat_template(messages, tokenize=True)``; a token is labelled when it starts
inside a labelled span.

An assistant message with ``"truncated": true`` (a self-generated answer cut off at ``max_new_tokens``) is
labelled without its end-of-turn token: the model should not learn to stop where the cut fell.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import QRecoverError

IGNORE = -100
ROLES = ("system", "user", "assistant", "tool")
_GENERATION = re.compile(r"\{%-?\s*generation\s*-?%\}")


def validate_messages(messages: Any, where: str = "conversation") -> list[dict[str, Any]]:
    """``messages`` as a list of ``{"role", "content"}`` dicts with string content, or a QRecoverError saying what is wrong."""
    if not isinstance(messages, list) or not messages:
        raise QRecoverError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects, got {type(messages).__name__}")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise QRecoverError(f"{where}: message {i} must be an object with 'role' and 'content', got {m!r:.120}")
        if m["role"] not in ROLES:
            raise QRecoverError(f"{where}: message {i} has role {m['role']!r}; use one of {list(ROLES)}")
        if not isinstance(m["content"], str):
            raise QRecoverError(f"{where}: message {i} content must be a string, got {type(m['content']).__name__}")
    if messages[0]["role"] == "assistant":
        raise QRecoverError(f"{where}: the conversation starts with an assistant message; start it with a system or user message")
    return messages


def has_generation_markers(tokenizer: Any) -> bool:
    """True when the tokenizer's chat template marks assistant text with ``{% generation %}``."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    return bool(template) and bool(_GENERATION.search(template))


def _render(tokenizer: Any, messages: list[dict], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def _end_of_turn(tokenizer: Any, rest: str) -> int:
    """Length of whitespace + the special token that closes a turn at the start of ``rest`` (0 if none)."""
    specials = [t for t in [tokenizer.eos_token, *getattr(tokenizer, "all_special_tokens", [])] if t]
    lead = len(rest) - len(rest.lstrip())
    for tok in specials:
        if rest.startswith(tok, lead):
            return lead + len(tok)
    return 0


def assistant_spans(tokenizer: Any, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """``(rendered conversation, [(start, end) character spans that carry loss])`` by the prefix-diff method."""
    full = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], True)
        upto = _render(tokenizer, messages[: i + 1], False)
        if not (upto.startswith(prefix) and full.startswith(upto)):
            raise QRecoverError(
                f"the chat template of {getattr(tokenizer, 'name_or_path', 'this tokenizer')!r} is not prefix-stable "
                f"(rendering messages[:{i}] is not a prefix of rendering messages[:{i + 1}]), so assistant turns cannot "
                "be located; use a template with {% generation %} markers")
        turn = upto[len(prefix):]
        content = m["content"]
        at = turn.find(content) if content else -1
        if at < 0 and content.strip():
            content = content.strip()  # templates often trim the content
            at = turn.find(content)
        if at < 0:
            if content.strip():
                raise QRecoverError(f"assistant message {i} does not appear verbatim in the chat template's render; "
                                    "use a template with {% generation %} markers")
            at, content = 0, ""  # an empty answer: only the end-of-turn token
        start = len(prefix) + at
        end = start + len(content)
        if not m.get("truncated"):
            end += _end_of_turn(tokenizer, full[end : len(upto)])
        if end > start:
            spans.append((start, end))
    return full, spans


def encode_chat(tokenizer: Any, messages: list[dict], where: str = "conversation") -> tuple[list[int], list[int]]:
    """``(input_ids, labels)`` of one conversation, each ``(T,)``; labels ``-100`` except on assistant tokens."""
    messages = validate_messages(messages, where)
    if getattr(tokenizer, "chat_template", None) is None:
        raise QRecoverError(f"{where}: the tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has no chat template, "
                            "so chat data cannot be rendered; use text data or a tokenizer with a chat template")
    if has_generation_markers(tokenizer):
        out = tokenizer.apply_chat_template([{k: v for k, v in m.items() if k != "truncated"} for m in messages],
                                            tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
        return ids, [t if k else IGNORE for t, k in zip(ids, mask)]
    if not getattr(tokenizer, "is_fast", False):
        raise QRecoverError(f"{where}: locating assistant tokens needs a fast tokenizer (character offsets); "
                            f"load it with AutoTokenizer.from_pretrained(..., use_fast=True)")
    text, spans = assistant_spans(tokenizer, messages)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True, verbose=False)
    ids = list(enc["input_ids"])
    labels = [IGNORE] * len(ids)
    k = 0
    for t, (s, e) in enumerate(enc["offset_mapping"]):
        while k < len(spans) and s >= spans[k][1]:
            k += 1
        if k < len(spans) and spans[k][0] <= s < spans[k][1] and e > s:
            labels[t] = ids[t]
    return ids, labels


def chat_text(messages: list[dict]) -> str:
    """The plain text of a conversation (every message's content), for decontamination."""
    return "\n".join(m.get("content", "") for m in messages if isinstance(m, dict))


__all__ = ["IGNORE", "encode_chat", "validate_messages", "has_generation_markers", "assistant_spans", "chat_text"]

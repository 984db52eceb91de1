"""One chat-completions call against an OpenAI-compatible endpoint, with retries and error meanings.

``ChatCompletionsClient.complete`` posts one request body on a shared ``httpx.AsyncClient`` and turns
whatever comes back into a :class:`CallOutcome`:

- 200 with ``choices[0].message``: success (action text via :func:`prompting.reply_to_action`).
- Retried with exponential backoff and full jitter (``backoff_base_s * 2**attempt``, capped at
  ``max_backoff_s``), honouring a ``Retry-After`` header in seconds (or an HTTP date): timeouts,
  connection errors, HTTP 408/429/500/502/503/504 (and other 5xx), a 402 that carries ``Retry-After``,
  and errors inside a 200 body whose code is one of those.
- Stop the teacher (``CallOutcome.stop`` set; the replay skips its later calls): HTTP 400 (bad
  request), 401 (bad or missing API key), 402 (insufficient credits), 403 (moderation or guardrail
  block), 404 (model or endpoint not found), also when they arrive as codes inside a 200 body.
- Any other failure (other 4xx, a malformed body, ``finish_reason: "error"`` without a transient
  code) is a final error for this call only.

Every error text is scrubbed of the API key before it is stored or logged.
"""

from __future__ import annotations

import asyncio
import email.utils
import json
import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from composer_replication.teacher_replay.keys import SecretKey, scrub
from composer_replication.teacher_replay.prompting import reply_to_action

__all__ = ["STATUS_MEANINGS", "RETRYABLE_STATUSES", "STOP_STATUSES", "CallOutcome", "ChatCompletionsClient"]

log = logging.getLogger(__name__)

STATUS_MEANINGS = {
    400: "bad request",
    401: "bad or missing API key",
    402: "insufficient credits",
    403: "moderation or guardrail block",
    404: "model or endpoint not found",
    408: "request timeout",
    429: "rate limited",
    500: "server error",
    502: "model down or invalid response",
    503: "no provider available",
    504: "gateway timeout",
}
RETRYABLE_STATUSES = frozenset({408, 429, 500, 502, 503, 504})
STOP_STATUSES = frozenset({400, 401, 402, 403, 404})


def _meaning(status: int) -> str:
    return STATUS_MEANINGS.get(status, "server error" if status >= 500 else "error")


@dataclass
class CallOutcome:
    """What one (possibly retried) call produced.

    Attributes:
        text: the action text (``None`` on error).
        usage: the reply's ``usage`` object (``None`` when absent or on error).
        error: the final error text (scrubbed), ``None`` on success.
        stop: set to e.g. ``"HTTP 402 (insufficient credits)"`` when the teacher must not be called again.
        attempts: requests sent.
    """

    text: str | None = None
    usage: dict[str, Any] | None = None
    error: str | None = None
    stop: str | None = None
    attempts: int = 0


class _Transient(Exception):
    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class _Final(Exception):
    def __init__(self, message: str, stop: str | None = None) -> None:
        super().__init__(message)
        self.stop = stop


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP date); ``None`` if unusable."""
    if not value:
        return None
    value = value.strip()
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


class ChatCompletionsClient:
    """Posts chat-completions requests with retries; one instance per replay.

    Args:
        http: the shared ``httpx.AsyncClient`` (owned by the caller).
        api_key: sent as ``Authorization: Bearer`` when not ``None``.
        timeout_s: per-request timeout.
        max_retries: retries after the first attempt for transient failures.
        backoff_base_s: first backoff; doubles per retry (full jitter).
        max_backoff_s: backoff cap (``Retry-After`` is honoured up to ``max_retry_after_s``).
        max_retry_after_s: a longer ``Retry-After`` makes the call fail instead of waiting.
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        api_key: SecretKey | None,
        timeout_s: float = 120.0,
        max_retries: int = 5,
        backoff_base_s: float = 0.5,
        max_backoff_s: float = 30.0,
        max_retry_after_s: float = 300.0,
    ) -> None:
        self._http = http
        self._key = api_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_base_s = backoff_base_s
        self.max_backoff_s = max_backoff_s
        self.max_retry_after_s = max_retry_after_s
        self._rng = random.Random()
        self._urls: dict[str, httpx.URL] = {}  # parsed once per endpoint: httpx re-parses a str per request

    def _parsed_url(self, url: str) -> httpx.URL:
        parsed = self._urls.get(url)
        if parsed is None:
            parsed = self._urls[url] = httpx.URL(url)
        return parsed

    def __repr__(self) -> str:
        return f"ChatCompletionsClient(api_key={self._key!r}, timeout_s={self.timeout_s})"

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "X-Title": "composer-replication"}
        if self._key is not None:
            headers["Authorization"] = "Bearer " + self._key.reveal()
        return headers

    def _delay(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return retry_after
        return self._rng.uniform(0.0, min(self.max_backoff_s, self.backoff_base_s * (2**attempt)))

    async def complete(self, url: str, body: dict[str, Any]) -> CallOutcome:
        """Send ``body`` to ``url`` until success, a final error, or retries run out."""
        outcome = CallOutcome()
        target = self._parsed_url(url)
        for attempt in range(self.max_retries + 1):
            outcome.attempts = attempt + 1
            try:
                outcome.text, outcome.usage = await self._attempt(target, body)
                return outcome
            except _Final as exc:
                outcome.error, outcome.stop = scrub(str(exc), self._key), exc.stop
                return outcome
            except _Transient as exc:
                message = scrub(str(exc), self._key)
                if exc.retry_after is not None and exc.retry_after > self.max_retry_after_s:
                    outcome.error = (
                        f"{message}; Retry-After {exc.retry_after:.0f}s exceeds {self.max_retry_after_s:.0f}s"
                    )
                    return outcome
                if attempt == self.max_retries:
                    outcome.error = f"{message}; gave up after {attempt + 1} attempts"
                    return outcome
                delay = self._delay(attempt, exc.retry_after)
                log.debug("transient failure (%s); retry %d in %.2fs", message, attempt + 1, delay)
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _attempt(self, url: httpx.URL, body: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
        try:
            resp = await self._http.post(url, json=body, headers=self._headers(), timeout=self.timeout_s)
        except httpx.TimeoutException as exc:
            raise _Transient(f"timeout: no reply within {self.timeout_s:g}s ({type(exc).__name__})") from None
        except httpx.TransportError as exc:
            raise _Transient(f"connection error: {type(exc).__name__}: {exc}") from None
        except httpx.RequestError as exc:  # decoding errors, redirect loops: not worth retrying
            raise _Final(f"request error: {type(exc).__name__}: {exc}") from None
        status = resp.status_code
        if status != 200:
            self._raise_for_status(status, resp)
        try:
            data = resp.json()
        except (ValueError, UnicodeDecodeError):
            raise _Final(f"malformed response: HTTP 200 body is not JSON: {resp.text[:200]!r}") from None
        return self._parse_ok(data)

    def _raise_for_status(self, status: int, resp: httpx.Response) -> None:
        detail = _error_message(resp)
        text = f"HTTP {status} ({_meaning(status)}): {detail}"
        retry_after = parse_retry_after(resp.headers.get("Retry-After"))
        if status in RETRYABLE_STATUSES or status >= 500 or (status == 402 and retry_after is not None):
            raise _Transient(text, retry_after)
        raise _Final(text, stop=f"HTTP {status} ({_meaning(status)})" if status in STOP_STATUSES else None)

    def _parse_ok(self, data: Any) -> tuple[str, dict[str, Any] | None]:
        if not isinstance(data, dict):
            raise _Final(f"malformed response: expected a JSON object, got {type(data).__name__}")
        if data.get("error"):
            _raise_body_error(data["error"], "in a 200 reply")
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise _Final("malformed response: no choices[0] in the reply")
        choice = choices[0]
        if choice.get("error") or choice.get("finish_reason") == "error":
            _raise_body_error(choice.get("error") or {}, "(finish_reason 'error')")
        message = choice.get("message")
        if not isinstance(message, dict):
            raise _Final("malformed response: choices[0].message is missing")
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else None
        return reply_to_action(message), usage


def _error_message(resp: httpx.Response) -> str:
    try:
        err = resp.json().get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])[:500]
        if isinstance(err, str):
            return err[:500]
    except (ValueError, AttributeError, UnicodeDecodeError):
        pass
    return resp.text[:200] or "(empty body)"


def _raise_body_error(err: Any, where: str) -> None:
    code = err.get("code") if isinstance(err, dict) else None
    message = err.get("message") if isinstance(err, dict) else err
    try:
        status = int(code) if code is not None else None
    except (TypeError, ValueError):
        status = None
    label = f"provider error {status} ({_meaning(status)})" if status else "provider error"
    text = f"{label} {where}: {json.dumps(message, ensure_ascii=False)[:500] if message else '(no message)'}"
    if status is not None and (status in RETRYABLE_STATUSES or status >= 500):
        raise _Transient(text)
    raise _Final(text, stop=f"HTTP {status} ({_meaning(status)})" if status in STOP_STATUSES else None)

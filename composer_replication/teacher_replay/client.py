"""One chat-completions attempt over stock httpx (sent once, one total deadline, an uncompressed body of at most
``max_response_bytes``), and the one retry policy. An :class:`AttemptOutcome` says what the attempt costs,
whether to retry it and whether to stop the teacher (``docs/teacher_replay.md``, Retries and errors). Every
text is scrubbed of the API key before it is cut.
"""

from __future__ import annotations

import asyncio
import collections
import email.utils
import json
import math
import random
import time
from dataclasses import dataclass
from typing import Any

import httpx

from composer_replication.teacher_replay.budget import BadUsageError, Usage, parse_usage
from composer_replication.teacher_replay.keys import SecretKey, scrub, scrub_clip
from composer_replication.teacher_replay.teachers import reply_to_action

__all__ = ["ChatCompletionsClient", "RetryPolicy"]

STATUS_MEANINGS = {
    400: "bad request", 401: "bad or missing API key", 402: "insufficient credits",
    403: "moderation or guardrail block", 404: "model or endpoint not found", 408: "request timeout",
    429: "rate limited", 500: "server error", 502: "model down or invalid response", 503: "no provider available",
    504: "gateway timeout",
}  # fmt: skip
RETRYABLE = frozenset({408, 429, 500, 502, 503, 504})
STOPS = frozenset({400, 401, 402, 403, 404})
STREAMING = "streaming replies are not supported; use a non-streaming endpoint"
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)


def _meaning(status: int) -> str:
    return STATUS_MEANINGS.get(status, "server error" if status >= 500 else "error")


AttemptOutcome = collections.namedtuple(
    "AttemptOutcome", "text usage error stop retryable retry_after reached answered",
    defaults=(None, None, None, None, False, None, True, False))
"""What one attempt produced: ``text`` and ``usage``, or an ``error`` (scrubbed) with ``stop`` (why the teacher
must not be called again), ``retryable`` and the server's ``retry_after``; ``reached`` (the server may have it)
and ``answered`` (the provider reported the error) decide its bill."""


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a ``Retry-After`` header (delta-seconds or HTTP date); ``None`` if unusable."""
    try:
        seconds = float(value or "nan")
    except ValueError:
        try:
            seconds = email.utils.parsedate_to_datetime(value.strip()).timestamp() - time.time()
        except (TypeError, ValueError, IndexError, OverflowError, OSError):  # a server's header: never fatal
            return None
    return max(0.0, seconds) if math.isfinite(seconds) else None


@dataclass(kw_only=True)
class RetryPolicy:
    """The only retry logic: a transient failure is retried ``max_retries`` times after ``backoff_base_s *
    2**attempt`` s (at most ``max_backoff_s``, full jitter) or ``Retry-After`` (above ``max_retry_after_s``: not)."""

    max_retries: int = 5
    backoff_base_s: float = 0.5
    max_backoff_s: float = 30.0
    max_retry_after_s: float = 300.0

    def __post_init__(self) -> None:
        self._rng = random.Random()

    def next_delay(self, attempt: int, outcome: AttemptOutcome) -> tuple[float | None, str | None]:
        """``(seconds to wait, None)`` to retry after attempt ``attempt`` (0-based), or ``(None, final error)``."""
        if not outcome.retryable:
            return None, outcome.error
        if outcome.retry_after is not None and outcome.retry_after > self.max_retry_after_s:
            return None, f"{outcome.error}; Retry-After {outcome.retry_after:.0f}s exceeds {self.max_retry_after_s:.0f}s"
        if attempt >= self.max_retries:
            return None, f"{outcome.error}; gave up after {attempt + 1} attempts"
        if outcome.retry_after is not None:
            return outcome.retry_after, None
        return self._rng.uniform(0.0, min(self.max_backoff_s, self.backoff_base_s * 2**attempt)), None


class _Failed(Exception):
    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.fields = fields


def _utf8(text: str) -> str:
    """``text`` with lone surrogates (legal JSON escapes, not UTF-8) as ``?``, so it can always be written."""
    return text.encode("utf-8", "replace").decode("utf-8")


class ChatCompletionsClient:
    """Single attempts on the shared ``http`` client (owned by the caller); ``api_key`` is sent as
    ``Authorization: Bearer`` when given."""

    def __init__(self, http: httpx.AsyncClient, *, api_key: SecretKey | None, timeout_s: float = 120.0,
                 max_response_bytes: int = 8 * 1024 * 1024) -> None:
        self._http, self._key = http, api_key
        self.timeout_s, self.max_response_bytes = timeout_s, max_response_bytes
        self._timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0))  # inside the total deadline
        self._headers = {"Content-Type": "application/json", "Accept-Encoding": "identity",
                         "X-Title": "composer-replication"}
        if api_key is not None:
            self._headers["Authorization"] = "Bearer " + api_key.reveal()

    def _clip(self, text: str, limit: int = 500) -> str:
        return _utf8(scrub_clip(text, self._key, limit))

    async def attempt(self, url: str, body: dict[str, Any]) -> AttemptOutcome:
        """Send ``body`` to ``url`` once; never raises for what the network or the server did."""
        sent = {"headers": False, "traced": False}

        async def trace(name: str, info: dict[str, Any]) -> None:  # httpcore's progress events
            sent["traced"] = True
            sent["headers"] = sent["headers"] or name.endswith("send_request_headers.started")

        try:
            status, headers, raw = await asyncio.wait_for(self._post(url, body, trace), self.timeout_s)
            return self._parse(status, headers, raw)
        except _Failed as exc:
            return AttemptOutcome(error=str(exc), **exc.fields)
        except asyncio.TimeoutError:
            return AttemptOutcome(error=f"timeout: no complete reply within {self.timeout_s:g}s (total deadline)",
                                  retryable=True, reached=sent["headers"] or not sent["traced"])
        except httpx.TransportError as exc:  # timeouts included
            what = "timeout" if isinstance(exc, httpx.TimeoutException) else "connection error"
            return AttemptOutcome(error=self._clip(f"{what}: {type(exc).__name__}: {exc}"), reached=not isinstance(
                exc, _NEVER_SENT), retryable=not isinstance(exc, httpx.UnsupportedProtocol))
        except httpx.RequestError as exc:  # decoding errors, redirect loops: not worth retrying
            return AttemptOutcome(error=self._clip(f"request error: {type(exc).__name__}: {exc}"))
        except Exception as exc:  # e.g. RecursionError on JSON nested 100k deep: one bad reply, one call
            return AttemptOutcome(error=self._clip(f"malformed response: {type(exc).__name__}"))

    async def _post(self, url: str, body: dict[str, Any], trace: Any) -> tuple[int, httpx.Headers, bytes]:
        request = self._http.build_request("POST", url, json=body, headers=self._headers, timeout=self._timeout,
                                           extensions={"trace": trace})
        response = await self._http.send(request, stream=True)
        try:
            if response.headers.get("Content-Type", "").lower().startswith("text/event-stream"):
                raise _Failed(STREAMING, stop=STREAMING)  # never read: it may stream for minutes
            return response.status_code, response.headers, await self._read(response)
        finally:
            await response.aclose()

    async def _read(self, response: httpx.Response) -> bytes:
        """The body, refused past ``max_response_bytes``; identity was asked for, so a compressed body is refused
        too (nothing is inflated: no gzip bomb)."""
        status, limit, parts, size = response.status_code, self.max_response_bytes, [], 0
        encoding = response.headers.get("Content-Encoding", "").strip().lower()
        if encoding not in ("", "identity") and not response.is_stream_consumed:
            raise _Failed(f"malformed response: Content-Encoding {encoding!r:.40} where identity was asked for "
                          f"(HTTP {status}); refused unread")
        async for chunk in response.aiter_bytes():  # identity: the raw bytes (or a read body, e.g. MockTransport's)
            size += len(chunk)
            if size > limit:
                raise _Failed(f"response too large: over {limit} bytes (HTTP {status}); refused")
            parts.append(chunk)
        return b"".join(parts)

    def _parse(self, status: int, headers: httpx.Headers, raw: bytes) -> AttemptOutcome:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            data = None
        if status != 200:  # answered with an error: billed its usage, 0 without one
            err = data.get("error") if isinstance(data, dict) else None
            detail = (err.get("message") if isinstance(err, dict) else err) or raw.decode("utf-8", "replace")
            text = f"HTTP {status} ({_meaning(status)}): {self._clip(str(detail or '(empty body)'))}"
            raise _answered(status, text, self._usage(data), parse_retry_after(headers.get("Retry-After")))
        if data is None:
            if raw.lstrip().startswith(b"data:"):
                raise _Failed(STREAMING, stop=STREAMING)
            shown = raw.decode("utf-8", errors="replace")
            raise _Failed(self._clip(f"malformed response: HTTP 200 body is not JSON: {shown!r}", 300))
        if not isinstance(data, dict):
            raise _Failed(f"malformed response: expected a JSON object, got {type(data).__name__}")
        choices = data.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else None
        if data.get("error"):
            self._body_error(data["error"], "in a 200 reply", data)
        if choice is None:
            raise _Failed("malformed response: no choices[0] in the reply")
        if choice.get("error") or choice.get("finish_reason") == "error":
            self._body_error(choice.get("error") or {}, "(finish_reason 'error')", data)
        if not isinstance(choice.get("message"), dict):
            raise _Failed("malformed response: choices[0].message is missing")
        usage = self._usage(data)
        try:
            text = reply_to_action(choice["message"])
        except (TypeError, ValueError, AttributeError) as exc:
            raise _Failed(self._clip(f"malformed response: choices[0].message: {exc}")) from None
        return AttemptOutcome(text=_utf8(scrub(text, self._key)), usage=usage)

    def _usage(self, data: Any) -> Usage | None:
        """The validated ``usage`` of a reply (``None`` when absent); a bad one fails the attempt, unanswered
        (its bill is unknown: it is paid at its reservation)."""
        if not isinstance(data, dict) or data.get("usage") is None:
            return None
        try:
            return parse_usage(data["usage"])
        except BadUsageError as exc:
            raise _Failed(self._clip(f"bad usage: {exc}")) from None

    def _body_error(self, err: Any, where: str, data: dict[str, Any]) -> None:
        code, message = (err.get("code"), err.get("message")) if isinstance(err, dict) else (None, err)
        try:
            status = int(code) if code is not None else None
        except (TypeError, ValueError, OverflowError):
            status = None
        label = f"provider error {status} ({_meaning(status)})" if status else "provider error"
        shown = json.dumps(message, ensure_ascii=False) if message else "(no message)"
        raise _answered(status, self._clip(f"{label} {where}: {shown}"), self._usage(data))


def _answered(status: int | None, text: str, usage: Usage | None, retry_after: float | None = None) -> _Failed:
    """An error the provider reported (``status``: its code, if any): retried, or stopping the teacher."""
    if status is not None and (status in RETRYABLE or status >= 500 or (status == 402 and retry_after is not None)):
        return _Failed(text, retryable=True, retry_after=retry_after, answered=True, usage=usage)
    return _Failed(text, stop=f"HTTP {status} ({_meaning(status)})" if status in STOPS else None, answered=True,
                   usage=usage)

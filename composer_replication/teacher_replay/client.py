"""One chat-completions attempt against an OpenAI-compatible endpoint, and the one retry policy.

``ChatCompletionsClient.attempt`` posts one request body on the shared stock ``httpx.AsyncClient``
(never resent by the transport) and turns whatever comes back into an :class:`AttemptOutcome`:

- 200 with ``choices[0].message``: success (action text via :func:`prompting.reply_to_action`), with
  its ``usage`` validated (:func:`budget.parse_usage`; a bad one is a final error for this call).
- ``reached``: whether the server may have received the request. Only a connection that was never
  made (``ConnectError``, ``ConnectTimeout``, ``PoolTimeout``, or a deadline that expired before
  the request headers were written) is ``False``; such an attempt costs nothing.
- ``refused``: the server answered with a 4xx status (it refused the request; providers bill nothing).
- Transient (``retryable``): timeouts, connection errors, HTTP 408/429/500/502/503/504 (and other
  5xx), a 402 that carries ``Retry-After``, and errors inside a 200 body whose code is one of those.
- ``stop`` (the replay skips the teacher's later calls): HTTP 400 (bad request), 401 (bad or missing
  API key), 402 (insufficient credits), 403 (moderation or guardrail block), 404 (model or endpoint
  not found), also when they arrive as codes inside a 200 body.
- Any other failure (other 4xx, a malformed body, ``finish_reason: "error"`` without a transient
  code, a reply over ``max_response_bytes``) is a final error for this call only.

Each attempt has ONE total deadline (``timeout_s``, from sending to the last body byte), so a server
that trickles bytes cannot hold a call forever, and its body is read up to ``max_response_bytes``
after decompression (a gzip bomb is cut off, not inflated). :class:`RetryPolicy` is the one place
that decides whether and when a failed attempt is tried again. Every text is scrubbed of the API key
before it is cut to length, stored or logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import zlib
from typing import Any

import httpx

from composer_replication.teacher_replay.budget import BadUsageError, parse_usage
from composer_replication.teacher_replay.keys import SecretKey, scrub, scrub_clip
from composer_replication.teacher_replay.prompting import reply_to_action
from composer_replication.teacher_replay.retry import AttemptOutcome, RetryPolicy, parse_retry_after

__all__ = [
    "STATUS_MEANINGS",
    "RETRYABLE_STATUSES",
    "STOP_STATUSES",
    "AttemptOutcome",
    "ChatCompletionsClient",
    "RetryPolicy",
    "parse_retry_after",
]

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
_NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout, httpx.UnsupportedProtocol)
_CLIP = 500


def _meaning(status: int) -> str:
    return STATUS_MEANINGS.get(status, "server error" if status >= 500 else "error")


class _Failed(Exception):
    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message)
        self.fields = fields


class ChatCompletionsClient:
    """Posts single chat-completions attempts on the shared client; one instance per replay.

    Args:
        http: the shared ``httpx.AsyncClient`` (owned by the caller).
        api_key: sent as ``Authorization: Bearer`` when not ``None``.
        timeout_s: the total deadline of one attempt, from sending to the last byte of the reply.
        max_response_bytes: the largest reply body accepted, counted after decompression.
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        api_key: SecretKey | None,
        timeout_s: float = 120.0,
        max_response_bytes: int = 8 * 1024 * 1024,
    ) -> None:
        self._http = http
        self._key = api_key
        self.timeout_s = timeout_s
        self.max_response_bytes = max_response_bytes
        self._urls: dict[str, httpx.URL] = {}  # parsed once per endpoint
        self._timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0))  # inside the total deadline

    def __repr__(self) -> str:
        return f"ChatCompletionsClient(api_key={self._key!r}, timeout_s={self.timeout_s})"

    def _headers(self) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "Accept-Encoding": "gzip, deflate",  # what _BoundedBody decodes
            "X-Title": "composer-replication",
        }
        if self._key is not None:
            headers["Authorization"] = "Bearer " + self._key.reveal()
        return headers

    def _clip(self, text: str, limit: int = _CLIP) -> str:
        return _utf8(scrub_clip(text, self._key, limit))

    async def attempt(self, url: str, body: dict[str, Any]) -> AttemptOutcome:
        """Send ``body`` to ``url`` once; never raises for what the network or the server did."""
        target = self._urls.get(url) or self._urls.setdefault(url, httpx.URL(url))
        sent = {"headers": False, "traced": False}

        async def trace(name: str, info: dict[str, Any]) -> None:  # httpcore's progress events
            sent["traced"] = True
            if name.endswith("send_request_headers.started"):
                sent["headers"] = True

        try:
            status, headers, raw = await asyncio.wait_for(self._post(target, body, trace), self.timeout_s)
        except _Failed as exc:
            return AttemptOutcome(error=str(exc), **exc.fields)
        except asyncio.TimeoutError:
            reached = sent["headers"] or not sent["traced"]  # a transport without traces: assume sent
            return AttemptOutcome(
                error=f"timeout: no complete reply within {self.timeout_s:g}s (total deadline)",
                retryable=True,
                reached=reached,
            )
        except httpx.TimeoutException as exc:
            return AttemptOutcome(
                error=f"timeout: {type(exc).__name__} within {self.timeout_s:g}s",
                retryable=True,
                reached=not isinstance(exc, _NEVER_SENT),
            )
        except httpx.TransportError as exc:
            never = isinstance(exc, _NEVER_SENT)
            return AttemptOutcome(
                error=self._clip(f"connection error: {type(exc).__name__}: {exc}"),
                retryable=not isinstance(exc, httpx.UnsupportedProtocol),
                reached=not never,
            )
        except httpx.RequestError as exc:  # decoding errors, redirect loops: not worth retrying
            return AttemptOutcome(error=self._clip(f"request error: {type(exc).__name__}: {exc}"))
        try:
            if status != 200:
                self._raise_for_status(status, headers, raw)
            return self._parse_ok(raw)
        except _Failed as exc:
            return AttemptOutcome(error=str(exc), **exc.fields)
        except Exception as exc:  # e.g. RecursionError on JSON nested 100k deep: one bad reply, one call
            return AttemptOutcome(
                error=self._clip(f"malformed response: HTTP {status}: {type(exc).__name__}")
            )

    async def _post(
        self, url: httpx.URL, body: dict[str, Any], trace: Any
    ) -> tuple[int, httpx.Headers, bytes]:
        request = self._http.build_request(
            "POST",
            url,
            json=body,
            headers=self._headers(),
            timeout=self._timeout,
            extensions={"trace": trace},
        )
        response = await self._http.send(request, stream=True)
        try:
            reader = _BoundedBody(response, self.max_response_bytes)
            if response.is_stream_consumed:  # handed over already read (e.g. by httpx.MockTransport)
                reader.feed(response.content)
            else:
                async for chunk in response.aiter_raw():  # as sent: decoded here, within the cap
                    reader.feed(chunk)
            return response.status_code, response.headers, reader.finish()
        finally:
            await response.aclose()

    def _raise_for_status(self, status: int, headers: httpx.Headers, raw: bytes) -> None:
        detail = self._clip(_error_message(raw))
        text = f"HTTP {status} ({_meaning(status)}): {detail}"
        retry_after = parse_retry_after(headers.get("Retry-After"))
        refused = 400 <= status < 500
        if status in RETRYABLE_STATUSES or status >= 500 or (status == 402 and retry_after is not None):
            raise _Failed(text, retryable=True, retry_after=retry_after, refused=refused)
        stop = f"HTTP {status} ({_meaning(status)})" if status in STOP_STATUSES else None
        raise _Failed(text, stop=stop, refused=refused)

    def _parse_ok(self, raw: bytes) -> AttemptOutcome:
        try:
            data = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            text = raw.decode("utf-8", errors="replace")
            raise _Failed(
                self._clip(f"malformed response: HTTP 200 body is not JSON: {text!r}", 300)
            ) from None
        if not isinstance(data, dict):
            raise _Failed(f"malformed response: expected a JSON object, got {type(data).__name__}")
        if data.get("error"):
            self._raise_body_error(data["error"], "in a 200 reply")
        choices = data.get("choices")
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
            raise _Failed("malformed response: no choices[0] in the reply")
        choice = choices[0]
        if choice.get("error") or choice.get("finish_reason") == "error":
            self._raise_body_error(choice.get("error") or {}, "(finish_reason 'error')")
        message = choice.get("message")
        if not isinstance(message, dict):
            raise _Failed("malformed response: choices[0].message is missing")
        usage = None
        if data.get("usage") is not None:
            try:
                usage = parse_usage(data["usage"])
            except BadUsageError as exc:  # never reaches the sums: the attempt is paid at its reservation
                raise _Failed(self._clip(f"bad usage: {exc}")) from None
        try:
            text = reply_to_action(message)
        except (TypeError, ValueError, AttributeError) as exc:
            raise _Failed(self._clip(f"malformed response: choices[0].message: {exc}")) from None
        return AttemptOutcome(text=_utf8(scrub(text, self._key)), usage=usage)

    def _raise_body_error(self, err: Any, where: str) -> None:
        code = err.get("code") if isinstance(err, dict) else None
        message = err.get("message") if isinstance(err, dict) else err
        try:
            status = int(code) if code is not None else None
        except (TypeError, ValueError, OverflowError):
            status = None
        label = f"provider error {status} ({_meaning(status)})" if status else "provider error"
        shown = json.dumps(message, ensure_ascii=False) if message else "(no message)"
        text = self._clip(f"{label} {where}: {shown}")
        if status is not None and (status in RETRYABLE_STATUSES or status >= 500):
            raise _Failed(text, retryable=True)
        raise _Failed(text, stop=f"HTTP {status} ({_meaning(status)})" if status in STOP_STATUSES else None)


def _utf8(text: str) -> str:
    """``text`` with lone surrogates (legal as JSON escapes, unencodable as UTF-8) replaced by ``?``,
    so a reply can always be written to the ledger, the results and the pairs."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")


class _BoundedBody:
    """A reply body decoded (identity, gzip or deflate) chunk by chunk, never past ``limit`` bytes.

    httpx's own decoders inflate a whole network chunk at once (64 KiB of gzip can become 64 MiB);
    here every ``decompress`` call is capped, so memory stays within ``limit`` plus one chunk.
    """

    def __init__(self, response: httpx.Response, limit: int) -> None:
        self.status, self.limit, self.size, self.parts = response.status_code, limit, 0, []
        encoding = response.headers.get("Content-Encoding", "").strip().lower()
        if encoding in ("", "identity") or response.is_stream_consumed:
            self._z = None
        elif encoding in ("gzip", "x-gzip", "deflate"):
            self._z = zlib.decompressobj(zlib.MAX_WBITS | 32)  # gzip or zlib header, detected
        else:
            raise _Failed(
                f"malformed response: unsupported Content-Encoding {encoding!r:.40} (HTTP {self.status})"
            )

    def _add(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.limit:
            raise _Failed(
                f"response too large: over {self.limit} bytes after decompression (HTTP {self.status}); refused"
            )
        self.parts.append(data)

    def feed(self, data: bytes) -> None:
        """Decode one raw chunk."""
        if self._z is None:
            return self._add(data)
        try:
            while data:
                self._add(self._z.decompress(data, self.limit - self.size + 1))
                data = self._z.unconsumed_tail
        except zlib.error as exc:
            raise _Failed(f"malformed response: bad compressed body ({exc}) (HTTP {self.status})") from None

    def finish(self) -> bytes:
        """The whole decoded body."""
        if self._z is not None:
            try:
                self._add(self._z.flush())
            except zlib.error as exc:
                raise _Failed(f"malformed response: bad compressed body ({exc})") from None
        return b"".join(self.parts)


def _error_message(raw: bytes) -> str:
    """The ``error.message`` of an error body, else the body as text (uncut: scrubbed before cutting)."""
    text = raw.decode("utf-8", errors="replace")
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and err.get("message"):
            return str(err["message"])
        if isinstance(err, str):
            return err
    except (ValueError, AttributeError, RecursionError):
        pass
    return text or "(empty body)"

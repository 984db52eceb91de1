"""The replay's one retry policy, and what one attempt produced (the input of that policy).

Every retry that may reach the server is a new, separately paid attempt (``teacher_replay.calls``
reserves and records it before it is sent); only attempts that never reached the server are free.
"""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass

from composer_replication.teacher_replay.budget import Usage

__all__ = ["AttemptOutcome", "RetryPolicy", "parse_retry_after"]


@dataclass
class AttemptOutcome:
    """What one attempt (one request) produced.

    Attributes:
        text: the action text (``None`` on error).
        usage: the reply's validated ``usage`` (``None`` when absent or on error).
        error: the error text (scrubbed), ``None`` on success.
        stop: e.g. ``"HTTP 402 (insufficient credits)"`` when the teacher must not be called again.
        retryable: a transient failure another attempt may fix.
        retry_after: seconds the server asked to wait (``Retry-After``), if any.
        reached: the server may have received the request (it may bill it).
        refused: the server answered with a 4xx status (nothing billed).
    """

    text: str | None = None
    usage: Usage | None = None
    error: str | None = None
    stop: str | None = None
    retryable: bool = False
    retry_after: float | None = None
    reached: bool = True
    refused: bool = False


def parse_retry_after(value: str | None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or HTTP date); ``None`` if unusable."""
    if not value:
        return None
    value = value.strip()
    try:
        seconds = float(value)
    except ValueError:
        seconds = None
    if seconds is not None:
        return max(0.0, seconds) if seconds == seconds and seconds != float("inf") else None
    try:
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, when.timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError, OSError):  # a server's header: never fatal
        return None


@dataclass(kw_only=True)
class RetryPolicy:
    """When a failed attempt is tried again: the only retry logic of the replay.

    A transient failure is retried up to ``max_retries`` times after the first attempt, after
    ``backoff_base_s * 2**attempt`` seconds (capped at ``max_backoff_s``, full jitter), or exactly the
    server's ``Retry-After``. Every retry that may reach the server is a new, separately paid attempt
    (the replay reserves and records it before it is sent); only attempts that never reached the
    server are free.
    """

    max_retries: int = 5
    """Retries after the first attempt of a call."""
    backoff_base_s: float = 0.5
    """First backoff; doubles per retry."""
    max_backoff_s: float = 30.0
    """Backoff cap (``Retry-After`` is honoured up to ``max_retry_after_s``)."""
    max_retry_after_s: float = 300.0
    """A longer ``Retry-After`` makes the call fail instead of waiting."""

    def __post_init__(self) -> None:
        self._rng = random.Random()

    def next_delay(self, attempt: int, outcome: AttemptOutcome) -> tuple[float | None, str | None]:
        """``(seconds to wait, None)`` to retry after attempt number ``attempt`` (0-based), or
        ``(None, final error text)`` when the call ends with this outcome's error."""
        if not outcome.retryable:
            return None, outcome.error
        if outcome.retry_after is not None and outcome.retry_after > self.max_retry_after_s:
            return None, (
                f"{outcome.error}; Retry-After {outcome.retry_after:.0f}s exceeds {self.max_retry_after_s:.0f}s"
            )
        if attempt >= self.max_retries:
            return None, f"{outcome.error}; gave up after {attempt + 1} attempts"
        if outcome.retry_after is not None:
            return outcome.retry_after, None
        return self._rng.uniform(0.0, min(self.max_backoff_s, self.backoff_base_s * (2**attempt))), None

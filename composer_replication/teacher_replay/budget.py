"""A hard spending cap for teacher calls: reserve the worst case before each attempt, settle after.

Before an attempt is sent its worst-case cost is reserved: the prompt tokens estimated from the
request messages (UTF-8 bytes / 3 plus a per-message overhead, which over-counts real tokenizers)
plus the call's ``max_tokens``, at the teacher's prices, or more when what the endpoint billed shows
those prices to be too low (:class:`CostModel`). When the attempt ends the reservation is settled at
what the provider billed (``usage.cost`` when reported, else tokens x prices) and the difference is
released; an attempt whose bill is unknown (no or invalid ``usage``, a timeout, a dropped connection,
an error status from a server that may have worked on it) is settled at its full reservation. Only an
attempt that certainly never reached the server (a connection that was never made) costs 0.

``spent + reserved`` never exceeds ``max_total_usd``: a reservation that does not fit waits for the
attempts in flight to settle, and is refused (the caller reports ``error="skipped: budget"``) only
when it does not fit even with nothing else in flight.

Unknown prices (:class:`CostModel`): each teacher starts *calibrating*: one call at a time, until one
reply with a valid ``usage`` shows what the endpoint bills. When every bill so far is at or below the
teacher's prices (the usual case, and a free local server at prices 0 without ``usage.cost``), the
prices stay the worst case. When a bill is above them (``--price-in 0 --price-out 0`` against an
endpoint that reports ``usage.cost``, or prices set too low), the worst case also covers per-token
prices as high as every bill allows: input <= min(cost / prompt_tokens), output <=
min(cost / completion_tokens) over the replies seen, which bounds any later call if the endpoint's
per-token prices are constant.

Safe for concurrent use from one event loop (``asyncio.Condition`` objects guard the totals).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from composer_replication.types import TeacherSpec

__all__ = [
    "Budget",
    "BadUsageError",
    "CostModel",
    "Reservation",
    "Usage",
    "estimate_prompt_tokens",
    "parse_usage",
    "worst_case_cost",
    "usage_cost",
]

log = logging.getLogger(__name__)

_PER_MESSAGE_TOKENS = 8
_BASE_TOKENS = 16
_EPS = 1e-12


def estimate_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """A conservative prompt-token estimate: UTF-8 bytes of every message / 3, plus overheads.

    Real BPE tokenizers average about 4 characters per token on English and code; counting bytes
    (not characters) keeps the estimate above the truth for non-Latin scripts as well.
    """
    total = _BASE_TOKENS
    for m in messages:
        content = m.get("content")
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        total += _PER_MESSAGE_TOKENS + (len(text.encode("utf-8")) + 2) // 3
    return total


def _price(teacher: TeacherSpec, key: str) -> float:
    return float(teacher.get(key, 0.0)) / 1_000_000.0


def worst_case_cost(teacher: TeacherSpec, messages: list[dict[str, Any]], max_tokens: int) -> float:
    """USD for the estimated prompt plus ``max_tokens`` completion tokens at ``teacher``'s prices."""
    return estimate_prompt_tokens(messages) * _price(teacher, "input_per_mtok") + max_tokens * _price(
        teacher, "output_per_mtok"
    )


class BadUsageError(ValueError):
    """A reply's ``usage`` holds a negative, non-numeric or non-finite value (or is not an object)."""


@dataclass(frozen=True)
class Usage:
    """A reply's validated ``usage``: token counts, and the billed USD when the endpoint reports it."""

    prompt_tokens: int
    completion_tokens: int
    cost_usd: float | None


def _usage_number(usage: dict[str, Any], key: str) -> float:
    value = usage.get(key)
    if value is None:
        return 0.0
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise BadUsageError(f"usage.{key} must be a finite number >= 0; got {value!r:.60}")
    return float(value)


def parse_usage(usage: Any) -> Usage:
    """Validate an OpenAI-style ``usage`` object (``prompt_tokens``, ``completion_tokens``, optional ``cost``).

    Raises:
        BadUsageError: not an object, or a value that is negative, non-numeric, infinite or NaN.
    """
    if not isinstance(usage, dict):
        raise BadUsageError(f"usage must be a JSON object; got {type(usage).__name__}")
    pt, ct = _usage_number(usage, "prompt_tokens"), _usage_number(usage, "completion_tokens")
    cost = _usage_number(usage, "cost") if usage.get("cost") is not None else None
    return Usage(int(pt), int(ct), cost)


def usage_cost(teacher: TeacherSpec, usage: dict[str, Any] | None) -> tuple[int, int, float]:
    """``(prompt_tokens, completion_tokens, cost_usd)`` from a valid ``usage`` (see :func:`parse_usage`).

    ``usage.cost`` (OpenRouter, in USD) wins when present; else tokens x the teacher's prices.
    """
    u = parse_usage(usage or {})
    if u.cost_usd is not None:
        return u.prompt_tokens, u.completion_tokens, u.cost_usd
    priced = u.prompt_tokens * _price(teacher, "input_per_mtok") + u.completion_tokens * _price(
        teacher, "output_per_mtok"
    )
    return u.prompt_tokens, u.completion_tokens, priced


@dataclass
class Reservation:
    """A held worst-case amount (USD) for one call; settle it exactly once."""

    amount_usd: float
    settled: bool = False


class Budget:
    """The spend cap shared by every call of a replay.

    Args:
        max_total_usd: the cap (>= 0).
        already_spent_usd: spend recorded before this run (e.g. in a resumed ledger).
    """

    def __init__(self, max_total_usd: float, *, already_spent_usd: float = 0.0) -> None:
        if (
            not isinstance(max_total_usd, (int, float))
            or isinstance(max_total_usd, bool)
            or not math.isfinite(max_total_usd)
            or max_total_usd < 0
        ):
            raise ValueError(
                f"max_total_usd must be a finite number >= 0; got {max_total_usd!r}. Pass the spending cap in USD."
            )
        self.max_total_usd = float(max_total_usd)
        self.spent_usd = float(already_spent_usd)
        self.reserved_usd = 0.0
        self.peak_committed_usd = self.spent_usd
        self._in_flight = 0
        self._cond = asyncio.Condition()

    @property
    def remaining_usd(self) -> float:
        """Cap minus settled spend minus outstanding reservations (may be 0)."""
        return max(0.0, self.max_total_usd - self.spent_usd - self.reserved_usd)

    def _fits(self, amount: float) -> bool:
        return self.spent_usd + self.reserved_usd + amount <= self.max_total_usd + _EPS

    async def reserve(self, amount_usd: float) -> Reservation | None:
        """Hold ``amount_usd``; wait while calls in flight may still free room; ``None`` if it never fits."""
        if not math.isfinite(amount_usd) or amount_usd < 0:
            raise ValueError(f"a reservation must be a finite number >= 0 USD; got {amount_usd!r}.")
        async with self._cond:
            while not self._fits(amount_usd):
                if self._in_flight == 0:
                    return None
                await self._cond.wait()
            self.reserved_usd += amount_usd
            self._in_flight += 1
            self.peak_committed_usd = max(self.peak_committed_usd, self.spent_usd + self.reserved_usd)
            return Reservation(amount_usd)

    async def settle(self, reservation: Reservation, actual_usd: float) -> None:
        """Replace the held worst case by what the attempt was billed and wake waiters.

        ``actual_usd`` must be finite and >= 0 (callers settle an unknown bill at ``reservation.amount_usd``).
        """
        if not math.isfinite(actual_usd) or actual_usd < 0:
            raise ValueError(f"a settled cost must be a finite number >= 0 USD; got {actual_usd!r}.")
        async with self._cond:
            if reservation.settled:
                raise RuntimeError("this reservation was already settled; settle each call exactly once.")
            reservation.settled = True
            self.reserved_usd = max(0.0, self.reserved_usd - reservation.amount_usd)
            self._in_flight -= 1
            if actual_usd > reservation.amount_usd + _EPS:
                log.warning(
                    "a call cost %.6f USD, more than its reserved worst case %.6f USD (the endpoint "
                    "billed more tokens than requested); the cap may be exceeded by the difference",
                    actual_usd,
                    reservation.amount_usd,
                )
            self.spent_usd += actual_usd
            self.peak_committed_usd = max(self.peak_committed_usd, self.spent_usd + self.reserved_usd)
            self._cond.notify_all()


class CostModel:
    """What one teacher's next attempt reserves, learned from what its endpoint bills (see module doc).

    Use :meth:`admit` / :meth:`release` around each attempt (one at a time while calibrating),
    :meth:`reservation` for its worst case and :meth:`bill` for what it cost.

    Args:
        teacher: the teacher; its ``input_per_mtok`` / ``output_per_mtok`` are the starting prices.
    """

    def __init__(self, teacher: TeacherSpec) -> None:
        self.slug = teacher["slug"]
        self.price_in, self.price_out = _price(teacher, "input_per_mtok"), _price(teacher, "output_per_mtok")
        self.trusted = True  # every bill so far was at or below the teacher's prices
        self.calibrated = False  # a valid bill has been seen (and, if not trusted, both bounds are known)
        self.bound_in: float | None = None  # USD per input token no bill exceeds (untrusted prices)
        self.bound_out: float | None = None
        self.largest_usd = 0.0
        self._probing = False
        self._cond = asyncio.Condition()

    def __repr__(self) -> str:
        return (
            f"CostModel({self.slug!r}, calibrated={self.calibrated}, trusted={self.trusted}, "
            f"largest_usd={self.largest_usd:.6f})"
        )

    async def admit(self) -> bool:
        """Wait until this teacher may start an attempt; ``True`` if it is the calibrating one."""
        async with self._cond:
            while not self.calibrated and self._probing:
                await self._cond.wait()
            probe = not self.calibrated
            self._probing = self._probing or probe
            return probe

    async def release(self, probe: bool) -> None:
        """End an attempt admitted by :meth:`admit` (pass what it returned)."""
        if probe:
            async with self._cond:
                self._probing = False
                self._cond.notify_all()

    def reservation(self, messages: list[dict[str, Any]], max_tokens: int) -> float:
        """USD to reserve for an attempt with these messages and ``max_tokens`` (>= the priced worst case)."""
        prompt = estimate_prompt_tokens(messages)
        amount = prompt * self.price_in + max_tokens * self.price_out
        if not self.trusted:
            learned = prompt * (self.bound_in or 0.0) + max_tokens * (self.bound_out or 0.0)
            amount = max(amount, learned, self.largest_usd)
        return amount

    def bill(self, usage: Usage | None, reserved_usd: float) -> float:
        """USD an attempt that got a reply was billed; learns from it. ``None`` usage: the reservation."""
        if usage is None:
            return reserved_usd
        priced = usage.prompt_tokens * self.price_in + usage.completion_tokens * self.price_out
        if usage.cost_usd is None:
            if not self.trusted:  # the prices are known to be too low: the bill is unknown
                return reserved_usd
            self._observe(usage, priced)
            return priced
        self._observe(usage, priced)
        return usage.cost_usd

    def _observe(self, usage: Usage, priced: float) -> None:
        cost = priced if usage.cost_usd is None else usage.cost_usd
        self.largest_usd = max(self.largest_usd, cost)
        if cost > priced * (1 + 1e-9) + _EPS and self.trusted:
            self.trusted = False
            log.warning(
                "teacher %s billed %.6f USD for a call its prices put at %.6f USD; its reservations now "
                "cover the highest per-token prices the bills allow",
                self.slug,
                cost,
                priced,
            )
        if usage.prompt_tokens > 0:
            rate = cost / usage.prompt_tokens
            self.bound_in = rate if self.bound_in is None else min(self.bound_in, rate)
        if usage.completion_tokens > 0:
            rate = cost / usage.completion_tokens
            self.bound_out = rate if self.bound_out is None else min(self.bound_out, rate)
        self.calibrated = self.trusted or (self.bound_in is not None and self.bound_out is not None)

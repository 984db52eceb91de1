"""A hard spending cap: each attempt's worst case is reserved before it is sent, then settled at its bill.

``spent + reserved`` never exceeds the cap (a reservation waits for attempts in flight; it is refused when it
cannot fit with none). :class:`CostModel`: the worst case is the estimated prompt plus ``max_tokens`` at the
teacher's prices, or at the per-token prices its bills allow once a bill is above them (a teacher calibrates,
one attempt at a time, until a bill is known). One event loop only.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
from dataclasses import dataclass
from typing import Any

from composer_replication.types import TeacherSpec

__all__ = ["Budget"]

log = logging.getLogger(__name__)
_EPS = 1e-12


def is_amount(value: Any) -> bool:
    """True for a finite number >= 0 that is not a bool (a USD amount or a token count)."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and math.isfinite(value) and value >= 0


def estimate_prompt_tokens(messages: list[dict[str, Any]]) -> int:
    """Prompt tokens, over-counted: 16 + per message 8 + its UTF-8 bytes / 3 (bytes: non-Latin scripts too)."""
    texts = [m.get("content") if isinstance(m.get("content"), str) else json.dumps(m.get("content")) for m in messages]
    return 16 + sum(8 + (len(t.encode("utf-8")) + 2) // 3 for t in texts)


def _price(teacher: TeacherSpec, key: str) -> float:
    return float(teacher.get(key, 0.0)) / 1e6


def worst_case_cost(teacher: TeacherSpec, messages: list[dict[str, Any]], max_tokens: int) -> float:
    """USD of the estimated prompt plus ``max_tokens`` completion tokens at ``teacher``'s prices."""
    return (estimate_prompt_tokens(messages) * _price(teacher, "input_per_mtok")
            + max_tokens * _price(teacher, "output_per_mtok"))


class BadUsageError(ValueError):
    """A reply's ``usage`` is not an object, or holds a negative, non-numeric or non-finite value."""


Usage = collections.namedtuple("Usage", "prompt_tokens completion_tokens cost_usd")  # cost_usd: None if not reported


def parse_usage(usage: Any) -> Usage:
    """Validate an OpenAI-style ``usage`` (``prompt_tokens``, ``completion_tokens``, optional ``cost``);
    ``BadUsageError`` for anything else than an object of finite numbers >= 0."""
    if not isinstance(usage, dict):
        raise BadUsageError(f"usage must be a JSON object; got {type(usage).__name__}")
    for key in ("prompt_tokens", "completion_tokens", "cost"):
        if usage.get(key) is not None and not is_amount(usage[key]):
            raise BadUsageError(f"usage.{key} must be a finite number >= 0; got {usage[key]!r:.60}")
    cost = usage.get("cost")
    return Usage(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0),
                 None if cost is None else float(cost))


@dataclass
class Reservation:
    """A held worst-case amount (USD) for one attempt; settle it exactly once."""

    amount_usd: float
    settled: bool = False


class Budget:
    """The cap shared by every attempt of a replay (``max_total_usd`` >= 0; ``already_spent_usd``: e.g. the
    spend of a resumed ledger)."""

    def __init__(self, max_total_usd: float, *, already_spent_usd: float = 0.0) -> None:
        if not is_amount(max_total_usd):
            raise ValueError(f"max_total_usd must be a finite number >= 0; got {max_total_usd!r:.200}. "
                             "Pass the spending cap in USD.")
        self.max_total_usd = float(max_total_usd)
        self.spent_usd = self.peak_committed_usd = float(already_spent_usd)
        self.reserved_usd = 0.0
        self._in_flight = 0
        self._cond = asyncio.Condition()

    async def reserve(self, amount_usd: float) -> Reservation | None:
        """Hold ``amount_usd``, waiting while attempts in flight may free room; ``None`` if it never fits."""
        if not is_amount(amount_usd):
            raise ValueError(f"a reservation must be a finite number >= 0 USD; got {amount_usd!r}.")
        async with self._cond:
            while self.spent_usd + self.reserved_usd + amount_usd > self.max_total_usd + _EPS:
                if self._in_flight == 0:
                    return None
                await self._cond.wait()
            self.reserved_usd += amount_usd
            self._in_flight += 1
            self.peak_committed_usd = max(self.peak_committed_usd, self.spent_usd + self.reserved_usd)
            return Reservation(amount_usd)

    async def settle(self, reservation: Reservation, actual_usd: float) -> None:
        """Replace the held worst case by the attempt's bill (finite, >= 0) and wake the waiters."""
        if not is_amount(actual_usd):
            raise ValueError(f"a settled cost must be a finite number >= 0 USD; got {actual_usd!r}.")
        async with self._cond:
            if reservation.settled:
                raise RuntimeError("this reservation was already settled; settle each call exactly once.")
            reservation.settled = True
            self.reserved_usd = max(0.0, self.reserved_usd - reservation.amount_usd)
            self._in_flight -= 1
            if actual_usd > reservation.amount_usd + _EPS:
                log.warning("a call cost %.6f USD, more than its reserved worst case %.6f USD (the endpoint billed "
                            "more than requested); the cap may be exceeded by the difference",
                            actual_usd, reservation.amount_usd)
            self.spent_usd += actual_usd
            self.peak_committed_usd = max(self.peak_committed_usd, self.spent_usd + self.reserved_usd)
            self._cond.notify_all()


class CostModel:
    """What one teacher's next attempt reserves, learned from its bills (module docstring). Wrap each attempt
    in :meth:`admit` / :meth:`release`; :meth:`reservation` is its worst case, :meth:`bill` what it cost."""

    def __init__(self, teacher: TeacherSpec) -> None:
        self.slug = teacher["slug"]
        self.price_in, self.price_out = _price(teacher, "input_per_mtok"), _price(teacher, "output_per_mtok")
        self.trusted = True  # every bill so far was at or below the prices
        self.calibrated = False  # a valid bill was seen (and, if untrusted, both bounds are known)
        self.bound_in = self.bound_out = math.inf  # USD per token no bill exceeds (inf: not known yet)
        self.largest_usd = 0.0
        self._lock = asyncio.Lock()  # held by the calibrating attempt

    async def admit(self) -> bool:
        """Wait until this teacher may start an attempt; ``True`` if it is the calibrating one."""
        if not self.calibrated:
            await self._lock.acquire()
            if not self.calibrated:
                return True
            self._lock.release()
        return False

    async def release(self, probe: bool) -> None:
        """End an attempt admitted by :meth:`admit` (pass what it returned)."""
        if probe:
            self._lock.release()

    def reservation(self, messages: list[dict[str, Any]], max_tokens: int) -> float:
        """USD to hold for an attempt with these messages and ``max_tokens``."""
        prompt = estimate_prompt_tokens(messages)
        amount = prompt * self.price_in + max_tokens * self.price_out
        if not self.trusted:
            known_in, known_out = (b if b < math.inf else 0.0 for b in (self.bound_in, self.bound_out))
            amount = max(amount, prompt * known_in + max_tokens * known_out, self.largest_usd)
        return amount

    def bill(self, usage: Usage | None, reserved_usd: float) -> float:
        """USD of an answered attempt with this ``usage``, learning from it; unknown (the reservation) without
        ``usage``, or without ``usage.cost`` once the prices are known to be too low."""
        if usage is None or (usage.cost_usd is None and not self.trusted):
            return reserved_usd
        priced = usage.prompt_tokens * self.price_in + usage.completion_tokens * self.price_out
        cost = priced if usage.cost_usd is None else usage.cost_usd
        self.largest_usd = max(self.largest_usd, cost)
        if cost > priced * (1 + 1e-9) + _EPS and self.trusted:
            self.trusted = False
            log.warning("teacher %s billed %.6f USD for a call its prices put at %.6f USD; its reservations now "
                        "cover the highest per-token prices the bills allow", self.slug, cost, priced)
        if usage.prompt_tokens:
            self.bound_in = min(self.bound_in, cost / usage.prompt_tokens)
        if usage.completion_tokens:
            self.bound_out = min(self.bound_out, cost / usage.completion_tokens)
        self.calibrated = self.trusted or max(self.bound_in, self.bound_out) < math.inf
        return cost

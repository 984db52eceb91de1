"""A hard spending cap for teacher calls: reserve the worst case before a call, settle after.

Before a call is made its worst-case cost is reserved: the prompt tokens estimated from the
request messages (UTF-8 bytes / 3 plus a per-message overhead, which over-counts real tokenizers)
plus the call's ``max_tokens``, at the teacher's prices. When the reply arrives the reservation is
settled at the real cost (``usage.cost`` when the endpoint reports it, else tokens x prices) and the
difference is released. ``spent + reserved`` never exceeds ``max_total_usd``: a call whose
reservation does not fit waits for the calls in flight to settle, and is refused (the caller reports
``error="skipped: budget"``) only when it does not fit even with nothing else in flight.

Safe for concurrent use from one event loop (an ``asyncio.Condition`` guards the totals).
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from composer_replication.types import TeacherSpec

__all__ = ["Budget", "Reservation", "estimate_prompt_tokens", "worst_case_cost", "usage_cost"]

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


def usage_cost(teacher: TeacherSpec, usage: dict[str, Any] | None) -> tuple[int, int, float]:
    """``(prompt_tokens, completion_tokens, cost_usd)`` from an OpenAI-style ``usage`` object.

    ``usage.cost`` (OpenRouter, in USD) wins when present; else tokens x the teacher's prices.
    """
    usage = usage or {}
    pt = int(usage.get("prompt_tokens") or 0)
    ct = int(usage.get("completion_tokens") or 0)
    cost = usage.get("cost")
    if isinstance(cost, (int, float)) and not isinstance(cost, bool) and cost >= 0:
        return pt, ct, float(cost)
    return pt, ct, pt * _price(teacher, "input_per_mtok") + ct * _price(teacher, "output_per_mtok")


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
            or max_total_usd < 0
        ):
            raise ValueError(
                f"max_total_usd must be a number >= 0; got {max_total_usd!r}. Pass the spending cap in USD."
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
        if amount_usd < 0:
            raise ValueError(f"a reservation must be >= 0 USD; got {amount_usd!r}.")
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
        """Replace the held worst case by ``actual_usd`` (0 for a failed call) and wake waiters."""
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
            self.spent_usd += max(0.0, actual_usd)
            self.peak_committed_usd = max(self.peak_committed_usd, self.spent_usd + self.reserved_usd)
            self._cond.notify_all()

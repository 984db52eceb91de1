"""Paid calls: every attempt reserved and written ahead before it is sent, settled at its bill.

:class:`PaidCalls` is the call path of a replay. One call (a state asked of a teacher) is a series
of attempts, each of which

1. waits for its teacher's :class:`~.budget.CostModel` (one attempt at a time until the teacher's
   bills are known) and reserves its worst case in the :class:`~.budget.Budget` (``None``: it does
   not fit, nothing is sent);
2. is written to the ledger as ``reserve`` and fsync'ed *before* a byte is sent (write-ahead), so a
   replay killed with the attempt in flight counts it as spent at its reservation on ``--resume``;
3. is sent once (:meth:`~.client.ChatCompletionsClient.attempt`; the transport never resends);
4. is settled at what it was billed (:func:`billed`) in the budget, then in the ledger (``settle``;
   the call's last attempt carries its :class:`TeacherCallResult`).

:class:`~.client.RetryPolicy` decides after each attempt whether another follows. A result's
``cost_usd`` is the sum over its attempts.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from composer_replication.teacher_replay.budget import Budget, CostModel, Usage
from composer_replication.teacher_replay.client import AttemptOutcome, ChatCompletionsClient, RetryPolicy
from composer_replication.teacher_replay.ledger import Ledger
from composer_replication.teacher_replay.local import LOCAL_PREFIX
from composer_replication.teacher_replay.specs import BUDGET_SKIP, OPENROUTER_BASE_URL, make_result
from composer_replication.types import TeacherCallResult, TeacherSpec

__all__ = ["PaidCalls", "billed"]

log = logging.getLogger(__name__)

LocalAttempt = Callable[[TeacherSpec, dict[str, Any], str], Awaitable[AttemptOutcome]]


def billed(out: AttemptOutcome, costs: CostModel, reserved_usd: float) -> float:
    """USD one attempt costs: 0 if it never reached the server or was refused with a 4xx status;
    what its valid ``usage`` says on success (:meth:`CostModel.bill`); else its full reservation
    (the server may have worked on it and the bill is unknown)."""
    if not out.reached or out.refused:
        return 0.0
    if out.error is None:
        return costs.bill(out.usage, reserved_usd)
    return reserved_usd


def teacher_url(teacher: TeacherSpec) -> str:
    """The teacher's ``.../chat/completions`` URL."""
    return teacher.get("base_url", OPENROUTER_BASE_URL).rstrip("/") + "/chat/completions"


class PaidCalls:
    """The call path of one replay (see module docstring).

    Args:
        teachers: the replay's teachers (one :class:`CostModel` each).
        budget: the replay's budget (the ledger's spend already counted).
        ledger: the write-ahead ledger, or ``None``.
        client: the HTTP client (``None`` when every teacher is local).
        retry: the retry policy.
        local_attempt: runs one attempt of a ``local:`` teacher.
    """

    def __init__(
        self,
        teachers: list[TeacherSpec],
        *,
        budget: Budget,
        ledger: Ledger | None,
        client: ChatCompletionsClient | None,
        retry: RetryPolicy,
        local_attempt: LocalAttempt,
    ) -> None:
        self.budget, self.ledger, self.client, self.retry = budget, ledger, client, retry
        self.local_attempt = local_attempt
        self.costs = {t["slug"]: CostModel(t) for t in teachers}

    async def call(
        self,
        teacher: TeacherSpec,
        body: dict[str, Any],
        sid: str,
        req_hash: str,
        messages: list[dict[str, str]],
    ) -> tuple[TeacherCallResult, str | None]:
        """Attempts until success, a final error, or the policy gives up: ``(result, stop reason)``."""
        slug, total_cost, t0 = teacher["slug"], 0.0, None
        error: str | None = None
        for attempt in range(self.retry.max_retries + 1):
            paid = await self.attempt(teacher, body, sid, req_hash, messages)
            if paid is None:  # the reservation does not fit: nothing sent
                text = f"{error}; retry skipped: budget" if attempt else BUDGET_SKIP
                return make_result(sid, slug, error=text, cost_usd=total_cost), None
            attempt_id, out, cost, sent_at = paid
            total_cost, t0 = total_cost + cost, t0 or sent_at  # latency: from the first send
            delay, error = self.retry.next_delay(attempt, out)
            result = None
            if delay is None:
                ok = error is None
                usage = out.usage or Usage(0, 0, None)
                result = make_result(
                    sid,
                    slug,
                    error=error,
                    text=out.text if ok else None,
                    latency_s=time.perf_counter() - t0,  # includes retries and their backoff
                    prompt_tokens=usage.prompt_tokens if ok else 0,
                    completion_tokens=usage.completion_tokens if ok else 0,
                    cost_usd=total_cost,
                )
            if self.ledger is not None:
                rec = Ledger.settle_record(attempt_id, cost, error=out.error, result=result)
                await self.ledger.write(rec)
            if result is not None:
                return result, out.stop
            log.debug("teacher %s: %s; retry %d in %.2fs", slug, out.error, attempt + 1, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    async def attempt(
        self,
        teacher: TeacherSpec,
        body: dict[str, Any],
        sid: str,
        req_hash: str,
        messages: list[dict[str, str]],
    ) -> tuple[str, AttemptOutcome, float, float] | None:
        """One attempt, paid before it is sent: ``(attempt id, outcome, USD billed, perf_counter at
        send)``, or ``None`` when its reservation does not fit the budget."""
        slug = teacher["slug"]
        costs = self.costs[slug]
        probe = await costs.admit()  # one attempt at a time until this teacher's bills are known
        try:
            reservation = await self.budget.reserve(costs.reservation(messages, body["max_tokens"]))
            if reservation is None:
                return None
            attempt_id, cost = uuid.uuid4().hex, reservation.amount_usd  # unknown bill: the reservation
            try:
                if self.ledger is not None:  # write-ahead: durable before a byte is sent
                    rec = Ledger.reserve_record(attempt_id, sid, slug, req_hash, reservation.amount_usd)
                    await self.ledger.write(rec)
                sent_at = time.perf_counter()
                if slug.startswith(LOCAL_PREFIX):
                    out = await self.local_attempt(teacher, body, sid)
                else:
                    assert self.client is not None
                    out = await self.client.attempt(teacher_url(teacher), body)
                cost = billed(out, costs, reservation.amount_usd)
            finally:  # cancelled or failed mid-attempt: counted at the reservation
                await self.budget.settle(reservation, cost)
            return attempt_id, out, cost, sent_at
        finally:
            await costs.release(probe)

"""One replay in flight: the per-teacher and global semaphores, the budget, the ledger and the results.

:class:`ReplayRun` is what :meth:`TeacherReplayer.replay <composer_replication.teacher_replay.TeacherReplayer.replay>`
drives; :class:`ReplayProgress` is what its ``progress`` callback receives after each finished call.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from composer_replication.teacher_replay.budget import Budget
from composer_replication.teacher_replay.calls import PaidCalls
from composer_replication.teacher_replay.client import ChatCompletionsClient
from composer_replication.teacher_replay.ledger import Ledger, request_sha256
from composer_replication.teacher_replay.prompting import build_teacher_messages
from composer_replication.teacher_replay.recorded import is_recorded, recorded_result
from composer_replication.teacher_replay.specs import STOPPED_PREFIX, error_kind, make_result
from composer_replication.types import TeacherCallResult, TeacherSpec, TraceState

__all__ = ["ReplayProgress", "ReplayRun"]

log = logging.getLogger("composer_replication.teacher_replay.replay")


@dataclass
class ReplayProgress:
    """Passed to the ``progress`` callback after each finished (or skipped) call.

    Attributes:
        done / total: calls finished so far / calls in the replay (states x teachers).
        result: the call's result. from_ledger: it was read back from the ledger (not paid again).
        spent_usd / reserved_usd / max_total_usd: settled spend (incl. the ledger's), held
            reservations, the cap.
        errors: counts of :func:`error_kind` over the results so far (``"ok"`` excluded).
    """

    done: int
    total: int
    result: TeacherCallResult
    from_ledger: bool
    spent_usd: float
    reserved_usd: float
    max_total_usd: float
    errors: Counter = field(default_factory=Counter)


class ReplayRun:
    """The state of one replay: semaphores, budget, ledger, results, stopped teachers.

    ``rp`` is the :class:`~composer_replication.teacher_replay.TeacherReplayer` (its teachers, concurrency,
    retry policy, request bodies and local backends).
    """

    def __init__(
        self,
        rp: Any,
        states: list[TraceState],
        budget: Budget,
        ledger: Ledger | None,
        client: ChatCompletionsClient | None,
        progress: Callable[[ReplayProgress], None] | None,
    ) -> None:
        self.rp, self.states, self.budget, self.ledger, self.client = rp, states, budget, ledger, client
        self.progress = progress
        self.global_sem = asyncio.Semaphore(rp.max_concurrency)
        self.teacher_sem = {
            t["slug"]: asyncio.Semaphore(int(t.get("max_concurrency", rp.per_teacher_concurrency)))
            for t in rp.teachers
        }
        self.calls = PaidCalls(
            rp.teachers,
            budget=budget,
            ledger=ledger,
            client=client,
            retry=rp.retry,
            local_attempt=rp._attempt_local,
        )
        self.stopped: dict[str, str] = {}
        self.total = len(states) * len(rp.teachers)
        self.results: list[TeacherCallResult | None] = [None] * self.total
        self.done = 0
        self.errors: Counter = Counter()

    async def go(self) -> list[TeacherCallResult]:
        n_t = len(self.rp.teachers)
        window = asyncio.Semaphore(
            max(4 * self.rp.max_concurrency, 2 * n_t * self.rp.per_teacher_concurrency)
        )
        tasks: list[asyncio.Task] = []
        try:
            for si, state in enumerate(self.states):
                messages = build_teacher_messages(state)
                for ti, teacher in enumerate(self.rp.teachers):
                    await window.acquire()
                    task = asyncio.create_task(self.one(si * n_t + ti, state, teacher, messages))
                    task.add_done_callback(lambda _t: window.release())
                    tasks.append(task)
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                if not task.done():
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return [r for r in self.results if r is not None]

    async def one(
        self, idx: int, state: TraceState, teacher: TeacherSpec, messages: list[dict[str, str]]
    ) -> None:
        slug, sid = teacher["slug"], state["state_id"]
        if is_recorded(slug):  # in-process, free: never reserved, sent or written to the ledger
            return self.finish(idx, recorded_result(state))
        body = self.rp._body(teacher, messages)
        req_hash = ""
        if self.ledger is not None:  # the canonical-JSON hash is only needed to find / record the call
            req_hash = request_sha256(body)
            hit = self.ledger.lookup(sid, slug, req_hash)
            if hit is not None:
                return self.finish(idx, hit, from_ledger=True)
        async with self.teacher_sem[slug], self.global_sem:
            if slug in self.stopped:
                return self.finish(idx, make_result(sid, slug, error=STOPPED_PREFIX + self.stopped[slug]))
            result, stop = await self.calls.call(teacher, body, sid, req_hash, messages)
            if stop is not None and slug not in self.stopped:
                self.stopped[slug] = stop
                log.warning("teacher %s stopped: %s; its remaining calls are skipped", slug, stop)
        self.finish(idx, result)

    def finish(self, idx: int, result: TeacherCallResult, *, from_ledger: bool = False) -> None:
        self.results[idx] = result
        self.done += 1
        if result["error"] is not None:
            self.errors[error_kind(result["error"])] += 1
        if self.progress is None:
            return
        event = ReplayProgress(
            done=self.done,
            total=self.total,
            result=result,
            from_ledger=from_ledger,
            spent_usd=self.budget.spent_usd,
            reserved_usd=self.budget.reserved_usd,
            max_total_usd=self.budget.max_total_usd,
            errors=Counter(self.errors),
        )
        try:
            self.progress(event)
        except Exception:  # a broken progress display must not lose the replay
            log.exception("the progress callback raised; continuing")

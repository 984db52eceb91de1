"""Replay a frozen trace against N teachers: the one async fan-out, every attempt paid before it is sent.

One result per (state, teacher), in order; calls share one stock ``httpx.AsyncClient`` under a global and a
per-teacher semaphore. Each attempt reserves its worst case (nothing is sent when it does not fit: ``"skipped:
budget"``), is written ahead to the ledger, sent once and settled at :func:`billed`; ``RetryPolicy`` decides
whether another follows. Failures are results with ``error`` set; only a failed ledger write raises.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from composer_replication.teacher_replay import teachers as roster
from composer_replication.teacher_replay.budget import Budget, CostModel, Usage
from composer_replication.teacher_replay.client import AttemptOutcome, ChatCompletionsClient, RetryPolicy
from composer_replication.teacher_replay.keys import SecretKey, resolve_api_key, scrub
from composer_replication.teacher_replay.ledger import Ledger, request_sha256
from composer_replication.types import TeacherCallResult, TeacherSpec, TraceState

__all__ = ["TeacherReplayer", "replay_trace", "replay_trace_sync"]

log = logging.getLogger(__name__)


ReplayProgress = collections.namedtuple(
    "ReplayProgress", "done total result from_ledger spent_usd reserved_usd max_total_usd errors")
"""What ``progress`` gets after each call: ``done`` of ``total``, the call's ``result`` (``from_ledger``: not paid
again), the spend (the ledger's included), the held reservations, the cap, and a Counter of error kinds."""


def billed(out: AttemptOutcome, costs: CostModel, reserved_usd: float) -> float:
    """USD one attempt costs: 0 if it never reached the server; its bill whenever the provider answered (a
    success: its ``usage``, the reservation without one; an error the provider reported: its ``usage``, 0
    without one); else (dropped after sending, a timeout, a broken body) its reservation: the bill is unknown."""
    if not out.reached:
        return 0.0
    if out.error is None or (out.answered and out.usage is not None):
        return costs.bill(out.usage, reserved_usd)
    return 0.0 if out.answered else reserved_usd


class TeacherReplayer:
    """A reusable replay engine; ``local:`` models stay loaded (``local_teachers``: ``{slug: LocalTeacher}`` to
    reuse). ``api_key`` (else ``$OPENROUTER_API_KEY``, else ``dotenv_path``) is sent to every remote endpoint and
    required only when one is off loopback. ``timeout_s``: one attempt's total deadline; ``max_tokens``,
    ``temperature``, ``seed``: per call (a teacher's own values win; local teachers default to 0.7 and 0);
    ``http_client``: an ``httpx.AsyncClient`` (used, not closed) or a transport to build one on. ``ValueError``
    names a bad argument; ``MissingAPIKeyError`` says where it looked for a key."""

    def __init__(self, teachers: Sequence[TeacherSpec] = tuple(roster.DEFAULT_TEACHERS), *,
                 api_key: str | SecretKey | None = None, dotenv_path: str | os.PathLike[str] | None = None,
                 max_concurrency: int = 32, per_teacher_concurrency: int = 8, timeout_s: float = 120.0,
                 max_retries: int = 5, max_tokens: int = 1024, temperature: float | None = None,
                 seed: int | None = None, http_client: httpx.AsyncClient | httpx.AsyncBaseTransport | None = None,
                 backoff_base_s: float = 0.5, max_backoff_s: float = 30.0, max_retry_after_s: float = 300.0,
                 max_response_bytes: int = 8 * 1024 * 1024, local_device: str = "cpu",
                 local_teachers: dict[str, roster.LocalTeacher] | None = None) -> None:
        self.teachers = roster.validate_teachers(teachers)
        for name, value, minimum, integer in (
            ("max_concurrency", max_concurrency, 1, True), ("per_teacher_concurrency", per_teacher_concurrency, 1, True),
            ("max_retries", max_retries, 0, True), ("max_tokens", max_tokens, 1, True),
            ("timeout_s", timeout_s, 1e-3, False), ("max_response_bytes", max_response_bytes, 1024, True),
            ("backoff_base_s", backoff_base_s, 0, False), ("max_backoff_s", max_backoff_s, 0, False),
            ("max_retry_after_s", max_retry_after_s, 0, False),
            *((("temperature", temperature, 0, False),) if temperature is not None else ()),
        ):  # fmt: skip
            roster.check_number(name, value, minimum=minimum, integer=integer)
        if http_client is not None and not isinstance(http_client, (httpx.AsyncClient, httpx.AsyncBaseTransport)):
            raise ValueError(f"http_client must be an httpx.AsyncClient or httpx.AsyncBaseTransport; "
                             f"got {type(http_client).__name__}.")
        self._key = resolve_api_key(api_key, dotenv_path=dotenv_path,
                                    required=any(roster.teacher_needs_key(t) for t in self.teachers))
        self.max_concurrency, self.per_teacher_concurrency = max_concurrency, per_teacher_concurrency
        self.max_tokens, self.temperature, self.seed = max_tokens, temperature, seed
        self.timeout_s, self.max_response_bytes, self._http_arg = float(timeout_s), max_response_bytes, http_client
        self.retry = RetryPolicy(max_retries=max_retries, backoff_base_s=float(backoff_base_s),
                                 max_backoff_s=float(max_backoff_s), max_retry_after_s=float(max_retry_after_s))
        given = dict(local_teachers or {})
        self.local_teachers = {
            t["slug"]: given.get(t["slug"]) or roster.LocalTeacher(roster.local_model_name(t["slug"]), device=local_device)
            for t in self.teachers if t["slug"].startswith(roster.LOCAL_PREFIX)
        }  # fmt: skip

    def _body(self, teacher: TeacherSpec, messages: list[dict[str, str]]) -> dict[str, Any]:
        body: dict[str, Any] = {"model": teacher["slug"], "messages": messages,
                                "max_tokens": int(teacher.get("max_tokens", self.max_tokens))}
        temperature, seed = teacher.get("temperature", self.temperature), teacher.get("seed", self.seed)
        if teacher["slug"].startswith(roster.LOCAL_PREFIX):  # the hash must change with the values actually used
            temperature, seed = 0.7 if temperature is None else temperature, 0 if seed is None else seed
        body.update({k: cast(v) for k, v, cast in (("temperature", temperature, float), ("seed", seed, int))
                     if v is not None})  # fmt: skip
        return body

    async def _attempt_local(self, teacher: TeacherSpec, body: dict[str, Any], state_id: str) -> AttemptOutcome:
        try:
            gen = await asyncio.to_thread(self.local_teachers[teacher["slug"]].generate, body["messages"],
                                          state_id=state_id, max_new_tokens=body["max_tokens"],
                                          temperature=body["temperature"], seed=body["seed"])
        except Exception as exc:  # a broken local model fails every call the same way: stop it
            msg = scrub(f"local teacher error: {type(exc).__name__}: {exc}", self._key)
            return AttemptOutcome(error=msg, stop=msg, reached=False)
        return AttemptOutcome(text=gen.text, usage=Usage(gen.prompt_tokens, gen.completion_tokens, None))

    async def replay(self, states: Sequence[TraceState], *, max_total_usd: float = 5.0,
                     ledger_path: str | os.PathLike[str] | None = None,
                     progress: Callable[[ReplayProgress], None] | None = None) -> list[TeacherCallResult]:
        """Replay ``states`` against every teacher under the cap (the ledger's spend counts), resuming from and
        appending to ``ledger_path``; ``ValueError`` for bad states, cap or ledger path."""
        states = roster.validate_states(states)
        Budget(max_total_usd)  # validates the cap before the ledger is opened
        ledger = Ledger(ledger_path) if ledger_path is not None else None
        http, owned = None, False
        try:
            if ledger is not None and ledger.unsettled_usd > 0:
                log.warning("ledger %s: %.6f USD of attempts were sent but never settled (the replay was killed); "
                            "they count as spent at their reservations", ledger.path, ledger.unsettled_usd)
            budget = Budget(max_total_usd, already_spent_usd=ledger.spent_usd if ledger else 0.0)
            if isinstance(self._http_arg, httpx.AsyncClient):
                http = self._http_arg
            elif any(not roster.in_process(t["slug"]) for t in self.teachers):  # limits: of the default transport
                limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
                http, owned = httpx.AsyncClient(transport=self._http_arg, limits=limits, timeout=httpx.Timeout(
                    self.timeout_s, connect=min(self.timeout_s, 30.0))), True
            client = None if http is None else ChatCompletionsClient(
                http, api_key=self._key, timeout_s=self.timeout_s, max_response_bytes=self.max_response_bytes)
            return await _Run(self, states, budget, ledger, client, progress).go()
        finally:
            if owned and http is not None:
                await http.aclose()
            if ledger is not None:
                ledger.close()


class _Run:
    """One replay in flight: semaphores, budget, ledger, cost models, results, stopped teachers."""

    def __init__(self, rp: TeacherReplayer, states: list[TraceState], budget: Budget, ledger: Ledger | None,
                 client: ChatCompletionsClient | None, progress: Callable[[ReplayProgress], None] | None) -> None:
        self.rp, self.states, self.budget, self.ledger, self.client = rp, states, budget, ledger, client
        self.progress = progress
        self.global_sem = asyncio.Semaphore(rp.max_concurrency)
        self.teacher_sem = {t["slug"]: asyncio.Semaphore(int(t.get("max_concurrency", rp.per_teacher_concurrency)))
                            for t in rp.teachers}
        self.costs = {t["slug"]: CostModel(t) for t in rp.teachers}
        self.stopped: dict[str, str] = {}
        self.total, self.done, self.errors = len(states) * len(rp.teachers), 0, collections.Counter()
        self.results: list[TeacherCallResult | None] = [None] * self.total

    async def go(self) -> list[TeacherCallResult]:
        n_t = len(self.rp.teachers)
        window = asyncio.Semaphore(max(4 * self.rp.max_concurrency, 2 * n_t * self.rp.per_teacher_concurrency))
        tasks: list[asyncio.Task] = []
        try:
            for si, state in enumerate(self.states):
                messages = roster.build_teacher_messages(state)
                for ti, teacher in enumerate(self.rp.teachers):
                    await window.acquire()  # a bounded window of tasks: a long trace is not all in memory
                    tasks.append(asyncio.create_task(self.one(si * n_t + ti, state, teacher, messages)))
                    tasks[-1].add_done_callback(lambda _t: window.release())
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return [r for r in self.results if r is not None]

    async def one(self, idx: int, state: TraceState, teacher: TeacherSpec, messages: list[dict[str, str]]) -> None:
        slug, sid = teacher["slug"], state["state_id"]
        if slug == roster.RECORDED_SLUG:
            return self.finish(idx, roster.recorded_result(state))
        body, req_hash = self.rp._body(teacher, messages), ""
        if self.ledger is not None:
            req_hash = request_sha256(body)
            if (hit := self.ledger.lookup(sid, slug, req_hash)) is not None:
                return self.finish(idx, hit, from_ledger=True)
        async with self.teacher_sem[slug], self.global_sem:
            if slug in self.stopped:
                return self.finish(idx, roster.make_result(sid, slug, error=roster.STOPPED_PREFIX + self.stopped[slug]))
            result, stop = await self.call(teacher, body, sid, req_hash, messages)
            if stop is not None and slug not in self.stopped:
                self.stopped[slug] = stop
                log.warning("teacher %s stopped: %s; its remaining calls are skipped", slug, stop)
        self.finish(idx, result)

    async def call(self, teacher: TeacherSpec, body: dict[str, Any], sid: str, req_hash: str,
                   messages: list[dict[str, str]]) -> tuple[TeacherCallResult, str | None]:
        """Attempts, each paid before it is sent, until one ends the call: ``(result, stop reason)``."""
        slug, costs, total, t0, error = teacher["slug"], self.costs[teacher["slug"]], 0.0, None, None
        for attempt in range(self.rp.retry.max_retries + 1):
            probe = await costs.admit()  # one attempt at a time until the teacher's bills are known
            try:
                reservation = await self.budget.reserve(costs.reservation(messages, body["max_tokens"]))
                if reservation is None:  # it does not fit: nothing sent
                    error = f"{error}; retry skipped: budget" if attempt else roster.BUDGET_SKIP
                    return roster.make_result(sid, slug, error=error, cost_usd=total), None
                attempt_id, cost = uuid.uuid4().hex, reservation.amount_usd  # an unknown bill: the reservation
                try:
                    if self.ledger is not None:  # write-ahead: durable before a byte is sent
                        await self.ledger.write(Ledger.reserve_record(attempt_id, sid, slug, req_hash, cost))
                    t0 = t0 or time.perf_counter()  # latency: from the first send, retries included
                    if slug.startswith(roster.LOCAL_PREFIX):
                        out = await self.rp._attempt_local(teacher, body, sid)
                    else:
                        url = teacher.get("base_url", roster.OPENROUTER_BASE_URL).rstrip("/") + "/chat/completions"
                        out = await self.client.attempt(url, body)  # type: ignore[union-attr]
                    cost = billed(out, costs, reservation.amount_usd)
                finally:  # cancelled or failed mid-attempt: counted at the reservation
                    await self.budget.settle(reservation, cost)
            finally:
                await costs.release(probe)
            total += cost
            delay, error = self.rp.retry.next_delay(attempt, out)
            result = None
            if delay is None:
                usage = out.usage if error is None and out.usage else Usage(0, 0, None)
                result = roster.make_result(sid, slug, error=error, text=None if error else out.text, cost_usd=total,
                                            latency_s=time.perf_counter() - t0, prompt_tokens=usage.prompt_tokens,
                                            completion_tokens=usage.completion_tokens)
            if self.ledger is not None:
                await self.ledger.write(Ledger.settle_record(attempt_id, cost, error=out.error, result=result))
            if result is not None:
                return result, out.stop
            log.debug("teacher %s: %s; retry %d in %.2fs", slug, out.error, attempt + 1, delay)
            await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def finish(self, idx: int, result: TeacherCallResult, *, from_ledger: bool = False) -> None:
        self.results[idx] = result
        self.done += 1
        if result["error"] is not None:
            self.errors[roster.error_kind(result["error"])] += 1
        if self.progress is not None:
            event = ReplayProgress(self.done, self.total, result, from_ledger, self.budget.spent_usd,
                                   self.budget.reserved_usd, self.budget.max_total_usd, collections.Counter(self.errors))
            try:
                self.progress(event)
            except Exception:  # a broken progress display must not lose the replay
                log.exception("the progress callback raised; continuing")


async def replay_trace(states: Sequence[TraceState], teachers: Sequence[TeacherSpec] = tuple(roster.DEFAULT_TEACHERS),
                       max_total_usd: float = 5.0, api_key: str | SecretKey | None = None, *,
                       ledger_path: str | os.PathLike[str] | None = None,
                       progress: Callable[[ReplayProgress], None] | None = None,
                       **kwargs: Any) -> list[TeacherCallResult]:
    """Ask every teacher for the next action at every state: one result per (state, teacher), in order. Spend
    (settled + reserved) never exceeds ``max_total_usd``: calls that would are ``"skipped: budget"``. ``kwargs``:
    :class:`TeacherReplayer`'s. ``ValueError`` for bad arguments; ``MissingAPIKeyError`` when a key is needed."""
    replayer = TeacherReplayer(teachers, api_key=api_key, **kwargs)
    return await replayer.replay(states, max_total_usd=max_total_usd, ledger_path=ledger_path, progress=progress)


def replay_trace_sync(*args: Any, **kwargs: Any) -> list[TeacherCallResult]:
    """``asyncio.run(replay_trace(...))`` (a ``RuntimeError`` inside a running event loop: await ``replay_trace``)."""
    return asyncio.run(replay_trace(*args, **kwargs))

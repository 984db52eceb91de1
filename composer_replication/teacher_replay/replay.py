"""Replay a frozen trace against N teachers: async fan-out, hard budget, ledger resume, local teachers.

``replay_trace`` asks every teacher for the next action at every state and returns one
:class:`TeacherCallResult` per (state, teacher), in (state, teacher) order. Remote calls share ONE
stock ``httpx.AsyncClient`` (``httpx.Limits`` of ``max_concurrency`` connections, ``httpx.Timeout``
inside each attempt's total deadline); a global semaphore (``max_concurrency``) and a per-teacher one
(``per_teacher_concurrency``, or the teacher's own ``max_concurrency``) bound the calls in flight.

Every attempt is paid for before it is sent: its worst case is reserved in the budget
(:mod:`.budget`, priced by the teacher's :class:`~.budget.CostModel`) and written to the ledger
(:mod:`.ledger`, write-ahead, fsync'ed); when it ends it is settled at what it was billed and
recorded again. :class:`~.client.RetryPolicy` alone decides retries; each retry is a new paid
attempt. ``local:<model>`` teachers generate in-process (:mod:`.local`). Failures never raise out of
a replay: they are results with ``error`` set (a failed ledger write does raise: resumability first).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import httpx

from composer_replication.teacher_replay.budget import Budget, Usage
from composer_replication.teacher_replay.client import AttemptOutcome, ChatCompletionsClient, RetryPolicy
from composer_replication.teacher_replay.keys import SecretKey, resolve_api_key, scrub
from composer_replication.teacher_replay.ledger import Ledger
from composer_replication.teacher_replay.local import LOCAL_PREFIX, LocalTeacher, local_model_name
from composer_replication.teacher_replay.recorded import (
    StudentSampling,
    is_recorded,
    sample_student_actions,
)
from composer_replication.teacher_replay.replay_run import ReplayProgress, ReplayRun
from composer_replication.teacher_replay.specs import (
    DEFAULT_TEACHERS,
    check_number,
    teacher_needs_key,
    validate_states,
    validate_teachers,
)
from composer_replication.types import TeacherCallResult, TeacherSpec, TraceState

__all__ = ["ReplayProgress", "TeacherReplayer", "replay_trace", "replay_trace_sync"]

log = logging.getLogger(__name__)

LOCAL_DEFAULT_TEMPERATURE = 0.7


class TeacherReplayer:
    """A reusable replay engine (keeps ``local:`` models loaded between replays).

    Args:
        teachers: the teachers (see :class:`TeacherSpec`).
        api_key: key for remote teachers; else ``$OPENROUTER_API_KEY``; else ``dotenv_path``.
            Sent to every non-local teacher endpoint. Only required when some teacher is neither
            ``local:`` nor on a loopback ``base_url``.
        dotenv_path: a dotenv file with ``OPENROUTER_API_KEY=...`` (read only when given).
        max_concurrency: calls in flight over all teachers.
        per_teacher_concurrency: calls in flight per teacher (a teacher's ``max_concurrency`` wins).
        timeout_s: total deadline of one attempt (sending to last reply byte).
        max_retries: retries of transient failures per call (each one a new paid attempt).
        max_tokens: completion cap per call (a teacher's ``max_tokens`` wins); also the budget's worst case.
        temperature / seed: sent when set (a teacher's own values win); local teachers default to 0.7 / 0.
        http_client: an ``httpx.AsyncClient`` (used as is, not closed) or an ``httpx.AsyncBaseTransport``
            (e.g. ``httpx.MockTransport``) to build the shared client on. Default: a stock
            ``httpx.AsyncClient`` with ``max_concurrency`` connections (it honours proxy variables).
        backoff_base_s / max_backoff_s / max_retry_after_s: retry timing (:class:`~.client.RetryPolicy`).
        max_response_bytes: the largest reply body accepted, after decompression (default 8 MiB).
        local_device: device of ``local:`` teachers.
        local_teachers: ``slug -> LocalTeacher`` to reuse (e.g. a model already loaded by another
            replayer); other ``local:`` slugs get a new :class:`LocalTeacher`, loaded on first use.
        student / student_sampling: the student model (a ``local:<model>`` slug or a :class:`LocalTeacher`)
            and how its own actions are sampled (:meth:`sample_student`); required by the ``recorded``
            teacher (:mod:`.recorded`), whose answers are free and never sent anywhere.

    Raises:
        ValueError: a bad argument (named in the message).
        MissingAPIKeyError: a remote teacher needs a key and none was found.
    """

    def __init__(
        self,
        teachers: Sequence[TeacherSpec] = tuple(DEFAULT_TEACHERS),
        *,
        api_key: str | SecretKey | None = None,
        dotenv_path: str | os.PathLike[str] | None = None,
        max_concurrency: int = 32,
        per_teacher_concurrency: int = 8,
        timeout_s: float = 120.0,
        max_retries: int = 5,
        max_tokens: int = 1024,
        temperature: float | None = None,
        seed: int | None = None,
        http_client: httpx.AsyncClient | httpx.AsyncBaseTransport | None = None,
        backoff_base_s: float = 0.5,
        max_backoff_s: float = 30.0,
        max_retry_after_s: float = 300.0,
        max_response_bytes: int = 8 * 1024 * 1024,
        local_device: str = "cpu",
        local_teachers: dict[str, LocalTeacher] | None = None,
        student: str | LocalTeacher | None = None,
        student_sampling: StudentSampling | None = None,
    ) -> None:
        self.teachers = validate_teachers(teachers)
        check_number("max_concurrency", max_concurrency)
        check_number("per_teacher_concurrency", per_teacher_concurrency)
        check_number("max_retries", max_retries, minimum=0)
        check_number("max_tokens", max_tokens)
        check_number("timeout_s", timeout_s, minimum=1e-3, integer=False)
        check_number("max_response_bytes", max_response_bytes, minimum=1024)
        for name, value in (
            ("backoff_base_s", backoff_base_s),
            ("max_backoff_s", max_backoff_s),
            ("max_retry_after_s", max_retry_after_s),
        ):
            check_number(name, value, minimum=0, integer=False)
        if temperature is not None:
            check_number("temperature", temperature, minimum=0, integer=False)
        if http_client is not None and not isinstance(
            http_client, (httpx.AsyncClient, httpx.AsyncBaseTransport)
        ):
            raise ValueError(
                f"http_client must be an httpx.AsyncClient or httpx.AsyncBaseTransport; got {type(http_client).__name__}."
            )
        needs_key = any(teacher_needs_key(t) for t in self.teachers)
        self._key = resolve_api_key(api_key, dotenv_path=dotenv_path, required=needs_key)
        self.max_concurrency = max_concurrency
        self.per_teacher_concurrency = per_teacher_concurrency
        self.max_tokens = max_tokens
        self.temperature = temperature
        self.seed = seed
        self._http_arg = http_client
        self.timeout_s = float(timeout_s)
        self.max_response_bytes = max_response_bytes
        self.retry = RetryPolicy(
            max_retries=max_retries,
            backoff_base_s=float(backoff_base_s),
            max_backoff_s=float(max_backoff_s),
            max_retry_after_s=float(max_retry_after_s),
        )
        given = dict(local_teachers or {})
        self.local_teachers: dict[str, LocalTeacher] = {
            t["slug"]: given.get(t["slug"]) or LocalTeacher(local_model_name(t["slug"]), device=local_device)
            for t in self.teachers
            if t["slug"].startswith(LOCAL_PREFIX)
        }
        if isinstance(student, str):  # the same model as a local teacher: one instance
            student = self.local_teachers.get(student) or LocalTeacher(local_model_name(student), device=local_device)
        self.student = student
        self.student_sampling = student_sampling or StudentSampling()
        if self.student is None and any(is_recorded(t["slug"]) for t in self.teachers):
            raise ValueError("the 'recorded' teacher answers with the session's recorded action, so the other side "
                             "of each pair must be the student's own sample: pass student='local:<student model>'")

    async def sample_student(self, states: Sequence[TraceState]) -> dict[str, str]:
        """``{state_id: the student's sampled action}`` (:func:`.recorded.sample_student_actions`, in a thread).

        Raises:
            ValueError: no ``student`` was given, or bad states.
        """
        if self.student is None:
            raise ValueError("sample_student needs TeacherReplayer(student='local:<student model>')")
        states = validate_states(states)
        return await asyncio.to_thread(sample_student_actions, self.student, states, self.student_sampling)

    def __repr__(self) -> str:
        slugs = [t["slug"] for t in self.teachers]
        return f"TeacherReplayer(teachers={slugs}, api_key={self._key!r}, max_concurrency={self.max_concurrency})"

    # ------------------------------------------------------------------ requests

    def _body(self, teacher: TeacherSpec, messages: list[dict[str, str]]) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": teacher["slug"],
            "messages": messages,
            "max_tokens": int(teacher.get("max_tokens", self.max_tokens)),
        }
        local = teacher["slug"].startswith(LOCAL_PREFIX)
        temperature = teacher.get("temperature", self.temperature)
        seed = teacher.get("seed", self.seed)
        if local:  # the hash must change with the values actually used
            temperature = LOCAL_DEFAULT_TEMPERATURE if temperature is None else temperature
            seed = 0 if seed is None else seed
        if temperature is not None:
            body["temperature"] = float(temperature)
        if seed is not None:
            body["seed"] = int(seed)
        return body

    def _make_http(self) -> tuple[httpx.AsyncClient | None, bool]:
        if not any(not t["slug"].startswith(LOCAL_PREFIX) and not is_recorded(t["slug"]) for t in self.teachers):
            return None, False
        if isinstance(self._http_arg, httpx.AsyncClient):
            return self._http_arg, False
        timeout = httpx.Timeout(self.timeout_s, connect=min(self.timeout_s, 30.0))
        if self._http_arg is not None:
            return httpx.AsyncClient(transport=self._http_arg, timeout=timeout), True
        limits = httpx.Limits(
            max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency
        )
        return httpx.AsyncClient(limits=limits, timeout=timeout), True

    # ------------------------------------------------------------------ one attempt

    async def _attempt_local(
        self, teacher: TeacherSpec, body: dict[str, Any], state_id: str
    ) -> AttemptOutcome:
        try:
            gen = await asyncio.to_thread(
                self.local_teachers[teacher["slug"]].generate,
                body["messages"],
                state_id=state_id,
                max_new_tokens=body["max_tokens"],
                temperature=body["temperature"],
                seed=body["seed"],
            )
        except Exception as exc:  # a broken local model fails every call the same way: stop it
            msg = scrub(f"local teacher error: {type(exc).__name__}: {exc}", self._key)
            return AttemptOutcome(error=msg, stop=msg, reached=False)
        return AttemptOutcome(text=gen.text, usage=Usage(gen.prompt_tokens, gen.completion_tokens, None))

    # ------------------------------------------------------------------ a replay

    async def replay(
        self,
        states: Sequence[TraceState],
        *,
        max_total_usd: float = 5.0,
        ledger_path: str | os.PathLike[str] | None = None,
        progress: Callable[[ReplayProgress], None] | None = None,
    ) -> list[TeacherCallResult]:
        """Replay ``states`` against every teacher; results in (state, teacher) order.

        Args:
            states: the frozen trace (unique ``state_id``s).
            max_total_usd: the hard cap; the ledger's recorded spend counts against it.
            ledger_path: JSONL ledger to resume from and append to (``None``: no ledger).
            progress: called with a :class:`ReplayProgress` after each call (exceptions are logged).
        """
        states = validate_states(states)
        Budget(max_total_usd)  # validates the cap before the ledger is opened
        ledger = Ledger(ledger_path) if ledger_path is not None else None
        http, owned = None, False
        try:
            if ledger is not None and ledger.unsettled_usd > 0:
                log.warning(
                    "ledger %s: %.6f USD of attempts were sent but never settled (the replay was killed); "
                    "they count as spent at their reservations",
                    ledger.path,
                    ledger.unsettled_usd,
                )
            budget = Budget(max_total_usd, already_spent_usd=ledger.spent_usd if ledger else 0.0)
            http, owned = self._make_http()
            client = (
                ChatCompletionsClient(
                    http,
                    api_key=self._key,
                    timeout_s=self.timeout_s,
                    max_response_bytes=self.max_response_bytes,
                )
                if http
                else None
            )
            run = ReplayRun(self, states, budget, ledger, client, progress)
            return await run.go()
        finally:
            if owned and http is not None:
                await http.aclose()
            if ledger is not None:
                await ledger.drain()
                ledger.close()


async def replay_trace(
    states: Sequence[TraceState],
    teachers: Sequence[TeacherSpec] = tuple(DEFAULT_TEACHERS),
    max_total_usd: float = 5.0,
    api_key: str | SecretKey | None = None,
    *,
    ledger_path: str | os.PathLike[str] | None = None,
    dotenv_path: str | os.PathLike[str] | None = None,
    max_concurrency: int = 32,
    per_teacher_concurrency: int = 8,
    timeout_s: float = 120.0,
    max_retries: int = 5,
    max_tokens: int = 1024,
    progress: Callable[[ReplayProgress], None] | None = None,
    http_client: httpx.AsyncClient | httpx.AsyncBaseTransport | None = None,
    **kwargs: Any,
) -> list[TeacherCallResult]:
    """Ask every teacher for the next action at every state; one result per (state, teacher), in order.

    See :class:`TeacherReplayer` for the arguments (``kwargs``: temperature, seed, backoff_base_s,
    max_backoff_s, max_retry_after_s, local_device). Spend (settled + reserved) never exceeds
    ``max_total_usd``; calls that would are returned with ``error="skipped: budget"``.

    Raises:
        ValueError: bad arguments, states or teachers.
        MissingAPIKeyError: a remote teacher needs a key and none was found (says where it looked).
    """
    replayer = TeacherReplayer(
        teachers,
        api_key=api_key,
        dotenv_path=dotenv_path,
        max_concurrency=max_concurrency,
        per_teacher_concurrency=per_teacher_concurrency,
        timeout_s=timeout_s,
        max_retries=max_retries,
        max_tokens=max_tokens,
        http_client=http_client,
        **kwargs,
    )
    return await replayer.replay(
        states, max_total_usd=max_total_usd, ledger_path=ledger_path, progress=progress
    )


def replay_trace_sync(*args: Any, **kwargs: Any) -> list[TeacherCallResult]:
    """``asyncio.run(replay_trace(...))``; raises ``RuntimeError`` inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(replay_trace(*args, **kwargs))
    raise RuntimeError(
        "replay_trace_sync was called inside a running event loop; use `await replay_trace(...)`."
    )

"""The ``recorded`` teacher: the action the session recorded, against the student's own sampled action.

A pair's ``chosen`` must come from a teacher stronger than the student (DESIGN.md, decision 13).
Online, frontier models replay the student's recorded traces. Offline, the stronger teacher is the
agent that *recorded* the session: a Claude Code history is a frontier model's actions. The
``recorded`` teacher answers each state with its recorded action (``TraceState["student_action"]``),
at cost 0, in-process, with no key and no ledger entry (it is handled like the ``local:`` backends).

The other side of the pair is the student's own action at that state, sampled from the student model
(:class:`StudentSampling`, through :meth:`~.local.LocalTeacher.sample_actions`: the student's chat
format, the rollout sampler), so the pair says "the recorded action, not what you would do now"
(on-policy). Pass the samples to :func:`~.pairs.extract_dpo_pairs` as ``student_actions``; a state
where the student's sample agrees (``canonical_action``) with the winning action makes no pair.

The consensus rule is unchanged: ``recorded`` counts as one teacher, and ``agreement_threshold``
applies across all listed teachers (``[recorded]`` with threshold 1 offline; ``[recorded,
openai/gpt-5]`` with threshold 2: the frontier teacher must confirm the recorded action).

During training the engine re-samples the rejected side from the current student every
``rollout.pair_refresh_every`` steps (``composer_replication.engine.refresh``); the sampling step of
each rejected side is in ``metadata["student_sample"]["step"]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from composer_replication.teacher_replay.local import LocalTeacher
from composer_replication.types import TeacherCallResult, TeacherSpec, TraceState

__all__ = [
    "RECORDED_SLUG",
    "FAILED_CALL_KINDS",
    "RECORDED_TEACHER",
    "REJECTED_SOURCE_SAMPLE",
    "StudentSampling",
    "is_recorded",
    "is_student_sample",
    "recorded_result",
    "sample_student_actions",
]

RECORDED_SLUG = "recorded"
"""The slug of the recorded teacher in a teacher list (``teachers.slugs: [recorded]``)."""

RECORDED_TEACHER: TeacherSpec = {"slug": RECORDED_SLUG, "input_per_mtok": 0.0, "output_per_mtok": 0.0}
"""The recorded teacher's spec (it costs nothing)."""

REJECTED_SOURCE_SAMPLE = "student_sample"
"""``metadata["rejected_source"]`` of a pair whose rejected side is a student sample."""


def is_student_sample(pair: Any) -> bool:
    """True when a :class:`~composer_replication.types.PreferencePair`'s rejected side is a student sample."""
    return pair.metadata.get("rejected_source") == REJECTED_SOURCE_SAMPLE


def is_recorded(slug: str) -> bool:
    """True for the ``recorded`` teacher's slug."""
    return slug == RECORDED_SLUG


FAILED_CALL_KINDS = frozenset({"tool_not_found", "json_decode", "type_error", "repeated_failure"})
"""``TraceState["error_kind"]`` values that mark the recorded action itself as a mistake: a call to a tool
that does not exist, arguments that are not JSON or do not fit the tool, the same failure again. The
recorded teacher abstains there (a ``runtime_error``, e.g. a test run that fails, is a sound action)."""


def recorded_result(state: TraceState) -> TeacherCallResult:
    """The recorded teacher's answer at ``state``: its recorded action, cost 0, no latency.

    It abstains (an error result, no part in the vote, so no pair from it) where there is no recorded
    action (``"no recorded action"``) or where the recorded call failed as a call
    (``"recorded action failed: tool_not_found"``...; :data:`FAILED_CALL_KINDS`): the agent's own mistake,
    which the next state's action corrects, is not an action to teach.
    """
    action = state.get("student_action")
    ok = isinstance(action, str) and bool(action.strip())
    error = None if ok else "no recorded action"
    if ok and state.get("error_kind") in FAILED_CALL_KINDS:
        ok, error = False, f"recorded action failed: {state['error_kind']}"
    return {
        "state_id": state["state_id"],
        "teacher_slug": RECORDED_SLUG,
        "response_text": action if ok else None,
        "latency_s": 0.0,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "cost_usd": 0.0,
        "error": error,
    }


@dataclass(frozen=True, kw_only=True)
class StudentSampling:
    """How the student's own action at a state is sampled (the rejected side of recorded pairs).

    Use the student's rollout settings (``student.rollout.max_new_tokens`` / ``temperature`` / ``top_p``),
    so the samples are what the student's rollouts look like.
    """

    max_new_tokens: int = 48
    """Generation length limit of one sample."""
    temperature: float = 1.0
    """Sampling temperature (``<= 0``: greedy)."""
    top_p: float = 1.0
    """Nucleus sampling threshold in (0, 1]."""
    seed: int = 0
    """Seed of the samples (with the batch index; see ``local.sample_actions``)."""
    batch_size: int = 64
    """States sampled per ``generate`` call (left-padded batches)."""

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or self.max_new_tokens < 1 or self.batch_size < 1:
            raise ValueError(
                f"StudentSampling: need max_new_tokens >= 1 and batch_size >= 1, got "
                f"{self.max_new_tokens} and {self.batch_size}"
            )
        if not 0 < self.top_p <= 1 or self.temperature < 0:
            raise ValueError(
                f"StudentSampling: need temperature >= 0 and top_p in (0, 1], got "
                f"{self.temperature} and {self.top_p}"
            )

    def metadata(self, step: int) -> dict[str, Any]:
        """What a pair records about its rejected side: the sampling settings and the training ``step``
        whose weights sampled it (0: the initial student)."""
        meta = {k: v for k, v in asdict(self).items() if k != "batch_size"}
        return {"step": int(step), **meta}


def sample_student_actions(
    student: LocalTeacher, states: Sequence[TraceState], sampling: StudentSampling
) -> dict[str, str]:
    """``{state_id: the student's sampled action}`` for ``states`` (blocking; see :class:`StudentSampling`)."""
    texts = student.sample_actions(
        [s["messages"] for s in states],
        max_new_tokens=sampling.max_new_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        seed=sampling.seed,
        batch_size=sampling.batch_size,
    )
    return {s["state_id"]: text for s, text in zip(states, texts)}

"""Record types shared across the pipeline (ingestion -> teacher replay -> pairs -> collator).

These are plain ``TypedDict`` records so they round-trip through JSONL unchanged.
``composer_replication.teacher_replay`` re-exports them under the spec's names.
"""

from __future__ import annotations

from typing import Any, TypedDict

try:  # Python 3.11+
    from typing import NotRequired
except ImportError:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired

__all__ = ["TeacherSpec", "TraceState", "TeacherCallResult", "DPOPair", "ErrorSite"]


class TeacherSpec(TypedDict):
    """A teacher model and its prices.

    ``slug`` is an OpenRouter-style ``author/model`` slug, or ``local:<model>`` for an in-process
    Hugging Face teacher (``local:smollm2-135m``, ``local:tiny``, or a local folder).
    Prices are USD per million tokens. Optional keys: ``base_url`` (any OpenAI-compatible
    endpoint), ``max_tokens``, ``temperature``, ``seed``, ``max_concurrency``.
    """

    slug: str
    input_per_mtok: float
    output_per_mtok: float
    base_url: NotRequired[str]
    max_tokens: NotRequired[int]
    temperature: NotRequired[float]
    seed: NotRequired[int]
    max_concurrency: NotRequired[int]


class ErrorSite(TypedDict, total=False):
    """Context of a failed tool call, for the hint generator (``hint_generator.HintContext``)."""

    error_kind: str
    error_message: str
    available_tools: list[str]
    tool_name: str
    tool_schema: dict
    intent: str


class TraceState(TypedDict):
    """One step of a frozen agentic trace: the history and what the student did next.

    Required (the spec's fields):
        state_id: unique id, ``f"{path.stem}::{idx:04d}"`` for file-based ingesters.
        messages: OpenAI-style chat history up to this turn (system first; assistant messages carry
            ``tool_calls``; tool results are ``{"role": "tool", "tool_call_id", "content"}``).
        student_action: the recorded action as text (see ``composer_replication.actions``).

    Optional (set by the ingesters):
        tools: names of the tools the session offered (or used), for rewards and hints.
        error_kind / error_meta: set when this turn's tool results carried an error; ``error_meta``
            is an :class:`ErrorSite` for ``hint_generator.dispatch``.
        source: the format the state came from (``claude_code``, ``codex``, ``openai``, ``swe_agent``).
    """

    state_id: str
    messages: list[dict[str, Any]]
    student_action: str
    tools: NotRequired[list[str]]
    error_kind: NotRequired[str]
    error_meta: NotRequired[ErrorSite]
    source: NotRequired[str]


class TeacherCallResult(TypedDict):
    """One teacher's answer for one state (one row of the N states x T teachers results)."""

    state_id: str
    teacher_slug: str
    response_text: str | None
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    cost_usd: float
    error: str | None


class DPOPair(TypedDict):
    """A preference pair: the teachers' consensus action (chosen) against the student's (rejected)."""

    state_id: str
    state_messages: list[dict[str, Any]]
    chosen: str
    rejected: str
    n_teachers_agreeing: int

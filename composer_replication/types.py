"""Record types shared across the pipeline (ingestion -> teacher replay -> pairs -> collator).

States and teacher results are plain ``TypedDict`` records so they round-trip through JSONL unchanged;
the one preference pair record, :class:`PreferencePair`, is a dataclass with a mapping view under the
spec's ``DPOPair`` keys.
``composer_replication.teacher_replay`` re-exports them under the spec's names.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, TypedDict

from composer_replication.chat_format import messages_action

try:  # Python 3.11+
    from typing import NotRequired
except ImportError:  # pragma: no cover - Python 3.10
    from typing_extensions import NotRequired

__all__ = ["ERROR_KINDS", "TeacherSpec", "TraceState", "TeacherCallResult", "PreferencePair", "DPOPair",
           "HintContext", "recorded_action", "trace_state"]

ERROR_KINDS: tuple[str, ...] = (
    "tool_not_found", "json_decode", "type_error", "runtime_error", "repeated_failure", "other",
)  # fmt: skip
"""The error kinds of a failed tool call: what the ingesters and environments emit and the hint generator
knows (one definition; ``hint_generator`` and ``rollout`` re-export it)."""


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


class HintContext(TypedDict, total=False):
    """An error site: the context of one failed tool call, as the hint templates read it (all keys optional).

    The spec's ``hint_generator.HintContext`` (this class); the ingesters store one per failing turn in
    ``TraceState["error_meta"]`` and the rollout environments in ``Score.error_meta``.
    ``tool_schema`` is the tool's schema: a JSON schema, an OpenAI ``{"name", "parameters"}`` function
    (bare or under ``"function"``), or an Anthropic ``{"name", "input_schema"}``.
    """

    error_kind: str  # one of ERROR_KINDS (or a registered custom kind)
    error_message: str  # the error text the tool or the parser returned
    available_tools: list[str]  # the tools the session offers
    tool_name: str  # the tool the failing call named
    tool_schema: dict
    intent: str  # what the agent was trying to do


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
            is its :class:`HintContext` for ``hint_generator.dispatch``.
        source: the format the state came from (``claude_code``, ``codex``, ``openai``, ``swe_agent``).
    """

    state_id: str
    messages: list[dict[str, Any]]
    student_action: str
    tools: NotRequired[list[str]]
    error_kind: NotRequired[str]
    error_meta: NotRequired[HintContext]
    source: NotRequired[str]


def recorded_action(state: Mapping[str, Any]) -> str | None:
    """The action the session recorded at ``state``: the frontier agent's, never the student's.

    The spec names this field ``TraceState["student_action"]``; this function and :func:`trace_state` are the
    only code that spells that key. ``None`` when the state has no recorded action (a string).
    """
    action = state.get("student_action")
    return action if isinstance(action, str) else None


def trace_state(state_id: str, messages: list[dict[str, Any]], recorded: str, **optional: Any) -> TraceState:
    """A :class:`TraceState` whose recorded action is ``recorded`` (stored under the spec's ``student_action``).

    ``optional`` holds the optional keys (``tools``, ``error_kind``, ``error_meta``, ``source``); ``None`` values
    are left out.
    """
    state: dict[str, Any] = {"state_id": state_id, "messages": messages, "student_action": recorded}
    state.update({k: v for k, v in optional.items() if v is not None})
    return state  # type: ignore[return-value]


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


ROLLOUT_REJECTED = "rollout"
"""``metadata["rejected_source"]`` of a pair whose rejected side is not stored: each training step draws it from
its own rollouts at the pair's state (the ``recorded`` teacher; same policy, zero staleness). Such a pair is
written with ``rejected_messages == []``."""

_PAIR_TEXT_KEYS = ("chosen", "rejected")
_PAIR_FIELDS = ("state_id", "state_messages", "chosen_messages", "rejected_messages", "n_teachers_agreeing",
                "metadata")


@dataclass(kw_only=True, eq=True)
class PreferencePair(Mapping[str, Any]):
    """The one preference pair record of the pipeline: the teachers' action (chosen) against the student's.

    Every writer and reader of pairs uses it: consensus extraction (``teacher_replay.extract_dpo_pairs``),
    the normalizer (which filters and annotates, never converts), ``pairs.jsonl`` (:meth:`to_json` /
    :meth:`from_mapping`), the batching module, the collator, the TRL trainer and the Monarch actors.

    The actions are held in message form (``[{"role": "assistant", "content": ..., "tool_calls": ...}]``).
    The spec's field names stay available: ``pair["chosen"]`` / ``pair.chosen`` is the chosen action as
    text (``composer_replication.actions`` form), ``pair["rejected"]`` likewise, and ``dict(pair)`` has
    every spec key. ``DPOPair`` and ``replaysim.NormalizedDPOPair`` are this class under the spec's names.

    An empty action is representable (the normalizer drops such pairs, and batching skips them); malformed
    records are not.

    Raises:
        ValueError: an empty ``state_id``, actions that are not message lists, or ``n_teachers_agreeing < 1``.
    """

    state_id: str
    """Id of the trace state the pair was made at."""
    state_messages: list[dict[str, Any]]
    """The history (chat messages) both actions answer."""
    chosen_messages: list[dict[str, Any]]
    """The preferred action as assistant message(s)."""
    rejected_messages: list[dict[str, Any]]
    """The dispreferred action (the student's) as assistant message(s)."""
    n_teachers_agreeing: int = 1
    """Teachers that agreed on the chosen action."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """Provenance: teachers, normalizer operators, ``source_index``..."""

    def __post_init__(self) -> None:
        if not isinstance(self.state_id, str) or not self.state_id:
            raise ValueError(f"a pair needs a non-empty string state_id, got {self.state_id!r}")
        if not isinstance(self.state_messages, list):
            raise ValueError(f"pair {self.state_id!r}: 'state_messages' must be a list of chat messages")
        for side in ("chosen", "rejected"):
            msgs = getattr(self, f"{side}_messages")
            if not isinstance(msgs, list) or not all(isinstance(m, Mapping) for m in msgs):
                raise ValueError(f"pair {self.state_id!r}: '{side}_messages' must be a list of message dicts")
        if isinstance(self.n_teachers_agreeing, bool) or int(self.n_teachers_agreeing) < 1:
            raise ValueError(f"pair {self.state_id!r}: n_teachers_agreeing must be >= 1, got {self.n_teachers_agreeing!r}")
        self.n_teachers_agreeing = int(self.n_teachers_agreeing)

    @property
    def rejected_from_rollout(self) -> bool:
        """True when the rejected side comes from the training step's own rollouts (:data:`ROLLOUT_REJECTED`)."""
        return self.metadata.get("rejected_source") == ROLLOUT_REJECTED

    # ------------------------------------------------------------------ the spec's text fields
    @property
    def chosen(self) -> str:
        """The chosen action as text (``[TOOL_USE] name=... input=...`` for tool calls)."""
        return messages_action(self.chosen_messages)

    @property
    def rejected(self) -> str:
        """The rejected (student's) action as text."""
        return messages_action(self.rejected_messages)

    # ------------------------------------------------------------------ mapping view (spec keys)
    def __getitem__(self, key: str) -> Any:
        if key in _PAIR_TEXT_KEYS or key in _PAIR_FIELDS:
            return getattr(self, key)
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(("state_id", "state_messages", "chosen", "rejected", "n_teachers_agreeing",
                     "chosen_messages", "rejected_messages", "metadata"))

    def __len__(self) -> int:
        return len(_PAIR_FIELDS) + len(_PAIR_TEXT_KEYS)

    __hash__ = None  # type: ignore[assignment]  # mutable record

    # ------------------------------------------------------------------ construction and files
    @classmethod
    def from_actions(cls, *, state_id: str, state_messages: list[dict[str, Any]], chosen: str, rejected: str,
                     n_teachers_agreeing: int = 1, metadata: dict[str, Any] | None = None) -> PreferencePair:
        """A pair from two action texts (each becomes one assistant message)."""
        return cls(state_id=state_id, state_messages=list(state_messages),
                   chosen_messages=[{"role": "assistant", "content": chosen}],
                   rejected_messages=[{"role": "assistant", "content": rejected}],
                   n_teachers_agreeing=n_teachers_agreeing, metadata=dict(metadata or {}))

    @classmethod
    def from_mapping(cls, record: Mapping[str, Any] | PreferencePair, *, where: str = "pair") -> PreferencePair:
        """Read a pair from a ``pairs.jsonl`` record or the spec's ``DPOPair`` dict (text ``chosen``/``rejected``).

        Message-form keys win; text keys are used when they are absent. A record with both that disagree
        is refused (it was edited by hand on one side only). A record without ``state_id`` takes ``where``.

        Raises:
            ValueError: not a mapping, a missing key (named, with ``where``), or sides that disagree.
        """
        if isinstance(record, PreferencePair):
            return record
        if not isinstance(record, Mapping):
            raise ValueError(f"{where}: a pair must be a mapping, got {type(record).__name__}")
        sides: dict[str, list[dict[str, Any]]] = {}
        for side in ("chosen", "rejected"):
            msgs, text = record.get(f"{side}_messages"), record.get(side)
            if msgs is None:
                if not isinstance(text, str):
                    raise ValueError(f"{where}: '{side}' must be the action text (a string) or '{side}_messages' "
                                     f"a message list, got {text!r:.60}")
                msgs = [{"role": "assistant", "content": text}]
            sides[side] = list(msgs)
        if not isinstance(record.get("state_messages"), list):
            raise ValueError(f"{where}: a pair needs 'state_messages', a list of chat messages; got keys {sorted(record)}")
        pair = cls(state_id=record.get("state_id") or where, state_messages=list(record["state_messages"]),
                   chosen_messages=sides["chosen"], rejected_messages=sides["rejected"],
                   n_teachers_agreeing=record.get("n_teachers_agreeing", 1),
                   metadata=dict(record.get("metadata") or {}))
        for side in _PAIR_TEXT_KEYS:
            if isinstance(record.get(side), str) and f"{side}_messages" in record and record[side] != pair[side]:
                raise ValueError(f"{where}: '{side}' and '{side}_messages' disagree; keep one of them")
        return pair

    def to_json(self) -> dict[str, Any]:
        """The ``pairs.jsonl`` record: every field plus the spec's text ``chosen`` / ``rejected``."""
        return {"state_id": self.state_id, "state_messages": self.state_messages, "chosen": self.chosen,
                "rejected": self.rejected, "n_teachers_agreeing": self.n_teachers_agreeing,
                "chosen_messages": self.chosen_messages, "rejected_messages": self.rejected_messages,
                "metadata": self.metadata}


DPOPair = PreferencePair
"""The spec's name for :class:`PreferencePair` (its dict form, with text ``chosen``/``rejected``, is accepted
wherever pairs are read, through :meth:`PreferencePair.from_mapping`)."""

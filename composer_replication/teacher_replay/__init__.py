"""Trace replay against N teachers, and DPO pairs from their consensus.

- :func:`replay_trace` / :func:`replay_trace_sync` / :class:`TeacherReplayer`: ask every teacher
  (any OpenAI-compatible endpoint, OpenRouter by default, or ``local:<model>`` in-process) for the
  next action at every trace state, under a hard USD budget, with a resumable JSONL ledger.
- :func:`extract_dpo_pairs`, :func:`save_pairs`, :func:`load_pairs`: consensus pairs.
- ``python -m composer_replication.teacher_replay``: the command line (see ``docs/teacher_replay.md``).
"""

from composer_replication.teacher_replay.budget import Budget, estimate_prompt_tokens, worst_case_cost
from composer_replication.teacher_replay.keys import (
    InvalidAPIKeyError,
    MissingAPIKeyError,
    SecretKey,
    resolve_api_key,
)
from composer_replication.teacher_replay.ledger import Ledger, LedgerLockedError, ledger_spend, request_sha256
from composer_replication.teacher_replay.local import LocalTeacher
from composer_replication.teacher_replay.pairs import PairCollector, extract_dpo_pairs, load_pairs, save_pairs
from composer_replication.teacher_replay.prompting import (
    REPLAY_INSTRUCTION,
    build_teacher_messages,
    reply_to_action,
)
from composer_replication.teacher_replay.replay import (
    ReplayProgress,
    TeacherReplayer,
    replay_trace,
    replay_trace_sync,
)
from composer_replication.teacher_replay.specs import (
    BUDGET_SKIP,
    DEFAULT_TEACHERS,
    OPENROUTER_BASE_URL,
    error_kind,
    teacher_needs_key,
)
from composer_replication.types import DPOPair, PreferencePair, TeacherCallResult, TeacherSpec, TraceState

__all__ = [
    "DEFAULT_TEACHERS",
    "OPENROUTER_BASE_URL",
    "BUDGET_SKIP",
    "TeacherSpec",
    "TraceState",
    "TeacherCallResult",
    "DPOPair",
    "PreferencePair",
    "PairCollector",
    "replay_trace",
    "replay_trace_sync",
    "TeacherReplayer",
    "ReplayProgress",
    "extract_dpo_pairs",
    "save_pairs",
    "load_pairs",
    "Budget",
    "Ledger",
    "LedgerLockedError",
    "ledger_spend",
    "InvalidAPIKeyError",
    "LocalTeacher",
    "SecretKey",
    "MissingAPIKeyError",
    "resolve_api_key",
    "request_sha256",
    "estimate_prompt_tokens",
    "worst_case_cost",
    "build_teacher_messages",
    "reply_to_action",
    "REPLAY_INSTRUCTION",
    "error_kind",
    "teacher_needs_key",
]

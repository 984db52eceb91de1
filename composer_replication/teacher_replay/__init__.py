"""Trace replay against N teachers, and preference pairs from their consensus (``docs/teacher_replay.md``).

``replay`` (the fan-out), ``pairs`` (consensus, ``pairs.jsonl``), ``budget``, ``ledger``, ``client`` (one
attempt, retries), ``keys``, ``teachers`` (specs, the recorded and local teachers); ``python -m
composer_replication.teacher_replay`` is the CLI. ``TeacherSpec``, ``TraceState``, ``TeacherCallResult`` and
``DPOPair`` are the spec's names of ``composer_replication.types`` records.
"""

from composer_replication.teacher_replay.budget import Budget
from composer_replication.teacher_replay.ledger import Ledger
from composer_replication.teacher_replay.pairs import PairCollector, extract_dpo_pairs, load_pairs, save_pairs
from composer_replication.teacher_replay.replay import TeacherReplayer, replay_trace, replay_trace_sync
from composer_replication.teacher_replay.teachers import DEFAULT_TEACHERS, RECORDED_TEACHER
from composer_replication.types import DPOPair, TeacherCallResult, TeacherSpec, TraceState

__all__ = ["DEFAULT_TEACHERS", "RECORDED_TEACHER", "TeacherSpec", "TraceState", "TeacherCallResult",
           "DPOPair", "replay_trace", "replay_trace_sync", "TeacherReplayer", "extract_dpo_pairs",
           "save_pairs", "load_pairs", "PairCollector", "Budget", "Ledger"]  # fmt: skip

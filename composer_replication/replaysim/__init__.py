"""replaysim: normalisation of teacher-replay DPO pairs (ADR-004).

The normalizer filters and annotates the one pair record (:class:`~composer_replication.types.PreferencePair`,
exported here under the spec's names ``DPOPair`` and ``NormalizedDPOPair``); it never converts pairs.
Re-exports ``TeacherCallResult``, ``extract_dpo_pairs`` and ``replay_trace`` from
``composer_replication.teacher_replay`` (replaysim builds on teacher replay, never the other way round).
"""

from __future__ import annotations

from composer_replication.replaysim.normalize import (
    DJNormalizer,
    DroppedPair,
    NormalizedDPOPair,
    NormalizeReport,
    replay_and_normalize_trace,
    replay_and_normalize_trace_sync,
)
from composer_replication.replaysim.recipe import RecipeError, load_recipe
from composer_replication.teacher_replay import extract_dpo_pairs, replay_trace
from composer_replication.types import DPOPair, TeacherCallResult

__all__ = [
    "NormalizedDPOPair",
    "DJNormalizer",
    "DroppedPair",
    "NormalizeReport",
    "RecipeError",
    "load_recipe",
    "replay_and_normalize_trace",
    "replay_and_normalize_trace_sync",
    "DPOPair",
    "TeacherCallResult",
    "extract_dpo_pairs",
    "replay_trace",
]

"""replaysim: normalisation of teacher-replay preference pairs (``replaysim.normalize``; ``docs/replaysim.md``)."""

from composer_replication.replaysim.normalize import (
    DJNormalizer,
    NormalizedDPOPair,
    replay_and_normalize_trace,
    replay_and_normalize_trace_sync,
)
from composer_replication.teacher_replay import extract_dpo_pairs, replay_trace
from composer_replication.types import DPOPair, TeacherCallResult

__all__ = ["NormalizedDPOPair", "DJNormalizer", "replay_and_normalize_trace", "replay_and_normalize_trace_sync",
           "DPOPair", "TeacherCallResult", "extract_dpo_pairs", "replay_trace"]

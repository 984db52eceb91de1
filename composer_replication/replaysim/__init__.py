"""replaysim: normalisation of teacher-replay DPO pairs (ADR-004).

Re-exports ``DPOPair``, ``TeacherCallResult``, ``extract_dpo_pairs`` and ``replay_trace`` from
``composer_replication.teacher_replay`` (the last two are imported on first access).
"""

from __future__ import annotations

import importlib
from typing import Any

from composer_replication.replaysim.normalize import (
    DJNormalizer,
    DroppedPair,
    NormalizedDPOPair,
    NormalizeReport,
    replay_and_normalize_trace,
    replay_and_normalize_trace_sync,
)
from composer_replication.replaysim.recipe import RecipeError, load_recipe
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

_LAZY = ("extract_dpo_pairs", "replay_trace")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module("composer_replication.teacher_replay"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

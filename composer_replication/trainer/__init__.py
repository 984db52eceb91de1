"""The TRL integration (the spec's ``composer_replication.trainer``): the collator and ``ComposerReplicationTrainer``.

``ComposerReplicationTrainer`` (a TRL ``GRPOTrainer`` subclass) is imported on first access, so that this package
imports without ``trl``.
"""

from __future__ import annotations

import importlib
from typing import Any

from composer_replication.trainer.collator_config import CollatorConfig, CollatorStats, TraceExample
from composer_replication.trainer.convert import trace_states_to_examples
from composer_replication.trainer.data_collator import ComposerDataCollator, TokenizerLike, TraceTurn

__all__ = ["CollatorConfig", "CollatorStats", "ComposerDataCollator", "TokenizerLike", "TraceExample",
           "TraceTurn", "trace_states_to_examples", "ComposerReplicationTrainer"]


def __getattr__(name: str) -> Any:
    """``ComposerReplicationTrainer``, imported on first access (it needs trl)."""
    if name != "ComposerReplicationTrainer":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return importlib.import_module("composer_replication.trainer.composer_trainer").ComposerReplicationTrainer

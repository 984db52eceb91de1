"""Training-side building blocks: the data collator (channels 1-3) and the trainer.

``ComposerReplicationTrainer`` (the TRL ``GRPOTrainer`` subclass) is imported lazily on first
access so that this package imports without ``trl``.
"""

from __future__ import annotations

from typing import Any

from composer_replication.chat_format import (
    build_hinted_teacher_sequence,
    build_prompt_ids,
    build_response_ids,
    to_chat_messages,
)
from composer_replication.trainer.convert import trace_state_to_example, trace_states_to_examples
from composer_replication.trainer.data_collator import (
    CollatorConfig,
    CollatorStats,
    ComposerDataCollator,
    TokenizerLike,
    TraceExample,
    TraceTurn,
)

__all__ = [
    "CollatorConfig",
    "CollatorStats",
    "ComposerDataCollator",
    "TokenizerLike",
    "TraceExample",
    "TraceTurn",
    "build_hinted_teacher_sequence",
    "build_prompt_ids",
    "build_response_ids",
    "to_chat_messages",
    "trace_state_to_example",
    "trace_states_to_examples",
    "ComposerReplicationTrainer",
]

# ---------------------------------------------------------------------------- trainer (lazy)
# ComposerReplicationTrainer lives in composer_replication/trainer/composer_trainer.py and is imported on
# first attribute access below, so `import composer_replication.trainer` never needs trl.
_LAZY = {"ComposerReplicationTrainer": "composer_replication.trainer.composer_trainer"}


def __getattr__(name: str) -> Any:
    """Import lazily-exported names (the trainer) on first access."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)

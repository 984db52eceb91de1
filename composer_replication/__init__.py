"""composer-replication: Composer-style agentic RL post-training.

A student model learns from three signals at once: GRPO on its own rollouts, self-distillation at
hinted error sites (SDPO), and DPO/SimPO on pairs where frontier teachers replaying its traces agree
against it. This package is the core library (losses, ingestion, teacher replay, collator,
rollouts, the single-process engine); ``meshes/`` and ``recipes/`` wire it on Monarch.

The top-level names below are the spec's re-exports and the five calls a newcomer makes first
(``ingest_any``, ``build_training_data``, ``StudentConfig``, ``run_plain``, ``load_model_and_tokenizer``;
docs/api.md, "Start here"); everything else is imported from its module. They are resolved lazily (PEP 562),
so ``import composer_replication`` stays cheap and does not import TRL or torchft until asked. The list is an
allowlist (tests/core/test_public_surface.py): adding a top-level name is a decision.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Any

__version__ = "0.1.0"

#: True iff ``torchft`` is importable (gates ``make_diloco_outer_loop``).
_DILOCO_AVAILABLE: bool = importlib.util.find_spec("torchft") is not None

_EXPORTS: dict[str, str] = {
    "compose_loss": "composer_replication.loss",
    "LossConfig": "composer_replication.loss",
    "LossComponents": "composer_replication.loss",
    "build_batch": "composer_replication.batch",
    "generalized_jsd_loss": "composer_replication.opsd",
    "ClaudeCodeIngester": "composer_replication.ingestion.claude_code",
    "IngestionStats": "composer_replication.ingestion.claude_code",
    "SYSTEM_PROMPT": "composer_replication.ingestion.claude_code",
    "DEFAULT_TEACHERS": "composer_replication.teacher_replay",
    "DPOPair": "composer_replication.teacher_replay",
    "TeacherCallResult": "composer_replication.teacher_replay",
    "TeacherSpec": "composer_replication.teacher_replay",
    "TraceState": "composer_replication.teacher_replay",
    "extract_dpo_pairs": "composer_replication.teacher_replay",
    "replay_trace": "composer_replication.teacher_replay",
    "ComposerReplicationTrainer": "composer_replication.trainer",
    "make_diloco_outer_loop": "composer_replication.diloco",
    # what a user calls first
    "ingest_any": "composer_replication.ingestion",
    "build_training_data": "composer_replication.engine",
    "StudentConfig": "composer_replication.engine",
    "run_plain": "composer_replication.engine",
    "load_model_and_tokenizer": "composer_replication.models",
}

__all__ = ["__version__", "_DILOCO_AVAILABLE", *_EXPORTS]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'composer_replication' has no attribute {name!r}")
    if name == "make_diloco_outer_loop" and not _DILOCO_AVAILABLE:
        value = None  # the spec: None when torchft is missing
    else:
        value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # cache: later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

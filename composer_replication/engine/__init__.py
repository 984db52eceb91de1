"""The single-process training engine that the Monarch actors wrap (no Monarch here).

- :mod:`.config`: ``StudentConfig`` tree (``OptimConfig``, ``LossConfig``, ``RolloutConfig``),
  ``from_dict`` / ``to_dict`` / ``apply_overrides`` for YAML presets and ``key=value`` overrides.
- :mod:`.data`: ``TrainingData``, ``build_training_data`` (environment by name), ``MixedEnvironment``,
  and the per-step draws ``prompts_for_step`` / ``pairs_for_step``.
- :mod:`.reference`: channel-3 reference log-probs, once per distinct sequence.
- :mod:`.evaluate`: greedy answers and reward statistics.
- :mod:`.student`: ``StudentTrainerCore`` (train_step, evaluate, state_dict, get/set_weights).
- :mod:`.checkpoint`: atomic ``save_checkpoint`` / ``latest_checkpoint`` / ``load_checkpoint``.
- :mod:`.run_dir`: ``RunDir`` (config.yaml, metrics.jsonl, TensorBoard, pairs.jsonl, summary.json).
- :mod:`.driver`: ``drive``, the one training driver (resume, steps, metrics, checkpoints, evaluation,
  summary) that ``run_plain`` and the Monarch controller both call.
- :mod:`.loop`: ``run_plain``, the driver over one replica in this process.
"""

from __future__ import annotations

from composer_replication.engine.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from composer_replication.engine.config import (
    LossConfig,
    OptimConfig,
    RolloutConfig,
    StudentConfig,
    apply_overrides,
    from_dict,
    resolve_device,
    resolve_dtype,
    to_dict,
)
from composer_replication.engine.data import (
    MixedEnvironment,
    TrainingData,
    build_training_data,
    derive_seed,
    pairs_for_step,
    prompts_for_step,
)
from composer_replication.engine.driver import DriveConfig, LocalTrainer, StepTrainer, drive
from composer_replication.engine.loop import run_plain
from composer_replication.engine.run_dir import RunDir
from composer_replication.engine.student import StudentTrainerCore

__all__ = [
    "OptimConfig",
    "LossConfig",
    "RolloutConfig",
    "StudentConfig",
    "from_dict",
    "to_dict",
    "apply_overrides",
    "resolve_device",
    "resolve_dtype",
    "TrainingData",
    "MixedEnvironment",
    "build_training_data",
    "prompts_for_step",
    "pairs_for_step",
    "StudentTrainerCore",
    "derive_seed",
    "save_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "RunDir",
    "run_plain",
    "drive",
    "DriveConfig",
    "StepTrainer",
    "LocalTrainer",
]

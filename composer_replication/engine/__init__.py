"""The single-process training engine that the Monarch actors wrap (no Monarch here).

What a user calls first is re-exported here; everything else is imported from its module: :mod:`.config` (the
``StudentConfig`` tree, ``from_dict`` / ``to_dict`` / ``apply_overrides``), :mod:`.data` (``TrainingData``, the
held-out split, each step's draw), :mod:`.student` (``StudentTrainerCore``), :mod:`.pairs` (channel-3 rows and
reference log-probs), :mod:`.accumulate`, :mod:`.metrics` (``reward/``, ``eval/``, ``loss/``, ``perf/``),
:mod:`.checkpoint`, :mod:`.run_dir` (``RunDir``) and :mod:`.driver` (``drive``, ``run_plain``, ``LocalReplica``).
"""

from __future__ import annotations

from composer_replication.engine.config import LossConfig, OptimConfig, RolloutConfig, StudentConfig
from composer_replication.engine.data import TrainingData, build_training_data
from composer_replication.engine.driver import DriveConfig, drive, run_plain
from composer_replication.engine.run_dir import RunDir
from composer_replication.engine.student import StudentTrainerCore

__all__ = ["StudentConfig", "OptimConfig", "LossConfig", "RolloutConfig", "TrainingData", "build_training_data",
           "StudentTrainerCore", "run_plain", "drive", "DriveConfig", "RunDir"]

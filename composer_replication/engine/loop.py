"""The plain single-process run: the one training driver (``engine.driver``) over one local replica.

Used as the baseline of the recipe-overhead benchmark and by tests. It writes a full run folder
(``config.yaml``, ``metrics.jsonl``, TensorBoard, ``pairs.jsonl``, checkpoints, ``summary.json``)
and resumes exactly from the latest complete checkpoint when ``resume=True``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from composer_replication.engine.config import StudentConfig, to_dict
from composer_replication.engine.data import TrainingData
from composer_replication.engine.driver import DriveConfig, LocalTrainer, drive
from composer_replication.engine.run_dir import RunDir
from composer_replication.engine.student import StudentTrainerCore

__all__ = ["run_plain"]

log = logging.getLogger(__name__)


def run_plain(
    config: StudentConfig,
    data: TrainingData,
    run_dir: str | Path,
    *,
    num_steps: int | None = None,
    checkpoint_every: int = 0,
    resume: bool = False,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    evaluate: bool = True,
    keep_last: int | None = None,
) -> dict[str, Any]:
    """Train ``num_steps`` steps of one :class:`StudentTrainerCore` in this process (the driver's plain caller).

    Args:
        config: the student config (written to ``config.yaml``).
        data: environment, prompts and pairs (the pairs are written to ``pairs.jsonl``).
        run_dir: the run folder (created if missing; locked while the run lasts).
        num_steps: steps to reach (total, counting resumed ones); default ``config.num_steps``.
        checkpoint_every: save every N completed steps (and after the last one); 0 saves only at the end.
        resume: continue from the latest complete checkpoint in ``run_dir`` (fresh start when none);
            metric lines after that checkpoint are dropped.
        on_step: called as ``on_step(step, metrics)`` after each step is logged.
        evaluate: evaluate at the start (fresh runs) and at the end (``eval_start`` / ``eval_end``).
        keep_last: keep only the newest N checkpoints.

    Returns:
        The summary also written to ``summary.json`` (see :func:`~composer_replication.engine.driver.drive`).

    Raises:
        ValueError: ``num_steps < 1``, ``checkpoint_every < 0``, or the folder is in use by another run.
    """
    drive_config = DriveConfig(num_steps=config.num_steps if num_steps is None else num_steps,
                               checkpoint_every=checkpoint_every, keep_last=keep_last, resume=resume,
                               evaluate=evaluate)
    run = RunDir(run_dir)
    try:
        if resume and run.config_path.is_file():
            _warn_if_config_changed(run, to_dict(config))
        trainer = LocalTrainer(StudentTrainerCore(config, data=data), run)
        run.write_pairs(data.pairs)
        return drive(trainer, run, drive_config, run_config=to_dict(config), on_step=on_step)
    finally:
        run.close()


def _warn_if_config_changed(run: RunDir, new: dict[str, Any]) -> None:
    """Log the keys whose value differs from the run's stored ``config.yaml`` (resuming with a new config)."""
    old = run.read_config()
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if changed:
        log.warning("resuming %s with a config that differs from its config.yaml in %s", run.path, changed)

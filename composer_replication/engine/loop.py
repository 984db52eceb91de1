"""The plain single-process training loop: the same steps as the Monarch recipe, without actors.

Used as the baseline of the recipe-overhead benchmark and by tests. It writes a full run folder
(``config.yaml``, ``metrics.jsonl``, TensorBoard, ``pairs.jsonl``, checkpoints, ``summary.json``)
and resumes exactly from the latest complete checkpoint when ``resume=True``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from composer_replication.engine.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from composer_replication.engine.config import StudentConfig, to_dict
from composer_replication.engine.data import TrainingData
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
    """Train ``num_steps`` steps of one :class:`StudentTrainerCore` in this process.

    Args:
        config: the student config (written to ``config.yaml``).
        data: environment, prompts and pairs.
        run_dir: the run folder (created if missing).
        num_steps: steps to reach (total, counting resumed ones); default ``config.num_steps``.
        checkpoint_every: save every N completed steps (and after the last one); 0 saves only at the end.
        resume: continue from the latest complete checkpoint in ``run_dir`` (fresh start when none);
            metric lines after that checkpoint are dropped.
        on_step: called as ``on_step(step, metrics)`` after each step is logged (an exception stops the run;
            the checkpoints already written stay valid).
        evaluate: run :meth:`StudentTrainerCore.evaluate` at the end and put it in the summary.
        keep_last: keep only the newest N checkpoints.

    Returns:
        The summary also written to ``summary.json``: ``steps``, ``start_step``, ``resumed_from``,
        ``final_metrics``, ``eval`` (when ``evaluate``), ``wall_time_s``, ``steps_per_s``.

    Raises:
        ValueError: ``num_steps < 1`` or ``checkpoint_every < 0``.
    """
    num_steps = config.num_steps if num_steps is None else num_steps
    if num_steps < 1:
        raise ValueError(f"'num_steps' must be >= 1, got {num_steps}")
    if checkpoint_every < 0:
        raise ValueError(f"'checkpoint_every' must be >= 0, got {checkpoint_every}")
    t0 = time.perf_counter()
    run = RunDir(run_dir)
    try:
        core = StudentTrainerCore(config, data=data)
        resumed_from = None
        if resume:
            ckpt = latest_checkpoint(run)
            if ckpt is not None:
                core.load_state_dict(load_checkpoint(ckpt))
                resumed_from = str(ckpt)
                log.info("resumed from %s at step %d", ckpt, core.step)
            run.truncate_metrics(core.step)
            _warn_if_config_changed(run, to_dict(config))
        run.write_config(to_dict(config))
        run.write_pairs(data.pairs)
        start = core.step
        metrics: dict[str, float] = {}
        for step in range(start, num_steps):
            metrics = core.train_step(step)
            run.log_metrics(step, metrics)
            if on_step is not None:
                on_step(step, metrics)
            done = step + 1
            if (checkpoint_every and done % checkpoint_every == 0) or done == num_steps:
                save_checkpoint(run, done, core.state_dict(), keep_last=keep_last)
        summary: dict[str, Any] = {
            "steps": num_steps,
            "start_step": start,
            "resumed_from": resumed_from,
            "final_metrics": metrics,
        }
        if evaluate:
            summary["eval"] = core.evaluate()
        wall = time.perf_counter() - t0
        summary["wall_time_s"] = wall
        summary["steps_per_s"] = (num_steps - start) / wall if wall > 0 else 0.0
        run.write_summary(summary)
        return summary
    finally:
        run.close()


def _warn_if_config_changed(run: RunDir, new: dict[str, Any]) -> None:
    """Log the keys whose value differs from the run's stored ``config.yaml`` (resuming with a new config)."""
    if not run.config_path.is_file():
        return
    old = run.read_config()
    changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    if changed:
        log.warning("resuming %s with a config that differs from its config.yaml in %s", run.path, changed)

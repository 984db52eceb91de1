"""The one training driver: :func:`drive` steps a :class:`Replicas` (:class:`LocalReplica`: one ``StudentTrainerCore``
in this process, from :func:`run_plain`; or the recipe's ``MeshReplicas`` / ``DilocoMeshReplicas``: actor calls, the
metrics folded by the reducer). Order of work, the same for every caller:

1. on resume, restore the latest complete checkpoint, drop the metric lines after it, and only then rewrite
   ``config.yaml`` (a bad override never damages the run being resumed);
2. a fresh run evaluates first (``eval_start``, an ``eval/*`` row at its start step);
3. each step: ``train_step`` -> one ``metrics.jsonl`` row (plus ``extra_metrics``) -> ``on_step`` -> a checkpoint
   every ``checkpoint_every`` steps and after the last; an ``eval/*`` row every ``eval_every`` steps if asked;
4. the final evaluation (``eval_end``), then ``summary.json``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from composer_replication.engine.checkpoint import load_latest_checkpoint, save_checkpoint
from composer_replication.engine.config import StudentConfig, to_dict
from composer_replication.engine.data import TrainingData
from composer_replication.engine.run_dir import RunDir

__all__ = ["Replicas", "DriveConfig", "drive", "run_plain"]

log = logging.getLogger(__name__)

CHANNEL_KEYS = ("loss/grpo", "loss/lm_ce", "loss/jsd", "loss/taid", "loss/entropy_opd", "loss/dpo", "loss/simpo")
"""Per-channel loss metrics counted in ``summary.json``'s ``channel_nonzero_steps``."""


class Replicas(Protocol):
    """What the driver steps: the replicas of one run (one in-process core, or actor meshes)."""

    def train_step(self, step: int) -> dict[str, float]:
        """Run optimizer step ``step`` (0-based) on every replica; the step's metrics."""

    def save(self, step: int, keep_last: int | None) -> None:
        """Checkpoint the state after ``step`` completed steps."""

    def load_latest(self) -> int:
        """Restore the latest complete checkpoint; the number of completed steps (0: none)."""

    def evaluate(self) -> dict[str, float]:
        """Evaluation metrics (``eval/*``)."""


class LocalReplica:
    """:class:`Replicas` over one ``StudentTrainerCore`` in this process; checkpoints in ``run_dir``."""

    def __init__(self, core: Any, run_dir: RunDir | Any) -> None:
        self.core, self.run_dir = core, run_dir
        self.train_step, self.evaluate = core.train_step, core.evaluate

    def save(self, step: int, keep_last: int | None) -> None:
        """``save_checkpoint`` of the core's full state."""
        save_checkpoint(self.run_dir, step, self.core.state_dict(), keep_last=keep_last)

    def load_latest(self) -> int:
        """Load the newest checkpoint that loads (damaged or unreadable ones fall back, ``engine.checkpoint``); its
        step."""
        if (found := load_latest_checkpoint(self.run_dir)) is None:
            return 0
        ckpt, state = found
        self.core.load_state_dict(state)
        log.info("resumed from %s at step %d", ckpt, self.core.step)
        return int(self.core.step)


@dataclass(kw_only=True)
class DriveConfig:
    """How long to train and what to keep (``ValueError`` for a negative count, or ``num_steps < 1``)."""

    num_steps: int
    """Steps to reach (total, counting resumed ones)."""
    checkpoint_every: int = 0
    """Save every N completed steps (and always after the last); 0 saves only at the end."""
    keep_last: int | None = None
    """Keep only the newest N checkpoints; ``None`` keeps all."""
    resume: bool = False
    """Continue from the latest complete checkpoint (a fresh start when there is none)."""
    evaluate: bool = True
    """Evaluate at the start of a fresh run and at the end (``eval_start`` / ``eval_end``)."""
    eval_every: int = 0
    """Also evaluate after every N completed steps (an ``eval/*`` row each: the learning curve); 0: never."""

    def __post_init__(self) -> None:
        for key, low in (("num_steps", 1), ("checkpoint_every", 0), ("eval_every", 0)):
            if getattr(self, key) < low:
                raise ValueError(f"'{key}' must be >= {low}, got {getattr(self, key)}")


def drive(
    replicas: Replicas,
    run: RunDir,
    config: DriveConfig,
    *,
    run_config: Mapping[str, Any],
    extra_metrics: Mapping[str, float] | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    on_resume: Callable[[int], None] | None = None,
    summary_extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``replicas`` to ``config.num_steps`` steps, writing the run folder (see the module docstring).

    Args:
        replicas / run / config: a :class:`Replicas`, the (locked) run folder, a :class:`DriveConfig`.
        run_config: the resolved config written to ``config.yaml`` (after a resume has loaded).
        extra_metrics: constant metrics added to every row (e.g. ``replay/spent_usd``).
        on_step: ``on_step(step, metrics)`` after each row is written; an exception stops the run (checkpoints
            already written stay valid).
        on_resume: called with the step a resume continues from, once its checkpoint has loaded.
        summary_extra: more keys for ``summary.json``.

    Returns:
        The summary (``summary.json``): ``steps``, ``start_step``, ``final_metrics``, ``channel_nonzero_steps``,
        ``eval_start`` (``None`` on resume), ``eval_end``, ``wall_time_s``, ``steps_per_s``, ``summary_extra``.
    """
    t0, start = time.perf_counter(), 0
    if config.resume:
        start = replicas.load_latest()
        run.truncate_metrics(start)
        if on_resume is not None:
            on_resume(start)
    run.write_config(dict(run_config))
    eval_start = _evaluation(replicas, run, start) if config.evaluate and start == 0 else None
    metrics: dict[str, float] = {}
    nonzero = dict.fromkeys(CHANNEL_KEYS, 0)
    for step in range(start, config.num_steps):
        metrics = {**replicas.train_step(step), **(extra_metrics or {})}
        if episodes := metrics.pop("episodes", None):  # agentic runs: the step's episodes, by turn
            run.log_episodes(step, episodes)
        run.log_metrics(step, metrics)
        if on_step is not None:
            on_step(step, metrics)
        for key in CHANNEL_KEYS:
            nonzero[key] += metrics.get(key) not in (None, 0.0)
        done = step + 1
        if (config.checkpoint_every and done % config.checkpoint_every == 0) or done == config.num_steps:
            replicas.save(done, config.keep_last)
        if config.evaluate and config.eval_every and done % config.eval_every == 0 and done < config.num_steps:
            _evaluation(replicas, run, done)
    eval_end = _evaluation(replicas, run, config.num_steps) if config.evaluate else None
    wall = time.perf_counter() - t0
    summary = {"steps": config.num_steps, "start_step": start, "final_metrics": metrics,
               "channel_nonzero_steps": {k: v for k, v in nonzero.items() if k in metrics},
               "eval_start": eval_start, "eval_end": eval_end, "wall_time_s": wall,
               "steps_per_s": (config.num_steps - start) / wall if wall > 0 else 0.0, **(summary_extra or {})}
    run.write_summary(summary)
    return summary


def _evaluation(replicas: Replicas, run: RunDir, step: int) -> dict[str, float]:
    """Evaluate and write the ``eval/*`` row for ``step``."""
    values = dict(replicas.evaluate())
    run.log_metrics(step, values)
    return values


def run_plain(config: StudentConfig, data: TrainingData, run_dir: str | Path, *, num_steps: int | None = None,
              checkpoint_every: int = 0, resume: bool = False,
              on_step: Callable[[int, dict[str, float]], None] | None = None, evaluate: bool = True,
              keep_last: int | None = None) -> dict[str, Any]:
    """Train one :class:`StudentTrainerCore` in this process: :func:`drive` over a :class:`LocalReplica`.

    Args:
        config / data: the student config (to ``config.yaml``) and its data (the pairs to ``pairs.jsonl``).
        run_dir: the run folder (created if missing; locked while the run lasts).
        num_steps: steps to reach (total, counting resumed ones); default ``config.num_steps``.
        checkpoint_every / keep_last / resume / evaluate / on_step: :class:`DriveConfig` and :func:`drive`;
            resuming with a config that differs from the stored ``config.yaml`` logs the keys that differ.

    Returns the summary of :func:`drive`; ``ValueError`` for ``num_steps < 1``, ``checkpoint_every < 0``, or a
    folder in use by another run.
    """
    from composer_replication.engine.student import StudentTrainerCore

    drive_config = DriveConfig(num_steps=config.num_steps if num_steps is None else num_steps,
                               checkpoint_every=checkpoint_every, keep_last=keep_last, resume=resume, evaluate=evaluate)
    run = RunDir(run_dir)
    try:
        new = to_dict(config)
        if resume and run.config_path.is_file():
            old = run.read_config()
            changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
            if changed:
                log.warning("resuming %s with a config that differs from its config.yaml in %s", run.path, changed)
        replica = LocalReplica(StudentTrainerCore(config, data=data), run)
        run.write_pairs(data.pairs)
        return drive(replica, run, drive_config, run_config=new, on_step=on_step)
    finally:
        run.close()

"""The one training driver: resume, step, metrics, checkpoints, evaluation and the summary.

``run_plain`` (one process) and the Monarch controller (``recipes.monarch.run``) both call
:func:`drive`; they differ only in the :class:`StepTrainer` they hand it: a :class:`LocalTrainer` over
a :class:`~composer_replication.engine.StudentTrainerCore`, or the recipe's mesh trainer whose every
method is an actor call (with its metrics folded across replicas by the reducer).

Order of work, the same for every caller:

1. on resume, restore the latest complete checkpoint, drop the metric lines after it, and only then
   rewrite ``config.yaml`` (a bad override never damages the run that is being resumed);
2. a fresh run evaluates first (``eval_start``, an ``eval/*`` row at its start step);
3. each step: ``train_step`` -> one ``metrics.jsonl`` row (plus ``extra_metrics``) -> ``on_step`` ->
   a checkpoint every ``checkpoint_every`` steps and after the last; an ``eval/*`` row every
   ``eval_every`` steps when asked (the learning curve);
4. the final evaluation (``eval_end``, an ``eval/*`` row), then ``summary.json``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from composer_replication.engine.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from composer_replication.engine.run_dir import RunDir

__all__ = ["StepTrainer", "LocalTrainer", "DriveConfig", "drive", "CHANNEL_KEYS"]

log = logging.getLogger(__name__)

CHANNEL_KEYS = ("loss/grpo", "loss/lm_ce", "loss/jsd", "loss/taid", "loss/entropy_opd", "loss/dpo", "loss/simpo")
"""Per-channel loss metrics counted in ``summary.json``'s ``channel_nonzero_steps``."""


class StepTrainer(Protocol):
    """What the driver drives: one training step, checkpoints and evaluation (a replica or a whole mesh)."""

    def train_step(self, step: int) -> dict[str, float]:
        """Run optimizer step ``step`` (0-based) and return its metrics."""
        ...

    def save(self, step: int, keep_last: int | None) -> None:
        """Checkpoint the state after ``step`` completed steps."""
        ...

    def load_latest(self) -> int:
        """Restore the latest complete checkpoint; the number of completed steps (0: none)."""
        ...

    def evaluate(self) -> dict[str, float]:
        """Evaluation metrics (``eval/*``)."""
        ...


class LocalTrainer:
    """A :class:`StepTrainer` over one ``StudentTrainerCore`` in this process; checkpoints in ``run_dir``."""

    def __init__(self, core: Any, run_dir: RunDir | Any) -> None:
        self.core = core
        self.run_dir = run_dir

    def train_step(self, step: int) -> dict[str, float]:
        """``core.train_step(step)``."""
        return self.core.train_step(step)

    def save(self, step: int, keep_last: int | None) -> None:
        """``save_checkpoint`` of the core's full state."""
        save_checkpoint(self.run_dir, step, self.core.state_dict(), keep_last=keep_last)

    def load_latest(self) -> int:
        """Load the latest complete checkpoint (damaged ones fall back, see ``engine.checkpoint``)."""
        ckpt = latest_checkpoint(self.run_dir)
        if ckpt is None:
            return 0
        self.core.load_state_dict(load_checkpoint(ckpt))
        log.info("resumed from %s at step %d", ckpt, self.core.step)
        return int(self.core.step)

    def evaluate(self) -> dict[str, float]:
        """``core.evaluate()``."""
        return self.core.evaluate()


@dataclass(kw_only=True)
class DriveConfig:
    """How long to train and what to keep."""

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
    """Also evaluate after every N completed steps (an ``eval/*`` row each, for the learning curve); 0: never."""

    def __post_init__(self) -> None:
        if self.num_steps < 1:
            raise ValueError(f"'num_steps' must be >= 1, got {self.num_steps}")
        if self.checkpoint_every < 0:
            raise ValueError(f"'checkpoint_every' must be >= 0, got {self.checkpoint_every}")
        if self.eval_every < 0:
            raise ValueError(f"'eval_every' must be >= 0, got {self.eval_every}")


def drive(
    trainer: StepTrainer,
    run: RunDir,
    config: DriveConfig,
    *,
    run_config: Mapping[str, Any],
    extra_metrics: Mapping[str, float] | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
    on_resume: Callable[[int], None] | None = None,
    summary_extra: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Train ``trainer`` to ``config.num_steps`` steps, writing the run folder; returns the summary.

    Args:
        trainer: a :class:`StepTrainer`.
        run: the (locked) run folder.
        config: steps, checkpoints, resume, evaluation.
        run_config: the resolved config written to ``config.yaml`` (after a resume has loaded).
        extra_metrics: constant metrics added to every row (e.g. ``replay/spent_usd``).
        on_step: called as ``on_step(step, metrics)`` after each row is written; an exception stops the run
            (checkpoints already written stay valid).
        on_resume: called with the step a resume continues from (after its checkpoint has loaded).
        summary_extra: more keys for ``summary.json``.

    Returns:
        ``steps``, ``start_step``, ``final_metrics``, ``channel_nonzero_steps``, ``eval_start``, ``eval_end``
        (``None`` when not evaluated; ``eval_start`` also ``None`` on resume), ``wall_time_s``,
        ``steps_per_s``, plus ``summary_extra``.
    """
    t0 = time.perf_counter()
    start = 0
    if config.resume:
        start = trainer.load_latest()
        run.truncate_metrics(start)
        if on_resume is not None:
            on_resume(start)
    run.write_config(dict(run_config))
    eval_start = _evaluation(trainer, run, start) if config.evaluate and start == 0 else None
    metrics: dict[str, float] = {}
    nonzero = dict.fromkeys(CHANNEL_KEYS, 0)
    for step in range(start, config.num_steps):
        metrics = {**trainer.train_step(step), **(extra_metrics or {})}
        run.log_metrics(step, metrics)
        if on_step is not None:
            on_step(step, metrics)
        for key in CHANNEL_KEYS:
            nonzero[key] += metrics.get(key) not in (None, 0.0)
        done = step + 1
        if (config.checkpoint_every and done % config.checkpoint_every == 0) or done == config.num_steps:
            trainer.save(done, config.keep_last)
        if config.evaluate and config.eval_every and done % config.eval_every == 0 and done < config.num_steps:
            _evaluation(trainer, run, done)
    eval_end = _evaluation(trainer, run, config.num_steps) if config.evaluate else None
    wall = time.perf_counter() - t0
    summary: dict[str, Any] = {
        "steps": config.num_steps,
        "start_step": start,
        "final_metrics": metrics,
        "channel_nonzero_steps": {k: v for k, v in nonzero.items() if k in metrics},
        "eval_start": eval_start,
        "eval_end": eval_end,
        "wall_time_s": wall,
        "steps_per_s": (config.num_steps - start) / wall if wall > 0 else 0.0,
        **(summary_extra or {}),
    }
    run.write_summary(summary)
    return summary


def _evaluation(trainer: StepTrainer, run: RunDir, step: int) -> dict[str, float]:
    """Evaluate and write the ``eval/*`` row for ``step``."""
    values = dict(trainer.evaluate())
    run.log_metrics(step, values)
    return values

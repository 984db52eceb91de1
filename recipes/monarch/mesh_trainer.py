"""The Monarch side of the one training driver: a ``StepTrainer`` whose every method is an actor call.

:func:`composer_replication.engine.drive` runs the loop (resume, steps, metrics, checkpoints,
evaluation, summary) exactly as for ``run_plain``; :class:`MeshTrainer` turns each of its calls into a
call on the ``StudentTrainer`` replicas, with a timeout, and folds the replicas' metrics with the
``Reducer``.
"""

from __future__ import annotations

from typing import Any

from meshes import wait

__all__ = ["MeshTrainer"]


class MeshTrainer:
    """``StepTrainer`` over a ``StudentTrainer`` mesh (``train_step`` / ``save`` / ``load_latest`` / ``evaluate``).

    Args:
        trainer: the spawned ``StudentTrainer`` actor mesh (``setup`` already called).
        reducer: the ``Reducer`` actor mesh.
        run_dir: the run folder (each replica writes its checkpoints there, see ``meshes.trainer.replica_dir``).
        call_timeout_s: timeout of every call.
    """

    def __init__(self, trainer: Any, reducer: Any, run_dir: str, *, call_timeout_s: float) -> None:
        self.trainer, self.reducer, self.run_dir, self.timeout_s = trainer, reducer, run_dir, call_timeout_s

    def train_step(self, step: int) -> dict[str, float]:
        """One step on every replica; metrics folded by ``Reducer.aggregate_metrics``."""
        per_rank = wait(self.trainer.train_step.call(step), actor="trainer", timeout_s=self.timeout_s,
                        what=f"train_step({step})").values()
        return wait(self.reducer.aggregate_metrics.call_one(list(per_rank)), actor="reducer",
                    timeout_s=self.timeout_s, what="aggregate_metrics")

    def save(self, step: int, keep_last: int | None) -> None:
        """Every replica checkpoints its full state."""
        wait(self.trainer.save.call(self.run_dir, step, keep_last), actor="trainer", timeout_s=self.timeout_s,
             what=f"save({step})")

    def load_latest(self) -> int:
        """Every replica restores its latest complete checkpoint; the run continues from the smallest step."""
        return min(wait(self.trainer.load_latest.call(self.run_dir), actor="trainer", timeout_s=self.timeout_s,
                        what="load_latest").values())

    def evaluate(self) -> dict[str, float]:
        """Evaluation on the replicas, folded like the step metrics."""
        per_rank = wait(self.trainer.evaluate.call(), actor="trainer", timeout_s=self.timeout_s,
                        what="evaluate").values()
        return wait(self.reducer.aggregate_metrics.call_one(list(per_rank)), actor="reducer",
                    timeout_s=self.timeout_s, what="aggregate_metrics")

"""The Monarch side of the one training driver: a ``StepTrainer`` whose every method is an actor call.

:func:`composer_replication.engine.drive` runs the loop (resume, steps, metrics, checkpoints,
evaluation, summary) exactly as for ``run_plain``; :class:`MeshTrainer` turns each of its calls into a
call on the ``StudentTrainer`` replicas, with a timeout, and folds the replicas' metrics with the
``Reducer``.
"""

from __future__ import annotations

from typing import Any

from meshes import wait

__all__ = ["MeshTrainer", "DilocoMeshTrainer"]


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


class DilocoMeshTrainer:
    """``StepTrainer`` over DiLoCo replicas (a :class:`~meshes.replicas.ReplicaSet`): one model, R replicas.

    Each ``train_step`` runs the step on every live replica at once (the outer sync happens inside the
    round's last step, between the replicas); the replicas' metrics are folded by the ``Reducer``, and a
    step that ends with a sync adds ``diloco/outer_step``, ``diloco/participants`` and, per live replica
    ``i``, ``diloco/param_sha256/<i>`` (its parameters' SHA-256 after the sync). Every row also has
    ``diloco/live_replicas`` and ``diloco/restarts``.

    Args:
        replicas: the started ``ReplicaSet``.
        reducer: the ``Reducer`` actor mesh.
        run_dir: the run folder (replica ``i`` checkpoints under ``meshes.trainer.replica_dir``).
        call_timeout_s: timeout of every call.
    """

    def __init__(self, replicas: Any, reducer: Any, run_dir: str, *, call_timeout_s: float) -> None:
        self.replicas, self.reducer, self.run_dir, self.timeout_s = replicas, reducer, run_dir, call_timeout_s
        self.last_digests: dict[int, str] = {}

    def train_step(self, step: int) -> dict[str, Any]:
        """One inner step on every live replica (joining replacements first); folded metrics plus sync keys."""
        per = self.replicas.step(step)
        digests = {i: m.pop("diloco/param_sha256") for i, m in per.items() if "diloco/param_sha256" in m}
        synced = [m for m in per.values() if m.get("diloco/synced")]
        out = wait(
            self.reducer.aggregate_metrics.call_one(list(per.values())),
            actor="reducer",
            timeout_s=self.timeout_s,
            what="aggregate_metrics",
        )
        for key in ("diloco/outer_step", "diloco/participants", "diloco/committed", "diloco/fragment"):
            out.pop(key, None)
            if synced:
                out[key] = max(float(m[key]) for m in synced)
        for i, digest in sorted(digests.items()):
            out[f"diloco/param_sha256/{i}"] = digest
        if digests:
            self.last_digests = dict(sorted(digests.items()))
        out["diloco/live_replicas"] = float(len(per))
        out["diloco/restarts"] = float(sum(self.replicas.restarts.values()))
        return out

    def save(self, step: int, keep_last: int | None) -> None:
        """Every live replica checkpoints its full state, DiLoCo state included."""
        self.replicas.call_all("save", self.run_dir, step, keep_last, what=f"save({step})", live_only=True)

    def load_latest(self) -> int:
        """Each replica loads its latest checkpoint of at most the newest step any replica has; the run
        continues from that step (a replica left behind heals from a peer at the first sync)."""
        latest = self.replicas.call_all("latest_step", self.run_dir, what="latest_step")
        start = max(latest.values(), default=0)
        loaded = self.replicas.call_all("load_latest", self.run_dir, start, what="load_latest")
        return max(loaded.values(), default=0)

    def evaluate(self) -> dict[str, float]:
        """Evaluation on one replica (after a sync they hold the same parameters): the lowest live slot
        (before the first step, when none has joined yet: the lowest set-up one)."""
        index = min(self.replicas.live or self.replicas.replicas())
        return self.replicas.call(index, "evaluate", what="evaluate")

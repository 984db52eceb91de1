"""The ``StudentTrainer`` actor: one student replica (a ``StudentTrainerCore``) per process of the trainer mesh.

The actor is a thin shell: ``__init__`` only reads the global rank (cheap, cannot fail), the heavy
``setup`` endpoint loads the model, the frozen reference, AdamW and the schedules, so that a bad
model name or an out-of-memory reaches the caller as an error instead of a dead spawn. Every other
endpoint forwards to one method of :class:`~composer_replication.engine.StudentTrainerCore` or to
the checkpoint functions. Errors are re-raised naming ``trainer rank <r>`` (:func:`~meshes.supervision.names_rank`).

Checkpoints: rank 0 writes ``<run>/checkpoints/``; rank ``r > 0`` writes ``<run>/replicas/rank_<r>/checkpoints/``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from monarch.actor import Actor, current_rank, endpoint

from meshes.supervision import FaultSpec, names_rank

__all__ = ["StudentTrainer", "replica_dir"]


def replica_dir(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where replica ``rank`` keeps its checkpoints: the run folder for rank 0, else ``replicas/rank_<r>``."""
    return Path(run_dir) if rank == 0 else Path(run_dir) / "replicas" / f"rank_{rank}"


class StudentTrainer(Actor):
    """One student replica. Spawn on a ``{"replica": N}`` proc mesh; call ``setup`` first.

    Endpoints (all synchronous, each a thin wrapper):
        warmup() -> pid; setup(config, states, pairs, ...) -> info; train_step(step) -> metrics; evaluate() -> metrics;
        save(run_dir, step) -> path; load_latest(run_dir) -> step; get_weights() / set_weights(w).
    """

    def __init__(self) -> None:
        point = current_rank()
        self.rank = int(point.rank)  # global rank: read here, not in endpoints (a slice renumbers ranks)
        self.core: Any = None
        self.fault: FaultSpec | None = None

    @endpoint
    @names_rank("trainer")
    def warmup(self) -> int:
        """Import torch, transformers and the training engine now (5-10 s per process), so that a later
        ``setup`` only loads the model; call it right after spawning, without waiting. Returns the PID."""
        import composer_replication.engine  # noqa: F401
        import composer_replication.models  # noqa: F401

        return os.getpid()

    @endpoint
    @names_rank("trainer")
    def setup(
        self,
        config: Any,
        *,
        states: list[dict[str, Any]],
        pairs: list[Any],
        world_size: int,
        tasks_path: str | None = None,
        num_eval_prompts: int = 0,
        eval_states: list[dict[str, Any]] | None = None,
        eval_max_new_tokens: int | None = None,
        inject_fault: str | None = None,
        threads: int = 0,
    ) -> dict[str, Any]:
        """Build the training data and the ``StudentTrainerCore`` (model, reference, optimizer).

        Args:
            config: a ``StudentConfig``.
            states: ``TraceState`` dicts (next-action prompts); pairs: channel-3 pairs.
            world_size: number of trainer replicas. tasks_path: Python tasks JSONL for ``python_tasks``/``mixed``.
            num_eval_prompts: prompts held out for ``evaluate``. inject_fault: see :class:`FaultSpec`.
            eval_states, eval_max_new_tokens: held-out sessions' states and the answer length of ``evaluate``
                (``build_training_data``).
            threads: ``torch.set_num_threads`` for this process (0 leaves the default).

        Returns:
            ``{"rank", "pid", "device", "n_prompts", "n_pairs", "n_params"}``.
        """
        import torch

        from composer_replication.engine import StudentTrainerCore, build_training_data

        if threads > 0:
            torch.set_num_threads(threads)
        tasks = None
        if tasks_path:
            from composer_replication.rollout.python_tasks import load_bundled_tasks

            tasks = load_bundled_tasks(tasks_path)
        data = build_training_data(config.rollout.environment, states=states, pairs=pairs, tasks=tasks,
                                   num_eval_prompts=num_eval_prompts, seed=config.seed, eval_states=eval_states,
                                   eval_max_new_tokens=eval_max_new_tokens)
        self.core = StudentTrainerCore(config, data=data, rank=self.rank, world_size=world_size,
                                       local_rank=self.rank)
        self.fault = FaultSpec(inject_fault) if inject_fault else None
        return {
            "rank": self.rank, "pid": os.getpid(), "device": str(self.core.device),
            "n_prompts": len(data.prompts), "n_pairs": len(data.pairs),
            "n_params": sum(p.numel() for p in self.core.model.parameters()),
        }

    def _core(self) -> Any:
        if self.core is None:
            raise RuntimeError("call setup() before any other endpoint")
        return self.core

    @endpoint
    @names_rank("trainer")
    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step (``StudentTrainerCore.train_step``); returns its metrics."""
        if self.fault is not None:
            self.fault.maybe_fire("trainer", self.rank, step)
        return self._core().train_step(step)

    @endpoint
    @names_rank("trainer")
    def evaluate(self) -> dict[str, float]:
        """Greedy evaluation on the held-out (or first) prompts (``StudentTrainerCore.evaluate``)."""
        return self._core().evaluate()

    @endpoint
    @names_rank("trainer")
    def save(self, run_dir: str, step: int, keep_last: int | None = None) -> str:
        """Save this replica's full state as checkpoint ``step`` (see :func:`replica_dir`); returns its folder."""
        from composer_replication.engine import save_checkpoint

        return str(save_checkpoint(replica_dir(run_dir, self.rank), step, self._core().state_dict(),
                                   keep_last=keep_last))

    @endpoint
    @names_rank("trainer")
    def load_latest(self, run_dir: str) -> int:
        """Restore this replica's latest complete checkpoint; returns the step to continue from (0: none)."""
        from composer_replication.engine import latest_checkpoint, load_checkpoint

        ckpt = latest_checkpoint(replica_dir(run_dir, self.rank))
        if ckpt is None:
            return 0
        self._core().load_state_dict(load_checkpoint(ckpt))
        return int(self._core().step)

    @endpoint
    @names_rank("trainer")
    def get_weights(self) -> dict[str, Any]:
        """The model weights cloned to CPU (``{name: tensor}``; tied tensors shared)."""
        return self._core().get_weights()

    @endpoint
    @names_rank("trainer")
    def set_weights(self, weights: dict[str, Any]) -> None:
        """Load weights in place (the optimizer state is kept)."""
        self._core().set_weights(weights)

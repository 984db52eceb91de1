"""The ``StudentTrainer`` actor: one student replica (a ``StudentTrainerCore``) per process of the trainer mesh.

The actor is a thin shell: ``__init__`` only reads the global rank (cheap, cannot fail), the heavy
``setup`` endpoint loads the model, the frozen reference, AdamW and the schedules, so that a bad
model name or an out-of-memory reaches the caller as an error instead of a dead spawn. Every other
endpoint forwards to one method of :class:`~composer_replication.engine.StudentTrainerCore` or to
the checkpoint functions. Errors are re-raised naming ``trainer rank <r>`` (:func:`~meshes.supervision.names_rank`).

Checkpoints: rank 0 writes ``<run>/checkpoints/``; rank ``r > 0`` writes ``<run>/replicas/rank_<r>/checkpoints/``.

DiLoCo (``docs/diloco.md``): each replica runs in its own 1-proc mesh (``setup(rank=r, shard=True)`` trains on
its disjoint data shard); ``join_diloco`` builds its torchft manager and DiLoCo
(:class:`~composer_replication.diloco.replica.DilocoReplica`), after which ``train_step`` runs the outer sync
inside the round's last inner step, ``save`` adds the DiLoCo state and ``leave_diloco`` stops the manager.
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
        self.diloco: Any = None  # DilocoReplica after join_diloco
        self.pending_diloco: dict[str, Any] | None = None  # DiLoCo state of a loaded checkpoint, applied at join

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
        rank: int | None = None,
        shard: bool = False,
        local_rank: int | None = None,
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
            rank: this replica's rank when each replica has its own 1-proc mesh (default: the mesh rank).
            shard: train on the disjoint shard ``rank::world_size`` of the data (DiLoCo replicas).
            local_rank: this replica's index on its host (``device: auto`` picks ``cuda:<local_rank>``;
                default: ``rank``).

        Returns:
            ``{"rank", "pid", "device", "n_prompts", "n_pairs", "n_params"}``.
        """
        import torch

        from composer_replication.engine import StudentTrainerCore, build_training_data

        if rank is not None:
            self.rank = int(rank)
        if threads > 0:
            torch.set_num_threads(threads)
        tasks = None
        if tasks_path:
            from composer_replication.rollout.python_tasks import load_bundled_tasks

            tasks = load_bundled_tasks(tasks_path)
        data = build_training_data(config.rollout.environment, states=states, pairs=pairs, tasks=tasks,
                                   num_eval_prompts=num_eval_prompts, seed=config.seed, eval_states=eval_states,
                                   eval_max_new_tokens=eval_max_new_tokens)
        if shard:
            from composer_replication.diloco.replica import shard_training_data

            data = shard_training_data(data, self.rank, world_size, keep_eval=config.rollout.prompts_per_step)
        self.core = StudentTrainerCore(config, data=data, rank=self.rank, world_size=world_size,
                                       local_rank=self.rank if local_rank is None else local_rank)
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
        if self.diloco is not None:
            return self.diloco.train_step(step)
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

        state = self._core().state_dict()
        if self.diloco is not None:
            state["diloco"] = self.diloco.state_dict()
        return str(save_checkpoint(replica_dir(run_dir, self.rank), step, state, keep_last=keep_last))

    @endpoint
    @names_rank("trainer")
    def load_latest(self, run_dir: str, max_step: int | None = None) -> int:
        """Restore this replica's latest complete checkpoint (of at most ``max_step``); returns the step to
        continue from (0: none). A checkpoint's DiLoCo state is applied by ``join_diloco``."""
        from composer_replication.engine import latest_checkpoint, load_checkpoint

        ckpt = latest_checkpoint(replica_dir(run_dir, self.rank), max_step=max_step)
        if ckpt is None:
            return 0
        state = load_checkpoint(ckpt)
        self._core().load_state_dict(state)
        self.pending_diloco = state.get("diloco")
        return int(self._core().step)

    @endpoint
    @names_rank("trainer")
    def latest_step(self, run_dir: str) -> int:
        """The step of this replica's latest complete checkpoint (0: none), without loading it."""
        from composer_replication.engine import latest_checkpoint
        from composer_replication.engine.checkpoint import checkpoint_step

        ckpt = latest_checkpoint(replica_dir(run_dir, self.rank))
        return 0 if ckpt is None else checkpoint_step(ckpt)

    @endpoint
    @names_rank("trainer")
    def join_diloco(self, config: Any, *, lighthouse_addr: str, host: str = "127.0.0.1", local_step: int = 0) -> str:
        """Build this replica's torchft manager and DiLoCo (``DilocoReplica``; ``config`` a ``DilocoConfig``),
        ``local_step`` inner steps into the current round; applies a loaded checkpoint's DiLoCo state.
        Returns the parameter digest."""
        from composer_replication.diloco.replica import DilocoReplica, param_sha256

        if self.diloco is not None:
            raise RuntimeError("join_diloco called twice on one replica; call leave_diloco first")
        self.diloco = DilocoReplica(self._core(), config, replica_id=f"replica_{self.rank}",
                                    lighthouse_addr=lighthouse_addr, host=host, local_step=local_step)
        if self.pending_diloco is not None:
            self.diloco.load_state_dict(self.pending_diloco)
            self.pending_diloco = None
        return param_sha256(self._core().model)

    @endpoint
    @names_rank("trainer")
    def leave_diloco(self) -> None:
        """Stop this replica's manager (its heartbeat ends: no quorum waits for it) and unhook DiLoCo."""
        if self.diloco is not None:
            self.diloco.shutdown()
            self.diloco = None

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

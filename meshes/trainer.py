"""The ``StudentTrainer`` actor: one student replica (a ``StudentTrainerCore``) per process of the trainer mesh.

A thin shell: ``__init__`` only reads the global rank; the heavy ``setup`` endpoint loads the model, the reference
and the optimizer, so that a bad model name or an out-of-memory reaches the caller as an error, not a dead spawn.
Every other endpoint forwards to the core or to the checkpoint functions; errors name ``trainer rank <r>``
(``names_rank``). Checkpoints go to :func:`replica_dir`. DiLoCo (``docs/diloco.md``): each replica has its own
1-proc mesh (``setup(rank=r, shard=True)``: its data shard); ``join_diloco`` builds its torchft manager and DiLoCo
(``diloco.replica.DilocoReplica``): ``train_step`` then runs the outer sync in the round's last inner step, ``save``
adds the DiLoCo state, ``leave_diloco`` stops the manager.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from monarch.actor import Actor, current_rank

import composer_replication.engine.checkpoint as checkpoints
from composer_replication.engine import StudentTrainerCore, build_training_data
from meshes.supervision import FaultSpec, rank_endpoint

endpoint = rank_endpoint("trainer")  # errors name "trainer rank <r>"

__all__ = ["StudentTrainer", "replica_dir"]


def replica_dir(run_dir: str | os.PathLike[str], rank: int) -> Path:
    """Where replica ``rank`` keeps its checkpoints: the run folder for rank 0, else ``replicas/rank_<r>``."""
    return Path(run_dir) if rank == 0 else Path(run_dir) / "replicas" / f"rank_{rank}"


class StudentTrainer(Actor):
    """One student replica. Spawn on a ``{"replica": N}`` proc mesh; call ``setup`` first (endpoints are synchronous)."""

    def __init__(self) -> None:
        self.rank = int(current_rank().rank)  # global rank: read here, not in endpoints (a slice renumbers ranks)
        self.core: Any = None
        self.fault: FaultSpec | None = None
        self.diloco: Any = None  # DilocoReplica after join_diloco
        self.pending_diloco: dict[str, Any] | None = None  # a loaded checkpoint's DiLoCo state, applied at join

    @endpoint
    def warmup(self) -> int:
        """Import transformers now (seconds per process), so that a later ``setup`` only loads the model; call it
        right after spawning, without waiting. Returns the PID."""
        import composer_replication.models  # noqa: F401

        return os.getpid()

    @endpoint
    def setup(self, config: Any, *, states: list[dict[str, Any]], pairs: list[Any], world_size: int,
              tasks_path: str | None = None, num_eval_prompts: int = 0, eval_states: list[dict[str, Any]] | None = None,
              eval_max_new_tokens: int | None = None, inject_fault: str | None = None, threads: int = 0,
              rank: int | None = None, shard: bool = False, local_rank: int | None = None,
              tasks: list[Any] | None = None, eval_tasks: list[Any] | None = None) -> dict[str, Any]:
        """Build the training data (``engine.build_training_data``) and the ``StudentTrainerCore``.

        Args:
            config / states / pairs: a ``StudentConfig``, ``TraceState`` dicts and channel-3 pairs.
            world_size: trainer replicas. tasks_path: Python tasks JSONL (``python_tasks``/``mixed``).
            num_eval_prompts / eval_states / eval_max_new_tokens: the held-out split and the answer length.
            inject_fault: see :class:`FaultSpec`. threads: ``torch.set_num_threads`` (0: the default).
            rank: this replica's rank when it has its own 1-proc mesh (default: the mesh rank); shard: train on
                the shard ``rank::world_size`` of the data (DiLoCo); local_rank: its index on its host
                (``device: auto`` picks ``cuda:<local_rank>``; default: ``rank``).
            tasks / eval_tasks: task records loaded by the caller (``agentic``: ``rollout.agent.Task``, the held-out
                ones in ``eval_tasks``; ``python_tasks``: ``PythonTask``), instead of ``tasks_path``.

        Returns:
            ``{"rank", "pid", "device", "n_prompts", "n_pairs", "n_params"}``.
        """
        from composer_replication.rollout.python_tasks import load_bundled_tasks

        self.rank = self.rank if rank is None else int(rank)
        if threads > 0:
            torch.set_num_threads(threads)
        if tasks is None and tasks_path:
            tasks = load_bundled_tasks(tasks_path)
        data = build_training_data(config.rollout.environment, states=states, pairs=pairs, tasks=tasks,
                                   num_eval_prompts=num_eval_prompts, seed=config.seed, eval_states=eval_states,
                                   eval_max_new_tokens=eval_max_new_tokens, eval_tasks=eval_tasks)
        if shard:
            from composer_replication.diloco.replica import shard_training_data

            data = shard_training_data(data, self.rank, world_size, keep_eval=config.rollout.prompts_per_step)
        self.core = StudentTrainerCore(config, data=data, rank=self.rank, world_size=world_size,
                                       local_rank=self.rank if local_rank is None else local_rank)
        self.fault = FaultSpec(inject_fault) if inject_fault else None
        return {"rank": self.rank, "pid": os.getpid(), "device": str(self.core.device), "n_prompts": len(data.prompts),
                "n_pairs": len(data.pairs), "n_params": sum(p.numel() for p in self.core.model.parameters())}

    def _core(self) -> Any:
        if self.core is None:
            raise RuntimeError("call setup() before any other endpoint")
        return self.core

    @endpoint
    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step (``StudentTrainerCore.train_step``); returns its metrics."""
        if self.fault is not None:
            self.fault.maybe_fire("trainer", self.rank, step)
        if self.diloco is not None:
            return self.diloco.train_step(step)
        return self._core().train_step(step)

    @endpoint
    def evaluate(self) -> dict[str, float]:
        """Greedy evaluation on the held-out (or first) prompts (``StudentTrainerCore.evaluate``)."""
        return self._core().evaluate()

    @endpoint
    def save(self, run_dir: str, step: int, keep_last: int | None = None) -> str:
        """Save this replica's full state as checkpoint ``step`` (see :func:`replica_dir`); returns its folder."""
        state = self._core().state_dict()
        if self.diloco is not None:
            state["diloco"] = self.diloco.state_dict()
        return str(checkpoints.save_checkpoint(replica_dir(run_dir, self.rank), step, state, keep_last=keep_last))

    @endpoint
    def load_latest(self, run_dir: str, max_step: int | None = None) -> int:
        """Restore this replica's latest complete checkpoint (of at most ``max_step``; its DiLoCo state is applied by
        ``join_diloco``); the step to continue from (0: none)."""
        if (found := checkpoints.load_latest_checkpoint(replica_dir(run_dir, self.rank), max_step=max_step)) is None:
            return 0
        self._core().load_state_dict(state := found[1])
        self.pending_diloco = state.get("diloco")
        return int(self._core().step)

    @endpoint
    def latest_step(self, run_dir: str) -> int:
        """The step of this replica's latest complete checkpoint (0: none), without loading it."""
        ckpt = checkpoints.latest_checkpoint(replica_dir(run_dir, self.rank))
        return 0 if ckpt is None else checkpoints.checkpoint_step(ckpt)

    @endpoint
    def join_diloco(self, config: Any, *, lighthouse_addr: str, host: str = "127.0.0.1", local_step: int = 0) -> str:
        """Build this replica's torchft manager and DiLoCo (``config``: a ``DilocoConfig``), ``local_step`` inner steps
        into the round, with a loaded checkpoint's DiLoCo state; returns the parameter digest."""
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
    def leave_diloco(self) -> None:
        """Stop this replica's manager (its heartbeat ends: no quorum waits for it) and unhook DiLoCo."""
        if self.diloco is not None:
            self.diloco.shutdown()
        self.diloco = None

    @endpoint
    def get_weights(self) -> dict[str, Any]:
        """The model weights cloned to CPU (``{name: tensor}``; tied tensors shared)."""
        return self._core().get_weights()

    @endpoint
    def set_weights(self, weights: dict[str, Any]) -> None:
        """Load weights in place (the optimizer state is kept)."""
        self._core().set_weights(weights)

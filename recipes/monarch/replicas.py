"""The recipe's DiLoCo side: the lighthouse, the replica set and its step trainer, built from the config.

Called by ``recipes.monarch.run`` when ``diloco.replicas > 1``; the training loop stays the one driver
(``engine.drive``) over a :class:`~recipes.monarch.mesh_trainer.DilocoMeshTrainer`.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from composer_replication.diloco.replica import Lighthouse
from meshes.hosts import ReplicaHosts, is_loopback
from meshes.replicas import ReplicaSet
from recipes.monarch.config import RecipeConfig
from recipes.monarch.mesh_trainer import DilocoMeshReplicas as DilocoMeshTrainer

__all__ = ["DilocoRun", "start_diloco", "lighthouse_host"]


def lighthouse_host(hosts: ReplicaHosts) -> str:
    """Where replicas reach the controller's lighthouse: loopback on one node or loopback workers, else the FQDN."""
    return "127.0.0.1" if all(is_loopback(w) for w in [*hosts.workers, *hosts.spares]) else socket.getfqdn()


@dataclass
class DilocoRun:
    """What the controller holds for a DiLoCo run (stop it in ``finally:``)."""

    lighthouse: Lighthouse
    replicas: ReplicaSet
    trainer: DilocoMeshTrainer
    setup: list[dict[str, Any]]

    def summary(self) -> dict[str, Any]:
        """``replica_param_sha256`` (``{replica: digest}`` after the last sync), ``restarts``, ``diloco_events``
        and, on named nodes (SLURM), ``replica_nodes`` (``{replica: node}`` at the end)."""
        events = [
            {k: v for k, v in ev.items() if k not in ("time", "healed_time")} for ev in self.replicas.events
        ]
        hosts = self.replicas.hosts
        nodes = {str(i): hosts.nodes.get(hosts.where(i)) for i in self.replicas.restarts} if hosts.nodes else {}
        return {
            **({"replica_nodes": nodes} if nodes else {}),
            "replica_param_sha256": {str(i): d for i, d in self.trainer.last_digests.items()},
            "restarts": {str(i): n for i, n in self.replicas.restarts.items()},
            "dropped_replicas": sorted(self.replicas.dropped),
            "diloco_events": events,
        }

    def stop(self, timeout_s: float) -> list[str]:
        """Stop every replica's manager and procs, then the lighthouse."""
        errors = self.replicas.stop(timeout_s=timeout_s)
        self.lighthouse.shutdown()
        return errors


def start_diloco(
    cfg: RecipeConfig,
    meshes: Any,
    reducer: Any,
    *,
    run_dir: str,
    states: list[dict[str, Any]],
    pairs: list[Any],
    eval_states: list[dict[str, Any]] | None,
    on_event: Any,
    tasks: tuple[list[Any], list[Any]] = ([], []),
) -> DilocoRun:
    """Start the lighthouse, then spawn and set up ``diloco.replicas`` replicas, each on its own proc mesh
    (``tasks``: the ``agentic`` (train, held-out) tasks, ``recipes.monarch.data.load_agentic_tasks``).

    Raises:
        ActorFailure: a replica's setup failed or timed out.
    """
    m, d = cfg.mesh, cfg.diloco
    lighthouse = Lighthouse(d, host=lighthouse_host(meshes.replica_hosts))

    def setup_args(index: int) -> tuple[tuple, dict]:
        return (cfg.student,), dict(
            states=states,
            pairs=pairs,
            world_size=d.replicas,
            tasks_path=None if tasks[0] else cfg.data.tasks,
            tasks=tasks[0] or None,
            eval_tasks=tasks[1] or None,
            num_eval_prompts=cfg.data.num_eval_prompts,
            eval_states=eval_states,
            eval_max_new_tokens=cfg.data.eval_max_new_tokens,
            inject_fault=m.inject_fault,
            threads=m.threads_per_proc,
            rank=index,
            shard=True,
            local_rank=meshes.replica_hosts.local_index(index),
        )

    replicas = ReplicaSet(
        meshes.replica_hosts,
        d,
        lighthouse_addr=lighthouse.address,
        setup_args=setup_args,
        setup_timeout_s=m.setup_timeout_s,
        call_timeout_s=m.call_timeout_s,
        on_event=on_event,
    )
    try:
        infos = replicas.start()
    except BaseException:
        replicas.stop(timeout_s=10.0)
        lighthouse.shutdown()
        raise
    trainer = DilocoMeshTrainer(replicas, reducer, run_dir, call_timeout_s=m.call_timeout_s)
    return DilocoRun(lighthouse=lighthouse, replicas=replicas, trainer=trainer, setup=infos)

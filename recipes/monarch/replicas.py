"""The Monarch side of the one training driver (``engine.drive``, as for ``run_plain``): ``engine.driver.Replicas``
whose every method calls the ``StudentTrainer`` replicas with a timeout, their metrics folded by the ``Reducer``.

:class:`MeshReplicas` drives one trainer mesh; :class:`DilocoMeshReplicas` (built by :func:`start_diloco` when
``diloco.replicas > 1``) drives the DiLoCo replicas of a :class:`~meshes.replicas.ReplicaSet`, and owns the lighthouse.
"""

from __future__ import annotations

import socket
from typing import Any

from composer_replication.diloco.replica import Lighthouse
from meshes import wait
from meshes.hosts import ReplicaHosts, is_loopback
from meshes.replicas import ReplicaSet
from recipes.monarch.config import RecipeConfig

__all__ = ["MeshReplicas", "DilocoMeshReplicas", "start_diloco", "lighthouse_host"]


def _fold(reducer: Any, per_rank: list[dict[str, Any]], timeout_s: float) -> dict[str, Any]:
    """The replicas' metrics folded by ``Reducer.aggregate_metrics``."""
    return wait(reducer.aggregate_metrics.call_one(per_rank), actor="reducer", timeout_s=timeout_s,
                what="aggregate_metrics")


class MeshReplicas:
    """``Replicas`` over a ``StudentTrainer`` mesh (``setup`` already called) and the ``Reducer`` mesh; every
    replica checkpoints under ``run_dir`` (``meshes.trainer.replica_dir``); every call times out after
    ``call_timeout_s``."""

    def __init__(self, trainer: Any, reducer: Any, run_dir: str, *, call_timeout_s: float) -> None:
        self.trainer, self.reducer, self.run_dir, self.timeout_s = trainer, reducer, run_dir, call_timeout_s

    def _call(self, name: str, *args: Any, what: str) -> list[Any]:
        """``name(*args)`` on every replica (with the timeout); their answers in rank order."""
        return list(wait(getattr(self.trainer, name).call(*args), actor="trainer", timeout_s=self.timeout_s,
                         what=what).values())

    def train_step(self, step: int) -> dict[str, float]:
        """One step on every replica; their metrics folded."""
        return _fold(self.reducer, self._call("train_step", step, what=f"train_step({step})"), self.timeout_s)

    def save(self, step: int, keep_last: int | None) -> None:
        """Every replica checkpoints its full state."""
        self._call("save", self.run_dir, step, keep_last, what=f"save({step})")

    def load_latest(self) -> int:
        """Every replica restores its latest complete checkpoint; the run continues from the smallest step."""
        return min(self._call("load_latest", self.run_dir, what="load_latest"))

    def evaluate(self) -> dict[str, float]:
        """Evaluation on the replicas, folded like the step metrics."""
        return _fold(self.reducer, self._call("evaluate", what="evaluate"), self.timeout_s)


class DilocoMeshReplicas:
    """``Replicas`` over DiLoCo replicas (``replicas``: a started :class:`~meshes.replicas.ReplicaSet`; ``lighthouse``:
    its torchft lighthouse; ``setup``: the replicas' ``setup`` infos; the other arguments as :class:`MeshReplicas`):
    one model, R replicas. ``train_step`` runs the step on every live replica at once (the outer sync happens inside
    the round's last step); a step that ends with a sync adds ``diloco/outer_step``, ``diloco/participants`` and, per
    live replica ``i``, ``diloco/param_sha256/<i>``; every row has ``diloco/live_replicas`` and ``diloco/restarts``.
    What the controller holds for a DiLoCo run: stop it in ``finally:``."""

    def __init__(self, replicas: ReplicaSet, reducer: Any, run_dir: str, *, call_timeout_s: float,
                 lighthouse: Lighthouse, setup: list[dict[str, Any]]) -> None:
        self.replicas, self.reducer, self.run_dir, self.timeout_s = replicas, reducer, run_dir, call_timeout_s
        self.lighthouse, self.setup = lighthouse, setup
        self.last_digests: dict[int, str] = {}

    def train_step(self, step: int) -> dict[str, Any]:
        """One inner step on every live replica (joining replacements first); folded metrics plus sync keys."""
        per = self.replicas.step(step)
        digests = {i: m.pop("diloco/param_sha256") for i, m in per.items() if "diloco/param_sha256" in m}
        out = _fold(self.reducer, list(per.values()), self.timeout_s)  # sync keys: the synced replicas' largest
        self.last_digests = dict(sorted(digests.items())) or self.last_digests
        out.update({f"diloco/param_sha256/{i}": d for i, d in sorted(digests.items())})
        out.update({"diloco/live_replicas": float(len(per)),
                    "diloco/restarts": float(sum(self.replicas.restarts.values()))})
        return out

    def save(self, step: int, keep_last: int | None) -> None:
        """Every live replica checkpoints its full state, DiLoCo state included."""
        self.replicas.call_all("save", self.run_dir, step, keep_last, what=f"save({step})", live_only=True)

    def load_latest(self) -> int:
        """Each replica loads its latest checkpoint of at most the newest step any replica has; the run
        continues from that step (a replica left behind heals from a peer at the first sync)."""
        start = max(self.replicas.call_all("latest_step", self.run_dir, what="latest_step").values(), default=0)
        return max(self.replicas.call_all("load_latest", self.run_dir, start, what="load_latest").values(), default=0)

    def evaluate(self) -> dict[str, float]:
        """Evaluation on the lowest live replica (after a sync they hold the same parameters; before the first step:
        the lowest set-up one)."""
        return self.replicas.call(min(self.replicas.live or self.replicas.replicas()), "evaluate", what="evaluate")

    def summary(self) -> dict[str, Any]:
        """``replica_param_sha256`` (``{replica: digest}`` after the last sync), ``restarts``, ``dropped_replicas``,
        ``diloco_events`` and, on named nodes (SLURM), ``replica_nodes`` (``{replica: node}`` at the end)."""
        rs, hosts = self.replicas, self.replicas.hosts
        nodes = {str(i): hosts.nodes.get(hosts.where(i)) for i in rs.restarts} if hosts.nodes else {}
        return {**({"replica_nodes": nodes} if nodes else {}),
                "replica_param_sha256": {str(i): d for i, d in self.last_digests.items()},
                "restarts": {str(i): n for i, n in rs.restarts.items()},
                "dropped_replicas": sorted(rs.dropped),
                "diloco_events": [{k: v for k, v in ev.items() if k not in ("time", "healed_time")} for ev in rs.events]}

    def stop(self, timeout_s: float) -> list[str]:
        """Stop every replica's manager and procs, then the lighthouse; the errors met."""
        errors = self.replicas.stop(timeout_s=timeout_s)
        self.lighthouse.shutdown()
        return errors


def setup_kwargs(cfg: RecipeConfig, *, states: list[dict[str, Any]], pairs: list[Any],
                 eval_states: list[dict[str, Any]] | None, tasks: tuple[list[Any], list[Any]],
                 world_size: int) -> dict[str, Any]:
    """The keyword arguments of ``StudentTrainer.setup(cfg.student, **kwargs)`` for the recipe's data (``tasks``: the
    ``agentic`` (train, held-out) tasks, else ``([], [])``: ``data.tasks`` is read by the trainers)."""
    d, m = cfg.data, cfg.mesh
    return dict(states=states, pairs=pairs, world_size=world_size, tasks_path=None if tasks[0] else d.tasks,
                tasks=tasks[0] or None, eval_tasks=tasks[1] or None, num_eval_prompts=d.num_eval_prompts,
                eval_states=eval_states, eval_max_new_tokens=d.eval_max_new_tokens, inject_fault=m.inject_fault,
                threads=m.threads_per_proc)


def lighthouse_host(hosts: ReplicaHosts) -> str:
    """Where replicas reach the controller's lighthouse: loopback on one node or loopback workers, else the FQDN."""
    return "127.0.0.1" if all(is_loopback(w) for w in [*hosts.workers, *hosts.spares]) else socket.getfqdn()


def start_diloco(cfg: RecipeConfig, meshes: Any, reducer: Any, *, run_dir: str, states: list[dict[str, Any]],
                 pairs: list[Any], eval_states: list[dict[str, Any]] | None, on_event: Any,
                 tasks: tuple[list[Any], list[Any]] = ([], [])) -> DilocoMeshReplicas:
    """Start the lighthouse, then spawn and set up ``diloco.replicas`` replicas, each on its own proc mesh
    (``tasks``: the ``agentic`` (train, held-out) tasks, ``recipes.monarch.data.load_agentic_tasks``).

    Raises:
        ActorFailure: a replica's setup failed or timed out.
    """
    m, d, hosts = cfg.mesh, cfg.diloco, meshes.replica_hosts
    lighthouse = Lighthouse(d, host=lighthouse_host(hosts))

    kwargs = setup_kwargs(cfg, states=states, pairs=pairs, eval_states=eval_states, tasks=tasks, world_size=d.replicas)

    def setup_args(index: int) -> tuple[tuple, dict]:
        return (cfg.student,), {**kwargs, "rank": index, "shard": True, "local_rank": hosts.local_index(index)}

    replicas = ReplicaSet(hosts, d, lighthouse_addr=lighthouse.address, setup_args=setup_args,
                          setup_timeout_s=m.setup_timeout_s, call_timeout_s=m.call_timeout_s, on_event=on_event)
    try:
        infos = replicas.start()
    except BaseException:
        replicas.stop(timeout_s=10.0)
        lighthouse.shutdown()
        raise
    return DilocoMeshReplicas(replicas, reducer, run_dir, call_timeout_s=m.call_timeout_s, lighthouse=lighthouse,
                              setup=infos)

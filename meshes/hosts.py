"""Host and proc meshes, built in one place: :class:`RoleMeshes` (``teacher``, ``trainer``, ``reducer``) on this host
(:func:`local_meshes`) or on Monarch workers (:func:`attach_meshes`), stopped in ``finally:`` by
:meth:`RoleMeshes.stop`. Spawning is non-blocking; the processes import torch when their first actor is set up
(5-10 s each), so keep the meshes for the whole run.

DiLoCo replicas get one proc mesh each (a dead replica never breaks a whole-mesh call): a
:class:`ReplicaHosts` spawns replica ``i``'s proc mesh on this host or on its worker, and moves a slot whose
worker stopped answering to a spare worker (which must be at a new address: a worker restarted at the same
address is never answered again by the same client, ``../shared/notes/monarch.md`` §10), or, with no spare left,
to a fresh worker its ``relaunch`` starts on the lost worker's node (a SLURM job, :mod:`meshes.launch`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RoleMeshes", "ReplicaHosts", "local_meshes", "attach_meshes", "child_pids", "is_loopback", "stop_quietly"]

log = logging.getLogger(__name__)


@dataclass
class RoleMeshes:
    """The proc meshes of one recipe run: ``teacher`` (1 proc), ``trainer`` (``{"replica": N}``), ``reducer``."""

    teacher: Any
    """Proc mesh hosting the ``TeacherReplay`` actor."""
    trainer: Any
    """Proc mesh ``{"replica": num_replicas}`` hosting the ``StudentTrainer`` actors (``None`` with DiLoCo)."""
    reducer: Any
    """Proc mesh hosting the ``Reducer`` actor."""
    replica_hosts: ReplicaHosts | None = None
    """Where DiLoCo replicas spawn their own proc meshes (``None`` without DiLoCo)."""
    spawned: list[tuple[str, Any]] = field(default_factory=list)
    """Every (name, mesh) spawned, in order (actor meshes are added by the recipe); stopped in reverse."""

    def add(self, name: str, mesh: Any) -> Any:
        """Remember an actor mesh so :meth:`stop` stops it; returns ``mesh``."""
        self.spawned.append((name, mesh))
        return mesh

    def stop(self, *, timeout_s: float = 30.0) -> list[str]:
        """Stop every spawned actor mesh, then every proc mesh (reverse order); returns the errors met.

        Never raises: a mesh whose process already died may fail to stop; the error is logged and
        the remaining meshes are still stopped (their processes also die with the controller).
        """
        errors: list[str] = []
        procs = [("teacher procs", self.teacher), ("trainer procs", self.trainer), ("reducer procs", self.reducer)]
        for name, mesh in [*reversed(self.spawned), *procs]:
            if mesh is not None:
                stop_quietly(name, mesh, timeout_s, errors)
        for address, host in (self.replica_hosts.hosts.items() if self.replica_hosts else []):
            stop_quietly(f"worker {address}", host, min(timeout_s, 10.0), errors)  # detaches; the worker keeps running
        self.spawned.clear()
        self.teacher = self.trainer = self.reducer = None
        return errors


def stop_quietly(name: str, mesh: Any, timeout_s: float, errors: list[str]) -> None:
    """``mesh.stop()`` (a proc, actor or host mesh) with a timeout; an error is logged and appended to ``errors``."""
    try:
        mesh.stop().get(timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - shutdown must go on
        errors.append(f"{name}: {type(exc).__name__}: {str(exc).strip()[:200]}")
        log.warning("stopping %s failed: %s", name, errors[-1])


def is_loopback(address: str) -> bool:
    """Whether a worker address ``tcp://HOST:PORT`` names this machine's loopback (127.x, localhost, ::1)."""
    host = worker_host(address)
    return host in ("localhost", "::1") or host.startswith("127.")


def worker_host(address: str) -> str:
    """``HOST`` of ``tcp://HOST:PORT`` (the part other processes dial)."""
    rest = address.split("://", 1)[-1].split("@", 1)[0]
    return rest.rsplit(":", 1)[0].strip("[]")


class ReplicaHosts:
    """Spawns DiLoCo replica ``i``'s own 1-proc mesh: on this host, or on the worker its slot is placed on.

    Args:
        env: extra environment variables for local procs.
        workers: attached worker addresses (replica ``i`` on ``workers[i % len(workers)]``); empty = this host.
        spares: spare worker addresses, attached only when a slot's worker is lost.
        relaunch: ``relaunch(lost address) -> new address | None``: a fresh worker on the lost one's node, tried
            when no spare is left.
        nodes: ``{address: node name}`` of the workers (named in the events).
    """

    def __init__(self, *, env: dict[str, str] | None = None, workers: list[str] | None = None,
                 spares: list[str] | None = None, relaunch: Callable[[str], str | None] | None = None,
                 nodes: dict[str, str] | None = None) -> None:
        self.env, self.workers, self.spares = dict(env or {}), list(workers or []), list(spares or [])
        self.relaunch, self.nodes = relaunch, dict(nodes or {})
        self.slot_worker: dict[int, str] = {}
        self.hosts: dict[str, Any] = {}
        """Attached host meshes by worker address (shared with :class:`RoleMeshes`)."""

    def where(self, index: int) -> str:
        """``"local"`` or the worker address replica ``index`` runs on."""
        if not self.workers:
            return "local"
        return self.slot_worker.setdefault(index, self.workers[index % len(self.workers)])

    def local_index(self, index: int) -> int:
        """Replica ``index``'s position among the replicas on its host (its GPU there: ``cuda:<local_index>``)."""
        where = self.where(index)
        return index if where == "local" else sum(self.where(j) == where for j in range(index))

    def advertise_host(self, index: int) -> str:
        """The host name other replicas reach replica ``index`` at (store, checkpoint server)."""
        where = self.where(index)
        return "127.0.0.1" if where == "local" or is_loopback(where) else worker_host(where)

    def spawn(self, index: int) -> Any:
        """A fresh 1-proc mesh for replica ``index`` (non-blocking)."""
        where = self.where(index)
        return _local_procs({"procs": 1}, self.env) if where == "local" else self.host(where).spawn_procs(
            per_host={"procs": 1})

    def host(self, address: str) -> Any:
        """The host mesh of worker ``address`` (attached on first use)."""
        if address not in self.hosts:
            from monarch.actor import attach_to_workers

            self.hosts[address] = attach_to_workers(name=f"worker_{len(self.hosts)}", ca="trust_all_connections",
                                                    workers=[address])
        return self.hosts[address]

    def describe(self, address: str) -> str:
        """``address``, with its node's name when known (``tcp://h:1 (node n2)``)."""
        return f"{address} (node {self.nodes[address]})" if address in self.nodes else address

    def replace_worker(self, index: int) -> str | None:
        """Move slot ``index`` to the next spare worker, else to a relaunched one; its address, or ``None``."""
        lost = self.where(index)
        new = self.spares.pop(0) if self.spares else self.relaunch(lost) if self.relaunch else None
        if new is None:
            return None
        if lost in self.nodes and not self.nodes.get(new):
            self.nodes[new] = self.nodes[lost]
        for slot, address in list(self.slot_worker.items()):
            if address == lost:  # every slot on the lost worker moves
                self.slot_worker[slot] = new
        return new


def local_meshes(*, num_replicas: int = 1, env: dict[str, str] | None = None, diloco: bool = False) -> RoleMeshes:
    """Spawn the three role proc meshes on the local host (``this_host()``).

    Args:
        num_replicas: trainer replicas (one process each; on GPU, one GPU each: ``device: auto``
            picks ``cuda:<replica>``).
        env: extra environment variables for every process (e.g. ``{"OMP_NUM_THREADS": "1"}``).
        diloco: no shared trainer mesh; ``replica_hosts`` spawns one proc mesh per replica instead.

    Raises:
        ValueError: ``num_replicas < 1``.
    """
    if num_replicas < 1:
        raise ValueError(f"'mesh.num_replicas' must be >= 1, got {num_replicas}")
    teacher = _local_procs({"procs": 1}, env)
    trainer = None if diloco else _local_procs({"replica": num_replicas}, env)
    return RoleMeshes(teacher=teacher, trainer=trainer, reducer=_local_procs({"procs": 1}, env),
                      replica_hosts=ReplicaHosts(env=env) if diloco else None)


def _local_procs(per_host: dict[str, int], env: dict[str, str] | None) -> Any:
    """A proc mesh of shape ``per_host`` on ``this_host()``, ``env`` added to its processes' (non-blocking)."""
    from monarch.actor import default_bootstrap_cmd, this_host

    kwargs = {"bootstrap_command": default_bootstrap_cmd().with_env(dict(env))} if env else {}
    return this_host().spawn_procs(per_host=per_host, **kwargs)


def attach_meshes(workers: list[str], *, spares: list[str] | None = None, teacher_worker: int = 0,
                  reducer_worker: int = 0, relaunch: Callable[[str], str | None] | None = None,
                  nodes: dict[str, str] | None = None) -> RoleMeshes:
    """Build the role meshes on Monarch workers (``python -m recipes.monarch.worker --address tcp://HOST:PORT``).

    Call it before any other Monarch call of the process: it enables the TCP transport
    (``tcp://127.0.0.1:0`` when every worker is on loopback). The teacher and the reducer get a 1-proc
    mesh on ``workers[teacher_worker]`` / ``workers[reducer_worker]``; DiLoCo replica ``i`` gets its own
    proc mesh on ``workers[i % len(workers)]`` (through ``replica_hosts``; ``relaunch`` and ``nodes`` go to it).

    Raises:
        ValueError: no workers, a worker index out of range, or an address that is not ``tcp://HOST:PORT``.
    """
    from monarch.actor import enable_transport

    if not workers:
        raise ValueError("'mesh.workers' is empty; list worker addresses (tcp://HOST:PORT) or use one node")
    for address in [*workers, *(spares or [])]:
        if not address.startswith("tcp://") or ":" not in address[len("tcp://"):]:
            raise ValueError(f"worker address {address!r} must look like tcp://HOST:PORT")
    for key, idx in (("teacher_worker", teacher_worker), ("reducer_worker", reducer_worker)):
        if not 0 <= idx < len(workers):
            raise ValueError(f"'mesh.{key}' must index 'mesh.workers' (0..{len(workers) - 1}), got {idx}")
    loopback = all(is_loopback(a) for a in [*workers, *(spares or [])])
    enable_transport("tcp://127.0.0.1:0" if loopback else "tcp")
    hosts = ReplicaHosts(workers=workers, spares=spares, relaunch=relaunch, nodes=nodes)
    teacher = hosts.host(workers[teacher_worker]).spawn_procs(per_host={"procs": 1})
    reducer = hosts.host(workers[reducer_worker]).spawn_procs(per_host={"procs": 1})
    return RoleMeshes(teacher=teacher, trainer=None, reducer=reducer, replica_hosts=hosts)


def child_pids(pid: int | None = None) -> list[int]:
    """PIDs of the live child processes of ``pid`` (default: this process), read from ``/proc``."""
    pid = os.getpid() if pid is None else pid
    out = []
    for entry in [e for e in os.listdir("/proc") if e.isdigit()] if os.path.isdir("/proc") else []:
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[-1].split()
        except OSError:  # not a process, or it just ended
            continue
        if len(fields) > 1 and int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out

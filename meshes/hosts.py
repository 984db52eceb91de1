"""Host and proc meshes, built in one place: one proc mesh per role on the local host.

:func:`local_meshes` spawns, on ``this_host()``, a ``teacher`` proc mesh (1 proc), a ``trainer`` proc
mesh (``{"replica": N}``) and a ``reducer`` proc mesh (1 proc), and returns them as :class:`RoleMeshes`,
whose :meth:`RoleMeshes.stop` stops every mesh it spawned (each stop with a timeout, errors logged,
never raised), so a recipe can call it in ``finally:``. Spawning is non-blocking; the processes import
torch when their first actor is set up (5-10 s each), so keep the meshes for the whole run.

:func:`attach_meshes` (several hosts: Monarch workers reached with ``attach_to_workers``) is the next
issue and raises ``NotImplementedError``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

__all__ = ["RoleMeshes", "local_meshes", "attach_meshes", "child_pids"]

log = logging.getLogger(__name__)


@dataclass
class RoleMeshes:
    """The proc meshes of one recipe run: ``teacher`` (1 proc), ``trainer`` (``{"replica": N}``), ``reducer``."""

    teacher: Any
    """Proc mesh hosting the ``TeacherReplay`` actor."""
    trainer: Any
    """Proc mesh ``{"replica": num_replicas}`` hosting the ``StudentTrainer`` actors."""
    reducer: Any
    """Proc mesh hosting the ``Reducer`` actor."""
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
            if mesh is None:
                continue
            try:
                mesh.stop().get(timeout=timeout_s)
            except Exception as exc:  # noqa: BLE001 - shutdown must go on
                errors.append(f"{name}: {type(exc).__name__}: {str(exc).strip()[:200]}")
                log.warning("stopping %s failed: %s", name, errors[-1])
        self.spawned.clear()
        self.teacher = self.trainer = self.reducer = None
        return errors


def local_meshes(*, num_replicas: int = 1, env: dict[str, str] | None = None) -> RoleMeshes:
    """Spawn the three role proc meshes on the local host (``this_host()``).

    Args:
        num_replicas: trainer replicas (one process each; on GPU, one GPU each: ``device: auto``
            picks ``cuda:<replica>``).
        env: extra environment variables for every process (e.g. ``{"OMP_NUM_THREADS": "1"}``).

    Raises:
        ValueError: ``num_replicas < 1``.
    """
    from monarch.actor import default_bootstrap_cmd, this_host

    if num_replicas < 1:
        raise ValueError(f"'mesh.num_replicas' must be >= 1, got {num_replicas}")
    host = this_host()
    kwargs: dict[str, Any] = {}
    if env:
        kwargs["bootstrap_command"] = default_bootstrap_cmd().with_env(dict(env))
    teacher = host.spawn_procs(per_host={"procs": 1}, **kwargs)
    trainer = host.spawn_procs(per_host={"replica": num_replicas}, **kwargs)
    reducer = host.spawn_procs(per_host={"procs": 1}, **kwargs)
    return RoleMeshes(teacher=teacher, trainer=trainer, reducer=reducer)


def attach_meshes(workers: list[str], *, num_replicas: int = 1) -> RoleMeshes:
    """Build the role meshes on remote Monarch workers (``attach_to_workers``): the multi-host issue.

    Raises:
        NotImplementedError: always, for now; run ``local_meshes`` (single node) instead.
    """
    raise NotImplementedError(
        "attaching to remote Monarch workers (multi-host meshes) is the next issue; "
        f"got workers={workers!r}. Use the single-node recipe (local_meshes) for now."
    )


def child_pids(pid: int | None = None) -> list[int]:
    """PIDs of the live child processes of ``pid`` (default: this process), read from ``/proc``."""
    pid = os.getpid() if pid is None else pid
    out = []
    try:
        entries = os.listdir("/proc")
    except OSError:  # pragma: no cover - not Linux
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(entry))
    return out

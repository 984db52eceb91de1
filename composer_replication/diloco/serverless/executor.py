"""Serverless executors (ADR-005): launch N replicas somewhere, watch them, collect their results.

A backend implements :class:`ServerlessExecutor`: :class:`LocalProcessExecutor` here, ``ModalExecutor`` and
``HFJobsExecutor`` in ``cloud.py``. Each replica runs :func:`replica_entrypoint`; they meet only in its store.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from composer_replication.diloco.serverless.allreduce import ObjectStoreAllReduce

__all__ = ["ReplicaHandle", "ServerlessExecutor", "LocalProcessExecutor", "replica_entrypoint", "run_replica"]

STATUSES = ("pending", "running", "succeeded", "failed", "cancelled")
_FINAL = ("succeeded", "failed", "cancelled")


@dataclass
class ReplicaHandle:
    """Opaque handle returned by ``ServerlessExecutor.launch_replicas``; ``metadata`` is backend-specific."""

    rank: int
    backend_name: str
    metadata: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class ServerlessExecutor(Protocol):
    """Structural protocol of serverless backends (``isinstance`` works on it).

    ``launch_replicas`` starts ``n_replicas`` running ``entrypoint(**entrypoint_args)`` (a dotted path; a callable
    only locally) and returns their handles in rank order; ``poll`` gives one of :data:`STATUSES`; ``stream_logs``
    the recent output (best effort); ``cancel`` stops one (best effort); ``collect`` blocks until all ended and
    returns one dict per handle: ``rank, status, exit_code, error`` (and ``result`` where the backend has it).
    """

    backend_name: str
    supports_inter_replica_network: bool

    def launch_replicas(self, n_replicas: int, entrypoint: str | Callable[..., Any],
                        entrypoint_args: Mapping[str, Any], *, gpu: str | None = None,
                        timeout: int = 3600) -> list[ReplicaHandle]: ...

    def poll(self, handle: ReplicaHandle) -> str: ...

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str: ...

    def cancel(self, handle: ReplicaHandle) -> None: ...

    def collect(self, handles: list[ReplicaHandle], *, timeout: int | None = None) -> list[dict[str, Any]]: ...


def resolve_entrypoint(entrypoint: str | Callable[..., Any], *, default_attr: str = "main") -> Callable[..., Any]:
    """A callable from ``"pkg.module"`` (its ``default_attr``) or ``"pkg.module.function"``.

    Raises:
        ValueError: nothing callable at that path (the message says what was tried).
    """
    if callable(entrypoint):
        return entrypoint
    if not isinstance(entrypoint, str) or not entrypoint:
        raise ValueError(f"entrypoint must be a dotted path or a callable, got {entrypoint!r}")
    try:
        module, attr = importlib.import_module(entrypoint), default_attr
    except ModuleNotFoundError as exc:
        if "." not in entrypoint or not entrypoint.startswith(exc.name or "\0"):
            raise
        parent, attr = entrypoint.rsplit(".", 1)
        module = importlib.import_module(parent)
    if not callable(fn := getattr(module, attr, None)):
        raise ValueError(f"entrypoint {entrypoint!r}: {module.__name__}.{attr} is not a callable; give the module a "
                         f"{attr}(), or name the function: 'pkg.module.function'")
    return fn


def replica_entrypoint(rendezvous_uri: str, world_size: int, trainer_module: str, rank_env: str = "REPLICA_RANK", *,
                       run_id: str | None = None, resume: bool = False, timeout_s: float = 1800.0,
                       poll_interval_s: float = 1.0, storage_options: Mapping[str, Any] | None = None,
                       trainer_kwargs: Mapping[str, Any] | None = None, min_world_size: int | None = None) -> Any:
    """What every replica runs: rank from ``$<rank_env>``, an ``ObjectStoreAllReduce`` on ``rendezvous_uri`` (with
    ``run_id``, ``resume``, ``timeout_s``, ``poll_interval_s``, ``storage_options``, ``min_world_size``; closed at the
    end), then ``trainer_module``'s ``train(allreduce=..., **trainer_kwargs)`` (or ``"pkg.module.function"``); its
    result.

    Raises:
        ValueError: ``$<rank_env>`` is unset or not an integer in ``[0, world_size)``.
    """
    raw = os.environ.get(rank_env)
    if raw is None or not raw.strip().isdigit():
        raise ValueError(f"replica rank: environment variable {rank_env}={raw!r} must be set to an int in "
                         f"[0, {world_size}) by the executor (or pass rank_env naming the variable it sets)")
    allreduce = ObjectStoreAllReduce(rendezvous_uri, int(raw), int(world_size), run_id=run_id, resume=resume,
                                     timeout_s=timeout_s, poll_interval_s=poll_interval_s,
                                     storage_options=storage_options, min_world_size=min_world_size)
    try:
        return resolve_entrypoint(trainer_module, default_attr="train")(allreduce=allreduce, **dict(trainer_kwargs or {}))
    finally:
        allreduce.close()


def run_replica(rank: int, entrypoint: str | Callable[..., Any], entrypoint_args: Mapping[str, Any]) -> Any:
    """The body of a remote replica (the Modal function): set ``$<rank_env>`` (default ``REPLICA_RANK``), run."""
    os.environ[str(entrypoint_args.get("rank_env", "REPLICA_RANK"))] = str(int(rank))
    return resolve_entrypoint(entrypoint)(**dict(entrypoint_args))


def _check_launch(n_replicas: Any, entrypoint: Any, backend: str) -> None:
    if isinstance(n_replicas, bool) or not isinstance(n_replicas, int) or n_replicas < 1:
        raise ValueError(f"n_replicas must be an int >= 1, got {n_replicas!r}")
    if backend and not isinstance(entrypoint, str):
        raise TypeError(f"{backend} needs entrypoint as a dotted path importable where the replica runs (callables "
                        f"run only with LocalProcessExecutor), got {type(entrypoint).__name__}")


class PollingExecutor:
    """What every backend shares: ``collect`` polls each handle every ``poll_interval_s`` until it is final."""

    poll_interval_s: float = 0.05

    def _report(self, handle: ReplicaHandle, status: str) -> dict[str, Any]:
        raise NotImplementedError  # the entry of a handle that ended with ``status``

    def collect(self, handles: list[ReplicaHandle], *, timeout: int | None = None) -> list[dict[str, Any]]:
        """Wait for every replica (at most ``timeout`` s: the rest are cancelled); per handle, in order: ``rank``,
        ``status``, ``exit_code``, ``error`` (``None`` on success), ``result`` (and what the backend adds)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        status = {id(h): self.poll(h) for h in handles}
        while any(s not in _FINAL for s in status.values()) and (deadline is None or time.monotonic() < deadline):
            time.sleep(self.poll_interval_s)
            status.update({id(h): self.poll(h) for h in handles if status[id(h)] not in _FINAL})
        out = []
        for h in handles:
            if status[id(h)] in _FINAL:
                out.append(self._report(h, status[id(h)]))
                continue
            self.cancel(h)
            out.append({"rank": h.rank, "status": "cancelled", "exit_code": None, "result": None,
                        "error": f"still running after collect(timeout={timeout}); cancelled"})
        return out


def _child(entrypoint: str | Callable[..., Any], args: dict[str, Any], rank: int, log_path: str, conn: Any) -> None:
    """A replica process: send stdout/stderr to the log, run (:func:`run_replica`), report, exit."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for std in (1, 2):
        os.dup2(fd, std)
    sys.stdout, sys.stderr = (os.fdopen(std, "w", buffering=1, closefd=False) for std in (1, 2))
    try:  # plain pickle: multiprocessing's would share tensors through descriptors that die with this process
        message, code = pickle.dumps(("ok", run_replica(rank, entrypoint, args))), 0
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher with its traceback
        traceback.print_exc()
        message, code = pickle.dumps(("error", f"{type(exc).__name__}: {exc}")), 1
    conn.send_bytes(message)
    sys.stdout.flush()
    sys.stderr.flush()
    conn.close()
    os._exit(code)


class LocalProcessExecutor(PollingExecutor):
    """Reference executor: one ``spawn`` process per replica on this machine.

    A handle's ``metadata``: ``pid``, ``start_ts``, ``log_path`` (stdout and stderr), ``deadline``. A replica past
    its ``timeout`` is killed and reported ``failed``. In ``collect`` results, ``result`` is the entrypoint's return
    value (which must be picklable), a negative ``exit_code`` the signal that killed it; ``log_path`` is added.
    """

    backend_name = "local_process"
    supports_inter_replica_network = True

    def __init__(self, *, log_dir: str | os.PathLike[str] | None = None) -> None:
        self._log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="replicas-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._ctx = mp.get_context("spawn")
        self._procs: dict[int, Any] = {}
        self._state: dict[int, dict[str, Any]] = {}

    def launch_replicas(self, n_replicas: int, entrypoint: str | Callable[..., Any],
                        entrypoint_args: Mapping[str, Any], *, gpu: str | None = None,
                        timeout: int = 3600) -> list[ReplicaHandle]:
        """Start ``n_replicas`` processes running ``entrypoint(**entrypoint_args)`` with ``$REPLICA_RANK`` (or
        ``$<entrypoint_args["rank_env"]>``) set. ``gpu`` only warns: local processes share the visible devices."""
        _check_launch(n_replicas, entrypoint, "")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if gpu is not None:
            warnings.warn(f"LocalProcessExecutor ignores gpu={gpu!r}: local replicas share the visible devices",
                          UserWarning, stacklevel=2)
        if isinstance(entrypoint, str):
            resolve_entrypoint(entrypoint)  # fail here, not in N children
        args = dict(entrypoint_args)
        handles = []
        for rank in range(n_replicas):
            log_path = self._log_dir / f"replica_{rank}_{time.time_ns()}.log"
            recv, send = self._ctx.Pipe(duplex=False)
            proc = self._ctx.Process(target=_child, name=f"replica-{rank}",
                                     args=(entrypoint, args, rank, str(log_path), send))
            proc.start()
            send.close()
            self._procs[proc.pid] = proc
            self._state[proc.pid] = {"conn": recv, "outcome": None, "cancelled": False, "timed_out": False}
            start = time.time()
            handles.append(ReplicaHandle(rank, self.backend_name, {
                "pid": proc.pid, "start_ts": start, "log_path": str(log_path), "deadline": start + timeout}))
        return handles

    def poll(self, handle: ReplicaHandle) -> str:
        """``running`` until the process exits, then ``succeeded``, ``failed`` or ``cancelled``."""
        proc, state = self._procs[handle.metadata["pid"]], self._state[handle.metadata["pid"]]
        if proc.exitcode is None and time.time() > handle.metadata["deadline"]:
            state["timed_out"] = True
            self._kill(proc)
        try:
            while state["outcome"] is None and state["conn"].poll():
                state["outcome"] = pickle.loads(state["conn"].recv_bytes())
        except (EOFError, OSError):
            pass
        if proc.exitcode is None:
            return "running"
        if state["cancelled"]:
            return "cancelled"
        ok = proc.exitcode == 0 and state["outcome"] is not None and state["outcome"][0] == "ok"
        return "succeeded" if ok else "failed"

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        """The last ``n_lines`` of the replica's stdout and stderr."""
        try:
            with open(handle.metadata["log_path"], errors="replace") as f:
                return "".join(deque(f, maxlen=n_lines))
        except FileNotFoundError:
            return ""

    def cancel(self, handle: ReplicaHandle) -> None:
        """Terminate the replica (SIGTERM, then SIGKILL after 5 s); no-op once it ended."""
        proc = self._procs[handle.metadata["pid"]]
        if proc.exitcode is None:
            self._state[handle.metadata["pid"]]["cancelled"] = True
            self._kill(proc)

    @staticmethod
    def _kill(proc: Any) -> None:
        proc.terminate()
        proc.join(5)
        if proc.exitcode is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)

    def _report(self, handle: ReplicaHandle, status: str) -> dict[str, Any]:
        proc, state = self._procs[handle.metadata["pid"]], self._state[handle.metadata["pid"]]
        proc.join()
        outcome, code, error = state["outcome"], proc.exitcode, None
        if state["timed_out"]:
            error = f"ran past its launch timeout ({handle.metadata['deadline'] - handle.metadata['start_ts']:g} s); killed"
        elif status == "cancelled":
            error = "cancelled"
        elif outcome is not None and outcome[0] == "error":
            error = outcome[1]
        elif status == "failed":
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            error = f"replica process {how} without reporting a result"
        return {"rank": handle.rank, "status": status, "exit_code": code, "error": error,
                "result": outcome[1] if outcome is not None and outcome[0] == "ok" else None,
                "log_path": handle.metadata["log_path"]}

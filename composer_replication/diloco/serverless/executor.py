"""Serverless executors: launch N replicas somewhere, watch them, collect their results (ADR-005).

A backend implements the :class:`ServerlessExecutor` protocol. :class:`LocalProcessExecutor` runs each
replica in a fresh ``spawn`` process on this machine (tests, CI, local development with a ``file://``
store); ``ModalExecutor`` and ``HFJobsExecutor`` (modules ``modal`` and ``hf_jobs``) run them on Modal and
on Hugging Face Jobs. The replicas find each other only through the object store whose URI is in
``entrypoint_args`` (see :func:`replica_entrypoint`).
"""

from __future__ import annotations

import importlib
import logging
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

__all__ = [
    "ReplicaHandle",
    "ServerlessExecutor",
    "LocalProcessExecutor",
    "resolve_entrypoint",
    "run_replica",
    "collect_by_polling",
    "STATUSES",
]

log = logging.getLogger(__name__)

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
    """Structural protocol for serverless backends (``isinstance`` works on it)."""

    backend_name: str
    supports_inter_replica_network: bool

    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: str | Callable[..., Any],
        entrypoint_args: Mapping[str, Any],
        *,
        gpu: str | None = None,
        timeout: int = 3600,
    ) -> list[ReplicaHandle]:
        """Start ``n_replicas``; returns their handles in rank order."""
        ...

    def poll(self, handle: ReplicaHandle) -> str:
        """One of ``pending``, ``running``, ``succeeded``, ``failed``, ``cancelled``."""
        ...

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        """Best-effort recent stdout/stderr of the replica."""
        ...

    def cancel(self, handle: ReplicaHandle) -> None:
        """Best-effort stop."""
        ...

    def collect(self, handles: list[ReplicaHandle], *, timeout: int | None = None) -> list[dict[str, Any]]:
        """Block until every replica ended; one dict per handle: ``rank, status, exit_code, error``."""
        ...


def resolve_entrypoint(
    entrypoint: str | Callable[..., Any], *, default_attr: str = "main"
) -> Callable[..., Any]:
    """A callable from ``"pkg.module"`` (its ``default_attr``, ``main``), ``"pkg.module.function"``,
    ``"pkg.module:function"`` or a callable.

    Raises:
        ValueError: nothing importable and callable at that path (the message says what was tried).
    """
    if callable(entrypoint):
        return entrypoint
    if not isinstance(entrypoint, str) or not entrypoint:
        raise ValueError(f"entrypoint must be a dotted path or a callable, got {entrypoint!r}")
    if ":" in entrypoint:
        module, attr = entrypoint.split(":", 1)
        return _attr(importlib.import_module(module), attr, entrypoint)
    try:
        module = importlib.import_module(entrypoint)
    except ModuleNotFoundError as exc:
        if "." not in entrypoint or not entrypoint.startswith(exc.name or "\0"):
            raise
        parent, attr = entrypoint.rsplit(".", 1)
        return _attr(importlib.import_module(parent), attr, entrypoint)
    return _attr(module, default_attr, entrypoint)


def _attr(module: Any, attr: str, path: str) -> Callable[..., Any]:
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise ValueError(
            f"entrypoint {path!r}: {module.__name__}.{attr} is not a callable; give the module a "
            f"{attr}(), or name the function: 'pkg.module.function'"
        )
    return fn


def run_replica(rank: int, entrypoint: str, entrypoint_args: Mapping[str, Any]) -> Any:
    """Set ``$<rank_env>`` (``entrypoint_args["rank_env"]``, default ``REPLICA_RANK``) and run the entrypoint.

    This is the body of a remote replica (the Modal function, the HF Job command).
    """
    os.environ[str(entrypoint_args.get("rank_env", "REPLICA_RANK"))] = str(int(rank))
    return resolve_entrypoint(entrypoint)(**dict(entrypoint_args))


def collect_by_polling(
    executor: Any,
    handles: list[ReplicaHandle],
    timeout: int | None,
    interval_s: float,
    report: Callable[[ReplicaHandle, str], dict[str, Any]],
) -> list[dict[str, Any]]:
    """Poll every handle until it is final (cancelling those still running after ``timeout`` s), then
    return ``report(handle, status)`` for each, with ``error`` set for a timed-out one."""
    deadline = None if timeout is None else time.monotonic() + timeout
    status = {id(h): executor.poll(h) for h in handles}
    while any(s not in _FINAL for s in status.values()):
        if deadline is not None and time.monotonic() >= deadline:
            break
        time.sleep(interval_s)
        status.update({id(h): executor.poll(h) for h in handles if status[id(h)] not in _FINAL})
    out = []
    for h in handles:
        if status[id(h)] not in _FINAL:
            executor.cancel(h)
            out.append(
                {
                    "rank": h.rank,
                    "status": "cancelled",
                    "exit_code": None,
                    "error": f"still running after collect(timeout={timeout}); cancelled",
                    "result": None,
                }
            )
        else:
            out.append(report(h, status[id(h)]))
    return out


# ---------------------------------------------------------------------------- local processes


def _child(
    entrypoint: str | Callable[..., Any],
    args: dict[str, Any],
    rank_env: str,
    rank: int,
    log_path: str,
    conn: Any,
) -> None:
    """Body of a replica process: set the rank variable, send stdout/stderr to the log, run, report."""
    os.environ[rank_env] = str(rank)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    try:
        result = resolve_entrypoint(entrypoint)(**args)
        # Plain pickle: multiprocessing's own would share tensors through file descriptors that die with
        # this process before the launcher reads them.
        message, code = pickle.dumps(("ok", result)), 0
    except BaseException as exc:  # noqa: BLE001 - reported to the launcher with its traceback
        traceback.print_exc()
        message, code = pickle.dumps(("error", f"{type(exc).__name__}: {exc}")), 1
    conn.send_bytes(message)
    sys.stdout.flush()
    sys.stderr.flush()
    conn.close()
    os._exit(code)


class LocalProcessExecutor:
    """Reference executor: one ``spawn`` process per replica on this machine.

    ``metadata`` of a handle: ``pid``, ``start_ts``, ``log_path`` (the replica's stdout and stderr),
    ``deadline`` (``start_ts + timeout``). A replica still running past its ``timeout`` is killed and
    reported ``failed`` with an error saying so. ``collect`` results also carry ``result``: the value the
    entrypoint returned (it must be picklable).
    """

    backend_name = "local_process"
    supports_inter_replica_network = True

    def __init__(self, *, log_dir: str | os.PathLike[str] | None = None) -> None:
        self._log_dir = Path(log_dir) if log_dir is not None else Path(tempfile.mkdtemp(prefix="replicas-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self._ctx = mp.get_context("spawn")
        self._procs: dict[int, Any] = {}
        self._state: dict[int, dict[str, Any]] = {}

    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: str | Callable[..., Any],
        entrypoint_args: Mapping[str, Any],
        *,
        gpu: str | None = None,
        timeout: int = 3600,
    ) -> list[ReplicaHandle]:
        """Start ``n_replicas`` processes running ``entrypoint(**entrypoint_args)`` with ``$REPLICA_RANK`` set.

        ``entrypoint_args["rank_env"]`` (default ``"REPLICA_RANK"``) names the rank variable; it is also
        passed on to the entrypoint. ``gpu`` only warns: local processes share the visible devices.
        """
        if isinstance(n_replicas, bool) or not isinstance(n_replicas, int) or n_replicas < 1:
            raise ValueError(f"n_replicas must be an int >= 1, got {n_replicas!r}")
        if not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if gpu is not None:
            warnings.warn(
                f"LocalProcessExecutor ignores gpu={gpu!r}: local replicas share the visible devices",
                UserWarning,
                stacklevel=2,
            )
        if isinstance(entrypoint, str):
            resolve_entrypoint(entrypoint)  # fail here, not in N children
        args = dict(entrypoint_args)
        rank_env = str(args.get("rank_env", "REPLICA_RANK"))
        handles = []
        for rank in range(n_replicas):
            log_path = self._log_dir / f"replica_{rank}_{time.time_ns()}.log"
            recv, send = self._ctx.Pipe(duplex=False)
            proc = self._ctx.Process(
                target=_child,
                args=(entrypoint, args, rank_env, rank, str(log_path), send),
                name=f"replica-{rank}",
                daemon=False,
            )
            proc.start()
            send.close()
            start = time.time()
            self._procs[proc.pid] = proc
            self._state[proc.pid] = {"conn": recv, "outcome": None, "cancelled": False, "timed_out": False}
            handles.append(
                ReplicaHandle(
                    rank=rank,
                    backend_name=self.backend_name,
                    metadata={
                        "pid": proc.pid,
                        "start_ts": start,
                        "log_path": str(log_path),
                        "deadline": start + timeout,
                    },
                )
            )
        return handles

    def _receive(self, pid: int) -> None:
        state = self._state[pid]
        try:
            while state["outcome"] is None and state["conn"].poll():
                state["outcome"] = pickle.loads(state["conn"].recv_bytes())
        except (EOFError, OSError):
            pass

    def poll(self, handle: ReplicaHandle) -> str:
        """``running`` until the process exits, then ``succeeded``, ``failed`` or ``cancelled``."""
        pid = handle.metadata["pid"]
        proc, state = self._procs[pid], self._state[pid]
        self._receive(pid)
        if proc.exitcode is None and time.time() > handle.metadata["deadline"]:
            state["timed_out"] = True
            self._kill(proc)
        if proc.exitcode is None:
            return "running"
        self._receive(pid)
        if state["cancelled"]:
            return "cancelled"
        if proc.exitcode == 0 and state["outcome"] is not None and state["outcome"][0] == "ok":
            return "succeeded"
        return "failed"

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        """The last ``n_lines`` of the replica's stdout and stderr."""
        try:
            with open(handle.metadata["log_path"], errors="replace") as f:
                return "".join(deque(f, maxlen=n_lines))
        except FileNotFoundError:
            return ""

    def cancel(self, handle: ReplicaHandle) -> None:
        """Terminate the replica (SIGTERM, then SIGKILL after 5 s); no-op once it ended."""
        pid = handle.metadata["pid"]
        proc = self._procs[pid]
        if proc.exitcode is None:
            self._state[pid]["cancelled"] = True
            self._kill(proc)

    @staticmethod
    def _kill(proc: Any) -> None:
        proc.terminate()
        proc.join(5)
        if proc.exitcode is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.join(5)

    def collect(self, handles: list[ReplicaHandle], *, timeout: int | None = None) -> list[dict[str, Any]]:
        """Wait for every replica (at most ``timeout`` s: the rest are cancelled) and report each.

        Returns one dict per handle, in order: ``rank``, ``status``, ``exit_code`` (negative: killed by
        that signal), ``error`` (``None`` on success; the exception or the reason otherwise), ``result``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        pending = list(handles)
        while pending:
            pending = [h for h in pending if self.poll(h) not in _FINAL]
            if pending and deadline is not None and time.monotonic() >= deadline:
                for h in pending:
                    self._state[h.metadata["pid"]]["collect_timeout"] = timeout
                    self.cancel(h)
                break
            if pending:
                time.sleep(0.05)
        return [self._result(h) for h in handles]

    def _result(self, handle: ReplicaHandle) -> dict[str, Any]:
        pid = handle.metadata["pid"]
        proc, state = self._procs[pid], self._state[pid]
        status = self.poll(handle)
        proc.join()
        outcome = state["outcome"]
        error = None
        if state.get("collect_timeout") is not None:
            error = f"still running after collect(timeout={state['collect_timeout']}); cancelled"
        elif state["timed_out"]:
            error = f"ran past its launch timeout ({handle.metadata['deadline'] - handle.metadata['start_ts']:g} s); killed"
        elif status == "cancelled":
            error = "cancelled"
        elif outcome is not None and outcome[0] == "error":
            error = outcome[1]
        elif status == "failed":
            code = proc.exitcode
            how = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            error = f"replica process {how} without reporting a result"
        return {
            "rank": handle.rank,
            "status": status,
            "exit_code": proc.exitcode,
            "error": error,
            "result": outcome[1] if outcome is not None and outcome[0] == "ok" else None,
            "log_path": handle.metadata["log_path"],
        }

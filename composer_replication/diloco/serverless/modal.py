"""ModalExecutor: serverless DiLoCo replicas as calls of a deployed Modal function.

Modal containers have no network between them, so the replicas meet in an object store. Deploy once an app
whose function returns ``run_replica(rank, entrypoint, entrypoint_args)`` (docs/diloco.md, "Modal"); the image
needs composer-replication and the store's fsspec adapter, the store's credentials come from a Modal secret.
SDK calls used (modal >= 1.0): ``Function.from_name``, ``Function.with_options(gpu=, timeout=)``,
``Function.spawn``, ``FunctionCall.get(timeout=0)``, ``FunctionCall.cancel``, ``FunctionCall.from_id``,
``FunctionCall.object_id`` and ``Function.logs.tail``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from composer_replication.diloco.serverless.executor import ReplicaHandle, _check_launch, collect_by_polling

__all__ = ["ModalExecutor"]

log = logging.getLogger(__name__)


class ModalExecutor:
    """Run each replica as one ``spawn`` of ``function_name`` (which calls ``run_replica(rank, entrypoint,
    entrypoint_args)``) of the deployed Modal app ``app_name``, in ``environment_name`` (default: the active one).
    ``ImportError`` without ``modal`` (the message says how to install and log in)."""

    backend_name = "modal"
    supports_inter_replica_network = False

    def __init__(self, app_name: str, function_name: str = "replica", *, environment_name: str | None = None,
                 poll_interval_s: float = 5.0) -> None:
        try:
            import modal
        except ImportError as exc:
            raise ImportError("ModalExecutor needs the `modal` package, which is not installed: `pip install modal`, "
                              "then `modal token new` (or set MODAL_TOKEN_ID / MODAL_TOKEN_SECRET)") from exc
        if not app_name or not function_name:
            raise ValueError(f"app_name and function_name must name a deployed Modal function, got {app_name!r}, "
                             f"{function_name!r}")
        self._modal, self.app_name, self.function_name = modal, app_name, function_name
        self.environment_name, self.poll_interval_s = environment_name, poll_interval_s
        self._fn: Any = None
        self._calls: dict[str, Any] = {}
        self._outcome: dict[str, tuple[str, Any]] = {}

    def _function(self) -> Any:
        if self._fn is None:
            kwargs = {"environment_name": self.environment_name} if self.environment_name else {}
            self._fn = self._modal.Function.from_name(self.app_name, self.function_name, **kwargs)
        return self._fn

    def launch_replicas(self, n_replicas: int, entrypoint: str | Callable[..., Any],
                        entrypoint_args: Mapping[str, Any], *, gpu: str | None = None,
                        timeout: int = 3600) -> list[ReplicaHandle]:
        """Spawn ``n_replicas`` calls ``replica(rank=r, entrypoint=..., entrypoint_args=...)``; ``gpu`` (``"H100"``)
        and ``timeout`` (seconds) override the deployed function's options."""
        _check_launch(n_replicas, entrypoint, "ModalExecutor")
        options: dict[str, Any] = {"timeout": int(timeout)} | ({"gpu": gpu} if gpu is not None else {})
        fn = self._function().with_options(**options)
        handles = []
        for rank in range(n_replicas):
            call = fn.spawn(rank=rank, entrypoint=entrypoint, entrypoint_args=dict(entrypoint_args))
            self._calls[call.object_id] = call
            handles.append(ReplicaHandle(rank, self.backend_name, {
                "function_call_id": call.object_id, "app_name": self.app_name, "function_name": self.function_name}))
        log.info("Modal: spawned %d replica(s) of %s.%s", n_replicas, self.app_name, self.function_name)
        return handles

    def _call(self, handle: ReplicaHandle) -> Any:
        call_id = handle.metadata["function_call_id"]
        if call_id not in self._calls:  # a handle from another process: look the call up by id
            self._calls[call_id] = self._modal.FunctionCall.from_id(call_id)
        return self._calls[call_id]

    def poll(self, handle: ReplicaHandle) -> str:
        """``running`` until the call returns (``succeeded``) or raises (``failed``); ``cancelled`` after cancel."""
        call_id = handle.metadata["function_call_id"]
        if call_id not in self._outcome:
            try:
                self._outcome[call_id] = ("succeeded", self._call(handle).get(timeout=0))
            except TimeoutError:  # the builtin one: no output yet
                return "running"
            except Exception as exc:  # noqa: BLE001 - a remote exception, a function timeout, an expired output
                self._outcome[call_id] = ("failed", f"{type(exc).__name__}: {exc}")
        return self._outcome[call_id][0]

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        """The function's recent log lines that belong to this call (best effort)."""
        call_id = handle.metadata["function_call_id"]
        try:
            entries = list(self._function().logs.tail(n_lines * 4))
        except Exception as exc:  # noqa: BLE001 - logs are best effort
            return f"(logs unavailable: {type(exc).__name__}: {exc}; try `modal app logs {self.app_name}`)"
        mine = [e.message for e in entries if call_id in (getattr(e, "context_ids", None) or [])]
        return "".join(m if m.endswith("\n") else m + "\n" for m in mine[-n_lines:])

    def cancel(self, handle: ReplicaHandle) -> None:
        """Cancel the call and stop its container."""
        call_id = handle.metadata["function_call_id"]
        if self._outcome.get(call_id, ("",))[0] not in ("succeeded", "failed"):
            self._call(handle).cancel(terminate_containers=True)
            self._outcome[call_id] = ("cancelled", "cancelled")

    def collect(self, handles: list[ReplicaHandle], *, timeout: int | None = None) -> list[dict[str, Any]]:
        """Wait for every call; ``result`` is the function's return value, ``exit_code`` 0 on success and ``None``
        otherwise (Modal reports exceptions, not exit codes)."""

        def report(h: ReplicaHandle, status: str) -> dict[str, Any]:
            kind, value = self._outcome[h.metadata["function_call_id"]]
            ok = kind == "succeeded"
            return {"rank": h.rank, "status": status, "exit_code": 0 if ok else None,
                    "error": None if ok else value, "result": value if ok else None}

        return collect_by_polling(self, handles, timeout, self.poll_interval_s, report)

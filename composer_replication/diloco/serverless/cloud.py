"""Cloud executors (no network between replicas: they meet in an object store); each imports its SDK when
constructed, ``ImportError`` (saying how to install) without it.

Modal (>= 1.0): deploy once an app whose function returns ``run_replica(rank, entrypoint, entrypoint_args)``
(docs/diloco.md, "Modal"), its image with composer-replication and the store's fsspec adapter, the credentials in a
Modal secret. HF Jobs (huggingface_hub >= 1.0): one ``HfApi.run_job`` per replica, in an image with
composer-replication (or installed by ``setup_command``), running ``python -m
composer_replication.diloco.serverless.entrypoint --entrypoint <entrypoint> --args '<json>'`` with ``REPLICA_RANK``
set; store credentials as Job secrets, the Hub token from ``hf auth login`` or ``HF_TOKEN``.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from composer_replication.diloco.serverless.executor import PollingExecutor, ReplicaHandle, _check_launch

__all__ = ["ModalExecutor", "HFJobsExecutor"]

log = logging.getLogger(__name__)

_STAGES = {"SCHEDULING": "pending", "RUNNING": "running", "COMPLETED": "succeeded", "ERROR": "failed",
           "CANCELED": "cancelled", "DELETED": "cancelled"}


def _lines(lines: Iterable[str]) -> str:
    return "".join(m if m.endswith("\n") else m + "\n" for m in lines)


class _CloudExecutor(PollingExecutor):
    """What the cloud backends share: a subclass's ``_start(rank, entrypoint, args, gpu, timeout)`` starts one
    replica and returns its handle's metadata; ``collect`` reports no exit code (0 on success, else ``None``: the
    clouds report a stage or an exception)."""

    backend_name = ""
    supports_inter_replica_network = False

    def launch_replicas(self, n_replicas: int, entrypoint: str | Callable[..., Any],
                        entrypoint_args: Mapping[str, Any], *, gpu: str | None = None,
                        timeout: int = 3600) -> list[ReplicaHandle]:
        """Start ``n_replicas`` replicas running ``entrypoint(**entrypoint_args)`` (a dotted path); ``gpu`` and
        ``timeout`` (seconds) as the class says. Handles in rank order."""
        _check_launch(n_replicas, entrypoint, type(self).__name__)
        handles = [ReplicaHandle(rank, self.backend_name, self._start(rank, entrypoint, dict(entrypoint_args), gpu,
                                                                      int(timeout))) for rank in range(n_replicas)]
        log.info("%s: started %d replica(s): %s", self.backend_name, n_replicas, [h.metadata for h in handles])
        return handles


class ModalExecutor(_CloudExecutor):
    """Run each replica as one ``spawn`` of ``function_name`` (which calls ``run_replica(rank, entrypoint,
    entrypoint_args)``) of the deployed Modal app ``app_name``, in ``environment_name`` (default: the active one).
    ``launch_replicas``: ``gpu`` (``"H100"``) and ``timeout`` override the deployed function's options; ``collect``:
    ``result`` is the function's return value."""

    backend_name = "modal"

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

    def _start(self, rank: int, entrypoint: str, args: dict[str, Any], gpu: str | None,
               timeout: int) -> dict[str, Any]:
        if rank == 0:  # one set of options for the whole launch
            options = {"timeout": timeout} | ({"gpu": gpu} if gpu is not None else {})
            self._launching = self._function().with_options(**options)
        call = self._launching.spawn(rank=rank, entrypoint=entrypoint, entrypoint_args=args)
        self._calls[call.object_id] = call
        return {"function_call_id": call.object_id, "app_name": self.app_name, "function_name": self.function_name}

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
        return _lines([e.message for e in entries if call_id in (getattr(e, "context_ids", None) or [])][-n_lines:])

    def cancel(self, handle: ReplicaHandle) -> None:
        """Cancel the call and stop its container."""
        call_id = handle.metadata["function_call_id"]
        if self._outcome.get(call_id, ("",))[0] not in ("succeeded", "failed"):
            self._call(handle).cancel(terminate_containers=True)
            self._outcome[call_id] = ("cancelled", "cancelled")

    def _report(self, handle: ReplicaHandle, status: str) -> dict[str, Any]:
        kind, value = self._outcome[handle.metadata["function_call_id"]]
        ok = kind == "succeeded"
        return {"rank": handle.rank, "status": status, "exit_code": 0 if ok else None,
                "error": None if ok else value, "result": value if ok else None}


class HFJobsExecutor(_CloudExecutor):
    """Run each replica as one Hugging Face Job.

    ``image``: a Docker image with Python and composer-replication (or installed by ``setup_command``); ``flavor``:
    the hardware when ``launch_replicas`` gets no ``gpu`` (an HF flavour: ``"a10g-small"``, ``"h100"``...);
    ``namespace``/``token``: the Jobs' owner and Hub token (default: the saved login or ``HF_TOKEN``); ``env`` and
    ``secrets`` (store credentials): every replica's environment; ``python``: the image's interpreter. ``collect``
    adds ``url``; its ``result`` is ``None``. ``ImportError`` without a ``huggingface_hub`` with the Jobs API.
    """

    backend_name = "hf_jobs"

    def __init__(self, image: str, *, flavor: str = "cpu-basic", namespace: str | None = None,
                 token: str | None = None, env: Mapping[str, str] | None = None,
                 secrets: Mapping[str, str] | None = None, setup_command: str | None = None,
                 python: str = "python", poll_interval_s: float = 10.0) -> None:
        try:
            from huggingface_hub import HfApi
        except ImportError as exc:
            raise ImportError("HFJobsExecutor needs `huggingface_hub`, which is not installed: "
                              "`pip install huggingface_hub`") from exc
        self._api = HfApi(token=token)
        if not hasattr(self._api, "run_job"):
            raise ImportError("HFJobsExecutor needs a huggingface_hub with the Jobs API (HfApi.run_job): "
                              "`pip install -U huggingface_hub`")
        if not image:
            raise ValueError("image must name a Docker image with Python, e.g. 'pytorch/pytorch:latest'")
        self.image, self.flavor, self.namespace = image, flavor, namespace
        self.env, self.secrets = dict(env or {}), dict(secrets or {})
        self.setup_command, self.python, self.poll_interval_s = setup_command, python, poll_interval_s

    def _start(self, rank: int, entrypoint: str, args: dict[str, Any], gpu: str | None,
               timeout: int) -> dict[str, Any]:
        run = [self.python, "-m", "composer_replication.diloco.serverless.entrypoint", "--entrypoint", entrypoint,
               "--args", json.dumps(args)]
        command = ["bash", "-c", f"{self.setup_command} && {shlex.join(run)}"] if self.setup_command else run
        info = self._api.run_job(image=self.image, command=command, secrets=self.secrets or None,
                                 env={**self.env, str(args.get("rank_env", "REPLICA_RANK")): str(rank)},
                                 flavor=gpu or self.flavor, timeout=timeout, namespace=self.namespace)
        return {"job_id": info.id, "url": getattr(info, "url", None), "namespace": self.namespace}

    def _stage(self, handle: ReplicaHandle) -> tuple[str, str | None]:
        info = self._api.inspect_job(job_id=handle.metadata["job_id"], namespace=self.namespace)
        stage = getattr(info.status, "stage", None)
        return str(getattr(stage, "value", stage)), getattr(info.status, "message", None)

    def poll(self, handle: ReplicaHandle) -> str:
        """The Job's stage mapped to ``pending``/``running``/``succeeded``/``failed``/``cancelled``."""
        stage, _ = self._stage(handle)
        if stage not in _STAGES:
            raise RuntimeError(f"HF Job {handle.metadata['job_id']} is in an unknown stage {stage!r}; update "
                               "cloud._STAGES for this huggingface_hub")
        return _STAGES[stage]

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        """The Job's last ``n_lines`` log lines available now."""
        return _lines(deque(self._api.fetch_job_logs(job_id=handle.metadata["job_id"], namespace=self.namespace),
                            maxlen=n_lines))

    def cancel(self, handle: ReplicaHandle) -> None:
        """Cancel the Job."""
        self._api.cancel_job(job_id=handle.metadata["job_id"], namespace=self.namespace)

    def _report(self, handle: ReplicaHandle, status: str) -> dict[str, Any]:
        stage, message = self._stage(handle)
        ok = status == "succeeded"
        return {"rank": handle.rank, "status": status, "exit_code": 0 if ok else None, "result": None,
                "error": None if ok else f"job {handle.metadata['job_id']} {stage}: {message or 'no message'}",
                "url": handle.metadata.get("url")}

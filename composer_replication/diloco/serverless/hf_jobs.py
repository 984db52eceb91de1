"""HFJobsExecutor: serverless DiLoCo replicas as Hugging Face Jobs.

Each replica is one Job running a Docker image with composer-replication installed (or installed by
``setup_command``), started by ``HfApi.run_job`` with the command::

    python -m composer_replication.diloco.serverless.entrypoint --entrypoint <entrypoint> --args '<json>'

and ``REPLICA_RANK`` in its environment. The object store's credentials travel as Job secrets (encrypted
environment variables), e.g. ``secrets={"AWS_ACCESS_KEY_ID": ..., "AWS_SECRET_ACCESS_KEY": ...}``; the Hub
token comes from ``huggingface-cli login`` or ``HF_TOKEN``. SDK calls used (huggingface_hub >= 1.0):
``HfApi.run_job``, ``HfApi.inspect_job``, ``HfApi.fetch_job_logs``, ``HfApi.cancel_job`` and
``JobInfo.id`` / ``JobInfo.url`` / ``JobInfo.status.stage`` / ``.message``.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from composer_replication.diloco.serverless.executor import ReplicaHandle, collect_by_polling

__all__ = ["HFJobsExecutor"]

log = logging.getLogger(__name__)

_STAGES = {
    "SCHEDULING": "pending",
    "RUNNING": "running",
    "COMPLETED": "succeeded",
    "ERROR": "failed",
    "CANCELED": "cancelled",
    "DELETED": "cancelled",
}


def _hf_api(token: str | None) -> Any:
    try:
        from huggingface_hub import HfApi
    except ImportError as exc:
        raise ImportError(
            "HFJobsExecutor needs `huggingface_hub`, which is not installed: `pip install huggingface_hub`"
        ) from exc
    api = HfApi(token=token)
    if not hasattr(api, "run_job"):
        raise ImportError(
            "HFJobsExecutor needs a huggingface_hub with the Jobs API (HfApi.run_job): "
            "`pip install -U huggingface_hub`"
        )
    return api


class HFJobsExecutor:
    """Run each replica as one Hugging Face Job.

    Args:
        image: Docker image (Docker Hub or ``hf.co/spaces/...``) with Python and composer-replication.
        flavor: hardware flavour used when ``launch_replicas`` gets no ``gpu`` (e.g. ``"a10g-small"``).
        namespace: user or organisation that owns the Jobs (default: the token's user).
        token: Hub token (default: the saved login or ``HF_TOKEN``).
        env: extra environment variables for every replica.
        secrets: secret environment variables for every replica (store credentials).
        setup_command: shell command run before the replica (e.g. ``"pip install composer-replication[s3]"``).
        python: the interpreter in the image.
        poll_interval_s: pause between status checks in ``collect``.

    Raises:
        ImportError: ``huggingface_hub`` is missing or has no Jobs API (the message names the package).
    """

    backend_name = "hf_jobs"
    supports_inter_replica_network = False

    def __init__(
        self,
        image: str,
        *,
        flavor: str = "cpu-basic",
        namespace: str | None = None,
        token: str | None = None,
        env: Mapping[str, str] | None = None,
        secrets: Mapping[str, str] | None = None,
        setup_command: str | None = None,
        python: str = "python",
        poll_interval_s: float = 10.0,
    ) -> None:
        self._api = _hf_api(token)
        if not image:
            raise ValueError("image must name a Docker image with Python, e.g. 'pytorch/pytorch:latest'")
        self.image, self.flavor, self.namespace = image, flavor, namespace
        self.env, self.secrets = dict(env or {}), dict(secrets or {})
        self.setup_command, self.python, self.poll_interval_s = setup_command, python, poll_interval_s
        self._info: dict[str, Any] = {}

    def _command(self, entrypoint: str, args: Mapping[str, Any]) -> list[str]:
        run = [
            self.python,
            "-m",
            "composer_replication.diloco.serverless.entrypoint",
            "--entrypoint",
            entrypoint,
            "--args",
            json.dumps(dict(args)),
        ]
        if not self.setup_command:
            return run
        import shlex

        return ["bash", "-c", f"{self.setup_command} && {shlex.join(run)}"]

    def launch_replicas(
        self,
        n_replicas: int,
        entrypoint: str | Callable[..., Any],
        entrypoint_args: Mapping[str, Any],
        *,
        gpu: str | None = None,
        timeout: int = 3600,
    ) -> list[ReplicaHandle]:
        """Start ``n_replicas`` Jobs; ``gpu`` is an HF hardware flavour (``"a10g-small"``, ``"h100"``...)."""
        if not isinstance(entrypoint, str):
            raise TypeError(
                "HFJobsExecutor needs entrypoint as a dotted path importable in the image "
                f"(callables run only with LocalProcessExecutor), got {type(entrypoint).__name__}"
            )
        if isinstance(n_replicas, bool) or not isinstance(n_replicas, int) or n_replicas < 1:
            raise ValueError(f"n_replicas must be an int >= 1, got {n_replicas!r}")
        rank_env = str(entrypoint_args.get("rank_env", "REPLICA_RANK"))
        handles = []
        for rank in range(n_replicas):
            info = self._api.run_job(
                image=self.image,
                command=self._command(entrypoint, entrypoint_args),
                env={**self.env, rank_env: str(rank)},
                secrets=self.secrets or None,
                flavor=gpu or self.flavor,
                timeout=int(timeout),
                namespace=self.namespace,
            )
            self._info[info.id] = info
            handles.append(
                ReplicaHandle(
                    rank=rank,
                    backend_name=self.backend_name,
                    metadata={
                        "job_id": info.id,
                        "url": getattr(info, "url", None),
                        "namespace": self.namespace,
                    },
                )
            )
        log.info("HF Jobs: started %d replica(s): %s", n_replicas, [h.metadata["job_id"] for h in handles])
        return handles

    def _stage(self, handle: ReplicaHandle) -> tuple[str, str | None]:
        info = self._api.inspect_job(job_id=handle.metadata["job_id"], namespace=self.namespace)
        self._info[info.id] = info
        stage = getattr(info.status, "stage", None)
        return str(getattr(stage, "value", stage)), getattr(info.status, "message", None)

    def poll(self, handle: ReplicaHandle) -> str:
        """The Job's stage mapped to ``pending``/``running``/``succeeded``/``failed``/``cancelled``."""
        stage, _ = self._stage(handle)
        if stage not in _STAGES:
            raise RuntimeError(
                f"HF Job {handle.metadata['job_id']} is in an unknown stage {stage!r}; "
                "update HFJobsExecutor._STAGES for this huggingface_hub"
            )
        return _STAGES[stage]

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        """The Job's last ``n_lines`` log lines available now."""
        lines = deque(
            self._api.fetch_job_logs(job_id=handle.metadata["job_id"], namespace=self.namespace),
            maxlen=n_lines,
        )
        return "".join(line if line.endswith("\n") else line + "\n" for line in lines)

    def cancel(self, handle: ReplicaHandle) -> None:
        """Cancel the Job."""
        self._api.cancel_job(job_id=handle.metadata["job_id"], namespace=self.namespace)

    def collect(self, handles: list[ReplicaHandle], *, timeout: int | None = None) -> list[dict[str, Any]]:
        """Wait for every Job; ``exit_code`` is 0 when completed, ``None`` otherwise (Jobs report a stage and
        a message, not the exit code); ``error`` is the stage and its message."""

        def report(h: ReplicaHandle, status: str) -> dict[str, Any]:
            stage, message = self._stage(h)
            ok = status == "succeeded"
            return {
                "rank": h.rank,
                "status": status,
                "exit_code": 0 if ok else None,
                "error": None if ok else f"job {h.metadata['job_id']} {stage}: {message or 'no message'}",
                "result": None,
                "url": h.metadata.get("url"),
            }

        return collect_by_polling(self, handles, timeout, self.poll_interval_s, report)

"""HFJobsExecutor: serverless DiLoCo replicas as Hugging Face Jobs.

Each replica is one Job (``HfApi.run_job``) in a Docker image with composer-replication (or installed by
``setup_command``), running ``python -m composer_replication.diloco.serverless.entrypoint --entrypoint <entrypoint>
--args '<json>'`` with ``REPLICA_RANK`` in its environment. The store's credentials travel as Job secrets; the Hub
token comes from ``hf auth login`` or ``HF_TOKEN``. SDK calls used (huggingface_hub >= 1.0): ``HfApi.run_job``,
``inspect_job``, ``fetch_job_logs``, ``cancel_job`` and ``JobInfo.id`` / ``.url`` / ``.status.stage`` / ``.message``.
"""

from __future__ import annotations

import json
import logging
import shlex
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

from composer_replication.diloco.serverless.executor import ReplicaHandle, _check_launch, collect_by_polling

__all__ = ["HFJobsExecutor"]

log = logging.getLogger(__name__)

_STAGES = {"SCHEDULING": "pending", "RUNNING": "running", "COMPLETED": "succeeded", "ERROR": "failed",
           "CANCELED": "cancelled", "DELETED": "cancelled"}


class HFJobsExecutor:
    """Run each replica as one Hugging Face Job.

    ``image``: a Docker image with Python and composer-replication (or installed by ``setup_command``); ``flavor``:
    the hardware when ``launch_replicas`` gets no ``gpu``; ``namespace``/``token``: the Jobs' owner and Hub token
    (default: the saved login or ``HF_TOKEN``); ``env`` and ``secrets`` (store credentials): every replica's
    environment; ``python``: the image's interpreter. ``ImportError`` (naming the package) without a
    ``huggingface_hub`` that has the Jobs API.
    """

    backend_name = "hf_jobs"
    supports_inter_replica_network = False

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

    def _command(self, entrypoint: str, args: Mapping[str, Any]) -> list[str]:
        run = [self.python, "-m", "composer_replication.diloco.serverless.entrypoint", "--entrypoint", entrypoint,
               "--args", json.dumps(dict(args))]
        return ["bash", "-c", f"{self.setup_command} && {shlex.join(run)}"] if self.setup_command else run

    def launch_replicas(self, n_replicas: int, entrypoint: str | Callable[..., Any],
                        entrypoint_args: Mapping[str, Any], *, gpu: str | None = None,
                        timeout: int = 3600) -> list[ReplicaHandle]:
        """Start ``n_replicas`` Jobs; ``gpu`` is an HF hardware flavour (``"a10g-small"``, ``"h100"``...)."""
        _check_launch(n_replicas, entrypoint, "HFJobsExecutor")
        rank_env = str(entrypoint_args.get("rank_env", "REPLICA_RANK"))
        handles = []
        for rank in range(n_replicas):
            info = self._api.run_job(image=self.image, command=self._command(entrypoint, entrypoint_args),
                                     env={**self.env, rank_env: str(rank)}, secrets=self.secrets or None,
                                     flavor=gpu or self.flavor, timeout=int(timeout), namespace=self.namespace)
            handles.append(ReplicaHandle(rank, self.backend_name, {
                "job_id": info.id, "url": getattr(info, "url", None), "namespace": self.namespace}))
        log.info("HF Jobs: started %d replica(s): %s", n_replicas, [h.metadata["job_id"] for h in handles])
        return handles

    def _stage(self, handle: ReplicaHandle) -> tuple[str, str | None]:
        info = self._api.inspect_job(job_id=handle.metadata["job_id"], namespace=self.namespace)
        stage = getattr(info.status, "stage", None)
        return str(getattr(stage, "value", stage)), getattr(info.status, "message", None)

    def poll(self, handle: ReplicaHandle) -> str:
        """The Job's stage mapped to ``pending``/``running``/``succeeded``/``failed``/``cancelled``."""
        stage, _ = self._stage(handle)
        if stage not in _STAGES:
            raise RuntimeError(f"HF Job {handle.metadata['job_id']} is in an unknown stage {stage!r}; update "
                               "hf_jobs._STAGES for this huggingface_hub")
        return _STAGES[stage]

    def stream_logs(self, handle: ReplicaHandle, *, n_lines: int = 200) -> str:
        """The Job's last ``n_lines`` log lines available now."""
        lines = deque(self._api.fetch_job_logs(job_id=handle.metadata["job_id"], namespace=self.namespace),
                      maxlen=n_lines)
        return "".join(line if line.endswith("\n") else line + "\n" for line in lines)

    def cancel(self, handle: ReplicaHandle) -> None:
        """Cancel the Job."""
        self._api.cancel_job(job_id=handle.metadata["job_id"], namespace=self.namespace)

    def collect(self, handles: list[ReplicaHandle], *, timeout: int | None = None) -> list[dict[str, Any]]:
        """Wait for every Job; ``exit_code`` 0 when completed, else ``None`` (Jobs report a stage and a message)."""

        def report(h: ReplicaHandle, status: str) -> dict[str, Any]:
            stage, message = self._stage(h)
            ok = status == "succeeded"
            return {"rank": h.rank, "status": status, "exit_code": 0 if ok else None, "result": None,
                    "error": None if ok else f"job {h.metadata['job_id']} {stage}: {message or 'no message'}",
                    "url": h.metadata.get("url")}

        return collect_by_polling(self, handles, timeout, self.poll_interval_s, report)

"""Serverless DiLoCo (ADR-005): replicas with no network between them meet in an object store.

- :class:`ObjectStoreAllReduce` averages tensors through any fsspec store (file://, memory://, s3://...).
- :class:`MockManager` gives torchft's ``DiLoCo`` the ``Manager`` surface it needs over that allreduce.
- Executors launch the replicas: :class:`LocalProcessExecutor` (this machine), ``ModalExecutor``
  (``serverless.modal``) and ``HFJobsExecutor`` (``serverless.hf_jobs``); each replica runs
  :func:`replica_entrypoint`.

``ModalExecutor`` and ``HFJobsExecutor`` are importable here too; they need ``modal`` or
``huggingface_hub`` only when constructed.
"""

from composer_replication.diloco.serverless.allreduce import ObjectStoreAllReduce, RoundTimeoutError
from composer_replication.diloco.serverless.entrypoint import replica_entrypoint
from composer_replication.diloco.serverless.executor import (
    LocalProcessExecutor,
    ReplicaHandle,
    ServerlessExecutor,
    run_replica,
)
from composer_replication.diloco.serverless.hf_jobs import HFJobsExecutor
from composer_replication.diloco.serverless.manager import DroppedRoundError, MockManager
from composer_replication.diloco.serverless.modal import ModalExecutor
from composer_replication.diloco.serverless.store import StoreAccessError

__all__ = [
    "ObjectStoreAllReduce",
    "RoundTimeoutError",
    "StoreAccessError",
    "MockManager",
    "DroppedRoundError",
    "ReplicaHandle",
    "ServerlessExecutor",
    "LocalProcessExecutor",
    "ModalExecutor",
    "HFJobsExecutor",
    "replica_entrypoint",
    "run_replica",
]

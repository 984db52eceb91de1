"""Serverless DiLoCo (ADR-005): replicas with no network between them meet in an object store.

:class:`ObjectStoreAllReduce` averages tensors through any fsspec store; :class:`MockManager` gives torchft's
``DiLoCo`` the ``Manager`` surface it uses over it; the executors (:class:`LocalProcessExecutor`,
:class:`ModalExecutor`, :class:`HFJobsExecutor`, which import their SDK only when constructed) launch replicas
that each run :func:`replica_entrypoint`.
"""

from composer_replication.diloco.serverless.allreduce import (
    ObjectStoreAllReduce,
    RoundTimeoutError,
    RunConflictError,
)
from composer_replication.diloco.serverless.cloud import HFJobsExecutor, ModalExecutor
from composer_replication.diloco.serverless.executor import (
    LocalProcessExecutor,
    ReplicaHandle,
    ServerlessExecutor,
    replica_entrypoint,
)
from composer_replication.diloco.serverless.manager import DroppedRoundError, MockManager
from composer_replication.diloco.serverless.store import StoreAccessError

__all__ = ["ObjectStoreAllReduce", "RoundTimeoutError", "RunConflictError", "StoreAccessError",
           "MockManager", "DroppedRoundError", "ReplicaHandle", "ServerlessExecutor", "LocalProcessExecutor",
           "ModalExecutor", "HFJobsExecutor", "replica_entrypoint"]

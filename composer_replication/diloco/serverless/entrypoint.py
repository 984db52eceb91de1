"""What every serverless replica runs: read its rank, open the object store, call the trainer.

The same function serves every backend: ``LocalProcessExecutor`` calls it in a spawned process, a Modal
function calls it with its keyword arguments, and an HF Job runs it as a command (rank in ``$REPLICA_RANK``)::

    python -m composer_replication.diloco.serverless.entrypoint --args \\
        '{"rendezvous_uri": "s3://bucket/run1", "world_size": 4, "trainer_module": "my_pkg.trainer"}'

The trainer is a function ``train(allreduce, **trainer_kwargs)`` (``trainer_module`` names its module, or
``module.function``); it receives this replica's :class:`ObjectStoreAllReduce` (``rank``, ``world_size``,
``allreduce``...) and typically wraps it in a ``MockManager`` for torchft's ``DiLoCo``. Its return value is
the replica's result.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from typing import Any

from composer_replication.diloco.serverless.allreduce import ObjectStoreAllReduce
from composer_replication.diloco.serverless.executor import resolve_entrypoint

__all__ = ["replica_entrypoint", "main"]


def replica_entrypoint(
    rendezvous_uri: str,
    world_size: int,
    trainer_module: str,
    rank_env: str = "REPLICA_RANK",
    *,
    run_id: str | None = None,
    timeout_s: float = 1800.0,
    poll_interval_s: float = 1.0,
    storage_options: Mapping[str, Any] | None = None,
    trainer_kwargs: Mapping[str, Any] | None = None,
    min_world_size: int | None = None,
) -> Any:
    """Run one replica: rank from ``$<rank_env>``, an allreduce on ``rendezvous_uri``, then the trainer.

    Args:
        rendezvous_uri: the store prefix every replica shares (``s3://bucket/run1``, ``file:///tmp/run1``).
        world_size: number of replicas.
        trainer_module: ``"pkg.module"`` (its ``train``) or ``"pkg.module.function"``.
        rank_env: environment variable holding this replica's rank (set by the executor).
        run_id: the run's id, the same for every replica (executors pass a fresh one); ``None`` lets the
            replicas agree on one through the store.
        timeout_s: seconds a round waits for the other replicas.
        poll_interval_s: seconds between two looks at the store.
        storage_options: fsspec options of the store (endpoint, profile...).
        trainer_kwargs: keyword arguments for the trainer.
        min_world_size: elastic membership (see ``ObjectStoreAllReduce``); ``None`` needs every replica.

    Returns:
        Whatever the trainer returns.

    Raises:
        ValueError: ``$<rank_env>`` is unset or not an integer in ``[0, world_size)``.
    """
    raw = os.environ.get(rank_env)
    if raw is None or not raw.strip().isdigit():
        raise ValueError(
            f"replica rank: environment variable {rank_env}={raw!r} must be set to an int in "
            f"[0, {world_size}) by the executor (or pass rank_env naming the variable it sets)"
        )
    allreduce = ObjectStoreAllReduce(
        rendezvous_uri,
        int(raw),
        int(world_size),
        run_id=run_id,
        timeout_s=timeout_s,
        poll_interval_s=poll_interval_s,
        storage_options=storage_options,
        min_world_size=min_world_size,
    )
    train = resolve_entrypoint(trainer_module, default_attr="train")
    return train(allreduce=allreduce, **dict(trainer_kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    """Command line of a remote replica (what an HF Job runs): ``--entrypoint PATH --args JSON``.

    The rank comes from ``$REPLICA_RANK`` (or the variable named by ``rank_env`` in the arguments); the
    entrypoint's result is printed as one JSON line.
    """
    p = argparse.ArgumentParser(description="Run one serverless DiLoCo replica.")
    p.add_argument(
        "--entrypoint",
        default="composer_replication.diloco.serverless.replica_entrypoint",
        help="dotted path of the function to run (default: replica_entrypoint)",
    )
    p.add_argument("--args", default="{}", help="its keyword arguments as a JSON object")
    a = p.parse_args(argv)
    args = json.loads(a.args)
    if not isinstance(args, dict):
        p.error(f"--args must be a JSON object, got {a.args!r}")
    result = resolve_entrypoint(a.entrypoint)(**args)
    print(json.dumps({"result": result}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

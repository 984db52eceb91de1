"""The command line of a remote replica (what an HF Job runs; rank in ``$REPLICA_RANK``)::

    python -m composer_replication.diloco.serverless.entrypoint --args \\
        '{"rendezvous_uri": "s3://bucket/run1", "world_size": 4, "trainer_module": "my_pkg.trainer"}'
"""

from __future__ import annotations

import argparse
import json

from composer_replication.diloco.serverless.executor import replica_entrypoint, resolve_entrypoint

__all__ = ["replica_entrypoint", "main"]


def main(argv: list[str] | None = None) -> int:
    """``--entrypoint PATH --args JSON``: run it, print its result as one JSON line."""
    p = argparse.ArgumentParser(description="Run one serverless DiLoCo replica.")
    p.add_argument("--entrypoint", default="composer_replication.diloco.serverless.replica_entrypoint",
                   help="dotted path of the function to run (default: replica_entrypoint)")
    p.add_argument("--args", default="{}", help="its keyword arguments as a JSON object")
    a = p.parse_args(argv)
    args = json.loads(a.args)
    if not isinstance(args, dict):
        p.error(f"--args must be a JSON object, got {a.args[:200]!r}")
    print(json.dumps({"result": resolve_entrypoint(a.entrypoint)(**args)}, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

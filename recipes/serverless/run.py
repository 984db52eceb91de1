"""Serverless DiLoCo on this machine: N replica processes that share nothing but an object store.

    python -m recipes.serverless.run --replicas 2 --store file:///tmp/run1
    python -m recipes.serverless.run --replicas 3 --store s3://my-bucket/diloco --steps 40 --sync-every 10 \\
        --storage-option client_kwargs.endpoint_url=http://127.0.0.1:9000 --storage-option key=... --storage-option secret=...

Each replica (a process of ``LocalProcessExecutor``) runs ``replica_entrypoint``: the tiny Llama on its share of
the bundled text (``recipes.serverless.trainer``), torchft's ``DiLoCo`` averaging through the store every
``--sync-every`` steps. The replicas' final parameter digests are printed: they are equal. Exit codes: 0 done and
digests equal, 1 a replica failed or the digests differ, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
import uuid
from typing import Any

from composer_replication.diloco.serverless import LocalProcessExecutor

ENTRYPOINT = "composer_replication.diloco.serverless.replica_entrypoint"


def storage_options(pairs: list[str]) -> dict[str, Any]:
    """``key=value`` pairs as fsspec storage options; a dotted key nests (``client_kwargs.endpoint_url=...``), a value
    is parsed as JSON when it is JSON (``anon=true``, ``config_kwargs={"retries": {"max_attempts": 5}}``), else kept.

    Raises:
        ValueError: a pair without ``=`` or with an empty key part.
    """
    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not all(key.split(".")):
            raise ValueError(f"--storage-option must look like key=value (a dotted key nests), got {pair[:200]!r}")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--storage-option {key!r}: {part!r} is already set to a value, not a mapping")
        node[leaf] = value
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2, help="number of replica processes")
    p.add_argument("--store", required=True, help="store prefix shared by the replicas (file://, s3://, ...)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="an fsspec option of the store, repeatable (e.g. client_kwargs.endpoint_url=http://HOST:PORT)")
    p.add_argument("--steps", type=int, default=20, help="inner steps per replica (a multiple of --sync-every)")
    p.add_argument("--sync-every", type=int, default=5, help="inner steps between two DiLoCo outer steps")
    p.add_argument("--batch-size", type=int, default=4, help="windows per inner step")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per window")
    p.add_argument("--lr", type=float, default=3e-3, help="inner AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="initial weights (shared) and data order (per replica)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="seconds a round waits for the other replicas")
    p.add_argument("--poll-interval-s", type=float, default=0.1, help="seconds between two looks at the store")
    p.add_argument("--max-dropped-rounds", type=int, default=None,
                   help="stop after this many consecutive dropped rounds (default: go on)")
    p.add_argument("--min-replicas", type=int, default=None,
                   help="elastic membership: a round commits with at least this many replicas (default: all)")
    p.add_argument("--run-timeout-s", type=int, default=1800, help="kill replicas still running after this")
    args = p.parse_args(argv)
    if args.replicas < 1 or args.steps < 1 or args.sync_every < 1 or args.steps % args.sync_every:
        p.error(f"need --replicas >= 1 and --steps ({args.steps}) a positive multiple of --sync-every "
                f"({args.sync_every}), so that the run ends on an outer step")
    if args.min_replicas is not None and not 1 <= args.min_replicas <= args.replicas:
        p.error(f"--min-replicas must be in [1, --replicas={args.replicas}], got {args.min_replicas}")
    try:
        args.storage_options = storage_options(args.storage_option)
    except ValueError as exc:
        p.error(str(exc))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    run_id = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"  # a fresh run for every launch
    entry_args = {
        "rendezvous_uri": args.store, "world_size": args.replicas, "trainer_module": "recipes.serverless.trainer",
        "run_id": run_id, "min_world_size": args.min_replicas, "timeout_s": args.timeout_s,
        "poll_interval_s": args.poll_interval_s, "storage_options": args.storage_options,
        "trainer_kwargs": {"num_steps": args.steps, "sync_every": args.sync_every, "batch_size": args.batch_size,
                           "seq_len": args.seq_len, "lr": args.lr, "seed": args.seed,
                           "max_dropped_rounds": args.max_dropped_rounds},
    }
    executor = LocalProcessExecutor()
    print(f"run {run_id}: {args.replicas} replicas through {args.store}/runs/{run_id}", flush=True)
    handles = executor.launch_replicas(args.replicas, ENTRYPOINT, entry_args, timeout=args.run_timeout_s)
    try:
        results = executor.collect(handles, timeout=args.run_timeout_s)
    except KeyboardInterrupt:
        for h in handles:
            executor.cancel(h)
        return 130
    failed = [r for r in results if r["status"] != "succeeded"]
    for r in failed:
        print(f"replica {r['rank']} {r['status']} (exit code {r['exit_code']}): {r['error']}", file=sys.stderr)
        print(executor.stream_logs(handles[r["rank"]], n_lines=20), file=sys.stderr)
    if failed:
        return 1
    for r in (res["result"] for res in results):
        print(f"replica {r['rank']}: digest {r['digest']}  loss {r['first_loss']:.3f} -> {r['last_loss']:.3f}  "
              f"rounds {r['committed_rounds']} committed / {r['dropped_rounds']} dropped / {r['nonfinite_rounds']} "
              f"non-finite  store {r['bytes_written'] / 1e6:.1f} MB written, {r['bytes_read'] / 1e6:.1f} MB read  "
              f"{r['seconds']:.1f} s")
    equal = len({res["result"]["digest"] for res in results}) == 1
    print(f"final parameter digests {'EQUAL' if equal else 'DIFFER'} across {len(results)} replicas")
    return 0 if equal else 1


if __name__ == "__main__":
    raise SystemExit(main())

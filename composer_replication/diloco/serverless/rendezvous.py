"""Run rendezvous through the store, for replicas started without a shared ``run_id``."""

from __future__ import annotations

import time
import uuid
from typing import Any

from composer_replication.diloco.serverless.store import dump_json, read_json, write_atomic

__all__ = ["rendezvous", "RoundTimeoutError"]


class RoundTimeoutError(TimeoutError):
    """A round was aborted on every rank; ``missing`` lists the ranks whose object never arrived."""

    def __init__(self, message: str, *, round_id: int, missing: list[int]) -> None:
        super().__init__(message)
        self.round_id = round_id
        self.missing = missing


def rendezvous(
    fs: Any, root: str, rank: int, world_size: int, timeout_s: float, poll_interval_s: float, uri: str
) -> str:
    """Agree on a fresh run id through the store, with no launcher; returns it.

    Rank 0 draws the id and writes ``current_run.json``; a follower writes ``runs/<id>/join/rank_<r>.json``
    with a fresh nonce for every id it sees there, and accepts the run only once rank 0's ``ready.json``
    lists that nonce. A ``current_run.json`` or ``ready.json`` left by an earlier run therefore never
    makes a follower join it: the earlier ``ready.json`` cannot hold this process's nonce.

    Raises:
        RoundTimeoutError: a rank did not join within ``timeout_s`` (the message names it).
    """
    deadline = time.monotonic() + timeout_s
    current = f"{root}/current_run.json"
    if rank == 0:
        run_id = uuid.uuid4().hex[:16]
        write_atomic(fs, current, dump_json({"run": run_id}))
        nonces = {}
        while len(nonces) < world_size - 1:
            for r in range(1, world_size):
                joined = r in nonces or read_json(fs, f"{root}/runs/{run_id}/join/rank_{r}.json")
                if isinstance(joined, dict):
                    nonces[r] = joined["nonce"]
            if len(nonces) < world_size - 1:
                if time.monotonic() >= deadline:
                    missing = [r for r in range(1, world_size) if r not in nonces]
                    raise RoundTimeoutError(
                        f"rendezvous at {uri}: rank(s) {missing} did not join run {run_id} within "
                        f"{timeout_s:g} s; start every replica, or raise timeout_s",
                        round_id=-1,
                        missing=missing,
                    )
                time.sleep(poll_interval_s)
        ready = {"run": run_id, "nonces": {str(r): n for r, n in nonces.items()}}
        write_atomic(fs, f"{root}/runs/{run_id}/ready.json", dump_json(ready))
        return run_id
    nonce, joined_run = uuid.uuid4().hex, None
    while True:
        cur = read_json(fs, current)
        if cur is not None and cur["run"] != joined_run:
            joined_run = cur["run"]
            write_atomic(fs, f"{root}/runs/{joined_run}/join/rank_{rank}.json", dump_json({"nonce": nonce}))
        if joined_run is not None:
            ready = read_json(fs, f"{root}/runs/{joined_run}/ready.json")
            if ready is not None and ready["nonces"].get(str(rank)) == nonce:
                return joined_run
        if time.monotonic() >= deadline:
            raise RoundTimeoutError(
                f"rendezvous at {uri}: rank 0 did not start a run that acknowledged rank {rank} "
                f"within {timeout_s:g} s; start rank 0, or pass the same run_id to every rank",
                round_id=-1,
                missing=[0],
            )
        time.sleep(poll_interval_s)

"""Runs never mix: every object and decision is bound to a launch agreed through the store (rendezvous.py)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from tests_serverless_helpers import run_ranks

from composer_replication.diloco.serverless import ObjectStoreAllReduce, RunConflictError

FAST = {"timeout_s": 3.0, "poll_interval_s": 0.01}


def _run(uri: str, base: float, **kwargs) -> list:
    """One 2-rank run contributing ``base + rank``; per rank its mean or the exception it raised."""
    return run_ranks(lambda r: ObjectStoreAllReduce(uri, r, 2, **{**FAST, **kwargs}).allreduce(
        torch.full((2,), base + r)).tolist(), 2)


def test_two_concurrent_runs_without_a_run_id_never_average_each_other(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    out: dict[str, list] = {}
    threads = [threading.Thread(target=lambda k=k, b=b: out.__setitem__(k, _run(uri, b))) for k, b in
               (("a", 0.0), ("b", 100.0))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for key, base in (("a", 0.0), ("b", 100.0)):
        for result in out[key]:
            assert isinstance(result, RunConflictError) or result == [base + 0.5] * 2, out  # own mean, or refused
    refused = [r for v in out.values() for r in v if isinstance(r, Exception)]
    assert refused and len({str(e) for e in refused}) <= 2 and all(uri in str(e) for e in refused), out


def test_a_prefix_holding_a_live_run_is_refused_on_every_rank(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    live = [ObjectStoreAllReduce(uri, r, 2, **FAST) for r in range(2)]
    assert run_ranks(lambda r: live[r].allreduce(torch.zeros(1)).tolist(), 2) == [[0.0], [0.0]]
    second = _run(uri, 100.0)  # the first run is still live (not closed, lease not expired)
    assert all(isinstance(e, RunConflictError) for e in second), second
    assert str(second[0]) == str(second[1]) and f"the store prefix {uri} holds another live run" in str(second[0])
    assert "run_id" in str(second[0])  # the fix
    live[0].close()
    assert _run(uri, 100.0) == [[100.5, 100.5]] * 2  # once it ended, the prefix is free


def test_a_reused_run_id_is_refused_unless_resumed_and_never_reads_the_old_launch(tmp_path: Path) -> None:
    uri = str(tmp_path / "store")
    old = [ObjectStoreAllReduce(uri, r, 2, run_id="exp", **FAST) for r in range(2)]
    for _ in range(2):  # the old launch decided rounds 0 and 1
        run_ranks(lambda r: old[r].allreduce(torch.full((1,), 10.0 + r)), 2)
    old[0].close()
    again = _run(uri, 0.0, run_id="exp", timeout_s=0.5)
    assert all(isinstance(e, RunConflictError) for e in again) and str(again[0]) == str(again[1]), again
    assert "run_id 'exp' was already used at" in str(again[0]) and "resume=True" in str(again[0])

    def resumed(r: int):
        if r == 1:
            time.sleep(0.3)  # the follower finds the old launch's files first
        ar = ObjectStoreAllReduce(uri, r, 2, run_id="exp", resume=True, round_id=0, **FAST)
        return ar.allreduce(torch.full((2,), float(r))).tolist(), ar.launch_id

    out = run_ranks(resumed, 2)
    assert [o[0] for o in out] == [[0.5, 0.5]] * 2  # not the old rounds' 10.5
    assert out[0][1] == out[1][1] != old[0].launch_id


def test_a_follower_of_a_refused_launch_gets_the_same_message(tmp_path: Path) -> None:
    """Its rank 0 refused before the follower started: the follower reads the refusal from the store."""
    uri = str(tmp_path / "store")
    live = [ObjectStoreAllReduce(uri, r, 2, **FAST) for r in range(2)]
    run_ranks(lambda r: live[r].allreduce(torch.zeros(1)), 2)
    with pytest.raises(RunConflictError) as rank0:
        ObjectStoreAllReduce(uri, 0, 2, **FAST).allreduce(torch.ones(1))
    with pytest.raises(RunConflictError) as rank1:  # after its wait: the refusal came before it started
        ObjectStoreAllReduce(uri, 1, 2, timeout_s=0.5, poll_interval_s=0.01).allreduce(torch.ones(1))
    assert str(rank0.value) == str(rank1.value)


def test_a_restarted_replica_rejoins_a_live_run_with_resume(tmp_path: Path) -> None:
    """Rank 1 dies after round 0; its replacement (``resume=True``, ``round_id=1``) is admitted by rank 0 while
    round 1 waits for it, and the round commits with both. Without resume it would be refused as a second rank 1."""
    uri = str(tmp_path / "store")
    r0, old1 = (ObjectStoreAllReduce(uri, r, 2, run_id="live", **FAST) for r in range(2))
    run_ranks(lambda r: [r0, old1][r].allreduce(torch.zeros(1)), 2)

    def after_restart(r: int):
        if r == 0:
            return r0.allreduce(torch.full((2,), 0.0)).tolist()
        time.sleep(0.2)
        return ObjectStoreAllReduce(uri, 1, 2, run_id="live", resume=True, round_id=1, **FAST).allreduce(
            torch.full((2,), 1.0)).tolist()

    assert run_ranks(after_restart, 2) == [[0.5, 0.5]] * 2

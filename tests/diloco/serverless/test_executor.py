"""LocalProcessExecutor: success, failure, exit codes, cancel, timeouts, logs, replica_entrypoint, crashes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import tests_serverless_helpers as helpers

from composer_replication.diloco.serverless import (
    HFJobsExecutor,
    LocalProcessExecutor,
    ModalExecutor,
    ReplicaHandle,
    ServerlessExecutor,
    replica_entrypoint,
)
from composer_replication.diloco.serverless.executor import resolve_entrypoint


@pytest.fixture
def ex(tmp_path: Path) -> LocalProcessExecutor:
    return LocalProcessExecutor(log_dir=tmp_path / "logs")


def test_every_executor_class_satisfies_the_protocol(ex: LocalProcessExecutor) -> None:
    assert isinstance(ex, ServerlessExecutor)
    for cls in (ModalExecutor, HFJobsExecutor):
        for member in ("launch_replicas", "poll", "stream_logs", "cancel", "collect"):
            assert callable(getattr(cls, member))
        assert cls.supports_inter_replica_network is False and cls.backend_name
    assert not isinstance(object(), ServerlessExecutor)


@pytest.mark.slow
def test_success_returns_results_in_rank_order_and_logs(ex: LocalProcessExecutor) -> None:
    handles = ex.launch_replicas(2, helpers.ok, {"value": 7})
    assert [h.rank for h in handles] == [0, 1] and all(h.backend_name == "local_process" for h in handles)
    assert {"pid", "start_ts"} <= set(handles[0].metadata)
    results = ex.collect(handles, timeout=60)
    assert [(r["status"], r["exit_code"], r["error"]) for r in results] == [("succeeded", 0, None)] * 2
    assert [r["result"] for r in results] == [{"rank": 0, "value": 7}, {"rank": 1, "value": 7}]
    assert ex.poll(handles[1]) == "succeeded"
    assert "replica 1 says hello" in ex.stream_logs(handles[1])


@pytest.mark.slow
def test_failures_report_exit_code_and_error(ex: LocalProcessExecutor) -> None:
    raised = ex.launch_replicas(1, "tests_serverless_helpers.fail", {"message": "boom at step 3"})
    exited = ex.launch_replicas(1, helpers.exit_code, {"code": 3})
    (r1,), (r2,) = ex.collect(raised, timeout=60), ex.collect(exited, timeout=60)
    assert (r1["status"], r1["exit_code"]) == ("failed", 1) and r1["error"] == "ValueError: boom at step 3"
    assert "ValueError: boom at step 3" in ex.stream_logs(raised[0])  # the traceback is in the log
    assert (r2["status"], r2["exit_code"]) == ("failed", 3) and "exited with code 3" in r2["error"]


@pytest.mark.slow
def test_cancel_stops_a_running_replica(ex: LocalProcessExecutor) -> None:
    (h,) = ex.launch_replicas(1, helpers.sleep, {"seconds": 60})
    assert ex.poll(h) == "running"
    t0 = time.monotonic()
    ex.cancel(h)
    (r,) = ex.collect([h], timeout=30)
    assert r["status"] == "cancelled" and r["exit_code"] is not None and r["exit_code"] < 0
    assert time.monotonic() - t0 < 10


def test_launch_timeout_kills_the_replica_and_says_so(ex: LocalProcessExecutor) -> None:
    (h,) = ex.launch_replicas(1, helpers.sleep, {"seconds": 60}, timeout=1)
    (r,) = ex.collect([h], timeout=30)
    assert r["status"] == "failed" and "launch timeout" in r["error"]


@pytest.mark.slow
def test_collect_timeout_cancels_what_is_left(ex: LocalProcessExecutor) -> None:
    handles = ex.launch_replicas(1, helpers.sleep, {"seconds": 60}) + ex.launch_replicas(
        1, helpers.ok, {"value": 1}
    )
    assert ex.collect(handles[1:], timeout=120)[0]["status"] == "succeeded"
    results = ex.collect(handles, timeout=1)
    assert results[0]["status"] == "cancelled" and "collect(timeout=1)" in results[0]["error"]
    assert results[1]["status"] == "succeeded"


def test_bad_entrypoints_fail_at_launch(ex: LocalProcessExecutor) -> None:
    with pytest.raises(ModuleNotFoundError):
        ex.launch_replicas(1, "no_such_package.fn", {})
    with pytest.raises(ValueError, match="main"):
        resolve_entrypoint("tests_serverless_helpers")
    with pytest.raises(ValueError, match="n_replicas"):
        ex.launch_replicas(0, helpers.ok, {})


@pytest.mark.slow
def test_rank_env_is_configurable_and_gpu_only_warns(ex: LocalProcessExecutor) -> None:
    with pytest.warns(UserWarning, match="ignores gpu='H100'"):
        handles = ex.launch_replicas(
            2, helpers.rank_from, {"var": "MY_RANK", "rank_env": "MY_RANK"}, gpu="H100"
        )
    assert [r["result"] for r in ex.collect(handles, timeout=60)] == ["0", "1"]


@pytest.mark.slow
def test_replica_entrypoint_runs_replicas_through_the_store(ex: LocalProcessExecutor, tmp_path: Path) -> None:
    args = {
        "rendezvous_uri": f"file://{tmp_path}/run",
        "world_size": 3,
        "trainer_module": "tests_serverless_helpers.allreduce_trainer",
        "trainer_kwargs": {"rounds": 2},
        "poll_interval_s": 0.02,
        "timeout_s": 60,
    }
    handles = ex.launch_replicas(3, "composer_replication.diloco.serverless.replica_entrypoint", args)
    results = ex.collect(handles, timeout=120)
    assert [r["result"] for r in results] == [[1.0, 2.0]] * 3, results


def test_replica_entrypoint_needs_its_rank(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("REPLICA_RANK", raising=False)
    with pytest.raises(ValueError, match="REPLICA_RANK"):
        replica_entrypoint(str(tmp_path), 2, "tests_serverless_helpers.allreduce_trainer")


@pytest.mark.slow
def test_replica_crash_with_elastic_membership_survivors_go_on_together(
    ex: LocalProcessExecutor, tmp_path: Path
) -> None:
    args = {
        "uri": str(tmp_path / "store"),
        "world_size": 3,
        "run_id": "elastic",
        "rounds": 3,
        "crash_rank": 2,
        "crash_round": 2,
        "timeout_s": 3.0,
        "min_world_size": 2,
    }
    results = ex.collect(ex.launch_replicas(3, helpers.diloco_replica, args), timeout=240)
    assert (results[2]["status"], results[2]["exit_code"]) == ("failed", 3)
    a, b = results[0]["result"], results[1]["result"]
    assert a["committed"] == b["committed"] == 3 and a["dropped"] == 0 and a["participants"] == 2
    assert a["digests"] == b["digests"] and len(set(a["digests"])) == 3  # every round moved the model


@pytest.mark.slow
@pytest.mark.parametrize("max_dropped_rounds", [None, 0])
def test_replica_crash_mid_run_others_drop_the_round_and_go_on_or_stop(
    ex: LocalProcessExecutor, tmp_path: Path, max_dropped_rounds: int | None
) -> None:
    args = {
        "uri": str(tmp_path / "store"),
        "world_size": 3,
        "run_id": "crash",
        "rounds": 3,
        "crash_rank": 2,
        "crash_round": 2,
        "timeout_s": 3.0,
        "max_dropped_rounds": max_dropped_rounds,
    }
    results = ex.collect(ex.launch_replicas(3, helpers.diloco_replica, args), timeout=240)
    assert (results[2]["status"], results[2]["exit_code"]) == ("failed", 3)
    if max_dropped_rounds is None:  # go on: round 1 committed, rounds 2 and 3 dropped alike on both
        a, b = results[0]["result"], results[1]["result"]
        assert [r["status"] for r in results[:2]] == ["succeeded"] * 2
        assert a["committed"] == b["committed"] == 1 and a["dropped"] == b["dropped"] == 2
        assert a["digests"][0] == b["digests"][0] and a["digests"][1] == a["digests"][0]  # rolled back
        assert a["digests"] == b["digests"]
    else:  # stop cleanly: both survivors raise DroppedRoundError naming the missing rank
        for r in results[:2]:
            assert r["status"] == "failed" and r["exit_code"] == 1
            assert "DroppedRoundError" in r["error"] and "rank(s) [2]" in r["error"]


def test_handle_is_a_plain_dataclass() -> None:
    h = ReplicaHandle(rank=0, backend_name="local_process", metadata={"pid": 12345})
    assert h.metadata["pid"] == 12345 and ReplicaHandle(1, "x").metadata == {}

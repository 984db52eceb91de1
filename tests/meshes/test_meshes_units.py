"""The mesh helpers that need no process: averaging, fault specs, rank naming, pair collection, failures."""

from __future__ import annotations

import math

import pytest
import torch

from meshes import (
    FaultSpec,
    attach_meshes,
    mean_metrics,
    mean_tensors,
    names_rank,
    replica_dir,
)
from meshes.supervision import ActorFailure, to_failure


def test_mean_tensors_averages_and_keeps_dtype():
    a = {"w": torch.tensor([1.0, 2.0], dtype=torch.bfloat16), "b": torch.tensor([[1.0]])}
    b = {"w": torch.tensor([3.0, 4.0], dtype=torch.bfloat16), "b": torch.tensor([[3.0]])}
    out = mean_tensors([a, b])
    assert out["w"].dtype == torch.bfloat16 and torch.equal(out["w"], torch.tensor([2.0, 3.0], dtype=torch.bfloat16))
    assert torch.equal(out["b"], torch.tensor([[2.0]]))
    assert torch.equal(mean_tensors([a])["b"], a["b"])


def test_mean_tensors_rejects_mismatches():
    with pytest.raises(ValueError, match="at least one replica"):
        mean_tensors([])
    with pytest.raises(ValueError, match="different shapes"):
        mean_tensors([{"w": torch.zeros(2)}, {"w": torch.zeros(3)}])
    with pytest.raises(ValueError, match="replica 1 sends names"):
        mean_tensors([{"w": torch.zeros(2)}, {"v": torch.zeros(2)}])


def test_mean_metrics_means_sums_counts_and_skips_nan():
    out = mean_metrics([{"loss/total": 1.0, "replay/num_pairs": 2.0, "perf/tokens_per_s": 10.0,
                         "rollout/errors/json_decode": 1.0, "x": float("nan")},
                        {"loss/total": 3.0, "replay/num_pairs": 1.0, "perf/tokens_per_s": 5.0, "x": float("nan"),
                         "y": 4.0}])
    assert out["loss/total"] == 2.0 and out["replay/num_pairs"] == 3.0 and out["perf/tokens_per_s"] == 15.0
    assert out["rollout/errors/json_decode"] == 1.0
    assert math.isnan(out["x"]) and out["y"] == 4.0


def test_mean_metrics_takes_diloco_sync_keys_from_the_replicas_that_synced():
    synced = {"diloco/synced": 1.0, "diloco/outer_step": 3.0, "diloco/participants": 2.0, "loss/total": 1.0}
    behind = {"diloco/synced": 0.0, "diloco/outer_step": 9.0, "diloco/participants": 1.0, "loss/total": 3.0}
    out = mean_metrics([synced, behind])
    assert out["diloco/outer_step"] == 3.0 and out["diloco/participants"] == 2.0 and out["loss/total"] == 2.0
    inner = mean_metrics([{**behind, "diloco/synced": 0.0}, {**synced, "diloco/synced": 0.0}])
    assert "diloco/outer_step" not in inner and "diloco/participants" not in inner  # no sync this step
    only_behind = mean_metrics([synced, {**behind, "diloco/fragment": 1.0}])  # a key no synced replica sends
    assert "diloco/fragment" not in only_behind and only_behind["diloco/outer_step"] == 3.0


def test_fault_spec_parses_and_fires():
    spec = FaultSpec("trainer:1:3:raise")
    assert (spec.actor, spec.rank, spec.step, spec.mode) == ("trainer", 1, 3, "raise")
    spec.maybe_fire("trainer", 0, 3)  # other rank: nothing
    spec.maybe_fire("teacher", 1, 3)  # other actor: nothing
    with pytest.raises(RuntimeError, match=r"injected fault \(trainer:1:3:raise\)"):
        spec.maybe_fire("trainer", 1, 3)
    for bad in ("trainer:1:3", "bob:0:0:raise", "trainer:a:0:exit", "trainer:0:0:explode"):
        with pytest.raises(ValueError, match="ACTOR:RANK:STEP:MODE"):
            FaultSpec(bad)


def test_names_rank_wraps_sync_and_async():
    class A:
        rank = 3

        @names_rank("trainer")
        def f(self):
            raise KeyError("missing thing")

        @names_rank("teacher")
        async def g(self):
            raise ValueError("bad\nsecond line")

    with pytest.raises(RuntimeError, match=r"^trainer rank 3: KeyError: 'missing thing'$"):
        A().f()
    import asyncio

    with pytest.raises(RuntimeError, match=r"^teacher rank 3: ValueError: bad$"):
        asyncio.run(A().g())


def test_to_failure_classifies_timeouts_and_plain_errors():
    f = to_failure(TimeoutError(), actor="trainer", what="train_step(3)", timeout_s=5.0)
    assert isinstance(f, ActorFailure) and f.kind == "timeout" and f.rank is None
    assert "actor 'trainer' timed out during train_step(3): no answer within 5.0 s" in str(f)
    g = to_failure(OSError("boom"), actor="reducer")
    assert g.kind == "raised" and "OSError: boom" in str(g)
    assert to_failure(f, actor="x") is f


def test_replica_dir_and_attach():
    assert str(replica_dir("/r", 0)) == "/r" and str(replica_dir("/r", 2)) == "/r/replicas/rank_2"
    with pytest.raises(ValueError, match="'mesh.workers' is empty"):
        attach_meshes([])
    with pytest.raises(ValueError, match="worker address '127.0.0.1:1' must look like tcp://HOST:PORT"):
        attach_meshes(["127.0.0.1:1"])
    with pytest.raises(ValueError, match=r"'mesh.teacher_worker' must index 'mesh.workers' \(0..0\), got 1"):
        attach_meshes(["tcp://127.0.0.1:1"], teacher_worker=1)


def test_replica_hosts_place_and_move_replicas():
    from meshes.hosts import ReplicaHosts, is_loopback

    hosts = ReplicaHosts(workers=["tcp://h1:1", "tcp://127.0.0.1:2"], spares=["tcp://h3:1"])
    assert [hosts.where(i) for i in range(3)] == ["tcp://h1:1", "tcp://127.0.0.1:2", "tcp://h1:1"]
    assert hosts.advertise_host(0) == "h1" and hosts.advertise_host(1) == "127.0.0.1"
    assert [hosts.local_index(i) for i in range(3)] == [0, 0, 1]  # replica 2 is the second on h1
    assert hosts.replace_worker(0) == "tcp://h3:1"  # every slot on the lost worker moves
    assert hosts.where(0) == hosts.where(2) == "tcp://h3:1" and hosts.where(1) == "tcp://127.0.0.1:2"
    assert hosts.replace_worker(1) is None  # no spare left
    assert ReplicaHosts().where(5) == "local" and ReplicaHosts().advertise_host(5) == "127.0.0.1"
    assert is_loopback("tcp://localhost:3") and not is_loopback("tcp://node1:3")


def test_worker_address_parsing():
    from recipes.monarch.worker import split_address

    assert split_address("tcp://127.0.0.1:26601") == ("127.0.0.1", 26601)
    assert split_address("tcp://node1.cluster:5@tcp://0.0.0.0:5") == ("0.0.0.0", 5)
    with pytest.raises(ValueError, match="--address must look like tcp://HOST:PORT"):
        split_address("node1:5")


def test_display_shows_replicas_restarts_and_syncs():
    from recipes.monarch.display import format_step, summary_rows

    line = format_step(3, 8, {"loss/total": 1.0, "diloco/live_replicas": 1.0, "diloco/restarts": 1.0,
                              "diloco/outer_step": 2.0, "diloco/participants": 1.0}, 0.0)
    assert "replicas=1 restarts=1  sync=2(n=1)" in line
    rows = dict(summary_rows({"restarts": {"0": 0, "1": 1}, "replica_param_sha256": {"0": "ab" * 32, "1": "ab" * 32}}))
    assert rows["replica restarts"] == "0: 0, 1: 1"
    assert rows["replica parameters (sha256)"].startswith("2 replica(s), identical: 0=abababababab")

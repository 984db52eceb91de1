"""MockManager: the torchft Manager surface DiLoCo touches, and real torchft DiLoCo across processes."""

from __future__ import annotations

import ast
import inspect
import uuid
from pathlib import Path

import pytest
import torch
from tests_serverless_helpers import diloco_replica, mlp, run_ranks

from composer_replication.diloco.serverless import (
    DroppedRoundError,
    LocalProcessExecutor,
    MockManager,
    ObjectStoreAllReduce,
)

torchft_local_sgd = pytest.importorskip("torchft.local_sgd")


def manager_members_used_by_torchft() -> set[str]:
    """Every attribute read on a manager in torchft's local_sgd.py (``self._manager.X`` / ``manager.X``)."""
    tree = ast.parse(Path(inspect.getsourcefile(torchft_local_sgd)).read_text())
    used = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        base = node.value
        if (isinstance(base, ast.Attribute) and base.attr == "_manager") or (
            isinstance(base, ast.Name) and base.id == "manager"
        ):
            used.add(node.attr)
    return used


def test_mock_manager_has_every_member_torchft_diloco_touches() -> None:
    used = manager_members_used_by_torchft()
    # The parser must find the members the notes list; if torchft moves code, this fails loudly.
    assert {"allreduce", "should_commit", "start_quorum", "current_step", "_use_async_quorum"} <= used, used
    mgr = MockManager(ObjectStoreAllReduce("memory://surface", 0, 1))
    missing = sorted(m for m in used if not hasattr(mgr, m))
    assert not missing, (
        f"torchft DiLoCo uses manager members MockManager lacks: {missing}; update MockManager"
    )
    assert mgr._use_async_quorum is False
    assert {"num_participants", "rank"} <= set(dir(mgr))


def test_mock_manager_also_covers_what_the_engine_replica_reads() -> None:
    """composer_replication.diloco.replica.DilocoReplica (the mesh path) reads a few more manager members;
    MockManager has them, so that replica can run serverless once it accepts a manager."""
    replica = pytest.importorskip("composer_replication.diloco.replica")
    tree = ast.parse(Path(inspect.getsourcefile(replica)).read_text())
    used = {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "manager"
    }
    assert "current_step" in used, used
    mgr = MockManager(ObjectStoreAllReduce("memory://replica-surface", 0, 1))
    assert not sorted(m for m in used if not hasattr(mgr, m))


def test_world_size_1_commits_and_steps() -> None:
    mgr = MockManager(ObjectStoreAllReduce("memory://solo", 0, 1))
    t = torch.ones(3)
    mgr.start_quorum()
    mgr.allreduce(t).wait()
    assert mgr.should_commit() and mgr.current_step() == 1 and mgr.num_participants() == 1
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_a_failed_round_is_not_committed_and_stop_is_configurable(tmp_path: Path) -> None:
    ar = ObjectStoreAllReduce(str(tmp_path), 0, 2, run_id="x", timeout_s=0.2, poll_interval_s=0.01)
    mgr = MockManager(ar, max_dropped_rounds=1)
    for expect_raise in (False, True):
        mgr.start_quorum()
        work = mgr.allreduce(torch.ones(2))
        assert work.wait() is True  # errors are reported through should_commit, as in torchft
        assert work.get_future().done()
        if expect_raise:
            with pytest.raises(DroppedRoundError, match="2 consecutive round"):
                mgr.should_commit()
        else:
            assert mgr.should_commit() is False
            assert mgr.current_step() == 0 and mgr.num_participants() == 1


def test_register_state_dict_fn_refuses_duplicates() -> None:
    mgr = MockManager(ObjectStoreAllReduce("memory://sd", 0, 1))
    mgr.register_state_dict_fn("a", lambda s: None, lambda: 1)
    with pytest.raises(ValueError, match="already registered"):
        mgr.register_state_dict_fn("a", lambda s: None, lambda: 1)
    assert mgr.user_state_dict() == {"a": 1}
    mgr.disallow_state_dict_read()
    with pytest.raises(RuntimeError, match="during a DiLoCo sync"):
        mgr.user_state_dict()


def test_diloco_in_threads_matches_the_outer_sgd_formula() -> None:
    """One round of real DiLoCo: p = init - 0.7 * 1.9 * mean(pseudo-gradient) (Nesterov first step)."""
    from composer_replication.diloco import make_diloco_outer_loop

    uri = f"memory://formula-{uuid.uuid4().hex}"

    def replica(r: int):
        model = mlp()
        init = [p.detach().clone() for p in model.parameters()]
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        mgr = MockManager(ObjectStoreAllReduce(uri, r, 2, run_id="f", timeout_s=5, poll_interval_s=0.01))
        x = torch.full((2, 4), float(r + 1))
        with make_diloco_outer_loop(mgr, [model], inner, sync_every=1):
            inner.zero_grad()
            model(x).sum().backward()
            local = [p.detach() - 0.1 * p.grad for p in model.parameters()]
            inner.step()
        return init, local, [p.detach().clone() for p in model.parameters()], mgr.current_step()

    (init, local0, final0, step0), (_, local1, final1, step1) = run_ranks(replica, 2)
    assert step0 == step1 == 1
    for i, p0, l0, l1, f0, f1 in zip(init, init, local0, local1, final0, final1):
        pseudo = ((p0 - l0) + (p0 - l1)) / 2
        torch.testing.assert_close(f0, i - 0.7 * 1.9 * pseudo, rtol=1e-5, atol=1e-6)
        assert torch.equal(f0, f1)


@pytest.mark.slow
@pytest.mark.parametrize("bucketized", [False, True])
def test_two_processes_running_torchft_diloco_end_bit_identical(tmp_path: Path, bucketized: bool) -> None:
    ex = LocalProcessExecutor(log_dir=tmp_path / "logs")
    args = {
        "uri": f"file://{tmp_path}/store",
        "world_size": 2,
        "run_id": "bits",
        "rounds": 3,
        "bucketized": bucketized,
    }
    results = ex.collect(ex.launch_replicas(2, diloco_replica, args), timeout=240)
    assert [r["status"] for r in results] == ["succeeded"] * 2, results
    a, b = (r["result"] for r in results)
    assert a["committed"] == b["committed"] == 3 and a["dropped"] == 0
    assert a["digests"] == b["digests"]  # identical after every round
    assert all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert any(not torch.equal(x, y) for x, y in zip(a["params"], mlp().parameters()))  # it trained


def test_streaming_diloco_two_fragments_with_delay_stays_in_step() -> None:
    """Streaming DiLoCo (2 fragments, sync delay 1): fragments sync in turn, each bit-identical once synced."""
    from composer_replication.diloco import make_diloco_outer_loop

    uri = f"memory://stream-{uuid.uuid4().hex}"

    def replica(r: int):
        model = mlp()
        frags = [model[0], model[2]]
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
        mgr = MockManager(ObjectStoreAllReduce(uri, r, 2, run_id="s", timeout_s=10, poll_interval_s=0.01))
        g = torch.Generator().manual_seed(r)
        snapshots = []
        with make_diloco_outer_loop(mgr, frags, inner, sync_every=4, fragment_sync_delay=1):
            for step in range(8):
                x = torch.randn(8, 4, generator=g)
                inner.zero_grad()
                model(x).pow(2).mean().backward()
                inner.step()
                if (step + 1) % 2 == 0:  # a fragment has just synced
                    snapshots.append([[p.detach().clone() for p in f.parameters()] for f in frags])
        return snapshots, mgr.current_step()

    (snap0, step0), (snap1, step1) = run_ranks(replica, 2)
    assert step0 == step1 == 4
    for k, (s0, s1) in enumerate(zip(snap0, snap1)):
        synced = k % 2  # current_step() % 2 picks the fragment: 0, 1, 0, 1
        assert all(torch.equal(a, b) for a, b in zip(s0[synced], s1[synced])), k
        assert any(not torch.equal(a, b) for a, b in zip(s0[1 - synced], s1[1 - synced])), k


@pytest.mark.parametrize("elastic", [True, False])
def test_one_nan_replica_never_poisons_the_others_through_the_store(elastic: bool) -> None:
    """Replica 1's local step leaves a NaN: its pseudo-gradient counts as missing. Elastic: round 1 commits
    with replica 0's alone on both; strict: it is dropped on both. Either way both stay finite and equal."""
    from composer_replication.diloco import make_diloco_outer_loop

    uri = f"memory://nan-{uuid.uuid4().hex}"

    def replica(r: int):
        model = mlp()
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        ar = ObjectStoreAllReduce(uri, r, 2, run_id="nan", timeout_s=5, poll_interval_s=0.01,
                                  min_world_size=1 if elastic else None)
        mgr = MockManager(ar)
        outer = make_diloco_outer_loop(mgr, [model], inner, sync_every=2)
        with outer:
            for step in range(4):
                inner.zero_grad()
                model(torch.full((2, 4), float(r + 1))).sum().backward()
                inner.step()
                if r == 1 and step == 0:
                    with torch.no_grad():
                        model[0].weight[0, 0] = float("nan")
        return [p.detach().clone() for p in model.parameters()], mgr.current_step(), outer.finite_guard.own_rounds

    (p0, step0, bad0), (p1, step1, bad1) = run_ranks(replica, 2)
    assert all(bool(torch.isfinite(p).all()) for p in p0 + p1)
    assert all(torch.equal(a, b) for a, b in zip(p0, p1))
    assert (step0, step1) == ((2, 2) if elastic else (1, 1))
    assert (bad0, bad1) == (0, 1)

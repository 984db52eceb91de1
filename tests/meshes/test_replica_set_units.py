"""ReplicaSet's failure policy without processes: fake hosts, procs and actors record what it does."""

from __future__ import annotations

import pytest

from composer_replication.diloco.config import DilocoConfig
from meshes import ActorFailure
from meshes.replicas import Replica, ReplicaSet


class _Done:
    def __init__(self, value=None) -> None:
        self.value = value

    def get(self, timeout=None):
        return self.value


class _Endpoint:
    def __init__(self, log: list, name: str) -> None:
        self.log, self.name = log, name

    def call_one(self, *args, **kwargs):
        self.log.append(self.name)
        return _Done({"pid": 1})


class _Actor:
    def __init__(self, log: list) -> None:
        self.setup, self.leave_diloco = _Endpoint(log, "setup"), _Endpoint(log, "leave_diloco")


class _Procs:
    def __init__(self, log: list) -> None:
        self.log = log

    def spawn(self, name, cls):
        self.log.append("spawn")
        return _Actor(self.log)

    def stop(self):
        self.log.append("stop")
        return _Done()


class _Hosts:
    def __init__(self, where: str, spare: str | None) -> None:
        self.log: list = []
        self._where, self.spare = where, spare

    def where(self, index):
        return self._where

    def spawn(self, index):
        return _Procs(self.log)

    def replace_worker(self, index):
        return self.spare

    @property
    def spares(self):
        return [self.spare] if self.spare else []

    def describe(self, address):
        return address


def _set(policy: str, *, where="tcp://h2:1", spare=None, max_restarts=2) -> tuple[ReplicaSet, _Hosts]:
    hosts = _Hosts(where, spare)
    cfg = DilocoConfig(replicas=2, sync_every=2, on_host_loss=policy, max_restarts=max_restarts)
    events: list[str] = []
    rs = ReplicaSet(
        hosts,
        cfg,
        lighthouse_addr="http://127.0.0.1:1",
        setup_args=lambda i: ((), {}),
        setup_timeout_s=10,
        call_timeout_s=10,
        on_event=events.append,
    )
    rs.events_text = events
    return rs, hosts


def _timeout() -> ActorFailure:
    return ActorFailure(
        actor="trainer", rank=0, kind="timeout", what="train_step(5)", detail="no answer within 10 s"
    )


def test_a_lost_host_under_stop_ends_the_run_naming_the_worker():
    rs, hosts = _set("stop")
    with pytest.raises(
        ActorFailure,
        match=r"rank 1 timed out during train_step\(5\): worker tcp://h2:1 stopped "
        r"answering .*'diloco.on_host_loss' is stop",
    ):
        rs._fail_replica(Replica(1, _Procs(hosts.log), None), _timeout(), 5)
    assert hosts.log == ["stop"]  # its procs were stopped first


def test_a_lost_host_under_shrink_drops_the_replica():
    rs, hosts = _set("shrink")
    rs._fail_replica(Replica(1, _Procs(hosts.log), None), _timeout(), 5)
    assert rs.dropped == {1} and not rs.pending and rs.restarts[1] == 0
    assert "replica 1: worker tcp://h2:1 lost; going on with 0 replica(s)" in rs.events_text


def test_a_lost_host_under_replace_moves_the_replica_or_stops_without_spares():
    rs, hosts = _set("replace", spare="tcp://h3:1")
    rs._fail_replica(Replica(1, _Procs(hosts.log), None), _timeout(), 5)
    assert 1 in rs.pending and rs.restarts[1] == 1 and hosts.log == ["stop", "spawn", "setup"]
    rs2, hosts2 = _set("replace", spare=None)
    with pytest.raises(ActorFailure, match="no spare worker is left"):
        rs2._fail_replica(Replica(1, _Procs(hosts2.log), None), _timeout(), 5)


def test_a_local_death_restarts_until_max_restarts():
    rs, hosts = _set("stop", where="local", max_restarts=1)
    died = ActorFailure(
        actor="trainer", rank=0, kind="died", what="train_step(3)", detail="exited with code 3"
    )
    rs._fail_replica(Replica(1, _Procs(hosts.log), None), died, 3)  # a timeout-free death: restart
    assert rs.restarts[1] == 1 and 1 in rs.pending
    with pytest.raises(
        ActorFailure,
        match=r"actor 'trainer' rank 1 died \(its process exited\) during "
        r"train_step\(3\): exited with code 3 \(replica 1 failed 2 time\(s\)",
    ):
        rs._fail_replica(rs.pending.pop(1), died, 3)
    assert [e["replica"] for e in rs.events] == [1, 1]

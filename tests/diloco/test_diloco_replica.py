"""DilocoReplica without Monarch: two replicas in threads of one process, a real torchft lighthouse and gloo.

Checks that the replicas hold identical parameters after every sync, that the saved DiLoCo state resumes
exactly, that a replacement joining a running group heals from its peer, plus the pure helpers
(config checks, data shards, fragments, digests).
"""

from __future__ import annotations

import copy
import threading
import time

import pytest
import torch

from composer_replication.diloco.config import DilocoConfig
from composer_replication.diloco.replica import (
    DilocoReplica,
    Lighthouse,
    param_sha256,
    shard_training_data,
    split_fragments,
)

_INIT = threading.Lock()


class MLPTrainer:
    """The trainer surface DilocoReplica needs, over a small MLP; data is a function of (rank, step)."""

    def __init__(self, rank: int) -> None:
        with _INIT:  # the global RNG is shared by threads
            torch.manual_seed(0)
            self.model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.rank, self.step = rank, 0

    def train_step(self, step: int) -> dict[str, float]:
        x = torch.randn(16, 4, generator=torch.Generator().manual_seed(1000 * self.rank + step))
        loss = ((self.model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.step = step + 1
        return {"loss/total": float(loss.detach())}

    def state_dict(self):
        return {
            "model": {k: v.clone() for k, v in self.model.state_dict().items()},
            "optimizer": self.optimizer.state_dict(),
            "step": self.step,
        }

    def load_state_dict(self, state) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step = state["step"]


CFG = DilocoConfig(replicas=2, sync_every=4, heartbeat_timeout_ms=500, quorum_timeout_s=20, pg_timeout_s=5)


def _lockstep(replicas: dict[int, DilocoReplica], steps: range) -> dict[int, list[dict]]:
    """Run ``steps`` on every replica in its own thread, all at the same step (like the controller)."""
    barrier, out = threading.Barrier(len(replicas)), {i: [] for i in replicas}

    def run(i: int) -> None:
        for s in steps:
            barrier.wait()
            out[i].append(replicas[i].train_step(s))

    threads = [threading.Thread(target=run, args=(i,)) for i in replicas]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return out


@pytest.fixture
def lighthouse():
    lh = Lighthouse(CFG)
    yield lh
    lh.shutdown()


def _group(lighthouse, trainers):
    return {
        i: DilocoReplica(t, CFG, replica_id=f"replica_{i}", lighthouse_addr=lighthouse.address)
        for i, t in trainers.items()
    }


def test_replicas_hold_one_model_after_every_sync(lighthouse):
    group = _group(lighthouse, {0: MLPTrainer(0), 1: MLPTrainer(1)})
    try:
        out = _lockstep(group, range(8))
    finally:
        for r in group.values():
            r.shutdown()
    syncs = [[m for m in out[i] if m["diloco/synced"]] for i in (0, 1)]
    assert [m["diloco/outer_step"] for m in syncs[0]] == [1.0, 2.0]
    for a, b in zip(*syncs):
        assert a["diloco/participants"] == b["diloco/participants"] == 2.0
        assert a["diloco/param_sha256"] == b["diloco/param_sha256"]
    assert syncs[0][0]["diloco/param_sha256"] != syncs[0][1]["diloco/param_sha256"]


def test_saved_diloco_state_resumes_exactly(lighthouse):
    trainers = {0: MLPTrainer(0), 1: MLPTrainer(1)}
    group = _group(lighthouse, trainers)
    try:
        _lockstep(group, range(4))
        saved = copy.deepcopy(
            {i: (trainers[i].state_dict(), group[i].state_dict()) for i in group}
        )  # as on disk
        full = _lockstep(group, range(4, 12))
    finally:
        for r in group.values():
            r.shutdown()
    assert saved[0][1]["manager"]["step"] == 1 and saved[0][1]["local_step"] == 0
    fresh = {i: MLPTrainer(i) for i in (0, 1)}
    for i, t in fresh.items():
        t.load_state_dict(saved[i][0])
    lh2 = Lighthouse(CFG)  # a resumed run starts a new lighthouse
    group2 = _group(lh2, fresh)
    try:
        for i in group2:
            group2[i].load_state_dict(saved[i][1])
        resumed = _lockstep(group2, range(4, 12))
    finally:
        for r in group2.values():
            r.shutdown()
        lh2.shutdown()
    digests = [[m.get("diloco/param_sha256") for m in run[0]] for run in (full, resumed)]
    assert digests[0] == digests[1] and digests[0][-1] is not None


def test_a_replacement_heals_from_its_peer(lighthouse):
    """Replica 1 stops after step 5; the survivor commits alone; a fresh replica 1 joins and heals."""
    trainers = {0: MLPTrainer(0), 1: MLPTrainer(1)}
    group = _group(lighthouse, trainers)
    _lockstep(group, range(4))
    group[1].shutdown()  # a finished (or stopped) replica ends its heartbeat: nobody waits out the quorum timeout
    t0 = time.monotonic()
    alone = _lockstep({0: group[0]}, range(4, 8))
    assert [m["diloco/participants"] for m in alone[0] if m["diloco/synced"]] == [1.0]
    assert time.monotonic() - t0 < CFG.quorum_timeout_s / 2
    new = DilocoReplica(
        MLPTrainer(1),
        CFG,
        replica_id="replica_1",
        lighthouse_addr=lighthouse.address,
        local_step=CFG.period - 1,
    )
    out: dict[int, dict] = {}
    joiner = threading.Thread(target=lambda: out.setdefault(1, new.train_step(8)))
    joiner.start()  # asks for a quorum at once and waits for the survivor's next one
    try:
        rest, step = [], 8
        while (
            joiner.is_alive() and step < 8 + 4 * 8
        ):  # it is taken in at the survivor's next quorum it waits for
            rest += _lockstep({0: group[0]}, range(step, step + 4))[0]
            step += 4
        joiner.join(timeout=30)
        synced = {m["diloco/outer_step"]: m for m in rest if m["diloco/synced"]}
        assert out[1]["diloco/synced"] == 1.0
        same = synced[out[1]["diloco/outer_step"]]  # the survivor's sync that healed it
        assert same["diloco/participants"] == 2.0
        assert out[1]["diloco/param_sha256"] == same["diloco/param_sha256"]
    finally:
        group[0].shutdown()
        new.shutdown()


def test_config_rejects_bad_values_naming_the_key():
    with pytest.raises(
        ValueError, match=r"'diloco.sync_every' \(5\) must be a multiple of 'diloco.fragments'"
    ):
        DilocoConfig(sync_every=5, fragments=2)
    with pytest.raises(ValueError, match=r"'diloco.heartbeat_timeout_ms' \(5000\) must be below"):
        DilocoConfig(heartbeat_timeout_ms=5000, quorum_timeout_s=5)
    with pytest.raises(ValueError, match=r"'diloco.min_replicas' \(3\) cannot exceed"):
        DilocoConfig(replicas=2, min_replicas=3)
    assert not DilocoConfig().enabled and DilocoConfig(replicas=2, sync_every=6, fragments=3).period == 2


def test_shards_are_disjoint_and_cover_the_data():
    from composer_replication.engine.data import TrainingData

    class Env:
        def score(self, prompt, text):
            return 0.0

    data = TrainingData(environment=Env(), prompts=list(range(7)))
    shards = [shard_training_data(data, r, 3, keep_eval=2) for r in range(3)]
    assert sorted(p for s in shards for p in s.prompts) == list(range(7))
    assert not set(shards[0].prompts) & set(shards[1].prompts)
    assert all(s.eval_prompts == [0, 1] for s in shards)  # every replica evaluates on the same prompts
    with pytest.raises(ValueError, match="replica 2 of 3 gets no prompt and no pair"):
        shard_training_data(TrainingData(environment=Env(), prompts=[0, 1]), 2, 3)


def test_fragments_split_parameters_without_copies():
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(3)])
    frags = split_fragments(model, 2)
    params = [p for f in frags for p in f.parameters()]
    assert len(params) == 6 and {id(p) for p in params} == {id(p) for p in model.parameters()}
    assert split_fragments(model, 1) == [model]
    with pytest.raises(ValueError, match=r"'diloco.fragments' must be in \[1, 6\]"):
        split_fragments(model, 7)
    digest = param_sha256(model)
    with torch.no_grad():
        model[0].weight[0, 0] += 1e-6
    assert param_sha256(model) != digest


class PoisonedTrainer(MLPTrainer):
    """Its inner step at ``poison_steps`` leaves NaN in one weight (a bad batch, an overflow)."""

    def __init__(self, rank: int, poison_steps: tuple[int, ...] = ()) -> None:
        super().__init__(rank)
        self.poison_steps = poison_steps

    def train_step(self, step: int) -> dict[str, float]:
        out = super().train_step(step)
        if step in self.poison_steps:
            with torch.no_grad():
                self.model[0].weight[0, 0] = float("nan")
        return out


def _finite(model: torch.nn.Module) -> bool:
    return all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_one_nan_replica_never_poisons_the_others(lighthouse):
    """Replica 1's pseudo-gradient is NaN in round 1: the round commits with replica 0's alone, on both;
    replica 1 resets to the new global model and its NaN is logged as diloco/nonfinite/1."""
    trainers = {0: PoisonedTrainer(0), 1: PoisonedTrainer(1, poison_steps=(2,))}
    group = _group(lighthouse, trainers)
    try:
        out = _lockstep(group, range(8))
    finally:
        for r in group.values():
            r.shutdown()
    assert _finite(trainers[0].model) and _finite(trainers[1].model)
    first = [out[i][3] for i in (0, 1)]  # the sync of round 1
    assert first[0]["diloco/param_sha256"] == first[1]["diloco/param_sha256"]
    assert first[1]["diloco/nonfinite/1"] == 1.0 and "diloco/nonfinite/0" not in first[0]
    assert first[0]["diloco/nonfinite"] == first[1]["diloco/nonfinite"] == 1.0
    assert first[0]["diloco/committed"] == 1.0
    assert out[0][7]["diloco/param_sha256"] == out[1][7]["diloco/param_sha256"]  # round 2: both finite again
    assert out[1][7]["diloco/nonfinite"] == 0.0


def test_a_replica_that_stays_nonfinite_raises_for_its_restart(lighthouse):
    """Past 'diloco.max_nonfinite_rounds' consecutive non-finite syncs the replica raises NonFiniteReplicaError
    (its supervisor restarts it, and it heals from the survivors); the survivor committed without it."""
    import dataclasses

    from composer_replication.diloco.replica import NonFiniteReplicaError

    cfg = dataclasses.replace(CFG, max_nonfinite_rounds=0)
    trainers = {0: PoisonedTrainer(0), 1: PoisonedTrainer(1, poison_steps=(1,))}
    group = {i: DilocoReplica(t, cfg, replica_id=f"replica_{i}", lighthouse_addr=lighthouse.address)
             for i, t in trainers.items()}
    barrier, out = threading.Barrier(2), {}

    def run(i: int) -> None:
        try:
            for s in range(4):
                barrier.wait()
                out[i] = group[i].train_step(s)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in group]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        for r in group.values():
            r.shutdown()
    assert isinstance(out[1], NonFiniteReplicaError) and "'diloco.max_nonfinite_rounds' = 0" in str(out[1])
    assert out[0]["diloco/committed"] == 1.0 and out[0]["diloco/nonfinite"] == 1.0
    assert _finite(trainers[0].model) and _finite(trainers[1].model)

"""Helpers shared by the serverless tests (importable: pytest puts this folder on sys.path, and spawned
replica processes inherit that path). Replica functions here run in child processes."""

from __future__ import annotations

import hashlib
import os
import threading
import time

import torch

from composer_replication.diloco import make_diloco_outer_loop
from composer_replication.diloco.serverless import MockManager, ObjectStoreAllReduce


def run_ranks(fn, world_size: int) -> list:
    """Run ``fn(rank)`` in one thread per rank; returns results (or the exception each raised)."""
    out: list = [None] * world_size

    def body(r: int) -> None:
        try:
            out[r] = fn(r)
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            out[r] = exc

    threads = [threading.Thread(target=body, args=(r,)) for r in range(world_size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


def digest(model: torch.nn.Module) -> str:
    """SHA-256 of every parameter's bytes, in order."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


_INIT_LOCK = threading.Lock()  # torch's RNG is process-wide: threads (run_ranks) must not seed it concurrently


def mlp(seed: int = 0) -> torch.nn.Module:
    """A small MLP, the same on every replica for the same seed (also when replicas are threads)."""
    with _INIT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))


# ---------------------------------------------------------------------------- replica functions


def diloco_replica(
    *,
    uri: str,
    world_size: int,
    run_id: str,
    rounds: int,
    sync_every: int = 3,
    crash_rank: int | None = None,
    crash_round: int | None = None,
    max_dropped_rounds: int | None = None,
    timeout_s: float = 5.0,
    bucketized: bool = False,
    min_world_size: int | None = None,
) -> dict:
    """Real torchft DiLoCo over MockManager(ObjectStoreAllReduce); returns per-round digests."""
    from torchft.local_sgd import DiLoCo

    rank = int(os.environ["REPLICA_RANK"])
    ar = ObjectStoreAllReduce(
        uri,
        rank,
        world_size,
        run_id=run_id,
        timeout_s=timeout_s,
        poll_interval_s=0.02,
        min_world_size=min_world_size,
    )
    manager = MockManager(ar, max_dropped_rounds=max_dropped_rounds)
    model = mlp()
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    if bucketized:
        outer_opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        outer = DiLoCo(
            manager,
            [model],
            inner,
            outer_opt,
            sync_every=sync_every,
            use_bucketization=True,
            bucket_cap_mb=1 * 1024 * 1024,
        )
    else:
        outer = make_diloco_outer_loop(manager, [model], inner, sync_every=sync_every)
    g = torch.Generator().manual_seed(1000 + rank)  # each replica sees different data
    digests = []
    with outer:
        for step in range(rounds * sync_every):
            if rank == crash_rank and step == crash_round * sync_every - 1:
                os._exit(3)  # dies before writing its object of round `crash_round`
            x = torch.randn(16, 4, generator=g)
            loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
            inner.zero_grad()
            loss.backward()
            inner.step()
            if (step + 1) % sync_every == 0:
                digests.append(digest(model))
    return {
        "participants": manager.num_participants(),
        "digests": digests,
        "committed": manager.current_step(),
        "dropped": manager.dropped_rounds,
        "params": [p.detach().clone() for p in model.parameters()],
    }


def allreduce_trainer(*, allreduce: ObjectStoreAllReduce, rounds: int) -> list[float]:
    """Trainer for replica_entrypoint: reduce the rank as a scalar, ``rounds`` times."""
    return [
        allreduce.allreduce(torch.tensor([float(allreduce.rank + k)]), name=f"r{k}").item()
        for k in range(rounds)
    ]


def ok(value: int) -> dict:
    print(f"replica {os.environ.get('REPLICA_RANK')} says hello", flush=True)
    return {"rank": int(os.environ["REPLICA_RANK"]), "value": value}


def fail(message: str) -> None:
    raise ValueError(message)


def exit_code(code: int) -> None:
    os._exit(code)


def sleep(seconds: float) -> None:
    time.sleep(seconds)


def rank_from(var: str, rank_env: str = "REPLICA_RANK") -> str:
    return os.environ[var]

"""Object-store allreduce: average tensors across replicas that share nothing but a bucket (any fsspec store).

The ranks first agree on a launch (rendezvous.py); a round then lives in ``runs/<key>/<launch>/round_<n>/``: every
rank writes ``rank_<r>.bin`` (store.py) and polls for the others until they are there or ``timeout_s`` passes; the
first rank done creates ``decision.json`` (commit or abort) exclusively and every rank obeys it. So either every
rank averages the same objects (float64, rank order: bit-identical) or every rank raises the same
:class:`RoundTimeoutError`. A corrupt, stale, foreign or non-finite object counts as missing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from composer_replication.diloco.outer import _finite
from composer_replication.diloco.serverless import store
from composer_replication.diloco.serverless.rendezvous import (
    Launch,
    RoundTimeoutError,
    RunConflictError,
    open_launch,
)
from composer_replication.diloco.serverless.store import CorruptObjectError

__all__ = ["ObjectStoreAllReduce", "RoundTimeoutError", "RunConflictError"]  # MockManager: see __getattr__

log = logging.getLogger(__name__)


class ObjectStoreAllReduce:
    """Average tensors in place across ``world_size`` ranks through an fsspec store.

    Args:
        uri: store prefix shared by all ranks (``file:///tmp/run1``, ``/tmp/run1``, ``memory://run1``, ``s3://b/run1``).
        rank: this replica's rank, ``0 <= rank < world_size``. Rank 0 opens each launch.
        world_size: number of replicas.
        round_id: first round number (default 0); a replica restarted mid-run passes the round to rejoin at.
        timeout_s: how long a round (and the rendezvous) waits for the other ranks.
        poll_interval_s: pause between two listings of the store.
        run_id: the run's name, the same on every rank, fresh per launch (the executors and the recipe draw one);
            a ``run_id`` used before is refused unless ``resume``. ``None``: the prefix's ``auto`` run, refused
            while another launch without a run_id is live there.
        resume: continue a run in a new launch (a relaunch reusing its ``run_id``, or a replica restarted into a
            live run); nothing of an earlier launch is ever read.
        storage_options: keyword arguments of the fsspec filesystem (``{"client_kwargs": {"endpoint_url": ...}}``).
        keep_objects: keep every round's objects (default: a rank deletes its previous one once no rank needs it).
        min_world_size: ``None`` (strict): a round needs every rank. ``m < world_size``: a round commits with the
            at least ``m`` complete, finite objects present when its wait ends, and later rounds wait only for the
            ranks that were there (``.last_participants``).

    Raises (at the first allreduce; the constructor does not contact a remote store):
        ImportError: the protocol's fsspec adapter is missing (the message names the package).
        StoreAccessError: the store refused the credentials (the message says where they come from).
        RunConflictError: the run would mix with another (see ``run_id``); the same message on every rank.
    """

    def __init__(self, uri: str, rank: int, world_size: int, *, round_id: int | None = None,
                 timeout_s: float = 1800.0, poll_interval_s: float = 1.0, run_id: str | None = None,
                 resume: bool = False, storage_options: Mapping[str, Any] | None = None, keep_objects: bool = False,
                 min_world_size: int | None = None) -> None:
        if not isinstance(uri, str) or not uri.strip():
            raise ValueError(f"uri must be a non-empty store prefix such as 'file:///tmp/run1', got {uri!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        if round_id is not None and (not isinstance(round_id, int) or round_id < 0):
            raise ValueError(f"round_id must be None or an int >= 0, got {round_id!r}")
        if not timeout_s > 0 or not poll_interval_s > 0:
            raise ValueError(f"timeout_s and poll_interval_s must be > 0, got {timeout_s!r}, {poll_interval_s!r}")
        if run_id is not None and (not isinstance(run_id, str) or not run_id or "/" in run_id or run_id == "auto"):
            raise ValueError(f"run_id must be a non-empty string without '/' (and not 'auto'), got {run_id!r}")
        if min_world_size is not None and not (isinstance(min_world_size, int) and 1 <= min_world_size <= world_size):
            raise ValueError(f"min_world_size must be None or an int in [1, world_size={world_size}], got "
                             f"{min_world_size!r}")
        self.uri, self.rank, self.world_size = uri.rstrip("/"), rank, world_size
        self.timeout_s, self.poll_interval_s = float(timeout_s), float(poll_interval_s)
        self.keep_objects, self.resume = keep_objects, bool(resume)
        self.min_world_size = world_size if min_world_size is None else min_world_size
        self.last_participants: list[int] = list(range(world_size))
        self.last_nonfinite: list[int] = []
        self._waiting_for = list(range(world_size))
        self.round_id, self.run_id = round_id or 0, run_id  # round_id: the next round (aborted rounds count too)
        self._storage_options = dict(storage_options or {})
        self._launch: Launch | None = None
        self._refusal: str | None = None
        self._owner = f"{id(self):x}-{time.time_ns()}"
        self.bytes_written = self.bytes_read = 0
        if store.protocol_of(uri) == "file":  # local folders exist from construction on
            fs, root = store.open_store(uri, self._storage_options)
            fs.makedirs(root, exist_ok=True)

    @property
    def launch_id(self) -> str | None:
        """The launch's nonce, agreed at the first allreduce (``None`` before)."""
        return None if self._launch is None else self._launch.id

    def allreduce(self, tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
        """Replace ``tensor`` (any shape, floating dtype, any device) by its mean over the ranks; one round. Every
        rank calls with the same ``name``, shape and dtype in the same round.

        Raises:
            RoundTimeoutError: (a ``TimeoutError``) a rank's object was missing, corrupt or non-finite and the round
                could not commit; raised identically on every rank, the tensor left unchanged.
            ValueError: ranks disagree on name, shape or dtype (raised on every rank).
        """
        self.allreduce_tensors([tensor], name=name)
        return tensor

    def allreduce_tensors(self, tensors: Sequence[torch.Tensor], name: str = "tensors") -> list[torch.Tensor]:
        """Average several tensors in one round (one object written, ``world_size - 1`` read, per rank)."""
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
                raise TypeError(f"tensor {i} of {name!r} must be a floating torch.Tensor to average, got "
                                f"{getattr(t, 'dtype', type(t).__name__)}")
        round_id = self.round_id
        self.round_id += 1
        if self.world_size == 1:
            return tensors
        try:
            if self._launch is None:
                fs, root = store.open_store(self.uri, self._storage_options)
                self._launch = open_launch(
                    fs, root, uri=self.uri, rank=self.rank, world_size=self.world_size, run_id=self.run_id,
                    resume=self.resume, min_world_size=self.min_world_size, timeout_s=self.timeout_s,
                    poll_interval_s=self.poll_interval_s, owner=self._owner)
                log.info("rank %d/%d joined launch %s at %s", self.rank, self.world_size, self._launch.id, self.uri)
            return self._run_round(round_id, tensors, name)
        except Exception as exc:  # a refused credential surfaces at the first request, whichever it is
            ours = isinstance(exc, (ImportError, TimeoutError, ValueError, TypeError, RunConflictError))
            if not ours and (better := store.explain_access_error(exc, self.uri)) is not None:
                raise better from exc
            raise

    def close(self) -> None:
        """Release the run at once (rank 0), so a later launch without a run_id need not wait for the lease."""
        if self._launch is not None:
            self._launch.close()

    @property
    def _fs(self) -> Any:
        return self._launch.fs

    def _object(self, round_id: int, rank: int | None = None) -> str:
        folder = f"{self._launch.base}/round_{round_id:08d}"  # rank None: the round's folder
        return folder if rank is None else f"{folder}/rank_{rank}.bin"

    def _read(self, round_id: int, rank: int, expect: dict[str, Any]) -> tuple[dict, list[torch.Tensor]]:
        data = self._fs.cat_file(self._object(round_id, rank))
        self.bytes_read += len(data)
        return store.decode_tensors(data, dict(expect, rank=rank))

    def _admit(self) -> None:
        """Rank 0: admit late followers; a collision becomes the refusal of the next decision it can write."""
        if self.rank == 0 and self._refusal is None:
            try:
                self._launch.admit()
            except RunConflictError as exc:
                self._refusal = str(exc)

    def _run_round(self, round_id: int, tensors: list[torch.Tensor], name: str) -> list[torch.Tensor]:
        if self.rank == 0:
            self._launch.renew()
            self._admit()
        expect = {"launch": self._launch.id, "round": round_id}
        payload = store.encode_tensors(tensors, dict(expect, rank=self.rank, name=name))
        store.write_atomic(self._fs, self._object(round_id, self.rank), payload)
        self.bytes_written += len(payload)
        own = {"name": name, "tensors": [{"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}
                                         for t in tensors]}
        got: dict[int, tuple[dict, list[torch.Tensor]]] = {self.rank: (own, tensors)}
        decision = _checked(self._gather(round_id, expect, got), self.world_size, round_id)
        if decision["decision"] == "refuse":
            raise RunConflictError(decision["message"])
        participants, missing, problems = decision["participants"], decision["missing"], decision["problems"]
        commit, deadline = decision["decision"] == "commit", time.monotonic() + self.timeout_s
        for r in participants if commit else ():  # a rank that proposed abort but lost the race reads the rest now
            while r not in got:
                try:
                    got[r] = self._read(round_id, r, expect)
                except (FileNotFoundError, CorruptObjectError) as exc:
                    if time.monotonic() >= deadline:
                        raise RuntimeError(f"round {round_id} committed but rank {r}'s object is unreadable ({exc}); "
                                           "was the store modified during the run?") from exc
                    time.sleep(self.poll_interval_s)
        mean, finite = _mean_in_rank_order({r: got[r] for r in participants}, name) if commit else ([], [])
        bad = sorted(set(participants) - set(finite)) if commit else []  # every rank finds the same ones
        if bad:
            missing = sorted(set(missing) | set(bad))
            problems = dict(problems, **dict.fromkeys(map(str, bad), "non-finite values (NaN or inf)"))
        if not commit or len(finite) < self.min_world_size:
            detail = "; ".join(f"rank {r}: {why}" for r, why in sorted(problems.items()))
            raise RoundTimeoutError(f"round {round_id} of run {self._launch.key!r} at {self.uri}: rank(s) {missing} "
                                    f"missing ({detail}); the round is dropped on every rank", round_id=round_id,
                                    missing=missing, nonfinite=bad)
        if missing:
            log.warning("round %d committed with ranks %s; rank(s) %s missing (%s)", round_id, finite, missing, problems)
        self.last_participants, self.last_nonfinite = finite, bad
        self._waiting_for = participants  # a non-finite rank is alive: the next round waits for it too
        for t, m in zip(tensors, mean):
            t.copy_(m.to(t.device))
        if not self.keep_objects and round_id > 0 and len(participants) == self.world_size:
            try:  # every rank wrote this round, so every rank is done with the previous one
                self._fs.rm_file(self._object(round_id - 1, self.rank))
            except Exception:  # noqa: BLE001 - clean-up is best effort
                pass
        return tensors

    def _gather(self, round_id: int, expect: dict, got: dict) -> dict[str, Any]:
        """Poll until every expected object is there, a decision exists, or the timeout; return the decision."""
        folder, problems = self._object(round_id), {}
        path = f"{folder}/decision.json"
        deadline = time.monotonic() + self.timeout_s
        while self._refusal is None:
            names = store.listing(self._fs, folder)
            if "decision.json" in names and (decision := store.read_json(self._fs, path)) is not None:
                return decision
            for r in range(self.world_size):
                if r not in got and f"rank_{r}.bin" in names:
                    try:
                        got[r] = self._read(round_id, r, expect)
                    except (FileNotFoundError, CorruptObjectError) as exc:
                        problems[r] = str(exc)[:300]
            if set(self._waiting_for) <= set(got) or time.monotonic() >= deadline:
                break
            self._admit()
            time.sleep(self.poll_interval_s)
        missing = sorted(set(range(self.world_size)) - set(got))
        proposal = {
            "decision": "commit" if len(got) >= self.min_world_size else "abort",
            "participants": sorted(got), "missing": missing, "by": self.rank,
            "problems": {str(r): problems.get(r, f"no complete object within {self.timeout_s:g} s") for r in missing},
        }
        if self._refusal is not None:
            proposal = {"decision": "refuse", "message": self._refusal, "by": self.rank}
        if store.create_exclusive(self._fs, path, store.dump_json(proposal)):
            if proposal["decision"] == "refuse":
                self._refusal = None
            return proposal
        while True:  # another rank decided first: obey it
            if (decision := store.read_json(self._fs, path)) is not None:
                return decision
            time.sleep(min(self.poll_interval_s, 0.05))


def _checked(d: dict[str, Any], world_size: int, round_id: int) -> dict[str, Any]:
    """``d`` if it is a well-formed decision; else a ``RoundTimeoutError`` (every rank reads the same file)."""
    def ranks(key: str) -> bool:
        return isinstance(d.setdefault(key, []), list) and all(isinstance(r, int) and 0 <= r < world_size
                                                               for r in d[key])

    if d.get("decision") == "refuse" and isinstance(d.get("message"), str):
        return d
    if (d.get("decision") in ("commit", "abort") and ranks("participants") and ranks("missing")
            and isinstance(d.get("problems"), dict) and (d["decision"] == "abort" or d["participants"])):
        d["problems"] = {str(k)[:8]: str(v)[:300] for k, v in d["problems"].items()}
        return d
    raise RoundTimeoutError(f"round {round_id}: decision.json is not a valid decision; the round is dropped on every "
                            "rank (was the store modified during the run?)", round_id=round_id, missing=[])


def _sums(got: dict[int, tuple[dict, list[torch.Tensor]]], ranks: list[int]) -> list[torch.Tensor]:
    """Per tensor, the float64 (complex128) sum over ``ranks`` in rank order (every rank gets the same bits)."""
    out = []
    for i, t0 in enumerate(got[ranks[0]][1]):
        acc = t0.detach().to("cpu", torch.complex128 if t0.is_complex() else torch.float64, copy=True)
        for r in ranks[1:]:
            acc += got[r][1][i].detach().to("cpu", acc.dtype)
        out.append(acc)
    return out


def _mean_in_rank_order(got: dict[int, tuple[dict, list[torch.Tensor]]],
                        name: str) -> tuple[list[torch.Tensor], list[int]]:
    """``(mean, ranks)``: the mean over the ranks of ``got`` whose tensors are all finite, and those ranks. A NaN or
    inf shows in the float64 sum, so only then is each rank checked alone (no extra pass over a healthy round)."""
    ranks, ref = sorted(got), got[min(got)][1]
    sig = {r: (got[r][0].get("name"), [(s["dtype"], s["shape"]) for s in got[r][0]["tensors"]]) for r in ranks}
    for r in ranks[1:]:
        if sig[r] != sig[ranks[0]]:
            raise ValueError(f"ranks disagree on allreduce {name!r}: rank {ranks[0]} sent {sig[ranks[0]]}, rank {r} "
                             f"sent {sig[r]}; every rank must reduce the same tensors")
    sums = _sums(got, ranks)
    if not _finite(sums):
        ranks = [r for r in ranks if _finite(got[r][1])]
        sums = _sums(got, ranks) if ranks else []
        ranks = ranks if _finite(sums) else []  # finite values whose float64 sum overflows: no mean either
    return [(a / len(ranks)).to(t.dtype) for a, t in zip(sums, ref)] if ranks else [], ranks


def __getattr__(name: str) -> Any:  # the spec's path: serverless.allreduce.MockManager
    if name == "MockManager":
        from composer_replication.diloco.serverless.manager import MockManager

        return MockManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

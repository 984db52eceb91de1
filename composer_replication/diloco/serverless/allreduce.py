"""Object-store allreduce: average tensors across replicas that share nothing but a bucket.

DiLoCo (Douillard et al., arXiv 2311.08105) exchanges one pseudo-gradient per ``sync_every`` inner steps,
so its outer step tolerates a slow transport. When replicas have no network between them (serverless GPUs,
different clouds), the exchange goes through any fsspec store: ``file://`` (or a bare path), ``memory://``
(threads of one process), ``s3://`` (s3fs), ``gs://``, ``az://``, ``hf://``...

Layout of a run under ``uri``::

    current_run.json                       rank 0's run id (only when no run_id was given)
    runs/<run_id>/join/rank_<r>.json       the rendezvous (only when no run_id was given)
    runs/<run_id>/round_<n>/rank_<r>.bin   rank r's tensors for round n (self-checking, see store.py)
    runs/<run_id>/round_<n>/decision.json  commit or abort, created exactly once (compare-and-set)

A round: every rank writes its object, then polls for the others until all are there or ``timeout_s``
passes. The first rank to finish proposes ``commit`` (all objects complete) or ``abort`` (naming the missing
ranks) by creating ``decision.json`` exclusively; every rank obeys whichever decision won. So either every
rank averages the same objects, summed in rank order in float64 (bit-identical results), or every rank
raises the same ``TimeoutError``: replicas never diverge. Objects of another run or round, or half-written
ones, fail their header and SHA-256 check and are never read as current. With ``min_world_size`` below
``world_size`` membership is elastic: a round commits with the ranks that made it in time (at least
``min_world_size``), every rank adopting that mean, and later rounds wait only for those ranks.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from composer_replication.diloco.serverless.rendezvous import RoundTimeoutError, rendezvous
from composer_replication.diloco.serverless.store import (
    CorruptObjectError,
    create_exclusive,
    decode_tensors,
    dump_json,
    encode_tensors,
    explain_access_error,
    open_store,
    protocol_of,
    read_json,
    write_atomic,
)

__all__ = ["ObjectStoreAllReduce", "RoundTimeoutError"]  # MockManager: lazy, see __getattr__

log = logging.getLogger(__name__)


class ObjectStoreAllReduce:
    """Average tensors in place across ``world_size`` ranks through an fsspec store.

    Args:
        uri: store prefix shared by all ranks (``file:///tmp/run1``, ``/tmp/run1``, ``memory://run1``,
            ``s3://bucket/run1``). A run writes only under ``<uri>/runs/<run_id>/``.
        rank: this replica's rank, ``0 <= rank < world_size``.
        world_size: number of replicas.
        round_id: first round number (default 0); a replica restarted mid-run passes the round to rejoin at.
        timeout_s: how long a round waits for the other ranks before it is aborted on every rank.
        poll_interval_s: pause between two listings of the round's folder.
        run_id: the run's identity, the same on every rank (a launcher passes a fresh one). ``None``: rank 0
            draws one at the first allreduce and the others join it through ``current_run.json``; a
            follower accepts a run only once rank 0 has acknowledged the follower's fresh nonce, so a file
            left by an earlier run is never taken as current.
        storage_options: keyword arguments for the fsspec filesystem (e.g. ``{"client_kwargs":
            {"endpoint_url": ...}}`` for an S3-compatible server).
        min_world_size: ``None`` (default, strict): a round needs every rank. An int ``m < world_size``
            makes membership elastic: a round whose wait ends with at least ``m`` complete objects commits
            with those ranks (the mean is over them, on every rank alike), and the next rounds wait only for
            the ranks of the last committed round (a rank that comes back is included when its object is
            there in time). ``.last_participants`` lists the ranks of the last committed round.
        keep_objects: keep every round's objects (default: a rank deletes its previous object once a
            later round commits, when no rank can still need it).

    Raises (at the first allreduce, not at construction, as the store is not contacted before):
        ImportError: the protocol's fsspec adapter is missing; the message names the package.
        StoreAccessError: the store refused the credentials; the message says where they come from.
    """

    def __init__(
        self,
        uri: str,
        rank: int,
        world_size: int,
        *,
        round_id: int | None = None,
        timeout_s: float = 1800.0,
        poll_interval_s: float = 1.0,
        run_id: str | None = None,
        storage_options: Mapping[str, Any] | None = None,
        keep_objects: bool = False,
        min_world_size: int | None = None,
    ) -> None:
        if not isinstance(uri, str) or not uri.strip():
            raise ValueError(f"uri must be a non-empty store prefix such as 'file:///tmp/run1', got {uri!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, world_size={world_size}), got {rank!r}")
        if round_id is not None and (not isinstance(round_id, int) or round_id < 0):
            raise ValueError(f"round_id must be None or an int >= 0, got {round_id!r}")
        if not timeout_s > 0 or not poll_interval_s > 0:
            raise ValueError(
                f"timeout_s and poll_interval_s must be > 0, got {timeout_s!r}, {poll_interval_s!r}"
            )
        if run_id is not None and (not run_id or "/" in run_id):
            raise ValueError(f"run_id must be a non-empty string without '/', got {run_id!r}")
        self.uri, self.rank, self.world_size = uri.rstrip("/"), rank, world_size
        self.timeout_s, self.poll_interval_s = float(timeout_s), float(poll_interval_s)
        self.keep_objects = keep_objects
        if min_world_size is not None and not (
            isinstance(min_world_size, int) and 1 <= min_world_size <= world_size
        ):
            raise ValueError(
                f"min_world_size must be None or an int in [1, world_size={world_size}], got {min_world_size!r}"
            )
        self.min_world_size = world_size if min_world_size is None else min_world_size
        self.last_participants: list[int] = list(range(world_size))
        self._round_id = round_id or 0
        self._run_id = run_id
        self._storage_options = dict(storage_options or {})
        self._fs: Any = None
        self._prefix = ""
        self.bytes_written = 0
        self.bytes_read = 0
        if protocol_of(uri) == "file":  # local folders exist from construction on
            fs, root = open_store(uri, self._storage_options)
            fs.makedirs(root, exist_ok=True)

    @property
    def round_id(self) -> int:
        """The number of the next round (rounds that were aborted count too)."""
        return self._round_id

    @property
    def run_id(self) -> str | None:
        """The run's id (``None`` until the first allreduce when it is drawn by the rendezvous)."""
        return self._run_id

    def __repr__(self) -> str:
        return (
            f"ObjectStoreAllReduce(uri={self.uri!r}, rank={self.rank}, world_size={self.world_size}, "
            f"run_id={self._run_id!r}, round_id={self._round_id})"
        )

    # ------------------------------------------------------------------------ public API

    def allreduce(self, tensor: torch.Tensor, name: str = "tensor") -> torch.Tensor:
        """Replace ``tensor`` (any shape, floating dtype, any device) by its mean over all ranks; one round.

        Every rank must call with the same ``name``, shape and dtype in the same round.

        Raises:
            RoundTimeoutError: (a ``TimeoutError``) a rank did not write within ``timeout_s``; raised
                identically on every rank, the tensor is left unchanged.
            ValueError: ranks disagree on name, shape or dtype (raised on every rank).
        """
        self.allreduce_tensors([tensor], name=name)
        return tensor

    def allreduce_tensors(self, tensors: Sequence[torch.Tensor], name: str = "tensors") -> list[torch.Tensor]:
        """Average several tensors in one round (one object written, ``world_size - 1`` read, per rank)."""
        tensors = list(tensors)
        for i, t in enumerate(tensors):
            if not isinstance(t, torch.Tensor) or not (t.is_floating_point() or t.is_complex()):
                raise TypeError(
                    f"tensor {i} of {name!r} must be a floating torch.Tensor to average, got "
                    f"{getattr(t, 'dtype', type(t).__name__)}"
                )
        round_id = self._round_id
        self._round_id += 1
        if self.world_size == 1:
            return tensors
        try:
            self._ensure_started()
            return self._run_round(round_id, tensors, name)
        except (ImportError, TimeoutError, ValueError, TypeError):
            raise
        except Exception as exc:  # a refused credential surfaces at the first request, whichever it is
            better = explain_access_error(exc, self.uri)
            if better is not None:
                raise better from exc
            raise

    # ------------------------------------------------------------------------ start-up

    def _ensure_started(self) -> None:
        if self._fs is not None:
            return
        fs, root = open_store(self.uri, self._storage_options)
        if self._run_id is None:
            self._run_id = rendezvous(
                fs, root, self.rank, self.world_size, self.timeout_s, self.poll_interval_s, self.uri
            )
        fs.makedirs(f"{root}/runs/{self._run_id}", exist_ok=True)
        self._fs, self._prefix = fs, f"{root}/runs/{self._run_id}"
        log.info("rank %d/%d joined run %s at %s", self.rank, self.world_size, self._run_id, self.uri)

    # ------------------------------------------------------------------------ one round

    def _object(self, round_id: int, rank: int) -> str:
        return f"{self._prefix}/round_{round_id:08d}/rank_{rank}.bin"

    def _listing(self, folder: str) -> set[str]:
        self._fs.invalidate_cache(folder)
        try:
            return {p.rstrip("/").rsplit("/", 1)[-1] for p in self._fs.ls(folder, detail=False)}
        except FileNotFoundError:
            return set()
        finally:  # s3fs answers reads of unlisted keys from a cached listing: never keep one
            self._fs.invalidate_cache(folder)

    def _read(self, round_id: int, rank: int, expect: dict[str, Any]) -> tuple[dict, list[torch.Tensor]]:
        data = self._fs.cat_file(self._object(round_id, rank))
        self.bytes_read += len(data)
        return decode_tensors(data, dict(expect, rank=rank))

    def _run_round(self, round_id: int, tensors: list[torch.Tensor], name: str) -> list[torch.Tensor]:
        folder = f"{self._prefix}/round_{round_id:08d}"
        expect = {"run": self._run_id, "round": round_id}
        payload = encode_tensors(tensors, dict(expect, rank=self.rank, name=name))
        write_atomic(self._fs, self._object(round_id, self.rank), payload)
        self.bytes_written += len(payload)
        own = {
            "name": name,
            "tensors": [
                {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for t in tensors
            ],
        }
        got: dict[int, tuple[dict, list[torch.Tensor]]] = {self.rank: (own, tensors)}
        problems: dict[int, str] = {}
        decision = self._gather(round_id, folder, expect, got, problems)
        if decision["decision"] != "commit":
            missing = list(decision["missing"])
            detail = "; ".join(f"rank {r}: {why}" for r, why in decision.get("problems", {}).items())
            raise RoundTimeoutError(
                f"round {round_id} of run {self._run_id} at {self.uri}: rank(s) {missing} wrote no complete "
                f"object within {self.timeout_s:g} s{' (' + detail + ')' if detail else ''}; the round is "
                "dropped on every rank",
                round_id=round_id,
                missing=missing,
            )
        participants = list(decision.get("participants", range(self.world_size)))
        if decision["missing"]:
            log.warning(
                "round %d committed with ranks %s; rank(s) %s missing",
                round_id,
                participants,
                decision["missing"],
            )
        deadline = time.monotonic() + self.timeout_s
        for r in participants:  # a rank that proposed abort but lost the race reads the rest now
            while r not in got:
                try:
                    got[r] = self._read(round_id, r, expect)
                except (FileNotFoundError, CorruptObjectError) as exc:
                    if time.monotonic() >= deadline:
                        raise RuntimeError(
                            f"round {round_id} committed but rank {r}'s object is unreadable "
                            f"({exc}); was the store modified during the run?"
                        ) from exc
                    time.sleep(self.poll_interval_s)
        mean = _mean_in_rank_order({r: got[r] for r in participants}, name)
        self.last_participants = participants
        for t, m in zip(tensors, mean):
            t.copy_(m.to(t.device))
        if not self.keep_objects and round_id > 0 and len(participants) == self.world_size:
            # Every rank wrote this round, so every rank is done with the previous one.
            try:
                self._fs.rm_file(self._object(round_id - 1, self.rank))
            except Exception:  # noqa: BLE001 - clean-up is best effort
                pass
        return tensors

    def _gather(self, round_id: int, folder: str, expect: dict, got: dict, problems: dict) -> dict[str, Any]:
        """Poll until all objects are there, a decision exists, or the timeout; return the decision."""
        decision_path = f"{folder}/decision.json"
        deadline = time.monotonic() + self.timeout_s
        while True:
            names = self._listing(folder)
            if "decision.json" in names:
                decision = read_json(self._fs, decision_path)
                if decision is not None:
                    return decision
            for r in range(self.world_size):
                if r not in got and f"rank_{r}.bin" in names:
                    try:
                        got[r] = self._read(round_id, r, expect)
                        problems.pop(r, None)
                    except (FileNotFoundError, CorruptObjectError) as exc:
                        problems[r] = str(exc)
            complete = set(self.last_participants) <= set(got)  # everyone of the last committed round
            if complete or time.monotonic() >= deadline:
                break
            time.sleep(self.poll_interval_s)
        missing = sorted(set(range(self.world_size)) - set(got))
        commit = len(got) >= self.min_world_size  # strict: every rank; elastic: enough ranks
        proposal = {
            "decision": "commit" if commit else "abort",
            "participants": sorted(got),
            "missing": missing,
            "by": self.rank,
            "problems": {str(r): why for r, why in problems.items() if r in missing},
        }
        if create_exclusive(self._fs, decision_path, dump_json(proposal)):
            return proposal
        while True:  # another rank decided first: obey it
            decision = read_json(self._fs, decision_path)
            if decision is not None:
                return decision
            time.sleep(min(self.poll_interval_s, 0.05))


def _mean_in_rank_order(got: dict[int, tuple[dict, list[torch.Tensor]]], name: str) -> list[torch.Tensor]:
    """Mean over the ranks of ``got``, accumulated in float64 in rank order (every rank gets the same bits)."""
    ranks = sorted(got)
    ref_header, ref = got[ranks[0]]
    for r in ranks[1:]:
        header, tensors = got[r]
        if header["name"] != ref_header["name"] or [(s["dtype"], s["shape"]) for s in header["tensors"]] != [
            (s["dtype"], s["shape"]) for s in ref_header["tensors"]
        ]:
            raise ValueError(
                f"ranks disagree on allreduce {name!r}: rank {ranks[0]} sent {ref_header['name']!r} "
                f"{[(s['dtype'], s['shape']) for s in ref_header['tensors']]}, rank {r} sent {header['name']!r} "
                f"{[(s['dtype'], s['shape']) for s in header['tensors']]}; every rank must reduce the same tensors"
            )
    out = []
    for i, t0 in enumerate(ref):
        wide = torch.complex128 if t0.is_complex() else torch.float64
        acc = t0.detach().to("cpu", wide, copy=True)
        for r in ranks[1:]:
            acc += got[r][1][i].detach().to("cpu", wide)
        out.append((acc / len(ranks)).to(t0.dtype))
    return out


def __getattr__(name: str) -> Any:  # spec path: serverless.allreduce.MockManager
    if name == "MockManager":
        from composer_replication.diloco.serverless.manager import MockManager

        return MockManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Launches: the ranks of one launch agree on a fresh nonce through the store before their first round.

Layout under ``<uri>/runs/<key>/`` (``key`` is the ``run_id``, or ``auto`` without one)::

    launch.json                           rank 0's current launch: its nonce, a lease, closed or not
    refused.json                          the last refusal (a rank 0 that would have mixed two runs)
    <launch>/join/rank_<r>-<nonce>.json   a follower asking to join, with its own fresh nonce
    <launch>/ready.json                   rank 0's answer: each member's nonce, or the error every rank raises
    <launch>/ack/<nonce>.json             a follower admitted later (an elastic late member, or ``resume``)
    <launch>/round_<n>/...                the rounds (allreduce.py); objects and decisions name the launch

A follower writes a join into every launch ``launch.json`` names while it waits and accepts only an answer
that lists its own nonce, so a file left by an earlier run never makes it join that run. Rank 0 refuses a
key that holds a live run (lease neither closed nor expired), or a ``run_id`` used before, unless ``resume``;
two processes claiming one rank make every rank of the launch stop. Without a ``run_id`` the store cannot tell
two runs' followers apart: runs started together are refused (rank 0 waits ``SETTLE_S`` before admitting), but
a run whose follower starts before its own rank 0 while another run gathers can still lend it that follower;
concurrent runs on one prefix need a ``run_id`` each. Every refusal is one
:class:`RunConflictError` message, raised on every rank (followers read it from the store).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from composer_replication.diloco.serverless.store import dump_json, listing, read_json, write_atomic

__all__ = ["RoundTimeoutError", "RunConflictError", "Launch"]


SETTLE_S = 0.5
"""Rank 0 admits no one before this long after writing launch.json (at most ``timeout_s / 4``): a second rank 0
that started at the same instant (it read no launch.json either) has written its own by then, and both stop."""


class RoundTimeoutError(TimeoutError):
    """A round (or the rendezvous, ``round_id=-1``) was dropped on every rank; ``missing`` lists the ranks left out."""

    def __init__(self, message: str, *, round_id: int, missing: list[int], nonfinite: list[int] = ()) -> None:
        super().__init__(message)
        self.round_id, self.missing, self.nonfinite = round_id, missing, list(nonfinite)


class RunConflictError(RuntimeError):
    """Two runs would mix at one store prefix; raised on every rank with the same message (prefix and fix)."""


def collision_message(uri: str, key: str) -> str:
    return (f"two launches collided at {uri} (run {key!r}): one replica rank was claimed by two processes, so their "
            "tensors could mix; every rank stops. Give each launch its own run_id (the executors and "
            "recipes.serverless.run draw one), then relaunch")


@dataclass
class Launch:
    """One launch's identity (``id``) and, on rank 0, its members (rank -> nonce) and lease."""

    fs: Any
    key_dir: str
    uri: str
    key: str
    id: str
    rank: int
    lease_s: float
    members: dict[int, str] = field(default_factory=dict)
    handled: set[str] = field(default_factory=set)
    files: dict[str, Any] = field(default_factory=dict)
    renewed: float = field(default_factory=time.monotonic)
    admitted: float = 0.0

    @property
    def base(self) -> str:
        return f"{self.key_dir}/{self.id}"

    def _pointer(self, *, closed: bool) -> None:
        ptr = read_json(self.fs, f"{self.key_dir}/launch.json")
        if self.rank == 0 and ptr is not None and ptr.get("launch") == self.id:  # never clobber a takeover
            write_atomic(self.fs, f"{self.key_dir}/launch.json",
                         dump_json(dict(ptr, lease_until=time.time() + self.lease_s, closed=closed)))

    def renew(self) -> None:
        """Rank 0: extend the lease (called every round; writes once a quarter lease)."""
        if time.monotonic() - self.renewed > self.lease_s / 4:
            self.renewed = time.monotonic()
            self._pointer(closed=False)

    def close(self) -> None:
        """Rank 0: release the key at once (a later launch without run_id need not wait for the lease)."""
        self._pointer(closed=True)

    def admit(self) -> None:
        """Rank 0: admit followers that joined after ``ready.json`` (a rank that never joined, or ``resume``).

        Raises:
            RunConflictError: a second process claimed a member's rank while the rendezvous was open.
        """
        if time.monotonic() - self.admitted < 1.0:  # at most one listing a second
            return
        self.admitted = time.monotonic()
        for r, recs in _joins(self.fs, f"{self.base}/join", self.files).items():
            for nonce, rec in recs.items():
                if nonce == self.members.get(r) or nonce in self.handled:
                    continue
                self.handled.add(nonce)
                if r not in self.members or rec.get("resume") is True:
                    self.members[r] = nonce
                    write_atomic(self.fs, f"{self.base}/ack/{nonce}.json", dump_json({"rank": r}))
                elif rec.get("late") is False:  # written before it could see ready.json: rank 0 missed it
                    raise RunConflictError(collision_message(self.uri, self.key))
                # else: it found the launch complete: a follower of another launch, which its rank 0 refuses


def _num(v: Any, default: float) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _live(ptr: dict[str, Any] | None) -> bool:
    return ptr is not None and ptr.get("closed") is not True and _num(ptr.get("lease_until"), 0.0) > time.time()


def _joins(fs: Any, folder: str, seen: dict[str, dict[str, Any] | None]) -> dict[int, dict[str, dict[str, Any]]]:
    """``{rank: {nonce: join record}}`` of ``folder``; ``seen`` caches the files read (each is read once)."""
    for name in listing(fs, folder) - set(seen):
        rec = read_json(fs, f"{folder}/{name}") if name.startswith("rank_") else None
        ok = rec is not None and isinstance(rec.get("rank"), int) and isinstance(rec.get("nonce"), str)
        if ok or not name.startswith("rank_"):  # an unreadable join is read again next time
            seen[name] = rec if ok else None
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for rec in filter(None, seen.values()):
        out.setdefault(rec["rank"], {})[rec["nonce"]] = rec
    return out


def _refuse(fs: Any, key_dir: str, message: str) -> RunConflictError:
    write_atomic(fs, f"{key_dir}/refused.json", dump_json({"message": message, "time": time.time()}))
    return RunConflictError(message)


def open_launch(fs: Any, root: str, *, uri: str, rank: int, world_size: int, run_id: str | None, resume: bool,
                min_world_size: int, timeout_s: float, poll_interval_s: float, owner: str) -> Launch:
    """Join (rank 0: open) a launch of run ``run_id`` (``None``: the prefix's ``auto`` run); see the module docstring.

    ``owner``: a token of the caller; a launch.json it wrote itself (an earlier, failed rendezvous) is no reuse.

    Raises:
        RunConflictError: the key holds a live run, the run_id was used before (both without ``resume``), or two
            processes claimed one rank; the same message on every rank.
        RoundTimeoutError: ranks did not join within ``timeout_s`` (the message names them).
    """
    key = run_id or "auto"
    key_dir, ptr_path = f"{root}/runs/{key}", f"{root}/runs/{key}/launch.json"
    lease_s, deadline = 2 * timeout_s, time.monotonic() + timeout_s
    if rank == 0:
        ptr = read_json(fs, ptr_path)
        if ptr is not None and not resume and ptr.get("owner") != owner:
            since = f"started {time.time() - _num(ptr.get('started'), 0.0):.0f} s ago on {str(ptr.get('host'))[:64]}"
            if run_id is not None:
                raise _refuse(fs, key_dir, f"run_id {run_id!r} was already used at {uri} (launch "
                              f"{str(ptr.get('launch'))[:32]}, {since}); pass a fresh run_id (or none), or "
                              "resume=True on every replica to continue that run in a new launch")
            if _live(ptr) and read_json(fs, f"{key_dir}/{ptr.get('launch')}/ready.json") is None:
                raise _refuse(fs, key_dir, collision_message(uri, key))  # it is still gathering: we both stop
            if _live(ptr):
                raise _refuse(fs, key_dir, f"the store prefix {uri} holds another live run without a run_id (launch "
                              f"{str(ptr.get('launch'))[:32]}, {since}); give each run its own run_id or prefix, wait "
                              "for it to end, or pass resume=True on every replica to take the prefix over")
        launch = Launch(fs, key_dir, uri, key, uuid.uuid4().hex[:16], 0, lease_s)
        refusal, now = read_json(fs, f"{key_dir}/refused.json"), time.time()
        write_atomic(fs, ptr_path, dump_json({"launch": launch.id, "started": now, "lease_until": now + lease_s,
                                              "closed": False, "host": socket.gethostname(), "pid": os.getpid(),
                                              "owner": owner}))
        settle_until = time.monotonic() + min(SETTLE_S, timeout_s / 4)  # a rival rank 0 that read no launch.json
        while True:
            joins = {r: n for r, n in _joins(fs, f"{launch.base}/join", launch.files).items() if 0 < r < world_size}
            seen = sorted(n for recs in joins.values() for n in recs)
            error: Exception | None = None
            rival = (read_json(fs, ptr_path) or {}).get("owner") != owner  # another rank 0 took the key
            if rival or read_json(fs, f"{key_dir}/refused.json") != refusal:  # or was refused meanwhile
                error = _refuse(fs, key_dir, collision_message(uri, key))
            elif any(len(n) > 1 for n in joins.values()):
                error = RunConflictError(collision_message(uri, key))
            elif time.monotonic() < settle_until:
                pass  # writes its own within this window: both would see the other's followers, so wait it out
            elif len(joins) == world_size - 1 or (time.monotonic() >= deadline and len(joins) + 1 >= min_world_size):
                launch.members = {0: launch.id, **{r: next(iter(n)) for r, n in joins.items()}}
                launch.handled = set(seen)
                write_atomic(fs, f"{launch.base}/ready.json", dump_json(
                    {"members": {str(r): n for r, n in launch.members.items()}, "time": time.time()}))
                return launch
            elif time.monotonic() >= deadline:
                missing = [r for r in range(1, world_size) if r not in joins]
                error = RoundTimeoutError(f"rendezvous at {uri} (run {key!r}): rank(s) {missing} did not join within "
                                          f"{timeout_s:g} s, so the launch is dropped on every rank; start every "
                                          "replica, or raise timeout_s", round_id=-1, missing=missing)
            if error is not None:
                write_atomic(fs, f"{launch.base}/ready.json", dump_json(
                    {"error": str(error), "conflict": isinstance(error, RunConflictError), "seen": seen,
                     "missing": getattr(error, "missing", [])}))
                raise error
            time.sleep(poll_interval_s)
    nonce, started, joined, late = uuid.uuid4().hex, time.time(), None, False
    first_refusal = read_json(fs, f"{key_dir}/refused.json")
    deadline += min(timeout_s, 10.0)  # a follower outwaits rank 0, whose answer names the missing ranks
    while True:
        ptr, ready, refusal = read_json(fs, ptr_path), None, read_json(fs, f"{key_dir}/refused.json")
        if ptr is not None and isinstance(ptr.get("launch"), str) and ptr["launch"] != joined:
            joined = ptr["launch"]
            late = read_json(fs, f"{key_dir}/{joined}/ready.json") is not None  # complete before I asked
            write_atomic(fs, f"{key_dir}/{joined}/join/rank_{rank}-{nonce}.json",
                         dump_json({"rank": rank, "nonce": nonce, "resume": resume, "late": late}))
        if joined is not None and (ready := read_json(fs, f"{key_dir}/{joined}/ready.json")) is not None:
            members = ready.get("members") if isinstance(ready.get("members"), dict) else {}
            if isinstance(ready.get("error"), str) and nonce in (ready.get("seen") or ()):
                if ready.get("conflict"):
                    raise RunConflictError(ready["error"])
                raise RoundTimeoutError(ready["error"], round_id=-1, missing=list(ready.get("missing") or []))
            launch = Launch(fs, key_dir, uri, key, joined, rank, lease_s)
            if members.get(str(rank)) == nonce or read_json(fs, f"{launch.base}/ack/{nonce}.json") is not None:
                return launch
            if str(rank) in members and not resume and not late:
                raise RunConflictError(collision_message(uri, key))  # rank 0 took another process for my rank
        newer = refusal is not None and _num(refusal.get("time"), 0.0) > _num((ptr or {}).get("started"), 0.0)
        if newer and refusal != first_refusal and (ptr is None or ready is not None):
            raise RunConflictError(str(refusal.get("message"))[:2000])  # refused while I waited: my rank 0
        if time.monotonic() >= deadline:
            if newer and _num(refusal.get("time"), 0.0) >= started - timeout_s:  # refused just before I started
                raise RunConflictError(str(refusal.get("message"))[:2000])
            raise RoundTimeoutError(f"rendezvous at {uri} (run {key!r}): rank 0 did not admit rank {rank} within "
                                    f"{timeout_s:g} s; start rank 0 (it opens the launch), or raise timeout_s",
                                    round_id=-1, missing=[0])
        time.sleep(poll_interval_s)

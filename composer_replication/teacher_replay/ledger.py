"""A write-ahead JSONL ledger of teacher attempts: money paid is never forgotten, nor paid twice.

Every attempt is recorded *before* it is sent (``reserve``, with its worst-case cost) and again when
it ends (``settle``, with what it was billed; the last attempt of a call also carries the call's
:class:`TeacherCallResult`). Each record is flushed and fsync'ed before the replay goes on (records
written together share one fsync: group commit)::

    {"v": 2, "kind": "reserve", "attempt": "9f...", "state_id": "...", "teacher_slug": "...",
     "request_sha256": "...", "reserved_usd": 0.031, "time": 1767225600.0}
    {"v": 2, "kind": "settle", "attempt": "9f...", "cost_usd": 0.004, "error": null, "time": ...,
     "result": {TeacherCallResult}}

Spend (:func:`ledger_spend`, :attr:`Ledger.spent_usd`: the one fold of a ledger into USD) is the sum
of settled costs plus the reservation of every attempt that was reserved but never settled (the
process was killed while it was in flight: it may have been billed, so it counts as spent at its
worst case). A call is identified by ``(state_id, teacher_slug, request_sha256)``, where the hash
covers the canonical request body (:func:`request_sha256`); a successful call found in the ledger
is returned from it and never sent again. Version-1 lines (one ``result`` per finished call) are
still read. A torn last line (the process died mid-write) is dropped and the file truncated to its
last complete line; other unreadable lines, and costs that are negative or not finite, are skipped
with a warning (they never reach the sum).

The ledger is locked (``fcntl.flock``) while a :class:`Ledger` holds it open: a second replay on the
same file stops with :class:`LedgerLockedError` instead of paying for the same calls again. It never
holds the API key: request bodies are hashed, texts are scrubbed upstream.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import Any

from composer_replication.types import TeacherCallResult

__all__ = ["LEDGER_VERSION", "Ledger", "LedgerLockedError", "ledger_spend", "request_sha256"]

log = logging.getLogger(__name__)

LEDGER_VERSION = 2
_HASHED_FIELDS = ("model", "messages", "max_tokens", "temperature", "seed")


class LedgerLockedError(RuntimeError):
    """Another replay (or another :class:`Ledger` in this process) holds the ledger file."""


def request_sha256(body: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of the body's model, messages, max_tokens, temperature and seed."""
    canon = {k: body.get(k) for k in _HASHED_FIELDS}
    data = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


def _usd(value: Any) -> float:
    """A recorded USD amount, or ``ValueError`` when it is not a finite number >= 0."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    ):
        raise ValueError(f"not a finite USD amount >= 0: {value!r:.40}")
    return float(value)


class _Tally:
    """The fold of ledger records into spend and reusable results (shared by every reader)."""

    def __init__(self) -> None:
        self.settled_usd = 0.0
        self.unsettled: dict[str, float] = {}  # attempt id -> reserved USD
        self.done: dict[tuple[str, str, str], TeacherCallResult] = {}
        self.keys: dict[str, tuple[str, str, str]] = {}  # attempt id -> call key
        self.records = 0

    @property
    def spent_usd(self) -> float:
        return self.settled_usd + sum(self.unsettled.values())

    def add(self, rec: dict[str, Any]) -> None:
        """Fold one record in; ``ValueError`` / ``KeyError`` / ``TypeError`` for a bad one (nothing counted)."""
        kind = rec.get("kind")
        if kind == "reserve":
            amount = _usd(rec["reserved_usd"])
            self.unsettled[str(rec["attempt"])] = amount
            self.keys[str(rec["attempt"])] = (rec["state_id"], rec["teacher_slug"], rec["request_sha256"])
        elif kind == "settle":
            attempt = str(rec["attempt"])
            cost = _usd(rec["cost_usd"])  # a bad cost leaves the attempt counted at its reservation
            self.settled_usd += cost
            self.unsettled.pop(attempt, None)
            result = rec.get("result")
            if isinstance(result, dict) and result.get("error") is None and attempt in self.keys:
                self.done[self.keys[attempt]] = result  # type: ignore[assignment]
        elif kind is None:  # version 1: one finished call per line
            result = rec["result"]
            self.settled_usd += _usd(result.get("cost_usd") or 0.0)
            if rec.get("ok") and result.get("error") is None and "request_sha256" in rec:
                self.done[(rec["state_id"], rec["teacher_slug"], rec["request_sha256"])] = result
        else:
            raise ValueError(f"unknown record kind {kind!r:.40}")
        self.records += 1

    def add_lines(self, text: str, where: str) -> None:
        bad = 0
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise TypeError("not an object")
                self.add(rec)
            except (ValueError, KeyError, TypeError, AttributeError):
                bad += 1
        if bad:
            log.warning("ledger %s: skipped %d unreadable line(s) (bad JSON or amounts)", where, bad)


def ledger_spend(path: str | os.PathLike[str]) -> float:
    """USD a ledger file records as spent (0 when absent): settled costs + unsettled reservations.

    Read-only and lock-free (for reports); a replay uses :attr:`Ledger.spent_usd`, the same fold.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        return 0.0
    tally = _Tally()
    tally.add_lines(path.read_bytes().decode("utf-8", errors="replace"), str(path))
    return tally.spent_usd


class Ledger:
    """The ledger file at ``path`` (created with its parents), locked until :meth:`close`.

    Raises:
        LedgerLockedError: another replay holds the file.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._tally = _Tally()
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open (and locked) for appends
        try:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._fh.close()
            raise LedgerLockedError(
                f"ledger {self.path} is in use by another replay (it holds the file lock). Two replays on one "
                "ledger would pay for the same calls twice: wait for the other one to finish, or give this "
                "one its own --ledger."
            ) from None
        self._load()
        self._pending: list[tuple[dict[str, Any], asyncio.Future]] = []
        self._flusher: asyncio.Task | None = None

    # ------------------------------------------------------------------ reading

    def _load(self) -> None:
        raw = self.path.read_bytes()
        if raw and not raw.endswith(b"\n"):
            cut = raw.rfind(b"\n") + 1
            log.warning("ledger %s: dropping a torn last line (%d bytes)", self.path, len(raw) - cut)
            os.ftruncate(self._fh.fileno(), cut)
            os.fsync(self._fh.fileno())
            raw = raw[:cut]
        self._tally.add_lines(raw.decode("utf-8", errors="replace"), str(self.path))

    @property
    def spent_usd(self) -> float:
        """Settled costs plus reservations of attempts never settled, over every run of this ledger."""
        return self._tally.spent_usd

    @property
    def unsettled_usd(self) -> float:
        """Reservations of attempts that were recorded as sent but never settled (counted as spent)."""
        return sum(self._tally.unsettled.values())

    @property
    def num_records(self) -> int:
        """Records read back plus records written."""
        return self._tally.records

    def lookup(self, state_id: str, teacher_slug: str, request_hash: str) -> TeacherCallResult | None:
        """The recorded successful result of this exact call, or ``None``."""
        hit = self._tally.done.get((state_id, teacher_slug, request_hash))
        return dict(hit) if hit is not None else None  # type: ignore[return-value]

    def __len__(self) -> int:
        return self._tally.records

    # ------------------------------------------------------------------ records

    @staticmethod
    def reserve_record(
        attempt: str, state_id: str, teacher_slug: str, request_hash: str, reserved_usd: float
    ) -> dict[str, Any]:
        """The write-ahead record of an attempt about to be sent."""
        return {
            "v": LEDGER_VERSION,
            "kind": "reserve",
            "attempt": attempt,
            "state_id": state_id,
            "teacher_slug": teacher_slug,
            "request_sha256": request_hash,
            "reserved_usd": float(reserved_usd),
            "time": time.time(),
        }

    @staticmethod
    def settle_record(
        attempt: str, cost_usd: float, *, error: str | None, result: TeacherCallResult | None = None
    ) -> dict[str, Any]:
        """The record of an attempt that ended; ``result`` on the call's last attempt."""
        rec: dict[str, Any] = {
            "v": LEDGER_VERSION,
            "kind": "settle",
            "attempt": attempt,
            "cost_usd": float(cost_usd),
            "error": error,
            "time": time.time(),
        }
        if result is not None:
            rec["result"] = dict(result)
        return rec

    # ------------------------------------------------------------------ writing

    def write_records(self, records: list[dict[str, Any]]) -> None:
        """Append records, one line each, then flush and fsync once. Thread-safe; blocking."""
        data = "".join(json.dumps(rec, ensure_ascii=False, allow_nan=False) + "\n" for rec in records)
        with self._lock:
            if self._fh.closed:
                raise RuntimeError(f"ledger {self.path} is closed; open a new Ledger to append.")
            self._fh.write(data)
            self._fh.flush()
            os.fsync(self._fh.fileno())
            for rec in records:
                self._tally.add(rec)

    async def write(self, record: dict[str, Any]) -> None:
        """Return once ``record`` is durably in the file (group commit: one fsync per batch).

        A failed write (e.g. disk full) raises here, so the attempt it records is not sent / not
        reported. If the caller is cancelled the record is still written.
        """
        fut = asyncio.get_running_loop().create_future()
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved even if we are cancelled
        self._pending.append((record, fut))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())
        await asyncio.shield(fut)

    async def _flush(self) -> None:
        while self._pending:
            batch, self._pending = self._pending, []
            try:
                await asyncio.to_thread(self.write_records, [rec for rec, _ in batch])
            except Exception as exc:  # e.g. disk full: every attempt waiting on this batch fails with it
                for _, fut in batch:
                    if not fut.done():
                        fut.set_exception(exc)
                continue
            for _, fut in batch:
                if not fut.done():
                    fut.set_result(None)

    async def drain(self) -> None:
        """Wait for records being written (call before :meth:`close` from async code)."""
        if self._flusher is not None:
            await asyncio.gather(self._flusher, return_exceptions=True)

    def close(self) -> None:
        """Release the lock and close the file (idempotent)."""
        with self._lock:
            if not self._fh.closed:
                self._fh.close()  # closing the descriptor releases the flock

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({str(self.path)!r}, records={len(self)}, spent_usd={self.spent_usd:.6f})"

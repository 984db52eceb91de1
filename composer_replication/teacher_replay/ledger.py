"""A write-ahead JSONL ledger of teacher attempts: money paid is never forgotten, nor paid twice.

Each attempt is recorded (flushed, fsync'ed) before it is sent (``reserve``: its worst case) and when it ends
(``settle``: its bill; a call's last attempt also holds its result). Spend is the settled costs plus every
reservation never settled (killed in flight). A call's successful result is reused when it passes a check, else
the call is sent again; bad lines are skipped with a warning, a torn last line truncated; version-1 lines are
read. The file is locked while open. It never holds the API key.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from composer_replication.teacher_replay.budget import is_amount
from composer_replication.types import TeacherCallResult

__all__ = ["Ledger", "LedgerLockedError"]

log = logging.getLogger(__name__)

LEDGER_VERSION = 2
_HASHED = ("model", "messages", "max_tokens", "temperature", "seed")
_RESULT_TYPES = {"state_id": str, "teacher_slug": str, "response_text": str, "latency_s": (int, float),
                 "prompt_tokens": int, "completion_tokens": int, "cost_usd": (int, float)}


class LedgerLockedError(RuntimeError):
    """Another replay (or another :class:`Ledger` of this process) holds the ledger file."""


def request_sha256(body: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of the body's model, messages, max_tokens, temperature and seed."""
    canon = json.dumps({k: body.get(k) for k in _HASHED}, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canon.encode("utf-8")).hexdigest()


def _usd(value: Any) -> float:
    if not is_amount(value):
        raise ValueError(f"not a finite USD amount >= 0: {value!r:.40}")
    return float(value)


def _reusable(result: dict[str, Any], key: tuple[str, str, str]) -> bool:
    """True when every field of ``result`` has its type (numbers >= 0) and its ids are the call's."""
    return all(isinstance(result.get(f), str) if kind is str else is_amount(result.get(f))
               and isinstance(result[f], kind) for f, kind in _RESULT_TYPES.items()
               ) and (result["state_id"], result["teacher_slug"]) == key[:2]


class _Tally:
    """The fold of ledger records into spend and reusable results."""

    def __init__(self) -> None:
        self.settled_usd, self.records, self.damaged = 0.0, 0, 0
        self.unsettled: dict[str, float] = {}  # attempt id -> reserved USD
        self.keys: dict[str, tuple[str, str, str]] = {}  # attempt id -> call
        self.done: dict[tuple[str, str, str], TeacherCallResult] = {}

    @property
    def spent_usd(self) -> float:
        return self.settled_usd + sum(self.unsettled.values())

    def _reuse(self, key: tuple[str, str, str] | None, result: Any) -> None:
        if key is not None and isinstance(result, dict) and result.get("error") is None:
            if _reusable(result, key):
                self.done[key] = result  # type: ignore[assignment]
            else:
                self.damaged += 1

    def add(self, rec: dict[str, Any]) -> None:
        """Fold one record in (``ValueError``/``KeyError``/``TypeError`` for a bad one: nothing counted)."""
        kind = rec.get("kind")
        if kind == "reserve":
            amount, attempt = _usd(rec["reserved_usd"]), str(rec["attempt"])
            key = (rec["state_id"], rec["teacher_slug"], rec["request_sha256"])
            if not all(isinstance(k, str) for k in key):
                raise TypeError("call ids must be strings")
            self.unsettled[attempt], self.keys[attempt] = amount, key
        elif kind == "settle":
            attempt, cost = str(rec["attempt"]), _usd(rec["cost_usd"])  # a bad cost: counted at the reservation
            self.settled_usd += cost
            self.unsettled.pop(attempt, None)
            self._reuse(self.keys.get(attempt), rec.get("result"))
        elif kind is None:  # version 1: one finished call per line
            result = rec["result"]
            self.settled_usd += _usd(result.get("cost_usd") or 0.0)
            if rec.get("ok") and "request_sha256" in rec:
                self._reuse((rec["state_id"], rec["teacher_slug"], rec["request_sha256"]), result)
        else:
            raise ValueError(f"unknown record kind {kind!r:.40}")
        self.records += 1

    def add_lines(self, raw: bytes, where: str) -> _Tally:
        """Fold in every line of ``raw`` (bad ones skipped and counted in a warning); returns ``self``."""
        bad = 0
        for line in raw.decode("utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                if not isinstance(rec, dict):
                    raise TypeError("not an object")
                self.add(rec)
            except (ValueError, KeyError, TypeError, AttributeError, RecursionError):
                bad += 1
        if bad:
            log.warning("ledger %s: skipped %d unreadable line(s) (bad JSON, nested too deep, or bad amounts)",
                        where, bad)
        if self.damaged:
            log.warning("ledger %s: %d cached result(s) are damaged (wrong types, missing fields or text); "
                        "those calls are sent again", where, self.damaged)
        return self


def ledger_spend(path: str | os.PathLike[str]) -> float:
    """USD a ledger file records as spent (0 when absent); read-only and lock-free, the same fold."""
    path = Path(path).expanduser()
    return _Tally().add_lines(path.read_bytes(), str(path)).spent_usd if path.is_file() else 0.0


class Ledger:
    """The ledger file at ``path`` (created with its parents), locked until :meth:`close`. ``LedgerLockedError``:
    another replay holds it; ``ValueError``: ``path`` is a folder or cannot be opened for appending."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser()
        if self.path.is_dir():
            raise ValueError(f"the ledger {self.path} is a folder; give a file path, e.g. {self.path / 'ledger.jsonl'}")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open (and locked)
        except OSError as exc:
            raise ValueError(f"the ledger {self.path} cannot be opened for appending ({exc.strerror or exc}); "
                             "give a writable file path") from None
        try:
            fcntl.flock(self._fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._fh.close()
            raise LedgerLockedError(
                f"ledger {self.path} is in use by another replay (it holds the file lock). Two replays on one "
                "ledger would pay for the same calls twice: wait for the other one to finish, or give this one "
                "its own --ledger.") from None
        self._lock, self._tally = threading.Lock(), _Tally()
        raw = self.path.read_bytes()
        if raw and not raw.endswith(b"\n"):  # the process died mid-write
            cut = raw.rfind(b"\n") + 1
            log.warning("ledger %s: dropping a torn last line (%d bytes)", self.path, len(raw) - cut)
            os.ftruncate(self._fh.fileno(), cut)
            os.fsync(self._fh.fileno())
            raw = raw[:cut]
        self._tally.add_lines(raw, str(self.path))

    @property
    def spent_usd(self) -> float:
        """Settled costs plus the reservations of attempts never settled, over every run of this ledger."""
        return self._tally.spent_usd

    @property
    def unsettled_usd(self) -> float:
        """Reservations of attempts recorded as sent but never settled (counted as spent)."""
        return sum(self._tally.unsettled.values())

    def lookup(self, state_id: str, teacher_slug: str, request_hash: str) -> TeacherCallResult | None:
        """The recorded, checked successful result of this exact call, or ``None``."""
        hit = self._tally.done.get((state_id, teacher_slug, request_hash))
        return dict(hit) if hit is not None else None  # type: ignore[return-value]

    def __len__(self) -> int:
        return self._tally.records

    @staticmethod
    def reserve_record(attempt: str, state_id: str, teacher_slug: str, request_hash: str,
                       reserved_usd: float) -> dict[str, Any]:
        """The write-ahead record of an attempt about to be sent."""
        return {"v": LEDGER_VERSION, "kind": "reserve", "attempt": attempt, "state_id": state_id,
                "teacher_slug": teacher_slug, "request_sha256": request_hash, "reserved_usd": float(reserved_usd),
                "time": time.time()}

    @staticmethod
    def settle_record(attempt: str, cost_usd: float, *, error: str | None,
                      result: TeacherCallResult | None = None) -> dict[str, Any]:
        """The record of an attempt that ended (``result`` on the call's last attempt)."""
        rec = {"v": LEDGER_VERSION, "kind": "settle", "attempt": attempt, "cost_usd": float(cost_usd),
               "error": error, "time": time.time()}
        return rec if result is None else {**rec, "result": dict(result)}

    def write_records(self, records: list[dict[str, Any]]) -> None:
        """Append records, one line each, then flush and fsync once (thread-safe; blocking)."""
        data = "".join(json.dumps(rec, ensure_ascii=False, allow_nan=False) + "\n" for rec in records)
        with self._lock:
            self._fh.write(data)
            self._fh.flush()
            os.fsync(self._fh.fileno())
            for rec in records:
                self._tally.add(rec)

    async def write(self, record: dict[str, Any]) -> None:
        """Return once ``record`` is durably written (a failure raises here: its attempt is not sent); a cancelled
        caller's record is still written. One fsync per record: grouping did not pay (``docs/teacher_replay.md``)."""
        await asyncio.shield(asyncio.to_thread(self.write_records, [record]))

    def close(self) -> None:
        """Release the lock and close the file (idempotent)."""
        with self._lock:
            if not self._fh.closed:
                self._fh.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

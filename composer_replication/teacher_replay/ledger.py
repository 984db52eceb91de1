"""An append-only JSONL ledger of teacher calls, so that a killed replay resumes without paying twice.

Every finished call (success or final error; not calls skipped before they were made) is appended as
one JSON line and flushed + fsync'ed before the result is handed back (calls that finish together
share one fsync: group commit)::

    {"v": 1, "state_id": "...", "teacher_slug": "...", "request_sha256": "...", "ok": true,
     "time": 1767225600.0, "result": {TeacherCallResult}}

A call is identified by ``(state_id, teacher_slug, request_sha256)``, where the hash covers the
canonical request body (model, messages, max_tokens, temperature, seed; see :func:`request_sha256`),
so changing the prompt or the sampling settings makes a new call. When a replay starts on an
existing ledger, successful calls found in it are returned from it (never paid again) and the spend
recorded in it counts against the budget. A torn last line (the process died mid-write) is dropped
and the file truncated to its last complete line; other unreadable lines are skipped with a warning.
The ledger never holds the API key: request bodies are hashed, error texts are scrubbed upstream.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from composer_replication.types import TeacherCallResult

__all__ = ["Ledger", "request_sha256", "LEDGER_VERSION"]

log = logging.getLogger(__name__)

LEDGER_VERSION = 1
_HASHED_FIELDS = ("model", "messages", "max_tokens", "temperature", "seed")


def request_sha256(body: dict[str, Any]) -> str:
    """sha256 of the canonical JSON of the body's model, messages, max_tokens, temperature and seed."""
    canon = {k: body.get(k) for k in _HASHED_FIELDS}
    data = json.dumps(canon, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(data.encode("utf-8")).hexdigest()


class Ledger:
    """The ledger file at ``path`` (created with its parents when missing).

    Attributes:
        spent_usd: total ``cost_usd`` of every call recorded (this and earlier runs).
        num_records: lines read back plus lines appended.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._done: dict[tuple[str, str, str], TeacherCallResult] = {}
        self.spent_usd = 0.0
        self.num_records = 0
        self._load()
        self._fh = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - kept open for appends

    # ------------------------------------------------------------------ reading

    def _load(self) -> None:
        if not self.path.exists():
            return
        raw = self.path.read_bytes()
        if raw and not raw.endswith(b"\n"):
            cut = raw.rfind(b"\n") + 1
            log.warning("ledger %s: dropping a torn last line (%d bytes)", self.path, len(raw) - cut)
            with open(self.path, "r+b") as fh:
                fh.truncate(cut)
                fh.flush()
                os.fsync(fh.fileno())
            raw = raw[:cut]
        bad = 0
        for line in raw.decode("utf-8", errors="replace").splitlines():
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                self._index(rec)
            except (ValueError, KeyError, TypeError):
                bad += 1
        if bad:
            log.warning("ledger %s: skipped %d unreadable line(s)", self.path, bad)

    def _index(self, rec: dict[str, Any]) -> None:
        result: TeacherCallResult = rec["result"]
        self.spent_usd += float(result.get("cost_usd") or 0.0)
        self.num_records += 1
        if rec.get("ok") and result.get("error") is None:
            self._done[(rec["state_id"], rec["teacher_slug"], rec["request_sha256"])] = result

    def lookup(self, state_id: str, teacher_slug: str, request_hash: str) -> TeacherCallResult | None:
        """The recorded successful result of this exact call, or ``None``."""
        hit = self._done.get((state_id, teacher_slug, request_hash))
        return dict(hit) if hit is not None else None  # type: ignore[return-value]

    def __len__(self) -> int:
        return self.num_records

    # ------------------------------------------------------------------ writing

    def append(self, request_hash: str, result: TeacherCallResult) -> None:
        """Append one finished call durably (write, flush, fsync). Thread-safe; blocking."""
        self.append_many([(request_hash, result)])

    def append_many(self, items: list[tuple[str, TeacherCallResult]]) -> None:
        """Append finished calls, one line each, then flush and fsync once. Thread-safe; blocking."""
        now = time.time()
        recs = [
            {
                "v": LEDGER_VERSION,
                "state_id": result["state_id"],
                "teacher_slug": result["teacher_slug"],
                "request_sha256": request_hash,
                "ok": result["error"] is None,
                "time": now,
                "result": dict(result),
            }
            for request_hash, result in items
        ]
        data = "".join(json.dumps(rec, ensure_ascii=False) + "\n" for rec in recs)
        with self._lock:
            if self._fh.closed:
                raise RuntimeError(f"ledger {self.path} is closed; open a new Ledger to append.")
            self._fh.write(data)
            self._fh.flush()
            os.fsync(self._fh.fileno())
            for rec in recs:
                self._index(rec)

    def close(self) -> None:
        """Close the file handle (idempotent)."""
        with self._lock:
            if not self._fh.closed:
                self._fh.close()

    def __enter__(self) -> Ledger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Ledger({str(self.path)!r}, records={self.num_records}, spent_usd={self.spent_usd:.6f})"

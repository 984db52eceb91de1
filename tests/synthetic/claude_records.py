"""The one writer of Claude Code session records in the tests (``~/.claude/projects/.../<session>.jsonl``, 2.1.x).

:class:`SessionWriter` appends records the way Claude Code writes them (notes: traces.md): one line per assistant
content block, the blocks of one response sharing ``message.id`` and ``requestId`` and chained by ``parentUuid``;
tool results in user records (``is_error`` on failures, ``toolUseResult`` beside them); snapshot, progress and
system records as noise. Every id and timestamp comes from the writer's ``random.Random``: a session is a pure
function of its seed. Used by ``generate.py`` (the bundled sessions) and ``planted_secrets.py``.
"""

from __future__ import annotations

import json
import random
import uuid
from datetime import datetime, timedelta
from typing import Any

_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_NS = uuid.UUID("7b3c2e0a-5d1f-4c8e-9a6b-2f4d8e1c0b9a")  # the generator's own namespace for uuid5


class SessionWriter:
    """Appends the records of one session (``records``), keeping the ``parentUuid`` chain; every id and
    timestamp comes from ``rng``, so a session is a pure function of its seed. ``calls`` lists the tool calls
    written, ``(name, input)``, in order; ``failed`` holds the indices into ``calls`` whose result is an error."""

    def __init__(self, rng: random.Random, *, key: str, cwd: str, start: datetime, model: str, version: str) -> None:
        self.rng, self.key, self.cwd, self.model, self.version = rng, key, cwd, model, version
        self.clock = start
        self.session_id = str(uuid.uuid5(_NS, f"session:{key}"))
        self.records: list[dict[str, Any]] = []
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.failed: set[int] = set()
        self._call_index: dict[str, int] = {}
        self.parent: str | None = None
        self._n = 0

    def _token(self, n: int) -> str:
        return "".join(self.rng.choice(_ALNUM) for _ in range(n))

    def _tick(self, lo: float, hi: float) -> str:
        self.clock += timedelta(milliseconds=int(self.rng.uniform(lo, hi) * 1000))
        return self.clock.strftime("%Y-%m-%dT%H:%M:%S.") + f"{self.clock.microsecond // 1000:03d}Z"

    def record(self, rtype: str, lo: float, hi: float, *, chain: bool = True, **fields: Any) -> str:
        """Append one record (timestamp ``lo``-``hi`` s after the previous); returns its uuid."""
        self._n += 1
        uid = str(uuid.uuid5(_NS, f"{self.key}:{self._n}"))
        self.records.append({"parentUuid": self.parent, "isSidechain": False, "userType": "external", "cwd": self.cwd,
                             "sessionId": self.session_id, "version": self.version, "gitBranch": "main",
                             "type": rtype, **fields, "uuid": uid, "timestamp": self._tick(lo, hi)})  # fmt: skip
        if chain:
            self.parent = uid
        return uid

    def snapshot(self) -> None:
        """The ``file-history-snapshot`` record a session opens with (no uuid, not in the chain)."""
        mid = str(uuid.uuid5(_NS, f"{self.key}:snapshot"))
        snap = {"messageId": mid, "trackedFileBackups": {}, "timestamp": self._tick(1, 3)}
        self.records.append({"type": "file-history-snapshot", "messageId": mid, "snapshot": snap, "isSnapshotUpdate": False})

    def user(self, text: str) -> None:
        """A typed user message."""
        self.record("user", 5, 40, message={"role": "user", "content": text}, permissionMode="default")

    def assistant(self, blocks: list[dict[str, Any]], results: list[tuple[str, bool, Any]] | None = None, *,
                  interleave: bool = False, hook: bool = False) -> None:  # fmt: skip
        """One API response: one line per block, then ``(content, is_error, toolUseResult)`` per tool_use block,
        in order (``interleave``: each right after its call; ``hook``: a ``PreToolUse`` progress record first)."""
        mid, rid = f"msg_01{self._token(22)}", f"req_011C{self._token(18)}"
        usage = {"input_tokens": self.rng.randint(2, 9), "cache_creation_input_tokens": self.rng.randint(300, 2500),
                 "cache_read_input_tokens": self.rng.randint(9000, 40000), "output_tokens": self.rng.randint(20, 400),
                 "service_tier": "standard"}  # fmt: skip
        pending = list(results or [])
        if len(pending) != sum(b["type"] == "tool_use" for b in blocks):
            raise ValueError(f"{len(blocks)} blocks but {len(pending)} results")
        queue: list[tuple[dict[str, Any], tuple[str, bool, Any]]] = []
        for block in blocks:
            msg = {"model": self.model, "id": mid, "type": "message", "role": "assistant", "content": [block],
                   "stop_reason": None, "stop_sequence": None, "usage": usage}  # fmt: skip
            self.record("assistant", 1, 12, requestId=rid, message=msg)
            if block["type"] == "tool_use":
                queue.append((block, pending.pop(0)))
                if interleave:
                    self._results(queue, hook)
        self._results(queue, hook)

    def _results(self, queue: list[tuple[dict[str, Any], tuple[str, bool, Any]]], hook: bool) -> None:
        while queue:
            block, (content, is_error, tur) = queue.pop(0)
            if hook:
                data = {"type": "hook_progress", "hookEvent": "PreToolUse", "hookName": f"PreToolUse:{block['name']}",
                        "command": "~/.claude/hooks/guard.sh"}  # fmt: skip
                self.record("progress", 0.2, 2, chain=False, toolUseID=block["id"], data=data)
            item: dict[str, Any] = {"tool_use_id": block["id"], "type": "tool_result", "content": content}
            if is_error:
                item["is_error"] = True
                self.failed.add(self._call_index[block["id"]])
            self.record("user", 0.3, 9, message={"role": "user", "content": [item]}, toolUseResult=tur)

    def tool_block(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """A ``tool_use`` content block with a fresh ``toolu_`` id."""
        self.calls.append((name, arguments))
        block = {"type": "tool_use", "id": f"toolu_01{self._token(22)}", "name": name, "input": arguments}
        self._call_index[block["id"]] = len(self.calls) - 1
        return block

    def thinking_block(self, text: str) -> dict[str, Any]:
        return {"type": "thinking", "thinking": text, "signature": self._token(96)}

    def stop_hook(self) -> None:
        """The ``system/stop_hook_summary`` record that closes a turn."""
        self.record("system", 0.1, 1, subtype="stop_hook_summary", hookCount=1,
                    hookInfos=[{"command": "~/.claude/hooks/notify.sh"}], hookErrors=[], preventedContinuation=False,
                    stopReason="", hasOutput=False, level="suggestion")  # fmt: skip


def text_block(text: str) -> dict[str, Any]:
    return {"type": "text", "text": text}


def cat_n(lines: list[str], start: int = 1) -> str:
    """``lines`` as the Read tool shows them: a right-aligned line number, an arrow, the line."""
    return "\n".join(f"{i:6d}\u2192{line}" for i, line in enumerate(lines, start))


def pytest_pass(n: int, seconds: float) -> str:
    return f"{'.' * n}{' ' * max(0, 72 - n)}[100%]\n{n} passed in {seconds:.2f}s"


def pytest_failure(*, test_rel: str, test: str, signature: str, body: list[str], test_line: int, error: list[str],
                   frame: tuple[str, int, str, str] | None, order: list[bool], seconds: float) -> str:  # fmt: skip
    """The ``-q`` output (with ``Exit code 1``) of one failing test among ``order`` (True = passed); ``frame``
    is ``(module path, line, function, source line)`` when the exception was raised in the module."""
    dots = "".join("." if ok else "F" for ok in order)
    out = ["Exit code 1", f"{dots}{' ' * max(0, 72 - len(dots))}[100%]", " FAILURES ".center(80, "="),
           f" {test} ".center(80, "_"), "", f"    {signature}", *(f"    {line}" for line in body[:-1]),
           ">" + f"    {body[-1]}"[1:]]  # pytest marks the failing line in place of its first space  # fmt: skip
    if frame is None:
        out += [*error, "", f"{test_rel}:{test_line}: AssertionError"]
    else:
        path, line, fn, src = frame
        out += ["", f"{test_rel}:{test_line}: ", "_ " * 39 + "_", "", f"{path}:{line}: in {fn}", f"    {src.strip()}", *error]
    first = error[0].removeprefix("E").strip()
    summary = first if frame else f"AssertionError: {first.removeprefix('AssertionError: ')}"
    out += [" short test summary info ".center(80, "="), f"FAILED {test_rel}::{test} - {summary}",
            f"1 failed, {len(order) - 1} passed in {seconds:.2f}s"]  # fmt: skip
    return "\n".join(out)


def session_bytes(records: list[dict[str, Any]]) -> bytes:
    """One session file's bytes (one JSON record per line, UTF-8)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")

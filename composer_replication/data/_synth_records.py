"""Claude Code 2.1-style JSONL records for the synthetic session generator, and tool-output renderers.

:class:`SessionWriter` appends records the way Claude Code writes them (docs: ../shared/notes/traces.md):
one line per assistant content block, the blocks of one response sharing ``message.id`` and
``requestId`` and chained by ``parentUuid``; tool results in *user* records (``is_error`` on
failures, ``toolUseResult`` UI metadata beside them); ``file-history-snapshot``, ``progress`` and
``system`` records as noise. Every id and timestamp comes from the writer's ``random.Random``, so a
session is a pure function of its seed.
"""

from __future__ import annotations

import random
import uuid
from datetime import datetime, timedelta
from typing import Any

__all__ = ["SessionWriter", "cat_n", "pytest_failure", "pytest_pass"]

_ALNUM = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
_NS = uuid.UUID("7b3c2e0a-5d1f-4c8e-9a6b-2f4d8e1c0b9a")  # the generator's own namespace for uuid5


class SessionWriter:
    """Appends the records of one session (``records``), keeping the ``parentUuid`` chain."""

    def __init__(
        self, rng: random.Random, *, key: str, cwd: str, start: datetime, model: str, version: str
    ) -> None:
        self.rng, self.key, self.cwd, self.model, self.version = rng, key, cwd, model, version
        self.clock = start
        self.session_id = str(uuid.uuid5(_NS, f"session:{key}"))
        self.records: list[dict[str, Any]] = []
        self.parent: str | None = None
        self._n = 0

    # ------------------------------------------------------------------ ids and envelope
    def _uuid(self) -> str:
        self._n += 1
        return str(uuid.uuid5(_NS, f"{self.key}:{self._n}"))

    def _token(self, n: int) -> str:
        return "".join(self.rng.choice(_ALNUM) for _ in range(n))

    def _tick(self, lo: float, hi: float) -> str:
        self.clock += timedelta(milliseconds=int(self.rng.uniform(lo, hi) * 1000))
        return self.clock.strftime("%Y-%m-%dT%H:%M:%S.") + f"{self.clock.microsecond // 1000:03d}Z"

    def _append(self, rtype: str, lo: float, hi: float, *, chain: bool = True, **fields: Any) -> str:
        uid = self._uuid()
        rec: dict[str, Any] = {
            "parentUuid": self.parent,
            "isSidechain": False,
            "userType": "external",
            "cwd": self.cwd,
            "sessionId": self.session_id,
            "version": self.version,
            "gitBranch": "main",
            "type": rtype,
            **fields,
            "uuid": uid,
            "timestamp": self._tick(lo, hi),
        }
        self.records.append(rec)
        if chain:
            self.parent = uid
        return uid

    # ------------------------------------------------------------------ records
    def snapshot(self) -> None:
        """The ``file-history-snapshot`` record a session opens with (no uuid, not in the chain)."""
        mid = str(uuid.uuid5(_NS, f"{self.key}:snapshot"))
        self.records.append(
            {
                "type": "file-history-snapshot",
                "messageId": mid,
                "snapshot": {"messageId": mid, "trackedFileBackups": {}, "timestamp": self._tick(1, 3)},
                "isSnapshotUpdate": False,
            }
        )

    def user(self, text: str) -> None:
        """A typed user message."""
        self._append("user", 5, 40, message={"role": "user", "content": text}, permissionMode="default")

    def assistant(
        self,
        blocks: list[dict[str, Any]],
        results: list[tuple[str, bool, Any]] | None = None,
        *,
        interleave: bool = False,
        hook: bool = False,
    ) -> None:
        """One API response: one line per block; then one result per tool_use block, in order.

        Args:
            blocks: content blocks (:func:`text_block`, :func:`thinking_block`, :meth:`tool_block`).
            results: ``(content, is_error, toolUseResult)`` for each tool_use block, in block order.
            interleave: write each result right after its call (tools that run while the response streams).
            hook: a ``PreToolUse`` hook ``progress`` record before each result.
        """
        mid, rid = f"msg_01{self._token(22)}", f"req_011C{self._token(18)}"
        usage = {
            "input_tokens": self.rng.randint(2, 9),
            "cache_creation_input_tokens": self.rng.randint(300, 2500),
            "cache_read_input_tokens": self.rng.randint(9000, 40000),
            "output_tokens": self.rng.randint(20, 400),
            "service_tier": "standard",
        }
        pending = list(results or [])
        calls = [b for b in blocks if b["type"] == "tool_use"]
        if len(pending) != len(calls):
            raise ValueError(f"{len(calls)} tool_use blocks but {len(pending)} results")
        queue: list[tuple[dict[str, Any], tuple[str, bool, Any]]] = []
        for block in blocks:
            msg = {
                "model": self.model,
                "id": mid,
                "type": "message",
                "role": "assistant",
                "content": [block],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": usage,
            }
            self._append("assistant", 1, 12, requestId=rid, message=msg)
            if block["type"] == "tool_use":
                queue.append((block, pending.pop(0)))
                if interleave:
                    self._results(queue, hook)
        self._results(queue, hook)

    def _results(self, queue: list[tuple[dict[str, Any], tuple[str, bool, Any]]], hook: bool) -> None:
        while queue:
            block, (content, is_error, tur) = queue.pop(0)
            if hook:
                self._append(
                    "progress",
                    0.2,
                    2,
                    chain=False,
                    toolUseID=block["id"],
                    data={
                        "type": "hook_progress",
                        "hookEvent": "PreToolUse",
                        "hookName": f"PreToolUse:{block['name']}",
                        "command": "~/.claude/hooks/guard.sh",
                    },
                )
            item: dict[str, Any] = {"tool_use_id": block["id"], "type": "tool_result", "content": content}
            if is_error:
                item["is_error"] = True
            self._append("user", 0.3, 9, message={"role": "user", "content": [item]}, toolUseResult=tur)

    def tool_block(self, name: str, arguments: dict[str, Any]) -> dict[str, Any]:
        """A ``tool_use`` content block with a fresh ``toolu_`` id."""
        return {"type": "tool_use", "id": f"toolu_01{self._token(22)}", "name": name, "input": arguments}

    def thinking_block(self, text: str) -> dict[str, Any]:
        """A ``thinking`` content block with a signature."""
        return {"type": "thinking", "thinking": text, "signature": self._token(96)}

    def stop_hook(self) -> None:
        """The ``system/stop_hook_summary`` record that closes a turn."""
        self._append(
            "system",
            0.1,
            1,
            subtype="stop_hook_summary",
            hookCount=1,
            hookInfos=[{"command": "~/.claude/hooks/notify.sh"}],
            hookErrors=[],
            preventedContinuation=False,
            stopReason="",
            hasOutput=False,
            level="suggestion",
        )


def text_block(text: str) -> dict[str, Any]:
    """A ``text`` content block."""
    return {"type": "text", "text": text}


# ---------------------------------------------------------------------------- tool output


def cat_n(lines: list[str], start: int = 1) -> str:
    """``lines`` as the Read tool shows them: a right-aligned line number, an arrow, the line."""
    return "\n".join(f"{i:6d}\u2192{line}" for i, line in enumerate(lines, start))


def pytest_pass(n: int, seconds: float) -> str:
    """The ``-q`` output of ``n`` passing tests."""
    return f"{'.' * n}{' ' * max(0, 72 - n)}[100%]\n{n} passed in {seconds:.2f}s"


def pytest_failure(
    *,
    test_rel: str,
    test: str,
    signature: str,
    body: list[str],
    test_line: int,
    error: list[str],
    frame: tuple[str, int, str, str] | None,
    order: list[bool],
    seconds: float,
) -> str:
    """The ``-q`` output (with ``Exit code 1``) of one failing test among ``order`` (True = passed).

    ``frame`` is ``(module path, line, function, source line)`` when the exception was raised in the module.
    """
    dots = "".join("." if ok else "F" for ok in order)
    out = [
        "Exit code 1",
        f"{dots}{' ' * max(0, 72 - len(dots))}[100%]",
        " FAILURES ".center(80, "="),
        f" {test} ".center(80, "_"),
        "",
        f"    {signature}",
    ]
    out += [f"    {line}" for line in body[:-1]]
    out.append(">" + f"    {body[-1]}"[1:])  # pytest marks the failing line in place of its first space
    if frame is None:
        out += [*error, "", f"{test_rel}:{test_line}: AssertionError"]
    else:
        path, line, fn, src = frame
        out += [
            "",
            f"{test_rel}:{test_line}: ",
            "_ " * 39 + "_",
            "",
            f"{path}:{line}: in {fn}",
            f"    {src.strip()}",
            *error,
        ]
    first = error[0].removeprefix("E").strip()
    summary = first if frame else f"AssertionError: {first.removeprefix('AssertionError: ')}"
    out += [
        " short test summary info ".center(80, "="),
        f"FAILED {test_rel}::{test} - {summary}",
        f"1 failed, {len(order) - 1} passed in {seconds:.2f}s",
    ]
    return "\n".join(out)

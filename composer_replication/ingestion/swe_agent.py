"""SWE-agent ``.traj`` files -> one :class:`TraceState` per agent step.

A ``.traj`` is one JSON object: ``trajectory[]`` steps (``response``, ``thought``, ``action``,
``observation``), ``history[]`` (OpenAI-like messages with ``tool_calls`` / ``tool_call_ids``,
``message_type``, ``agent``), ``info`` (``exit_status``, ``submission``, ``model_stats``).

- ``history`` is used when present: demonstration messages (``is_demo``, ``message_type:
  "demonstration"``) and messages of other agents are skipped; CRLF becomes LF.
- Steps of ``trajectory`` that ``history`` does not reach (the final ``submit`` is often missing
  from it) are appended as further states.
- Without ``history`` the states come from ``trajectory`` alone: each step's action is its raw
  ``response`` (with the ``action`` command appended in a fenced block when the response does not
  contain it), each observation a user message.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from composer_replication.ingestion.history import IngestionStats
from composer_replication.ingestion.openai_messages import OpenAIMessagesIngester, normalize_message
from composer_replication.ingestion.streaming import NestingTooDeep, loads, read_text
from composer_replication.types import TraceState

__all__ = ["SWEAgentIngester", "step_action"]


def step_action(step: dict) -> str:
    """The action text of one ``trajectory`` step (raw response, plus the command when not in it)."""
    response = str(step.get("response") or step.get("thought") or "").replace("\r\n", "\n").strip()
    action = str(step.get("action") or "").replace("\r\n", "\n").strip()
    present = (
        action in response if "\n" in action else any(ln.strip() == action for ln in response.splitlines())
    )
    if action and not present:
        return f"{response}\n\n```\n{action}\n```".strip()
    return response


def _is_demo(m: dict) -> bool:
    return bool(m.get("is_demo")) or m.get("message_type") == "demonstration" or m.get("agent") not in (
        None, "main", "primary",
    )  # fmt: skip


def _crlf(m: dict) -> dict:
    if isinstance(m.get("content"), str):
        m["content"] = m["content"].replace("\r\n", "\n")
    return m


class SWEAgentIngester(OpenAIMessagesIngester):
    """Convert a SWE-agent ``.traj`` into TraceStates (``source="swe_agent"``).

    Args: ``system_prompt`` (used only when the trajectory records none), ``strip_thinking``,
    ``max_history_tokens``, ``tokenizer``, as for ``ClaudeCodeIngester``. A trajectory's ``history`` is
    OpenAI-style messages, so the conversation is built by :class:`OpenAIMessagesIngester`'s builder.
    """

    source = "swe_agent"

    def ingest(self, path: str | Path) -> Iterator[TraceState]:
        """Yield one TraceState per step; ``state_id = f"{path.stem}::{idx:04d}"``."""
        path = Path(path)
        stats = self.last_stats = IngestionStats()
        try:
            doc = loads(read_text(path), path)
        except NestingTooDeep:
            raise
        except ValueError:
            stats.n_records_total += 1
            stats.skipped_truncated_lines += 1
            stats.n_records_skipped += 1
            return
        if not isinstance(doc, dict):
            raise ValueError(
                f"{path} is not a SWE-agent .traj (a JSON object with 'trajectory'/'history'); "
                f"got a JSON {type(doc).__name__}. Use format='openai' for message lists."
            )
        steps = [s for s in doc.get("trajectory") or [] if isinstance(s, dict)]
        history = [m for m in doc.get("history") or [] if isinstance(m, dict)]
        messages: list[dict] = []
        for m in history:
            stats.n_records_total += 1
            nm = normalize_message(m) if not _is_demo(m) else None
            if nm is None:
                stats.skipped_meta += 1
                stats.n_records_skipped += 1
            else:
                messages.append(_crlf(nm))
        n_assistant = sum(m["role"] == "assistant" for m in messages)
        extra = steps[n_assistant:] if messages else steps
        stats.n_records_total += len(extra)
        extra_actions = [
            (step_action(s), str(s.get("observation") or "").replace("\r\n", "\n")) for s in extra
        ]
        builder = self.builder(stats)
        for idx, state in enumerate(builder.build(messages, extra_actions=extra_actions)):
            state["state_id"] = f"{path.stem}::{idx:04d}"
            stats.n_states_emitted += 1
            yield state

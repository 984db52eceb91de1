"""Claude Code session JSONL -> one :class:`TraceState` per assistant turn.

Claude Code writes ``~/.claude/projects/<cwd>/<session>.jsonl``: one record per line, one line per
content block, records linked into a tree by ``uuid``/``parentUuid`` (notes: ``traces.md``). This
module reads versions 1.0.x to 2.1.x:

- a *turn* is the set of assistant lines sharing ``message.id`` (else ``requestId``, else ``uuid``),
  even when its own tool results are interleaved between its lines (2.1.x streams tools);
- a turn's history is the ``parentUuid`` chain from its first line back to the root, so a rewound
  branch never leaks into the other branch; a compaction boundary resets it to the summary;
- histories are built incrementally: every record's history is its parent's plus its own
  contribution, appended in place while a chain does not fork (a fork copies once), so a session
  costs one pass plus a list slice per state, not a walk per turn.

See ``docs/ingestion.md`` for every rule (sidechains, noise records, tool results, images, errors).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from composer_replication.ingestion.claude_code_session import ClaudeCodeSession
from composer_replication.ingestion.history import (
    SYSTEM_PROMPT,
    BaseIngester,
    IngestionStats,
    gc_paused,
    iter_jsonl,
)
from composer_replication.types import TraceState

__all__ = ["SYSTEM_PROMPT", "IngestionStats", "ClaudeCodeIngester", "is_subagent_file"]

logger = logging.getLogger(__name__)

def is_subagent_file(path: Path) -> bool:
    """True for Claude Code subagent transcripts: ``agent-*.jsonl`` or any file under ``subagents/``."""
    return path.name.startswith("agent-") or path.parent.name == "subagents"


class ClaudeCodeIngester(BaseIngester):
    """Convert a Claude Code session JSONL into a stream of TraceStates, one per assistant turn.

    Args:
        system_prompt: synthetic system message put at ``messages[0]`` (Claude Code does not log one).
        skip_sidechain: skip subagent files and ``isSidechain`` records (their turns are a subagent's).
        strip_thinking: keep thinking out of histories (it always stays in ``student_action``);
            when False, history assistant messages carry it as ``[THINKING] ...`` text.
        max_history_tokens: drop the oldest non-system messages of each history until it fits
            (tool calls and their results go together); ``None`` keeps everything.
        tokenizer: counts tokens for ``max_history_tokens`` (a Hugging Face tokenizer or a callable
            ``text -> int | list``); ``None`` estimates ``len(text) / 4``.
    """

    source = "claude_code"

    def __init__(
        self,
        *,
        system_prompt: str = SYSTEM_PROMPT,
        skip_sidechain: bool = True,
        strip_thinking: bool = True,
        max_history_tokens: int | None = None,
        tokenizer: Any = None,
    ) -> None:
        super().__init__(
            system_prompt=system_prompt,
            strip_thinking=strip_thinking,
            max_history_tokens=max_history_tokens,
            tokenizer=tokenizer,
        )
        self.skip_sidechain = skip_sidechain

    # ------------------------------------------------------------------ public API
    def ingest(self, path: str | Path) -> Iterator[TraceState]:
        """Yield one TraceState per assistant turn of the session at ``path``.

        ``state_id`` is ``f"{path.stem}::{idx:04d}"`` (``idx`` counts emitted states). Replaces
        ``self.last_stats`` with fresh counters, filled as the file streams.
        """
        path = Path(path)
        stats = self.last_stats = IngestionStats()
        if self.skip_sidechain and is_subagent_file(path):
            stats.skipped_subagent += 1
            return
        session = ClaudeCodeSession(self, stats)
        with gc_paused():
            session.load(iter_jsonl(path, stats))
        yield from session.states(path.stem)
        logger.debug(
            "ingested %s: %d states from %d records", path, stats.n_states_emitted, stats.n_records_total
        )



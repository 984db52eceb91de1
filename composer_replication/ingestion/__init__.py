"""Trace ingestion: recorded agent sessions -> :class:`~composer_replication.types.TraceState` streams, secrets redacted.

``ingest_any(path)`` reads Claude Code, Codex CLI, OpenAI-messages and SWE-agent files (format detected from the
content); CLI: ``python -m composer_replication.ingestion PATH... --out states.jsonl``. The rest is reached through
the modules (``claude_code``, ``codex``, ``openai_messages``, ``registry``, ``errors``, ``redact``, ``history``).
"""

from composer_replication.ingestion.claude_code import SYSTEM_PROMPT, ClaudeCodeIngester, IngestionStats
from composer_replication.ingestion.registry import ingest_any

__all__ = ["ingest_any", "ClaudeCodeIngester", "IngestionStats", "SYSTEM_PROMPT"]

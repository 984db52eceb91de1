"""Trace ingestion: real agent sessions -> :class:`~composer_replication.types.TraceState` streams.

Formats: Claude Code session JSONL (:class:`ClaudeCodeIngester`), Codex CLI rollouts
(:class:`CodexIngester`), OpenAI chat messages (:class:`OpenAIMessagesIngester`) and SWE-agent
``.traj`` (:class:`SWEAgentIngester`); :func:`ingest_any` detects the format from the content.
CLI: ``python -m composer_replication.ingestion PATH... --out states.jsonl``.
"""

from composer_replication.ingestion.claude_code import ClaudeCodeIngester, is_subagent_file
from composer_replication.ingestion.codex import CodexIngester
from composer_replication.ingestion.errors import ERROR_KINDS, classify_tool_error
from composer_replication.ingestion.history import NO_RESULT, SYSTEM_PROMPT, IngestionStats, trim_history
from composer_replication.ingestion.openai_messages import OpenAIMessagesIngester
from composer_replication.ingestion.registry import (
    FORMATS,
    INGESTERS,
    detect_format,
    ingest_any,
    make_ingester,
)
from composer_replication.ingestion.streaming import NestingTooDeep
from composer_replication.ingestion.swe_agent import SWEAgentIngester

__all__ = [
    "SYSTEM_PROMPT",
    "NO_RESULT",
    "IngestionStats",
    "ClaudeCodeIngester",
    "CodexIngester",
    "OpenAIMessagesIngester",
    "SWEAgentIngester",
    "INGESTERS",
    "FORMATS",
    "ERROR_KINDS",
    "classify_tool_error",
    "detect_format",
    "ingest_any",
    "make_ingester",
    "is_subagent_file",
    "trim_history",
    "NestingTooDeep",
]

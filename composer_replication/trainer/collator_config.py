"""The collator's input records, its configuration and its counters (``trainer.data_collator`` re-exports them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

from composer_replication.batching import OVER_LENGTH

__all__ = ["TraceTurn", "TraceExample", "CollatorConfig", "CollatorStats"]


class TraceTurn(TypedDict, total=False):
    """One turn of an agentic trace.

    Attributes:
        role: ``"system"``, ``"user"``, ``"assistant"`` or ``"tool"``.
        content: the text (for an assistant turn: action text, see ``composer_replication.actions``).
        tool_call: an assistant turn's tool call, ``{"name", "arguments"}`` (dict or JSON string),
            OpenAI ``{"function": {...}}`` or ``{"name", "input"}``; appended to ``content`` as
            ``[TOOL_USE] name=... input=...`` unless ``content`` already has a ``[TOOL_USE]`` line
            for that tool name.
        tool_error: the error kind of a failed tool call (``json_decode``, ...). On an assistant turn
            it marks that turn as an error site; on a tool turn it marks the closest assistant turn
            before it.
        error_meta: the ``hint_generator.HintContext`` of the error (marks an error site like
            ``tool_error``); its ``error_kind`` wins over ``tool_error``.
    """

    role: str
    content: str
    tool_call: dict | None
    tool_error: str | None
    error_meta: dict


class TraceExample(TypedDict, total=False):
    """One training example: turns, a scalar reward and optional DPO pairs (``types.DPOPair`` dicts).

    ``group_id`` (any hashable, optional) puts examples that share a prompt in one GRPO group.
    """

    trace_id: str
    turns: list[TraceTurn]
    final_reward: float
    dpo_pairs: list[dict] | None
    group_id: Any


# ---------------------------------------------------------------------------- config and stats


@dataclass(kw_only=True)
class CollatorConfig:
    """Tunables for :class:`ComposerDataCollator` (the spec's fields plus padding and grouping)."""

    max_seq_len: int = 4096
    """Cap for student and teacher rows; history is dropped from the left, responses kept whole."""
    max_dpo_seq_len: int = 2048
    """Cap for DPO chosen/rejected rows (see ``over_length``)."""
    over_length: str = "truncate_left"
    """Over-length policy of DPO rows (``composer_replication.batching``): ``truncate_left`` cuts the shared
    prompt from the left; ``skip`` drops the pair; a response that alone reaches the cap is always dropped.
    Drops are counted in ``stats.skipped_dpo``."""
    pad_token_id: int | None = None
    """Padding id; ``None`` takes the tokenizer's ``pad_token_id`` (else its ``eos_token_id``)."""
    padding_side: str | None = None
    """``"left"`` or ``"right"``; ``None`` takes the tokenizer's ``padding_side`` (else right)."""
    ignore_index: int = -100
    """Kept for the spec; the batch uses 0/1 masks (batch contract), so nothing is filled with it."""
    enable_sdpo: bool = True
    """Emit channel-2 keys (also needs ``hint_generator`` and at least one hinted error site)."""
    hint_generator: Callable[[str, dict], str | None] | None = None
    """``(error_kind, error_meta) -> hint | None``, e.g. ``hint_generator.make_hint_generator()``."""
    enable_replay_dpo: bool = True
    """Emit channel-3 keys (when the batch carries at least one ``dpo_pairs`` entry)."""
    rlvr_reward_key: str = "final_reward"
    """Example key holding the scalar reward (0.0 when the key is absent)."""
    group_key: str = "group_id"
    """Example key naming a GRPO group; examples without it are grouped by identical prompt ids."""
    response_turns: str = "all"
    """``"all"``: every assistant turn is in ``response_mask``; ``"last"``: only the final one
    (recommended for trace states, whose history turns recur in many states)."""

    def __post_init__(self) -> None:
        for name in ("max_seq_len", "max_dpo_seq_len"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 2:
                raise ValueError(f"CollatorConfig.{name} must be an int >= 2, got {getattr(self, name)!r}")
        if self.pad_token_id is not None and (
            not isinstance(self.pad_token_id, int) or self.pad_token_id < 0
        ):
            raise ValueError(
                f"CollatorConfig.pad_token_id must be None or an int >= 0, got {self.pad_token_id!r}"
            )
        if self.padding_side not in (None, "left", "right"):
            raise ValueError(
                f"CollatorConfig.padding_side must be None, 'left' or 'right', got {self.padding_side!r}"
            )
        if self.hint_generator is not None and not callable(self.hint_generator):
            raise ValueError(
                f"CollatorConfig.hint_generator must be callable or None, got {self.hint_generator!r}"
            )
        if self.response_turns not in ("all", "last"):
            raise ValueError(
                f"CollatorConfig.response_turns must be 'all' or 'last', got {self.response_turns!r}"
            )
        if self.over_length not in OVER_LENGTH:
            raise ValueError(f"CollatorConfig.over_length must be one of {OVER_LENGTH}, got {self.over_length!r}")
        if not self.rlvr_reward_key or not self.group_key:
            raise ValueError("CollatorConfig.rlvr_reward_key and group_key must be non-empty strings")


@dataclass
class CollatorStats:
    """Counters a collator accumulates over its calls."""

    examples: int = 0
    """Examples collated."""
    truncated_policy: int = 0
    """Student rows cut from the left to fit ``max_seq_len``."""
    truncated_sdpo: int = 0
    """Teacher rows cut from the left to fit ``max_seq_len``."""
    truncated_dpo: int = 0
    """DPO pairs whose prompt was cut from the left to fit ``max_dpo_seq_len``."""
    sdpo_sites: int = 0
    """Error sites found (before hints)."""
    sdpo_sites_without_hint: int = 0
    """Error sites for which the hint generator returned ``None`` (no teacher row)."""
    sdpo_sites_dropped: int = 0
    """Error sites dropped because truncation cut their response out of the student row."""
    skipped_dpo: int = 0
    """DPO pairs skipped by the over-length policy (a response alone reaches ``max_dpo_seq_len``, or
    ``over_length="skip"``)."""

"""The collator's input records (the spec's ``TraceTurn``, ``TraceExample``), its config and its counters."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

from composer_replication.batching import OVER_LENGTH

__all__ = ["TraceTurn", "TraceExample", "CollatorConfig", "CollatorStats"]


class TraceTurn(TypedDict, total=False):
    """One turn of an agentic trace (the spec's record).

    ``role``: system, user, assistant or tool. ``content``: the text (an assistant turn's action text,
    ``composer_replication.actions``). ``tool_call``: an assistant turn's call (``{"name", "arguments"}``, OpenAI
    ``{"function": ...}`` or ``{"name", "input"}``), appended as ``[TOOL_USE] name=... input=...`` unless the
    content already has that line. ``tool_error``: the error kind of a failed call; it marks the assistant turn
    (or, on a tool turn, the closest assistant turn before it) as an error site. ``error_meta``: the error's
    ``hint_generator.HintContext`` (also marks a site; its ``error_kind`` wins).
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
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"CollatorConfig.{name} must be {rule}, got {getattr(self, name)!r}")

        for name in ("max_seq_len", "max_dpo_seq_len"):
            check(isinstance(getattr(self, name), int) and getattr(self, name) >= 2, name, "an int >= 2")
        check(self.pad_token_id is None or (isinstance(self.pad_token_id, int) and self.pad_token_id >= 0),
              "pad_token_id", "None or an int >= 0")
        check(self.padding_side in (None, "left", "right"), "padding_side", "None, 'left' or 'right'")
        check(self.hint_generator is None or callable(self.hint_generator), "hint_generator", "callable or None")
        check(self.response_turns in ("all", "last"), "response_turns", "'all' or 'last'")
        check(self.over_length in OVER_LENGTH, "over_length", f"one of {OVER_LENGTH}")
        for name in ("rlvr_reward_key", "group_key"):
            check(bool(getattr(self, name)), name, "non-empty")


@dataclass
class CollatorStats:
    """Counters a collator accumulates over its calls."""

    examples: int = 0  # examples collated
    truncated_policy: int = 0  # student rows cut from the left to fit ``max_seq_len``
    truncated_sdpo: int = 0  # teacher rows cut from the left to fit ``max_seq_len``
    truncated_dpo: int = 0  # DPO pairs whose prompt was cut from the left to fit ``max_dpo_seq_len``
    sdpo_sites: int = 0  # error sites found (before hints)
    sdpo_sites_without_hint: int = 0  # sites whose hint generator returned None (no teacher row)
    sdpo_sites_dropped: int = 0  # sites whose response truncation cut out of the student row
    skipped_dpo: int = 0  # DPO pairs dropped by the over-length policy

"""Token rows for the three channels: one pad, one over-length policy, pairs tokenized once.

Every producer of training batches builds its rows here (the engine, ``build_batch``, the collator and the
TRL trainer); text becomes token ids through :mod:`composer_replication.chat_format` only. Generation lives
in :mod:`composer_replication.rollout.generate`.

Rows and their tensors (the batch contract, ``docs/collator.md``):

- **policy rows** (channel 1): ``input_ids``, ``attention_mask``, ``response_mask`` ``[B, T]``;
- **hinted rows** (channel 2): the hinted history followed by exactly the student's response ids
  (:func:`hinted_batch`): ``ctx_teacher_input_ids``, ``ctx_teacher_attention_mask``, ``sdpo_loss_mask``
  ``[B2, Tt]``, and ``sdpo_student_index`` / ``sdpo_teacher_index`` ``[N, 2]`` pairing each response token of
  the student batch with the same token of the hinted batch;
- **preference rows** (channel 3): ``dpo_{chosen,rejected}_{input_ids,attention_mask,response_mask}``
  ``[P, T*]`` (:func:`preference_batch`), from pairs tokenized once (:func:`tokenize_pair`).

**Over-length policy** (:data:`OVER_LENGTH`), one rule for every row that holds a prompt and a response:
``"truncate_left"`` (the default) cuts the prompt from the left until the row fits; the response is never
cut, so a response that alone reaches the cap is skipped. ``"skip"`` drops any row over the cap. Every skip
is counted with its reason in :class:`BatchingStats`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from composer_replication.chat_format import build_prompt_ids, build_response_ids, end_of_turn_id
from composer_replication.types import PreferencePair

__all__ = ["BatchingStats", "TokenizedPair", "HintedRow", "pad_id", "pad_rows", "fit_prompt",
           "tokenize_pair", "preference_batch", "hinted_batch"]

log = logging.getLogger(__name__)

OverLength = Literal["truncate_left", "skip"]
OVER_LENGTH: tuple[str, ...] = ("truncate_left", "skip")
"""The over-length policies: cut the history from the left, or skip the row (counted)."""


@dataclass
class BatchingStats:
    """What the over-length policy did: rows cut from the left, rows skipped by reason."""

    truncated: int = 0
    """Rows whose prompt was cut from the left to fit."""
    skipped: Counter = field(default_factory=Counter)
    """``{reason: count}`` of rows that were dropped."""

    def as_metrics(self, prefix: str = "batching/") -> dict[str, float]:
        """``{prefix}truncated`` and ``{prefix}skipped/<reason>`` as floats."""
        out = {f"{prefix}truncated": float(self.truncated)}
        out.update({f"{prefix}skipped/{k}": float(v) for k, v in sorted(self.skipped.items())})
        return out


def pad_id(tokenizer: Any) -> int:
    """The padding id: the tokenizer's ``pad_token_id``, else its end-of-turn id."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return int(pad) if pad is not None else end_of_turn_id(tokenizer)


def pad_rows(
    rows: Sequence[Sequence[int]], fill: int, *, side: str = "right", width: int | None = None
) -> tuple[torch.Tensor, list[int]]:
    """Pad ``rows`` into one ``[N, T]`` long tensor; returns it and each row's first column.

    ``side="right"``: rows start at column 0; ``"left"``: rows end at column ``T - 1``. ``width`` is ``T``
    (default the longest row, at least 1).

    Raises:
        ValueError: no rows, a bad side, or a row longer than ``width``.
    """
    if not rows:
        raise ValueError("pad_rows needs at least one row")
    if side not in ("left", "right"):
        raise ValueError(f"padding side must be 'left' or 'right', got {side!r}")
    longest = max(len(r) for r in rows)
    width = max(1, longest) if width is None else width
    if longest > width:
        raise ValueError(f"a row has {longest} items but the width is {width}")
    out = torch.full((len(rows), width), fill, dtype=torch.long)
    offsets = []
    for i, row in enumerate(rows):
        off = width - len(row) if side == "left" else 0
        if len(row):
            out[i, off : off + len(row)] = torch.as_tensor(list(row), dtype=torch.long)
        offsets.append(off)
    return out, offsets


def _padded(rows: Sequence[Sequence[int]], starts: Sequence[int], fill: int, side: str) -> dict[str, torch.Tensor]:
    """``ids``, ``attention`` (1 on every item) and ``response`` (1 from ``starts[i]`` on) ``[N, T]``."""
    return {"ids": pad_rows(rows, fill, side=side)[0],
            "attention": pad_rows([[1] * len(r) for r in rows], 0, side=side)[0],
            "response": pad_rows([[0] * s + [1] * (len(r) - s) for r, s in zip(rows, starts)], 0, side=side)[0]}


def fit_prompt(
    prompt: list[int], longest_response: int, *, max_seq_len: int | None, over_length: str,
    stats: BatchingStats | None = None,
) -> list[int] | None:
    """Apply the over-length policy to a row ``prompt + response``: the prompt to use, or ``None`` to skip.

    Raises:
        ValueError: an unknown policy.
    """
    if over_length not in OVER_LENGTH:
        raise ValueError(f"over_length must be one of {OVER_LENGTH}, got {over_length!r}")
    if max_seq_len is None or len(prompt) + longest_response <= max_seq_len:
        return prompt
    if over_length == "truncate_left" and longest_response < max_seq_len:
        if stats is not None:
            stats.truncated += 1
        return prompt[len(prompt) + longest_response - max_seq_len :]
    reason = "over_length" if over_length == "skip" else "response_over_length"
    if stats is not None:
        stats.skipped[reason] += 1
    log.warning("skipping a row of %d tokens over max_seq_len=%d (%s)", len(prompt) + longest_response,
                max_seq_len, reason)
    return None


# ---------------------------------------------------------------------------- channel 3: preference rows


@dataclass(frozen=True)
class TokenizedPair:
    """A preference pair as token ids: the shared prompt and each side's response (end-of-turn included)."""

    state_id: str
    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]


def tokenize_pair(
    tokenizer: Any, pair: PreferencePair | Any, *, max_seq_len: int | None = None,
    over_length: str = "truncate_left", stats: BatchingStats | None = None,
) -> TokenizedPair | None:
    """Tokenize one pair (``prompt(state_messages)``, ``response(chosen)``, ``response(rejected)``).

    ``pair`` is a :class:`PreferencePair` or anything :meth:`PreferencePair.from_mapping` reads.
    Returns ``None`` when the over-length policy skips it, or a side is empty (counted in ``stats``).
    """
    pair = PreferencePair.from_mapping(pair)
    if not pair.chosen.strip() or not pair.rejected.strip():
        if stats is not None:
            stats.skipped["empty_action"] += 1
        return None
    chosen, rejected = build_response_ids(tokenizer, pair.chosen), build_response_ids(tokenizer, pair.rejected)
    prompt = fit_prompt(build_prompt_ids(tokenizer, pair.state_messages), max(len(chosen), len(rejected)),
                        max_seq_len=max_seq_len, over_length=over_length, stats=stats)
    return None if prompt is None else TokenizedPair(pair.state_id, tuple(prompt), tuple(chosen), tuple(rejected))


def tokenize_pairs(
    tokenizer: Any, pairs: Sequence[PreferencePair | Any], *, max_seq_len: int | None = None,
    over_length: str = "truncate_left", stats: BatchingStats | None = None,
) -> list[TokenizedPair | None]:
    """:func:`tokenize_pair` over ``pairs``, index for index (``None`` where a pair was skipped)."""
    return [tokenize_pair(tokenizer, p, max_seq_len=max_seq_len, over_length=over_length, stats=stats)
            for p in pairs]


def preference_batch(
    pairs: Sequence[TokenizedPair], fill: int, *, side: str = "right", device: torch.device | str | None = None,
) -> dict[str, torch.Tensor]:
    """Channel-3 tensors of tokenized pairs: ``dpo_{chosen,rejected}_{input_ids,attention_mask,response_mask}``.

    Each side is ``[P, T_side]`` (``T_side`` = its longest row), padded with ``fill`` on ``side``.
    Returns ``{}`` for no pairs.
    """
    if not pairs:
        return {}
    out: dict[str, torch.Tensor] = {}
    for name in ("chosen", "rejected"):
        rows = _padded([p.prompt + getattr(p, name) for p in pairs], [len(p.prompt) for p in pairs], fill, side)
        for key, suffix in (("ids", "input_ids"), ("attention", "attention_mask"), ("response", "response_mask")):
            out[f"dpo_{name}_{suffix}"] = rows[key].to(device)  # [P, T_side]
    return out


# ---------------------------------------------------------------------------- channel 2: hinted rows


@dataclass(frozen=True)
class HintedRow:
    """One hinted row of channel 2 and where its response sits in the student batch.

    Attributes:
        ids: ``prompt(history + [hint]) + response ids`` (``chat_format.build_hinted_teacher_sequence``).
        start: index in ``ids`` where the response starts.
        student_row: the student row (``b`` of ``[B, T]``) whose response this is.
        student_col: the column of the padded student tensor where that response starts.
    """

    ids: tuple[int, ...]
    start: int
    student_row: int
    student_col: int


def hinted_batch(
    rows: Sequence[HintedRow], fill: int, *, side: str = "right", device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """Channel-2 tensors, index-aligned with the student batch.

    Returns (``{}`` for no rows): ``ctx_teacher_input_ids``, ``ctx_teacher_attention_mask``,
    ``sdpo_loss_mask`` ``[B2, Tt]``; ``sdpo_student_index`` and ``sdpo_teacher_index`` ``[N, 2]`` long,
    where row ``n`` pairs student position ``(b, t)`` with hinted position ``(j, t')`` of the same response
    token (``N`` = all response tokens of all hinted rows).
    """
    if not rows:
        return {}
    offsets = pad_rows([r.ids for r in rows], fill, side=side)[1]
    s_index = [(r.student_row, r.student_col + k) for r in rows for k in range(len(r.ids) - r.start)]
    t_index = [(j, offsets[j] + r.start + k) for j, r in enumerate(rows) for k in range(len(r.ids) - r.start)]
    t = _padded([r.ids for r in rows], [r.start for r in rows], fill, side)
    out = {"ctx_teacher_input_ids": t["ids"], "ctx_teacher_attention_mask": t["attention"],
           "sdpo_loss_mask": t["response"],
           "sdpo_student_index": torch.tensor(s_index, dtype=torch.long).reshape(-1, 2),
           "sdpo_teacher_index": torch.tensor(t_index, dtype=torch.long).reshape(-1, 2)}
    return {k: v.to(device) for k, v in out.items()}

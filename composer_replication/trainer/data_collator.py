"""ComposerDataCollator (the spec's ``trainer.data_collator``): agentic traces -> one batch for the three channels.

Batch keys (the batch contract, ``docs/collator.md``): channel 1 ``input_ids``, ``attention_mask``,
``response_mask`` (each assistant turn's text tokens plus its end-of-turn token, never the role header), ``rewards``,
``group_ids`` when examples share a prompt; channel 2 ``ctx_teacher_input_ids``, ``ctx_teacher_attention_mask``,
``sdpo_loss_mask``, ``sdpo_student_index``, ``sdpo_teacher_index``; channel 3
``dpo_{chosen,rejected}_{input_ids,attention_mask,response_mask}``.

A student row renders the conversation turn by turn (:mod:`composer_replication.chat_format`): for each assistant
turn, the template text of the history not yet rendered, then that turn's response ids (``build_response_ids``);
turns after the last assistant turn are dropped. So each response appears in the row as exactly the ids that
channel 2 copies into the teacher row (``batching.hinted_batch``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import math
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_replication.actions import parse_action
from composer_replication.batching import (
    BatchingStats,
    HintedRow,
    TokenizedPair,
    hinted_batch,
    pad_rows,
    preference_batch,
    tokenize_pair,
)
from composer_replication.chat_format import (
    TokenizerLike,
    build_hinted_teacher_sequence,
    build_response_ids,
    encode_text,
    end_of_turn_id,
    render_chat_text,
    to_chat_messages,
)
from composer_replication.trainer.collator_config import (
    CollatorConfig,
    CollatorStats,
    TraceExample,
    TraceTurn,
)
from composer_replication.types import PreferencePair

__all__ = ["TraceTurn", "TraceExample", "TokenizerLike", "CollatorConfig", "CollatorStats", "ComposerDataCollator"]

log = logging.getLogger(__name__)


# a student row: ids, response mask, ``{assistant turn: (start, end)}`` spans (after truncation), the ids before
# its last response (the grouping key)
_StudentRow = collections.namedtuple("_StudentRow", "ids mask spans prompt_key")


@dataclass
class ComposerDataCollator:
    """Trainer-ready batches (channels 1-3) from :class:`TraceExample` dicts (the spec's collator):
    ``ComposerDataCollator(tok, CollatorConfig(hint_generator=make_hint_generator()))(examples)``.

    ``__call__`` raises ``ValueError`` (naming the example) for an empty batch, an example without an assistant
    turn, an unknown role, a response longer than the cap, or a malformed DPO pair.
    """

    tokenizer: TokenizerLike
    config: CollatorConfig = field(default_factory=CollatorConfig)
    stats: CollatorStats = field(default_factory=CollatorStats, init=False)
    stats_batching: BatchingStats = field(default_factory=BatchingStats, init=False)

    def __post_init__(self) -> None:
        if not callable(getattr(self.tokenizer, "apply_chat_template", None)):
            raise ValueError(f"tokenizer must provide apply_chat_template, got {type(self.tokenizer).__name__}")
        self._eot = end_of_turn_id(self.tokenizer)
        self._eot_text = self.tokenizer.decode([self._eot])
        pad = next((p for p in (self.config.pad_token_id, getattr(self.tokenizer, "pad_token_id", None),
                                 getattr(self.tokenizer, "eos_token_id", None)) if p is not None), None)
        if pad is None:
            raise ValueError("no pad id: the tokenizer has no pad_token_id/eos_token_id; set CollatorConfig.pad_token_id")
        self._pad_id = int(pad)
        self._side = self.config.padding_side or getattr(self.tokenizer, "padding_side", None) or "right"
        if self._side not in ("left", "right"):
            raise ValueError(f"tokenizer.padding_side must be 'left' or 'right', got {self._side!r}")

    def __call__(self, batch: Sequence[TraceExample]) -> dict[str, torch.Tensor]:
        """Collate ``batch`` into the contract's tensors (module docstring)."""
        if isinstance(batch, Mapping) or not isinstance(batch, Sequence) or len(batch) == 0:
            raise ValueError(f"batch must be a non-empty list of TraceExample dicts, got {batch!r:.80}")
        cfg = self.config
        rows: list[_StudentRow] = []
        rewards: list[float] = []
        teachers: list[tuple[HintedRow, int]] = []
        pairs: list[TokenizedPair] = []
        for b, ex in enumerate(batch):
            try:
                msgs, turns = self._messages(ex)
                rows.append(self._student_row(msgs))
                rewards.append(self._reward(ex))
                if cfg.enable_sdpo and cfg.hint_generator is not None:
                    teachers += self._teacher_rows(b, turns, msgs, rows[-1])
                if cfg.enable_replay_dpo:
                    pairs += [t for k, p in enumerate(ex.get("dpo_pairs") or []) if (t := self._dpo_pair(k, p))]
            except ValueError as e:
                tid = ex.get("trace_id") if isinstance(ex, Mapping) else None
                raise ValueError(f"example {b} (trace_id={tid!r}): {e}") from e
        self.stats.examples += len(batch)
        out, offsets = self._channel1(batch, rows, rewards)
        if teachers:
            out.update(self._channel2(teachers, offsets))
        if pairs:
            out.update(preference_batch(pairs, self._pad_id, side=self._side))
        return out

    def _messages(self, ex: Any) -> tuple[list[dict[str, str]], list[Mapping[str, Any]]]:
        if not isinstance(ex, Mapping):
            raise ValueError(f"an example must be a dict with 'turns', got {type(ex).__name__}")
        turns = ex.get("turns")
        if not isinstance(turns, list) or not turns:
            raise ValueError(f"'turns' must be a non-empty list of TraceTurn dicts, got {turns!r:.80}")
        return to_chat_messages(turns), turns

    def _student_row(self, msgs: list[dict[str, str]]) -> _StudentRow:
        tok = self.tokenizer
        asst = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
        if not asst:
            raise ValueError("has no assistant turn: channel 1 needs at least one assistant response")
        if asst[0] == 0:
            raise ValueError("turn 0 is an assistant turn: put a system or user turn before the first assistant turn")
        ids: list[int] = []
        spans: dict[int, tuple[int, int]] = {}
        consumed = ""
        for i in asst:
            text = render_chat_text(tok, msgs[:i], True)
            if not text.startswith(consumed):
                raise ValueError(f"the chat template rewrites the history before turn {i} (its rendering is not an "
                                 "extension of the earlier turns'); use a prefix-stable template such as ChatML")
            ids += encode_text(tok, text[len(consumed) :])
            resp = build_response_ids(tok, msgs[i]["content"])
            spans[i] = (len(ids), len(ids) + len(resp))
            ids += resp
            consumed = text + msgs[i]["content"] + self._eot_text
        last_start, last_end = spans[asst[-1]]
        prompt_key = tuple(ids[:last_start])
        cap = self.config.max_seq_len
        if last_end - last_start >= cap:
            raise ValueError(f"the last assistant response has {last_end - last_start} tokens but max_seq_len={cap} "
                             "must exceed it (response + at least one context token); raise max_seq_len or drop it")
        if (cut := len(ids) - cap) > 0:
            self.stats.truncated_policy += 1
            log.debug("collator: student row cut by %d tokens to max_seq_len=%d", cut, cap)
            ids = ids[cut:]
            spans = {i: (s - cut, e - cut) for i, (s, e) in spans.items()}
        mask = [0] * len(ids)
        for i in asst if self.config.response_turns == "all" else asst[-1:]:
            s, e = spans[i]
            mask[max(s, 0) : max(e, 0)] = [1] * (max(e, 0) - max(s, 0))
        return _StudentRow(ids=ids, mask=mask, spans=spans, prompt_key=prompt_key)

    def _reward(self, ex: Mapping[str, Any]) -> float:
        value = ex.get(self.config.rlvr_reward_key)
        if value is None:
            return 0.0
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
            raise ValueError(f"reward {self.config.rlvr_reward_key!r} must be a finite number, got {value!r}")
        return float(value)

    def _group_ids(self, batch: Sequence[Mapping[str, Any]], rows: list[_StudentRow]) -> torch.Tensor | None:
        key_name = self.config.group_key
        explicit = any(ex.get(key_name) is not None for ex in batch)
        keys = []
        for b, (ex, row) in enumerate(zip(batch, rows)):
            gid = ex.get(key_name)
            try:
                keys.append(("group", gid) if gid is not None else ("prompt", row.prompt_key))
                hash(keys[-1])
            except TypeError as e:
                raise ValueError(f"example {b}: {key_name!r} must be hashable, got {gid!r}") from e
        if not explicit and len(set(keys)) == len(keys):
            return None
        index: dict[Any, int] = {}
        return torch.tensor([index.setdefault(k, len(index)) for k in keys], dtype=torch.long)

    def _channel1(self, batch: Sequence[Mapping[str, Any]], rows: list[_StudentRow],
                  rewards: list[float]) -> tuple[dict[str, torch.Tensor], list[int]]:  # fmt: skip
        ids, offsets = pad_rows([r.ids for r in rows], self._pad_id, side=self._side)
        out = {"input_ids": ids, "attention_mask": pad_rows([[1] * len(r.ids) for r in rows], 0, side=self._side)[0],
               "response_mask": pad_rows([r.mask for r in rows], 0, side=self._side)[0],
               "rewards": torch.tensor(rewards, dtype=torch.float32)}
        group_ids = self._group_ids(batch, rows)
        if group_ids is not None:
            out["group_ids"] = group_ids
        return out, offsets

    def _error_sites(self, turns: list[Mapping[str, Any]], msgs: list[dict[str, str]]) -> dict[int, dict]:
        """``{assistant turn index: hint context}`` for every marked error (see :class:`TraceTurn`)."""
        sites: dict[int, dict] = {}
        for j, turn in enumerate(turns):
            err, meta = turn.get("tool_error"), turn.get("error_meta")
            if not err and not meta:
                continue
            if meta is not None and not isinstance(meta, Mapping):
                raise ValueError(f"turn {j}: error_meta must be a dict (a HintContext), got {type(meta).__name__}")
            role = msgs[j]["role"]
            if role == "tool":
                site = max((i for i in range(j) if msgs[i]["role"] == "assistant"), default=None)
                if site is None:
                    raise ValueError(f"turn {j} (tool) carries an error but no assistant turn precedes it")
            elif role == "assistant":
                site = j
            else:
                raise ValueError(f"turn {j} has role {role!r} but carries tool_error/error_meta; mark the assistant "
                                 "turn whose tool call failed, or its tool result")
            ctx = dict(meta or {})
            if err and ctx.get("error_kind") and err != ctx["error_kind"]:
                ctx.setdefault("error_message", str(err))
            ctx["error_kind"] = ctx.get("error_kind") or (str(err) if err else "other")
            for k, v in ctx.items():
                sites.setdefault(site, {}).setdefault(k, v)
        for site, ctx in sites.items():  # no tool named: the site's first call
            calls = [] if ctx.get("tool_name") else parse_action(msgs[site]["content"])
            ctx.update(next(({"tool_name": b.name} for b in calls if b.kind == "tool_use"), {}))
        return sites

    def _teacher_rows(self, b: int, turns: list[Mapping[str, Any]], msgs: list[dict[str, str]],
                      row: _StudentRow) -> list[tuple[HintedRow, int]]:  # fmt: skip
        out: list[tuple[HintedRow, int]] = []
        cap, generate = self.config.max_seq_len, self.config.hint_generator
        assert generate is not None
        for site, ctx in sorted(self._error_sites(turns, msgs).items()):
            self.stats.sdpo_sites += 1
            hint = generate(ctx["error_kind"], dict(ctx))
            if hint is None or not str(hint).strip():
                self.stats.sdpo_sites_without_hint += 1
                continue
            s, e = row.spans[site]
            if s < 1:  # truncation cut (part of) this response out of the student row
                self.stats.sdpo_sites_dropped += 1
                continue
            ids, start = build_hinted_teacher_sequence(self.tokenizer, msgs[:site], str(hint), row.ids[s:e])
            if (cut := len(ids) - cap) > 0:  # len(response) < cap, so the response survives whole
                self.stats.truncated_sdpo += 1
                ids, start = ids[cut:], start - cut
            out.append((HintedRow(tuple(ids), start, b, 0), s))  # column fixed once the student batch is padded
        return out

    def _channel2(self, teachers: list[tuple[HintedRow, int]], student_offsets: list[int]) -> dict[str, torch.Tensor]:
        rows = [dataclasses.replace(t, student_col=student_offsets[t.student_row] + s) for t, s in teachers]
        return hinted_batch(rows, self._pad_id, side=self._side)

    def _dpo_pair(self, k: int, pair: Any) -> TokenizedPair | None:
        """Tokenize one ``dpo_pairs`` entry (a ``PreferencePair`` or the spec's ``DPOPair`` dict)."""
        try:
            pair = PreferencePair.from_mapping(pair, where=f"dpo_pairs[{k}]")
        except ValueError as e:
            raise ValueError(f"dpo_pairs[{k}] must be a DPOPair dict or a PreferencePair ({e})") from e
        before = self.stats_batching.truncated
        out = tokenize_pair(self.tokenizer, pair, max_seq_len=self.config.max_dpo_seq_len,
                            over_length=self.config.over_length, stats=self.stats_batching)
        self.stats.truncated_dpo += self.stats_batching.truncated - before
        self.stats.skipped_dpo += out is None
        return out

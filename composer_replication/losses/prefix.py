"""Shared-prefix decoding: rows that begin with the same tokens put those tokens through the decoder once.

The rows of a training batch repeat their prompts: a GRPO group's ``G`` samples share one prompt, a
preference pair's chosen and rejected rows share theirs, the hinted-teacher rows of one prompt share the
hinted prompt. At agent-trace sizes the prompt is most of the row (a few hundred history tokens before a
few dozen response tokens), so running it once per distinct prefix instead of once per row removes most of
the decoder's work. This is the prefix sharing of vLLM's prefix cache and of "cascade"/"shared-prefix"
attention, done with the model's own KV cache, *with* gradients:

1. :func:`plan_prefix_split` finds the split column ``s`` that minimises the tokens put through the
   decoder, ``U(s) * s + B * (T - s)`` (``U(s)``: distinct rows of ``ids[:, :s]``): with the rows sorted,
   ``U(s)`` is one plus the number of neighbours whose common prefix is shorter than ``s`` (``O(B T)``
   memory, cheap next to one layer). Where the prefixes nest (all rows begin with the same system prompt,
   then each pair's two rows share the rest of their prompt), it cuts the prefix into levels
   ``s_1 < ... < s_k = s`` and pays ``sum_k U(s_k) * (s_k - s_{k-1})`` instead (a small dynamic
   programme over the candidate columns, each level charged ``LEVEL_TOKENS`` for its extra decoder call);
2. the distinct prefixes run once, level by level, with ``use_cache=True``; each level's KV cache is
   indexed out to the next level's prefixes and finally to the ``B`` rows (``Cache.batch_select_indices``,
   differentiable), and the suffixes ``ids[:, s:]`` run on top of it with the full attention mask and the
   same position ids as a whole-row pass;
3. the hidden states are put back together as ``[B, T, H]``, so every loss sees exactly the layout of a
   whole-row pass.

Gradients reach the shared prefix from every row that reads it (through the indexed cache and the
indexed prefix hidden states), so the loss and its gradient are those of the whole-row pass up to float
rounding (tested against it). Rows with nothing in common, or savings under ``min_saving``, take the
whole-row pass unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PrefixLevel", "PrefixSplit", "plan_prefix_split", "decode_prefixes", "shared_prefix_hidden_states"]

MIN_SAVING = 0.2
"""Share prefixes only when that removes at least this fraction of the batch's decoder tokens."""

LEVEL_TOKENS = 16
"""What one more prefix level costs the planner, in decoder tokens (a level is one more decoder call)."""


@dataclass(frozen=True)
class PrefixLevel:
    """One level of a :class:`PrefixSplit`: the distinct prefixes ``ids[:, :split]``.

    Attributes:
        split: the prefixes' length (the level decodes columns ``[previous split, split)``).
        unique_rows: ``[U]`` long, a representative row of each distinct prefix.
        inverse: ``[B]`` long, for each row the index (into ``unique_rows``) of its prefix.
    """

    split: int
    unique_rows: torch.Tensor
    inverse: torch.Tensor


@dataclass(frozen=True)
class PrefixSplit:
    """Where to split a batch ``[B, T]`` and which prefix each row reads.

    The prefix may be decoded in nested levels (a prefix tree cut at a few columns): every row of a
    preference batch begins with the same system prompt, each pair's two rows then share the rest of
    their prompt. ``levels`` holds the outer levels; the last (innermost) one is the plan's own fields.

    Attributes:
        split: ``s``, the first column of the suffixes (``1 <= s <= T``).
        unique_rows: ``[U]`` long, a representative row of each distinct prefix ``ids[:, :s]``.
        inverse: ``[B]`` long, for each row the index (into ``unique_rows``) of its prefix.
        tokens: decoder tokens of the split pass, ``sum_k U_k * (s_k - s_{k-1}) + B * (T - s)``.
        whole_tokens: decoder tokens of the whole-row pass, ``B * T``.
        levels: the outer levels, shortest first, each with a ``split`` below ``s`` (``()``: one level).
    """

    split: int
    unique_rows: torch.Tensor
    inverse: torch.Tensor
    tokens: int
    whole_tokens: int
    levels: tuple[PrefixLevel, ...] = ()

    def all_levels(self) -> list[PrefixLevel]:
        """The outer levels, then the innermost (``split``, ``unique_rows``, ``inverse``)."""
        return [*self.levels, PrefixLevel(self.split, self.unique_rows, self.inverse)]


def plan_prefix_split(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, *, min_saving: float = MIN_SAVING,
    level_tokens: int = LEVEL_TOKENS,
) -> PrefixSplit | None:
    """The split of ``input_ids [B, T]`` that puts the fewest tokens through the decoder, or ``None``.

    Two rows share a prefix of length ``s`` when their ids and attention masks agree on columns ``[0, s)``
    (so their position ids agree there too). The prefix is cut at the columns (one or more) that minimise
    the decoder's tokens plus ``level_tokens`` per level (each level is one more decoder call). ``None``
    when the best plan saves less than ``min_saving`` of the ``B * T`` whole-row tokens (no shared
    prefixes, a single row, or short prefixes).

    Args:
        input_ids: ``[B, T]`` long.
        attention_mask: ``[B, T]``, 1 on real tokens.
        min_saving: the least fraction of decoder tokens worth a split (in ``[0, 1)``).
        level_tokens: what one more level costs, in decoder tokens (>= 0).

    Raises:
        ValueError: ``min_saving`` outside ``[0, 1)``, ``level_tokens`` below 0, or ``attention_mask`` not
            shaped like ``input_ids``.
    """
    if not 0.0 <= min_saving < 1.0:
        raise ValueError(f"min_saving must be in [0, 1), got {min_saving!r}")
    if level_tokens < 0:
        raise ValueError(f"level_tokens must be >= 0, got {level_tokens!r}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    if B < 2 or T < 2:
        return None
    key = input_ids.long() * 2 + (attention_mask != 0).long()  # [B, T]: equal keys <=> equal ids and mask
    _, row_class = torch.unique(key, dim=0, return_inverse=True)  # classes numbered in lexicographic row order
    ordered = key[torch.argsort(row_class, stable=True)]  # rows sorted: a row's longest common prefix with
    lcp = (ordered[1:] == ordered[:-1]).long().cumprod(-1).sum(-1)  # any other is with a neighbour [B-1]
    cuts = sorted({int(v) for v in lcp.tolist() if v > 0})
    if not cuts:
        return None
    distinct = [1 + int((lcp < c).sum()) for c in cuts]  # sorted rows start a new prefix where they part before c
    # best[i]: (cost, previous cut) of decoding columns [0, cuts[i]) in levels, the last one ending at cuts[i]
    best: list[tuple[int, int]] = []
    for i, c in enumerate(cuts):
        options = [(distinct[i] * c + level_tokens, -1)]
        options += [(best[j][0] + distinct[i] * (c - cuts[j]) + level_tokens, j) for j in range(i)]
        best.append(min(options))
    last = min(range(len(cuts)), key=lambda i: (best[i][0] + B * (T - cuts[i]), i))
    chain = [last]
    while best[chain[-1]][1] >= 0:
        chain.append(best[chain[-1]][1])
    splits = [cuts[i] for i in reversed(chain)]
    tokens = best[last][0] - level_tokens * len(splits) + B * (T - splits[-1])
    if tokens > (1.0 - min_saving) * B * T:
        return None
    levels = [_level(key, s) for s in splits]
    inner = levels.pop()
    return PrefixSplit(split=inner.split, unique_rows=inner.unique_rows, inverse=inner.inverse, tokens=tokens,
                       whole_tokens=B * T, levels=tuple(levels))


def _level(key: torch.Tensor, s: int) -> PrefixLevel:
    """The distinct prefixes ``key[:, :s]`` of ``key [B, T]``: representatives and each row's index."""
    B = key.shape[0]
    _, inverse = torch.unique(key[:, :s], dim=0, return_inverse=True)  # [B] the prefix of each row
    first = torch.full((int(inverse.max()) + 1,), B, dtype=torch.long, device=key.device)
    unique_rows = first.scatter_reduce(0, inverse, torch.arange(B, device=key.device), reduce="amin")  # [U]
    return PrefixLevel(split=s, unique_rows=unique_rows, inverse=inverse)


def decode_prefixes(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    plan: PrefixSplit,
) -> tuple[torch.Tensor, Any]:
    """Decode each distinct prefix of ``plan`` once, level by level.

    Level ``k`` runs its ``U_k`` distinct prefixes' columns ``[s_{k-1}, s_k)`` on top of the previous
    level's KV cache, indexed out to them (``Cache.batch_select_indices``, differentiable).

    Args:
        decoder: the causal LM's decoder (``model.get_decoder()``), which accepts ``past_key_values``.
        input_ids / attention_mask / position_ids: ``[B, T]`` (the whole-row pass's inputs).
        plan: from :func:`plan_prefix_split` on the same ``input_ids`` and ``attention_mask``.

    Returns:
        The hidden states ``[B, s, H]`` of the columns ``[0, s)`` and the KV cache of those columns
        indexed out to the ``B`` rows (``[B, heads, s, d]`` per layer).

    Raises:
        ValueError: the decoder returned no KV cache that can be indexed by row.
    """
    heads, cache, start, previous = [], None, 0, None
    for level in plan.all_levels():
        u = level.unique_rows
        if cache is not None:
            cache.batch_select_indices(previous[u])  # the outer prefix each of these prefixes continues
        out = decoder(input_ids=input_ids[u, start:level.split], attention_mask=attention_mask[u, :level.split],
                      position_ids=position_ids[u, start:level.split], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        if cache is None or not hasattr(cache, "batch_select_indices"):
            raise ValueError(
                f"{type(decoder).__name__} returned no row-indexable KV cache; pass share_prefix=False for this model"
            )
        heads.append(out.last_hidden_state[level.inverse])  # [B, s_k - s_{k-1}, H]
        start, previous = level.split, level.inverse
    cache.batch_select_indices(previous)  # [U, heads, s, d] -> [B, heads, s, d]
    return torch.cat(heads, dim=1), cache


def shared_prefix_hidden_states(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    plan: PrefixSplit,
) -> torch.Tensor:
    """Final hidden states ``[B, T, H]`` of ``input_ids`` with each distinct prefix decoded once.

    Args:
        decoder: the causal LM's decoder (``model.get_decoder()``), which accepts ``past_key_values``.
        input_ids / attention_mask / position_ids: ``[B, T]`` (the whole-row pass's inputs).
        plan: from :func:`plan_prefix_split` on the same ``input_ids`` and ``attention_mask``.

    Returns:
        ``[B, T, H]``, differentiable; equal to the whole-row pass's up to float rounding.

    Raises:
        ValueError: the decoder returned no KV cache that can be indexed by row.
    """
    head, cache = decode_prefixes(decoder, input_ids, attention_mask, position_ids, plan)
    s = plan.split
    if s == input_ids.shape[1]:
        return head
    tail = decoder(input_ids=input_ids[:, s:], attention_mask=attention_mask, position_ids=position_ids[:, s:],
                   past_key_values=cache, use_cache=True)
    return torch.cat([head, tail.last_hidden_state], dim=1)

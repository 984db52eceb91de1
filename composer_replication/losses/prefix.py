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

Rows of unequal length (a batch right-padded to its longest row) waste the padding columns in a
rectangular pass. Each pass therefore decodes only the prefixes (and, after the last cut, the rows) that
still have a real token in its columns, and only up to the last such token: a pair whose two rows end
before the cut is not decoded again in the suffix pass, and a long outlier row no longer pads every other
row to its length. The planner counts exactly those tokens. Hidden states of columns that no pass decodes
(padding after a row's last real token) are zeros; no loss reads them.

Gradients reach the shared prefix from every row that reads it (through the indexed cache and the
indexed prefix hidden states), so the loss and its gradient are those of the whole-row pass up to float
rounding (tested against it). Rows with nothing in common, or savings under ``min_saving``, take the
whole-row pass unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "PrefixLevel", "PrefixSplit", "plan_prefix_split", "decode_prefixes", "shared_prefix_hidden_states",
    "PackedRows", "pack_rows", "packed_hidden_states", "can_pack",
]

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
        ends: ``[U]`` long, the column after the last real token of each prefix (at most ``split``); a prefix
            whose end is not past the previous split is not decoded at this level. ``None``: every prefix
            runs to ``split``.
    """

    split: int
    unique_rows: torch.Tensor
    inverse: torch.Tensor
    ends: torch.Tensor | None = None


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
        tokens: decoder tokens of the split pass: per level, the prefixes still running times the columns up
            to the last of their real tokens, then the same for the rows after ``s`` (all rows equally long:
            ``sum_k U_k * (s_k - s_{k-1}) + B * (T - s)``).
        whole_tokens: decoder tokens of the whole-row pass, ``B * T``.
        levels: the outer levels, shortest first, each with a ``split`` below ``s`` (``()``: one level).
        ends: ``[U]`` long, as :attr:`PrefixLevel.ends` for the innermost level (``None``: all ``s``).
        row_ends: ``[B]`` long, the column after each row's last real token (``None``: all ``T``).
    """

    split: int
    unique_rows: torch.Tensor
    inverse: torch.Tensor
    tokens: int
    whole_tokens: int
    levels: tuple[PrefixLevel, ...] = ()
    ends: torch.Tensor | None = None
    row_ends: torch.Tensor | None = None

    def all_levels(self) -> list[PrefixLevel]:
        """The outer levels, then the innermost (``split``, ``unique_rows``, ``inverse``, ``ends``)."""
        return [*self.levels, PrefixLevel(self.split, self.unique_rows, self.inverse, self.ends)]


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
    real = attention_mask != 0
    row_ends = torch.where(real.any(-1), T - real.flip(-1).long().argmax(-1), 0)  # [B] after the last real token
    _, row_class = torch.unique(key, dim=0, return_inverse=True)  # classes numbered in lexicographic row order
    order = torch.argsort(row_class, stable=True)
    ordered = key[order]  # rows sorted: a row's longest common prefix with any other is with a neighbour
    lcp = (ordered[1:] == ordered[:-1]).long().cumprod(-1).sum(-1).tolist()  # [B-1]
    cuts = sorted({v for v in lcp if v > 0})
    if not cuts or int(row_ends.max()) == 0:
        return None
    ends = row_ends[order].tolist()  # in sorted order
    # needs[i]: for each distinct prefix at cuts[i], the column after its last real token (at most cuts[i])
    needs = [_prefix_needs(lcp, ends, c) for c in cuts]

    def level_cost(start: int, i: int) -> int:  # the prefixes at cuts[i] still running after ``start``
        running = [n for n in needs[i] if n > start]
        return len(running) * (max(running) - start) if running else 0

    # best[i]: (cost, previous cut) of decoding columns [0, cuts[i]) in levels, the last one ending at cuts[i]
    best: list[tuple[int, int]] = []
    for i in range(len(cuts)):
        options = [(level_cost(0, i) + level_tokens, -1)]
        options += [(best[j][0] + level_cost(cuts[j], i) + level_tokens, j) for j in range(i)]
        best.append(min(options))
    last = min(range(len(cuts)), key=lambda i: (best[i][0] + _suffix_cost(ends, cuts[i]), i))
    chain = [last]
    while best[chain[-1]][1] >= 0:
        chain.append(best[chain[-1]][1])
    splits = [cuts[i] for i in reversed(chain)]
    tokens = best[last][0] - level_tokens * len(splits) + _suffix_cost(ends, splits[-1])
    if tokens > (1.0 - min_saving) * B * T:
        return None
    levels = [_level(key, s, row_ends) for s in splits]
    inner = levels.pop()
    return PrefixSplit(split=inner.split, unique_rows=inner.unique_rows, inverse=inner.inverse, tokens=tokens,
                       whole_tokens=B * T, levels=tuple(levels), ends=inner.ends, row_ends=row_ends)


def _prefix_needs(lcp: list[int], ends: list[int], cut: int) -> list[int]:
    """For each distinct prefix ``[0, cut)`` of the sorted rows, the column after its last real token."""
    needs, current = [], min(ends[0], cut)
    for k, shared in enumerate(lcp):  # sorted rows k and k + 1 share a prefix of length ``shared``
        if shared < cut:
            needs.append(current)
            current = 0
        current = max(current, min(ends[k + 1], cut))
    return [*needs, current]


def _suffix_cost(ends: list[int], split: int) -> int:
    """Decoder tokens after the last cut: the rows with a real token at or after ``split``, up to the last one."""
    running = [e for e in ends if e > split]
    return len(running) * (max(running) - split) if running else 0


def _level(key: torch.Tensor, s: int, row_ends: torch.Tensor) -> PrefixLevel:
    """The distinct prefixes ``key[:, :s]`` of ``key [B, T]``: representatives, each row's index, their ends."""
    B = key.shape[0]
    _, inverse = torch.unique(key[:, :s], dim=0, return_inverse=True)  # [B] the prefix of each row
    U = int(inverse.max()) + 1
    first = torch.full((U,), B, dtype=torch.long, device=key.device)
    unique_rows = first.scatter_reduce(0, inverse, torch.arange(B, device=key.device), reduce="amin")  # [U]
    ends = torch.zeros(U, dtype=torch.long, device=key.device).scatter_reduce(
        0, inverse, row_ends.clamp(max=s), reduce="amax")  # [U]
    return PrefixLevel(split=s, unique_rows=unique_rows, inverse=inverse, ends=ends)


def decode_prefixes(
    decoder: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    plan: PrefixSplit,
    rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Any]:
    """Decode each distinct prefix of ``plan`` once, level by level.

    Level ``k`` runs the columns ``[s_{k-1}, s_k)`` of its distinct prefixes that still hold a real token
    there (up to the last one), on top of the previous level's KV cache indexed out to them
    (``Cache.batch_select_indices``, differentiable).

    Args:
        decoder: the causal LM's decoder (``model.get_decoder()``), which accepts ``past_key_values``.
        input_ids / attention_mask / position_ids: ``[B, T]`` (the whole-row pass's inputs).
        plan: from :func:`plan_prefix_split` on the same ``input_ids`` and ``attention_mask``.
        rows: ``[R]`` long, the rows whose KV cache to return (default: all ``B``); each must have a real
            token in the last level's columns, so that its prefix was decoded there and its cache is whole.

    Returns:
        The hidden states ``[B, s, H]`` of the columns ``[0, s)`` (zeros where no level decodes a row) and
        the KV cache of those columns indexed out to ``rows`` (``[R, heads, s, d]`` per layer; ``None`` when
        ``rows`` is empty).

    Raises:
        ValueError: the decoder returned no KV cache that can be indexed by row, or one of ``rows`` ends
            before the last level's columns.
    """
    B = input_ids.shape[0]
    heads: list[torch.Tensor] = []
    cache, start, previous, slot, decoded = None, 0, None, None, 0
    for level in plan.all_levels():
        width = level.split - start
        ends = level.ends if level.ends is not None else torch.full_like(level.unique_rows, level.split)
        running = (ends > start).nonzero().squeeze(-1)  # [A] the prefixes with real tokens in these columns
        if running.numel() == 0:  # every row ended before this level (and so before all later ones)
            heads.append(heads[-1].new_zeros(B, level.split - start, heads[-1].shape[-1]))
            start, slot = level.split, None
            continue
        stop = int(ends[running].max())
        u = level.unique_rows[running]
        if cache is not None:
            cache.batch_select_indices(slot[previous[u]])  # the outer prefix each of these prefixes continues
        out = decoder(input_ids=input_ids[u, start:stop], attention_mask=attention_mask[u, :stop],
                      position_ids=position_ids[u, start:stop], past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        if cache is None or not hasattr(cache, "batch_select_indices"):
            raise ValueError(
                f"{type(decoder).__name__} returned no row-indexable KV cache; pass share_prefix=False for this model"
            )
        decoded = running.numel()
        slot = torch.full_like(ends, decoded)  # [U] each prefix's row in this call (``decoded``: not decoded)
        slot[running] = torch.arange(decoded, device=slot.device)
        heads.append(_to_rows(out.last_hidden_state, slot[level.inverse], width))  # [B, s_k - s_{k-1}, H]
        start, previous = level.split, level.inverse
        if stop < level.split:
            slot = None  # the cache stops short of the split: no later level runs, no row can continue
    wanted = torch.arange(B, device=input_ids.device) if rows is None else rows
    if wanted.numel() == 0:
        return torch.cat(heads, dim=1), None
    if slot is None or bool((slot[previous[wanted]] == decoded).any()):
        raise ValueError(
            "decode_prefixes: a requested row has no real token in the last level's columns, so its KV cache "
            "is not whole; ask only for rows that run past the split"
        )
    cache.batch_select_indices(slot[previous[wanted]])  # [A, heads, s, d] -> [R, heads, s, d]
    return torch.cat(heads, dim=1), cache


def _to_rows(hidden: torch.Tensor, row_slot: torch.Tensor, width: int) -> torch.Tensor:
    """``hidden [A, w, H]`` (one row per decoded prefix) laid out as ``[B, width, H]``: row ``b`` reads
    ``hidden[row_slot[b]]``; ``row_slot[b] == A`` (not decoded) and columns ``>= w`` read zeros."""
    A, w, H = hidden.shape
    if bool((row_slot == A).any()):
        hidden = torch.cat([hidden, hidden.new_zeros(1, w, H)])
    out = hidden[row_slot]
    return out if w == width else torch.nn.functional.pad(out, (0, 0, 0, width - w))


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
        ``[B, T, H]``, differentiable; equal to the whole-row pass's on every real token up to float
        rounding (zeros after a row's last real token, where the whole-row pass holds padding's states).

    Raises:
        ValueError: the decoder returned no KV cache that can be indexed by row.
    """
    B, T = input_ids.shape
    s = plan.split
    row_ends = plan.row_ends if plan.row_ends is not None else torch.full((B,), T, device=input_ids.device)
    tail = (row_ends > s).nonzero().squeeze(-1)  # [R] rows with real tokens after the split
    head, cache = decode_prefixes(decoder, input_ids, attention_mask, position_ids, plan, rows=tail)
    if tail.numel() == 0:
        return torch.nn.functional.pad(head, (0, 0, 0, T - s))
    stop = int(row_ends[tail].max())
    out = decoder(input_ids=input_ids[tail, s:stop], attention_mask=attention_mask[tail, :stop],
                  position_ids=position_ids[tail, s:stop], past_key_values=cache, use_cache=True)
    row_slot = torch.full((B,), tail.numel(), dtype=torch.long, device=input_ids.device)
    row_slot[tail] = torch.arange(tail.numel(), device=input_ids.device)
    return torch.cat([head, _to_rows(out.last_hidden_state, row_slot, T - s)], dim=1)


PACK_MAX_TOKENS = 8192
"""Pack a batch into one prefix-tree row only up to this many distinct tokens (its mask is ``N x N``)."""

PACKABLE_ATTENTION = ("sdpa", "eager")
"""Attention implementations that read a custom 4D mask (boolean for SDPA, additive float for eager)."""


@dataclass(frozen=True)
class PackedRows:
    """A batch's rows as one sequence: their prefix tree, each distinct token once, in depth-first order.

    Attributes:
        input_ids: ``[1, N]`` the tree's tokens; a token shared by several rows appears once.
        position_ids: ``[1, N]`` each token's position in its rows (the whole-row pass's position).
        attention: ``[N, N]`` bool, ``attention[i, j]``: token ``i`` reads token ``j`` (``j`` is ``i`` or
            one of its ancestors in the tree, which is exactly what it reads in each of its rows).
        index: ``[B, T]`` long, the packed index of each real token of the batch; ``N`` on padding.
        tokens: ``N``, the tokens put through the decoder.
        whole_tokens: ``B * T``, those of the whole-row pass.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention: torch.Tensor
    index: torch.Tensor
    tokens: int
    whole_tokens: int


def pack_rows(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, *, min_saving: float = MIN_SAVING,
    max_tokens: int = PACK_MAX_TOKENS,
) -> PackedRows | None:
    """Pack the rows of ``input_ids [B, T]`` into their prefix tree, or ``None`` when that saves too little.

    Each row's real tokens (``attention_mask`` 1, any padding side, gaps included) form a sequence; rows whose
    sequences begin alike share those tokens, so the distinct tokens form a tree. The tree is laid out
    depth first in one row, and a ``[N, N]`` mask lets each token read only its ancestors: every token sees
    exactly the tokens, at exactly the positions, that it sees in a whole-row pass, and no padding is
    decoded. ``None`` when ``N`` exceeds ``max_tokens`` or saves less than ``min_saving`` of ``B * T``.

    Args:
        input_ids: ``[B, T]`` long.
        attention_mask: ``[B, T]``, 1 on real tokens.
        min_saving: the least fraction of ``B * T`` decoder tokens worth packing (in ``[0, 1)``).
        max_tokens: the most tokens one packed row may hold (the mask is ``max_tokens ** 2`` booleans).

    Raises:
        ValueError: ``min_saving`` outside ``[0, 1)``, ``max_tokens`` below 1, or ``attention_mask`` not
            shaped like ``input_ids``.
    """
    if not 0.0 <= min_saving < 1.0:
        raise ValueError(f"min_saving must be in [0, 1), got {min_saving!r}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    if B < 2:
        return None
    device = input_ids.device
    real = attention_mask != 0
    lengths = real.sum(-1)  # [B]
    columns = torch.argsort((~real).to(torch.int8), dim=-1, stable=True)  # [B, T] real columns first, in order
    compact = torch.where(torch.arange(T, device=device) < lengths[:, None], input_ids.long().gather(1, columns), -1)
    _, row_class = torch.unique(compact, dim=0, return_inverse=True)
    order = torch.argsort(row_class, stable=True).tolist()  # rows in lexicographic order of their sequences
    ordered = compact[order]
    lcp = (ordered[1:] == ordered[:-1]).long().cumprod(-1).sum(-1)  # [B-1] with each row's sorted neighbour
    lcp = torch.minimum(lcp, torch.minimum(lengths[order][1:], lengths[order][:-1])).tolist()  # not the -1 padding
    n_tokens = int(lengths.sum()) - sum(lcp)
    if n_tokens == 0 or n_tokens > max_tokens or n_tokens > (1.0 - min_saving) * B * T:
        return None
    index = torch.full((B, T), n_tokens, dtype=torch.long, device=device)
    attention = torch.zeros(n_tokens, n_tokens, dtype=torch.bool, device=device)
    pieces, path, used = [], torch.zeros(0, dtype=torch.long, device=device), 0
    for k, row in enumerate(order):
        length, shared = int(lengths[row]), (lcp[k - 1] if k else 0)
        fresh = torch.arange(used, used + length - shared, device=device)
        path = torch.cat([path[:shared], fresh])  # [length] the row's tokens in the packed row
        pieces.append(compact[row, shared:length])
        used += length - shared
        index[row, columns[row, :length]] = path
        attention[path[shared:, None], path[None, :]] = torch.ones(
            length - shared, length, dtype=torch.bool, device=device).tril(shared)  # fresh tokens read their path
    positions = torch.zeros(n_tokens, dtype=torch.long, device=device)
    positions[index[index < n_tokens]] = (real.long().cumsum(-1) - 1)[index < n_tokens]
    return PackedRows(input_ids=torch.cat(pieces)[None].to(input_ids.dtype), position_ids=positions[None],
                      attention=attention, index=index, tokens=n_tokens, whole_tokens=B * T)


def packed_hidden_states(decoder: torch.nn.Module, packed: PackedRows) -> torch.Tensor:
    """Final hidden states ``[B, T, H]`` of the packed rows, from one decoder pass over their prefix tree.

    Args:
        decoder: the causal LM's decoder (``model.get_decoder()``) with SDPA or eager attention (see
            :func:`can_pack`).
        packed: from :func:`pack_rows`.

    Returns:
        ``[B, T, H]``, differentiable; equal to the whole-row pass's on every real token up to float rounding,
        zeros on padding.
    """
    mask = packed.attention[None, None]  # [1, 1, N, N]
    if _attention_implementation(decoder) == "eager":  # eager adds the mask to its scores
        dtype = next(decoder.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    out = decoder(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids, use_cache=False)
    hidden = out.last_hidden_state[0]  # [N, H]
    return torch.cat([hidden, hidden.new_zeros(1, hidden.shape[-1])])[packed.index]  # [B, T, H]


def can_pack(decoder: torch.nn.Module) -> bool:
    """Whether ``decoder``'s attention reads a custom 4D mask (:data:`PACKABLE_ATTENTION`)."""
    return _attention_implementation(decoder) in PACKABLE_ATTENTION


def _attention_implementation(decoder: torch.nn.Module) -> str | None:
    config = getattr(decoder, "config", None)
    return getattr(config, "_attn_implementation", None)

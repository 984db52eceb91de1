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
   memory, cheap next to one layer);
2. the ``U`` distinct prefixes run once with ``use_cache=True``; their KV cache is indexed out to the
   ``B`` rows (``Cache.batch_select_indices``, differentiable), and the suffixes ``ids[:, s:]`` run on top
   of it with the full attention mask and the same position ids as a whole-row pass;
3. the hidden states are put back together as ``[B, T, H]``, so every loss sees exactly the layout of a
   whole-row pass.

Gradients reach the shared prefix from every row that reads it (through the indexed cache and the
indexed prefix hidden states), so the loss and its gradient are those of the whole-row pass up to float
rounding (tested against it). Rows with nothing in common, or savings under ``min_saving``, take the
whole-row pass unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PrefixSplit", "plan_prefix_split", "shared_prefix_hidden_states"]

MIN_SAVING = 0.2
"""Share prefixes only when that removes at least this fraction of the batch's decoder tokens."""


@dataclass(frozen=True)
class PrefixSplit:
    """Where to split a batch ``[B, T]`` and which prefix each row reads.

    Attributes:
        split: ``s``, the first column of the suffixes (``1 <= s <= T``).
        unique_rows: ``[U]`` long, a representative row of each distinct prefix ``ids[:, :s]``.
        inverse: ``[B]`` long, for each row the index (into ``unique_rows``) of its prefix.
        tokens: decoder tokens of the split pass, ``U * s + B * (T - s)``.
        whole_tokens: decoder tokens of the whole-row pass, ``B * T``.
    """

    split: int
    unique_rows: torch.Tensor
    inverse: torch.Tensor
    tokens: int
    whole_tokens: int


def plan_prefix_split(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, *, min_saving: float = MIN_SAVING
) -> PrefixSplit | None:
    """The split of ``input_ids [B, T]`` that puts the fewest tokens through the decoder, or ``None``.

    Two rows share a prefix of length ``s`` when their ids and attention masks agree on columns ``[0, s)``
    (so their position ids agree there too). ``None`` when the best split saves less than ``min_saving``
    of the ``B * T`` whole-row tokens (no shared prefixes, a single row, or short prefixes).

    Args:
        input_ids: ``[B, T]`` long.
        attention_mask: ``[B, T]``, 1 on real tokens.
        min_saving: the least fraction of decoder tokens worth a split (in ``[0, 1)``).

    Raises:
        ValueError: ``min_saving`` outside ``[0, 1)``, or ``attention_mask`` not shaped like ``input_ids``.
    """
    if not 0.0 <= min_saving < 1.0:
        raise ValueError(f"min_saving must be in [0, 1), got {min_saving!r}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    if B < 2 or T < 2:
        return None
    key = input_ids.long() * 2 + (attention_mask != 0).long()  # [B, T]: equal keys <=> equal ids and mask
    _, row_class = torch.unique(key, dim=0, return_inverse=True)  # classes numbered in lexicographic row order
    ordered = key[torch.argsort(row_class, stable=True)]  # rows sorted: a row's longest common prefix with
    lcp = (ordered[1:] == ordered[:-1]).long().cumprod(-1).sum(-1)  # any other is with a neighbour [B-1]
    best: tuple[int, int] | None = None  # (tokens, split)
    for s in sorted({int(v) for v in lcp.tolist() if v > 0}):
        distinct = 1 + int((lcp < s).sum())  # sorted rows start a new prefix where they part before s
        tokens = distinct * s + B * (T - s)
        if best is None or tokens < best[0]:
            best = (tokens, s)
    if best is None or best[0] > (1.0 - min_saving) * B * T:
        return None
    tokens, s = best
    _, inverse = torch.unique(key[:, :s], dim=0, return_inverse=True)  # [B] the prefix of each row
    first = torch.full((int(inverse.max()) + 1,), B, dtype=torch.long, device=key.device)
    unique_rows = first.scatter_reduce(0, inverse, torch.arange(B, device=key.device), reduce="amin")  # [U]
    return PrefixSplit(split=s, unique_rows=unique_rows, inverse=inverse, tokens=tokens, whole_tokens=B * T)


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
    s, u = plan.split, plan.unique_rows
    prefix = decoder(input_ids=input_ids[u, :s], attention_mask=attention_mask[u, :s], position_ids=position_ids[u, :s],
                     use_cache=True)
    head = prefix.last_hidden_state[plan.inverse]  # [B, s, H]
    if s == input_ids.shape[1]:
        return head
    cache = prefix.past_key_values
    if cache is None or not hasattr(cache, "batch_select_indices"):
        raise ValueError(
            f"{type(decoder).__name__} returned no row-indexable KV cache; pass share_prefix=False for this model"
        )
    cache.batch_select_indices(plan.inverse)  # [U, heads, s, d] -> [B, heads, s, d], differentiable
    tail = decoder(input_ids=input_ids[:, s:], attention_mask=attention_mask, position_ids=position_ids[:, s:],
                   past_key_values=cache, use_cache=True)
    return torch.cat([head, tail.last_hidden_state], dim=1)

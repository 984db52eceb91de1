"""Shared-prefix decoding: the rows of a batch packed into their prefix tree, each distinct token decoded once.

The rows of a training batch repeat their prompts: a GRPO group's ``G`` samples share one prompt, a preference
pair's chosen and rejected rows share theirs (and all pairs the system prompt), the hinted rows of one prompt
share the hinted prompt. At agent-trace sizes the prompt is most of a row, and rows are padded to the longest.
:func:`pack_rows` lays the distinct tokens out depth first through the tree of the rows' common beginnings, in
packed rows of at most ``max_tokens``, each with an ``[n, n]`` mask that lets a token read only its ancestors:
every token sees exactly the tokens, at exactly the positions, it sees in a whole-row pass, and no padding is
decoded. This is the tree attention of speculative decoding (SpecInfer, Medusa) and the prefix cache of
inference servers (vLLM), applied to a training forward with gradients; transformers passes a custom 4D mask
through unchanged (SDPA and eager attention), so no kernel of our own is needed.

:func:`packed_hidden_states` runs the decoder once over the packed rows and gathers the states back to
``[B, T, H]`` (zeros on padding, which no loss reads). Gradients reach a shared token from every row that reads
it, so losses and gradients are the whole-row pass's up to float rounding (tested against it). A batch that
shares too little (:data:`MIN_SAVING`) or an attention kernel that takes no custom mask (:func:`can_pack`:
flash-attention's varlen path) takes the whole-row pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = []

MIN_SAVING = 0.2
"""Pack only when that removes at least this fraction of the batch's ``B * T`` decoder tokens."""

PACK_MAX_TOKENS = 8192
"""The most tokens of one packed row (its mask is ``n x n``); a larger tree is cut into several packed rows."""

PACKABLE_ATTENTION = ("sdpa", "eager")
"""Attention implementations that read a custom 4D mask (boolean for SDPA, additive float for eager)."""


@dataclass(frozen=True)
class PackedRows:
    """A batch's rows as ``R`` packed rows of their prefix tree, each distinct token once, in depth-first order.

    Attributes:
        input_ids: ``[R, n]`` the tree's tokens (a token shared by rows of one packed row appears once there).
        position_ids: ``[R, n]`` each token's position in its rows (the whole-row pass's position).
        attention: ``[R, n, n]`` bool, ``attention[r, i, j]``: token ``i`` reads token ``j`` (``i`` itself or an
            ancestor in the tree, exactly what it reads in each of its rows; padding reads only itself).
        index: ``[B, T]`` long, the flat packed index (``r * n + i``) of each real token; ``R * n`` on padding.
        tokens: ``R * n``, the tokens put through the decoder. whole_tokens: ``B * T``, those of the whole-row pass.
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

    Each row's real tokens (``attention_mask [B, T]`` 1; any padding side, gaps included) form a sequence; rows
    whose sequences begin alike share those tokens. Rows are taken in sorted order and a new packed row starts
    when the next row's fresh tokens would pass ``max_tokens``. ``None`` when a row alone is longer than
    ``max_tokens`` or packing saves less than ``min_saving`` (in ``[0, 1)``) of the ``B * T`` whole-row tokens.

    Raises:
        ValueError: ``min_saving`` outside ``[0, 1)``, ``max_tokens`` below 1, or ``attention_mask`` not shaped
            like ``input_ids``.
    """
    if not 0.0 <= min_saving < 1.0:
        raise ValueError(f"min_saving must be in [0, 1), got {min_saving!r}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens!r}")
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} must match input_ids {tuple(input_ids.shape)}")
    B, T = input_ids.shape
    real = attention_mask != 0
    lengths = real.sum(-1)  # [B]
    if B < 2 or int(lengths.max()) > max_tokens:
        return None
    device = input_ids.device
    columns = torch.argsort((~real).to(torch.int8), dim=-1, stable=True)  # [B, T] real columns first, in order
    compact = torch.where(torch.arange(T, device=device) < lengths[:, None], input_ids.long().gather(1, columns), -1)
    _, row_class = torch.unique(compact, dim=0, return_inverse=True)
    order = torch.argsort(row_class, stable=True).tolist()  # rows in lexicographic order of their sequences
    ordered = compact[order]
    lcp = (ordered[1:] == ordered[:-1]).long().cumprod(-1).sum(-1)  # [B-1] with each row's sorted neighbour
    lcp = [0, *torch.minimum(lcp, torch.minimum(lengths[order][1:], lengths[order][:-1])).tolist()]
    packed_row, shared, sizes = [], [], [0]  # per sorted row: its packed row and the tokens it shares there
    for k, row in enumerate(order):
        s = lcp[k] if sizes[-1] + int(lengths[row]) - lcp[k] <= max_tokens else 0
        if s == 0 and k and sizes[-1] + int(lengths[row]) > max_tokens:
            sizes.append(0)  # the row does not fit: a new packed row, sharing nothing
        packed_row.append(len(sizes) - 1)
        shared.append(s)
        sizes[-1] += int(lengths[row]) - s
    R, n = len(sizes), max(sizes)
    if n == 0 or R * n > (1.0 - min_saving) * B * T:
        return None
    ids = torch.zeros(R, n, dtype=input_ids.dtype, device=device)
    positions = torch.zeros(R, n, dtype=torch.long, device=device)
    attention = torch.eye(n, dtype=torch.bool, device=device).repeat(R, 1, 1)  # [R, n, n] padding reads itself
    index = torch.full((B, T), R * n, dtype=torch.long, device=device)
    path, used = torch.zeros(0, dtype=torch.long, device=device), 0
    for k, row in enumerate(order):
        r, s, length = packed_row[k], shared[k], int(lengths[row])
        if k and r != packed_row[k - 1]:
            used = 0
        path = torch.cat([path[:s], torch.arange(used, used + length - s, device=device)])  # [length] in row r
        ids[r, path[s:]] = compact[row, s:length].to(ids.dtype)
        positions[r, path[s:]] = torch.arange(s, length, device=device)
        attention[r, path[s:, None], path[None, :]] = torch.ones(
            length - s, length, dtype=torch.bool, device=device).tril(s)  # fresh tokens read their path
        index[row, columns[row, :length]] = r * n + path
        used += length - s
    return PackedRows(input_ids=ids, position_ids=positions, attention=attention, index=index, tokens=R * n,
                      whole_tokens=B * T)


def packed_hidden_states(decoder: torch.nn.Module, packed: PackedRows) -> torch.Tensor:
    """Final hidden states ``[B, T, H]`` of the packed rows, from one decoder pass over their prefix tree.

    ``decoder``: the causal LM's decoder (``model.get_decoder()``) with SDPA or eager attention (:func:`can_pack`).
    Differentiable; equal to the whole-row pass's on every real token up to float rounding, zeros on padding.
    """
    mask = packed.attention[:, None]  # [R, 1, n, n]
    if _attention_implementation(decoder) == "eager":  # eager adds the mask to its scores
        dtype = next(decoder.parameters()).dtype
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    out = decoder(input_ids=packed.input_ids, attention_mask=mask, position_ids=packed.position_ids, use_cache=False)
    hidden = out.last_hidden_state.flatten(0, 1)  # [R * n, H]
    return torch.cat([hidden, hidden.new_zeros(1, hidden.shape[-1])])[packed.index]  # [B, T, H]


def can_pack(decoder: torch.nn.Module) -> bool:
    """Whether ``decoder``'s attention reads a custom 4D mask (:data:`PACKABLE_ATTENTION`)."""
    return _attention_implementation(decoder) in PACKABLE_ATTENTION


def _attention_implementation(decoder: torch.nn.Module) -> str | None:
    return getattr(getattr(decoder, "config", None), "_attn_implementation", None)

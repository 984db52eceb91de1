"""The one batching module: token rows for the three channels, one pad, one over-length policy.

Every producer of training batches builds its rows here: the training engine (rollouts and pairs),
``build_batch`` (the spec's demo batch), :class:`~composer_replication.trainer.ComposerDataCollator`
and :class:`~composer_replication.trainer.ComposerReplicationTrainer`. Text becomes token ids through
:mod:`composer_replication.chat_format` only.

Rows and their tensors (the batch contract, ``docs/collator.md``):

- **policy rows** (channel 1): ``input_ids``, ``attention_mask``, ``response_mask`` ``[B, T]``;
- **hinted-teacher rows** (channel 2): the hinted history followed by exactly the student's response
  ids; ``ctx_teacher_input_ids``, ``ctx_teacher_attention_mask``, ``sdpo_loss_mask`` ``[B2, Tt]`` and
  the index pairs ``sdpo_student_index`` / ``sdpo_teacher_index`` ``[N, 2]`` that align each response
  token of the student batch with the same token of the teacher batch (:func:`teacher_batch`);
- **preference rows** (channel 3): ``dpo_{chosen,rejected}_{input_ids,attention_mask,response_mask}``
  ``[P, T*]`` (:func:`preference_batch`), from pairs tokenized once (:func:`tokenize_pair`).

**Over-length policy** (:data:`OVER_LENGTH`), one rule for every row that holds a prompt and a response:
``"truncate_left"`` (the default) cuts the prompt (history) from the left until the row fits; the
response is never cut, so a response that alone reaches the cap cannot fit and the row is skipped.
``"skip"`` drops any row over the cap. Every skip is counted with its reason in :class:`BatchingStats`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from composer_replication.chat_format import (
    build_prompt_ids,
    build_response_ids,
    content_text,
    end_of_turn_id,
)
from composer_replication.types import PreferencePair

__all__ = [
    "OVER_LENGTH",
    "OverLength",
    "BatchingStats",
    "TokenizedPair",
    "TeacherRow",
    "pad_id",
    "pad_rows",
    "fit_prompt",
    "tokenize_pair",
    "tokenize_pairs",
    "preference_batch",
    "teacher_batch",
    "left_padded_prompts",
    "length_order",
    "generate_in_length_order",
    "Generated",
    "generate_responses",
    "shared_prefix_cache",
    "static_cache",
    "cut_at_end_of_turn",
]

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

    Args:
        rows: token ids (or mask values) per row; at least one row.
        fill: the padding value.
        side: ``"right"`` (rows start at column 0) or ``"left"`` (rows end at column ``T - 1``).
        width: ``T``; default the longest row (and at least 1).

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
    reason = "over_length" if over_length == "skip" else "response_over_length"
    if over_length == "truncate_left" and longest_response < max_seq_len:
        if stats is not None:
            stats.truncated += 1
        return prompt[len(prompt) + longest_response - max_seq_len :]
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
    Returns ``None`` when the over-length policy skips it (counted in ``stats``).
    """
    pair = PreferencePair.from_mapping(pair)
    if not pair.chosen.strip() or not pair.rejected.strip():
        if stats is not None:
            stats.skipped["empty_action"] += 1
        return None
    prompt = build_prompt_ids(tokenizer, pair.state_messages)
    chosen, rejected = build_response_ids(tokenizer, pair.chosen), build_response_ids(tokenizer, pair.rejected)
    prompt = fit_prompt(prompt, max(len(chosen), len(rejected)), max_seq_len=max_seq_len,
                        over_length=over_length, stats=stats)
    if prompt is None:
        return None
    return TokenizedPair(pair.state_id, tuple(prompt), tuple(chosen), tuple(rejected))


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
    for side_name in ("chosen", "rejected"):
        rows = [list(p.prompt) + list(getattr(p, side_name)) for p in pairs]
        masks = [[0] * len(p.prompt) + [1] * len(getattr(p, side_name)) for p in pairs]
        out[f"dpo_{side_name}_input_ids"] = pad_rows(rows, fill, side=side)[0]  # [P, T_side]
        out[f"dpo_{side_name}_attention_mask"] = pad_rows([[1] * len(r) for r in rows], 0, side=side)[0]
        out[f"dpo_{side_name}_response_mask"] = pad_rows(masks, 0, side=side)[0]
    return {k: v.to(device) for k, v in out.items()} if device is not None else out


# ---------------------------------------------------------------------------- channel 2: hinted-teacher rows


@dataclass(frozen=True)
class TeacherRow:
    """One hinted-teacher row and where its response sits in the student batch.

    Attributes:
        ids: ``prompt(history + [hint]) + response ids`` (see ``chat_format.build_hinted_teacher_sequence``).
        start: index in ``ids`` where the response starts.
        student_row: the student row (``b`` of ``[B, T]``) whose response this is.
        student_col: the column of the padded student tensor where that response starts.
    """

    ids: tuple[int, ...]
    start: int
    student_row: int
    student_col: int


def teacher_batch(
    rows: Sequence[TeacherRow], fill: int, *, side: str = "right", device: torch.device | str | None = None
) -> dict[str, torch.Tensor]:
    """Channel-2 tensors, index-aligned with the student batch.

    Returns (``{}`` for no rows): ``ctx_teacher_input_ids``, ``ctx_teacher_attention_mask``,
    ``sdpo_loss_mask`` ``[B2, Tt]``; ``sdpo_student_index`` and ``sdpo_teacher_index`` ``[N, 2]`` long,
    where row ``n`` pairs student position ``(b, t)`` with teacher position ``(j, t')`` of the same
    response token (``N`` = all response tokens of all teacher rows).
    """
    if not rows:
        return {}
    ids, offsets = pad_rows([r.ids for r in rows], fill, side=side)
    s_index: list[tuple[int, int]] = []
    t_index: list[tuple[int, int]] = []
    for j, row in enumerate(rows):
        for k in range(len(row.ids) - row.start):
            s_index.append((row.student_row, row.student_col + k))
            t_index.append((j, offsets[j] + row.start + k))
    masks = [[0] * r.start + [1] * (len(r.ids) - r.start) for r in rows]
    out = {
        "ctx_teacher_input_ids": ids,
        "ctx_teacher_attention_mask": pad_rows([[1] * len(r.ids) for r in rows], 0, side=side)[0],
        "sdpo_loss_mask": pad_rows(masks, 0, side=side)[0],
        "sdpo_student_index": torch.tensor(s_index, dtype=torch.long).reshape(-1, 2),
        "sdpo_teacher_index": torch.tensor(t_index, dtype=torch.long).reshape(-1, 2),
    }
    return {k: v.to(device) for k, v in out.items()} if device is not None else out


# ---------------------------------------------------------------------------- prompts for generation


def left_padded_prompts(
    tokenizer: Any, prompts: Sequence[Sequence[dict[str, Any]]], *, repeat: int = 1
) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """Render message lists as prompts, each repeated ``repeat`` times, left-padded for ``generate``.

    Returns ``input_ids [N, P]``, ``attention_mask [N, P]`` (``N = len(prompts) * repeat``, row ``n``
    answers prompt ``n // repeat``) and the unpadded prompt ids of each distinct prompt.
    """
    rendered = [build_prompt_ids(tokenizer, p) for p in prompts]
    rows = [rendered[i] for i in range(len(rendered)) for _ in range(repeat)]
    ids, _ = pad_rows(rows, pad_id(tokenizer), side="left")
    mask, _ = pad_rows([[1] * len(r) for r in rows], 0, side="left")
    return ids, mask, rendered


def length_order(prompts: Sequence[Sequence[dict[str, Any]]]) -> list[int]:
    """Indices of ``prompts`` (message lists) from the shortest to the longest (characters of content, stable).

    Generation batches taken in this order hold prompts of similar length, so little padding.
    """
    return sorted(range(len(prompts)), key=lambda i: sum(len(content_text(m.get("content"))) for m in prompts[i]))


@dataclass
class Generated:
    """Responses generated for left-padded prompts (:func:`generate_responses`).

    Attributes:
        prompt_ids: ``[N, P]`` the left-padded prompts. prompt_mask: ``[N, P]`` 1 on prompt tokens.
        rendered: the unpadded ids of each distinct prompt. responses: ``N`` lists of response ids, cut
        after the first end-of-turn token (kept). truncated: ``N`` flags, True where no end-of-turn came.
    """

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    rendered: list[list[int]]
    responses: list[list[int]]
    truncated: list[bool]


@torch.no_grad()
def generate_responses(
    model: torch.nn.Module, tokenizer: Any, prompts: Sequence[Sequence[dict[str, Any]]], *, max_new_tokens: int,
    repeat: int = 1, do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
    share_prefix: bool = True,
) -> Generated:
    """The one left-pad + ``generate`` helper (rollout sampling, pair refresh and greedy evaluation).

    With ``share_prefix`` (the default) the prompt tokens that rows have in common are prefilled once
    (:func:`shared_prefix_cache`): a group's ``repeat`` copies of one prompt, and the system prompt and
    tool list that every prompt of an agent trace begins with. Decoding then writes into a preallocated
    KV cache (:func:`static_cache`) instead of growing one by concatenation at every token. The answers
    are those of the plain left-padded ``generate`` up to float rounding (same tokens attended, same
    position ids; tested token for token).

    Sampling runs inside ``torch.random.fork_rng`` seeded with ``seed`` (the caller's RNG is untouched);
    greedy decoding ignores the sampling arguments. The model is put in eval mode and its mode restored.
    """
    device = next(model.parameters()).device
    eot, fill = end_of_turn_id(tokenizer), pad_id(tokenizer)
    ids, mask, rendered = left_padded_prompts(tokenizer, prompts, repeat=repeat)
    sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if do_sample else dict(
        do_sample=False, temperature=None, top_p=None, top_k=None)
    was_training = model.training
    model.eval()
    try:
        gen_ids, gen_mask, cache = ids, mask, None
        if share_prefix:
            shared = shared_prefix_cache(model, rendered, repeat=repeat, fill=fill)
            if shared is not None:
                gen_ids, gen_mask, cache = shared
        cache = static_cache(model, cache, max_cache_len=gen_ids.shape[1] + max_new_tokens)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            extra = {} if cache is None else {"past_key_values": cache}
            out = model.generate(input_ids=gen_ids.to(device), attention_mask=gen_mask.to(device),
                                 max_new_tokens=max_new_tokens, eos_token_id=eot, pad_token_id=fill, **sampling,
                                 **extra)
    finally:
        model.train(was_training)
    responses, truncated = cut_at_end_of_turn(out[:, gen_ids.shape[1]:].tolist(), eot)
    return Generated(ids, mask, rendered, responses, truncated)


def generate_in_length_order(
    model: torch.nn.Module, tokenizer: Any, prompts: Sequence[Sequence[dict[str, Any]]], *, max_new_tokens: int,
    batch_size: int, do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
    batch_seed: Callable[[int], int] = lambda k: 0,
) -> list[list[int]]:
    """:func:`generate_responses` over many prompts, ``batch_size`` at a time in :func:`length_order`.

    Batches of similar lengths carry little padding (evaluation, student sampling). Batch ``k`` samples
    under ``batch_seed(k)``, so the result is a function of the weights, the prompts, the seeds and
    ``batch_size``.

    Returns:
        Each prompt's response ids (cut after the first end-of-turn, kept), in the order of ``prompts``.

    Raises:
        ValueError: ``batch_size`` below 1.
    """
    if batch_size < 1:
        raise ValueError(f"'batch_size' must be >= 1, got {batch_size}")
    order = length_order(prompts)
    out: list[list[int]] = [[] for _ in prompts]
    for k, start in enumerate(range(0, len(order), batch_size)):
        chunk = order[start:start + batch_size]
        gen = generate_responses(model, tokenizer, [prompts[i] for i in chunk], max_new_tokens=max_new_tokens,
                                 do_sample=do_sample, temperature=temperature, top_p=top_p, seed=batch_seed(k))
        for i, response in zip(chunk, gen.responses):
            out[i] = response
    return out


def static_cache(model: torch.nn.Module, prefilled: Any, *, max_cache_len: int) -> Any:
    """A preallocated (``transformers.StaticCache``) KV cache of ``max_cache_len`` columns for ``generate``.

    ``generate``'s default cache concatenates every layer's keys and values at every new token, which
    copies the whole cache each step (a third of a CPU decode step at 48 rows of 300 tokens); a static
    cache writes the new column in place. ``prefilled`` (a row-indexed cache from
    :func:`shared_prefix_cache`, or ``None``) is copied into its first columns.

    Returns:
        The static cache, or ``prefilled`` unchanged when the model's config cannot build one.
    """
    try:
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=max_cache_len)
    except (TypeError, ValueError, AttributeError, KeyError):  # a config StaticCache cannot read: stay dynamic
        return prefilled
    if prefilled is not None:
        layers = getattr(prefilled, "layers", None)
        if layers is None or len(layers) != len(cache.layers):
            return prefilled
        for static_layer, layer in zip(cache.layers, layers):
            static_layer.update(layer.keys, layer.values)  # [N, heads, s, d] into columns [0, s)
    return cache


def shared_prefix_cache(
    model: torch.nn.Module, rendered: Sequence[Sequence[int]], *, repeat: int = 1, fill: int = 0,
    min_saving: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
    """Prefill the prompt tokens that the rows share, once, for ``model.generate`` to continue from.

    The rows (each of ``rendered`` ``repeat`` times) are laid out *middle-padded*: the tokens every prompt
    begins with, then padding, then the rest of each prompt, so that every row ends at the last column and
    the shared tokens sit in the same columns. :func:`~composer_replication.losses.prefix.plan_prefix_split`
    (the loss's planner) then picks the cuts that prefill the fewest tokens: the common beginning once,
    then each distinct prompt once when a group repeats it. Each distinct prefix runs through the decoder
    once (``losses.prefix.decode_prefixes``); the KV cache is indexed out to the rows. Position ids count
    real tokens only (``generate``'s rule), so each row sees exactly its own prompt.

    Args:
        model: a causal LM whose decoder returns a row-indexable KV cache (in eval mode, under ``no_grad``).
        rendered: the distinct prompts' token ids (each non-empty).
        repeat: how many rows answer each prompt. fill: the padding id.
        min_saving: see ``plan_prefix_split`` (default: its default).

    Returns:
        ``(input_ids [N, P], attention_mask [N, P], cache)`` to pass to ``generate`` (``N = len(rendered) *
        repeat``; the cache holds the first ``s < P`` columns), or ``None`` when sharing saves too little or
        the model has no row-indexable cache (then generate from the plain left-padded prompts).
    """
    from composer_replication.losses.logprobs import decoder_of
    from composer_replication.losses.prefix import MIN_SAVING, decode_prefixes, plan_prefix_split

    if not rendered or any(len(r) == 0 for r in rendered):
        return None
    first = rendered[0]
    common = min(len(r) for r in rendered) - 1  # every row keeps a last token of its own to predict from
    for r in rendered[1:]:
        n = 0
        while n < common and r[n] == first[n]:
            n += 1
        common = n
    width = max(len(r) for r in rendered)
    rows, masks = [], []
    for r in rendered:
        gap = width - len(r)
        row, m = list(r[:common]) + [fill] * gap + list(r[common:]), [1] * common + [0] * gap + [1] * (len(r) - common)
        rows += [row] * repeat
        masks += [m] * repeat
    ids, mask = torch.tensor(rows, dtype=torch.long), torch.tensor(masks, dtype=torch.long)
    plan = plan_prefix_split(ids[:, :-1], mask[:, :-1], min_saving=MIN_SAVING if min_saving is None else min_saving)
    if plan is None:
        return None
    device = next(model.parameters()).device
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # [N, P] generate's position ids (pads get any value)
    decoder = decoder_of(model)
    try:
        _, cache = decode_prefixes(decoder, ids[:, :-1].to(device), mask[:, :-1].to(device),
                                   positions[:, :-1].to(device), plan)  # cache: [N, heads, s, d] per layer
    except ValueError:  # no row-indexable cache: generate from the plain prompts
        return None
    return ids, mask, cache


def cut_at_end_of_turn(generated: list[list[int]], eot: int) -> tuple[list[list[int]], list[bool]]:
    """Keep each row up to and including its first end-of-turn token; flag rows that never emit it."""
    responses, truncated = [], []
    for row in generated:
        cut = row.index(eot) + 1 if eot in row else len(row)
        responses.append(row[:cut])
        truncated.append(eot not in row)
    return responses, truncated

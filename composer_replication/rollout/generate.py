"""Generation: the one loop that answers chat prompts with the policy (rollouts, evaluation, pairs).

Plain inputs, plain outputs, no engine: message lists (or token rows) are rendered (``chat_format.build_prompt_ids``),
left-padded, decoded with ``model.generate`` and cut after each row's first end-of-turn token (kept).
:func:`generate_responses` returns the token ids; ``rollout.sample_rollouts`` adds the sampling log-probs and
texts. Decoding writes into a preallocated KV cache (:func:`static_cache`), and the prompt tokens rows share are
prefilled once (:func:`shared_prefix_cache`); both give the plain ``generate``'s tokens (tested token for
token). Sampling runs inside ``torch.random.fork_rng`` seeded with ``seed`` (the caller's RNG is untouched).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from composer_replication.batching import pad_id, pad_rows
from composer_replication.chat_format import build_prompt_ids, content_text, end_of_turn_id

__all__ = ["generate_responses", "generate_in_length_order", "shared_prefix_cache"]

Messages = Sequence[dict[str, Any]]

MIN_SAVING = 0.2
"""Prefill shared tokens only when that removes at least this fraction of the prompt tokens."""


@dataclass
class Generated:
    """Responses to left-padded prompts (:func:`generate_responses`): ``prompt_ids`` / ``prompt_mask`` ``[N, P]``
    long (row ``n`` answers prompt ``n // repeat``), ``rendered`` (each distinct prompt's ids), ``responses`` (``N``
    lists of ids, cut after the first end-of-turn, kept) and ``truncated`` (``N`` flags: no end-of-turn came)."""

    prompt_ids: torch.Tensor
    prompt_mask: torch.Tensor
    rendered: list[list[int]]
    responses: list[list[int]]
    truncated: list[bool]


def left_padded_prompts(tokenizer: Any, prompts: Sequence[Messages], *, repeat: int = 1
                        ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    """``input_ids [N, P]``, ``attention_mask [N, P]`` (``N = len(prompts) * repeat``, each prompt ``repeat``
    times, left-padded) and the unpadded ids of each distinct prompt. A prompt is a message list (rendered) or
    already a list of token ids (an agentic episode's row, ``rollout.agent.rollouts``)."""
    rendered = [[int(t) for t in p] if p and isinstance(p[0], int) else build_prompt_ids(tokenizer, p) for p in prompts]
    rows = [r for r in rendered for _ in range(repeat)]
    return (pad_rows(rows, pad_id(tokenizer), side="left")[0],
            pad_rows([[1] * len(r) for r in rows], 0, side="left")[0], rendered)


def length_order(prompts: Sequence[Messages]) -> list[int]:
    """Indices of ``prompts`` from the shortest to the longest (characters of content, stable): batches taken in
    this order carry little padding."""
    return sorted(range(len(prompts)), key=lambda i: sum(len(content_text(m.get("content"))) for m in prompts[i]))


@torch.no_grad()
def generate_responses(
    model: torch.nn.Module, tokenizer: Any, prompts: Sequence[Messages], *, max_new_tokens: int, repeat: int = 1,
    do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, share_prefix: bool = True,
) -> Generated:
    """Answer each prompt ``repeat`` times: greedy, or sampled at ``temperature`` / ``top_p`` (top-k off).

    ``share_prefix=False`` skips :func:`shared_prefix_cache` (same tokens, more prefill). The model is put in
    eval mode and its mode restored; greedy decoding ignores the sampling arguments.
    """
    device = next(model.parameters()).device
    eot, fill = end_of_turn_id(tokenizer), pad_id(tokenizer)
    ids, mask, rendered = left_padded_prompts(tokenizer, prompts, repeat=repeat)
    sampling = (dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=0) if do_sample
                else dict(do_sample=False, temperature=None, top_p=None, top_k=None))
    was_training = model.training
    model.eval()
    try:
        shared = shared_prefix_cache(model, rendered, repeat=repeat, fill=fill) if share_prefix else None
        gen_ids, gen_mask, cache = shared or (ids, mask, None)
        cache = static_cache(model, cache, max_cache_len=gen_ids.shape[1] + max_new_tokens)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = model.generate(input_ids=gen_ids.to(device), attention_mask=gen_mask.to(device),
                                 max_new_tokens=max_new_tokens, eos_token_id=eot, pad_token_id=fill, **sampling,
                                 **({} if cache is None else {"past_key_values": cache}))
    finally:
        model.train(was_training)
    responses, truncated = cut_at_end_of_turn(out[:, gen_ids.shape[1]:].tolist(), eot)
    return Generated(ids, mask, rendered, responses, truncated)


def generate_in_length_order(
    model: torch.nn.Module, tokenizer: Any, prompts: Sequence[Messages], *, max_new_tokens: int, batch_size: int,
    do_sample: bool = False, temperature: float = 1.0, top_p: float = 1.0,
    batch_seed: Callable[[int], int] = lambda k: 0,
) -> list[list[int]]:
    """:func:`generate_responses` over many prompts, ``batch_size`` at a time in :func:`length_order`.

    Batch ``k`` samples under ``batch_seed(k)``, so the result is a function of the weights, the prompts, the
    seeds and ``batch_size``. Returns each prompt's response ids, in the order of ``prompts``.

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


def shared_prefix_cache(
    model: torch.nn.Module, rendered: Sequence[Sequence[int]], *, repeat: int = 1, fill: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
    """Prefill the prompt tokens that rows share, once each, for ``model.generate`` to continue from.

    The rows (each of ``rendered`` ``repeat`` times) are laid out *middle-padded*: the ``c`` tokens every prompt
    begins with, then padding, then the rest of each prompt, so every row ends at the last column ``P - 1``.
    The common beginning runs through the decoder once; each distinct prompt's columns ``[c, P - 1)`` once, on
    top of it; the KV cache is then repeated to the ``N`` rows. Position ids count real tokens only
    (``generate``'s rule), so each row attends to exactly its own prompt at its own positions.

    ``model``: a causal LM (call under ``no_grad``, in eval mode); ``rendered``: the distinct prompts' ids (each
    non-empty); ``repeat``: rows per prompt; ``fill``: the padding id. Returns ``(input_ids [N, P], attention_mask
    [N, P], the cache of columns [0, P - 1) for N rows)``, or ``None`` when that saves under :data:`MIN_SAVING` of
    the ``N * P`` prompt tokens or the decoder keeps no repeatable cache.
    """
    from composer_replication.losses.logprobs import decoder_of

    if not rendered or min(len(r) for r in rendered) == 0:
        return None
    first, common = rendered[0], min(len(r) for r in rendered) - 1  # every row keeps its last token to predict from
    for r in rendered[1:]:
        common = next((n for n in range(common) if r[n] != first[n]), common)
    U, P = len(rendered), max(len(r) for r in rendered)
    if common + U * (P - 1 - common) + U * repeat > (1.0 - MIN_SAVING) * U * repeat * P:
        return None
    rows = [list(r[:common]) + [fill] * (P - len(r)) + list(r[common:]) for r in rendered]
    masks = [[1] * common + [0] * (P - len(r)) + [1] * (len(r) - common) for r in rendered]
    ids, mask = torch.tensor(rows, dtype=torch.long), torch.tensor(masks, dtype=torch.long)  # [U, P]
    device, decoder = next(model.parameters()).device, decoder_of(model)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)  # [U, P]
    cache = None
    for lo, hi, n in ((0, common, 1), (common, P - 1, U)):  # the common beginning once, then each prompt once
        if hi > lo:
            cache = decoder(input_ids=ids[:n, lo:hi].to(device), attention_mask=mask[:n, :hi].to(device),
                            position_ids=positions[:n, lo:hi].to(device), past_key_values=cache,
                            use_cache=True).past_key_values
            if not hasattr(cache, "batch_repeat_interleave"):
                return None  # a decoder without a repeatable cache: generate from the plain prompts
        if n == 1 and cache is not None:
            cache.batch_repeat_interleave(U)  # [1, heads, c, d] -> [U, heads, c, d]
    cache.batch_repeat_interleave(repeat)  # [U, heads, P - 1, d] -> [N, heads, P - 1, d]
    return ids.repeat_interleave(repeat, 0), mask.repeat_interleave(repeat, 0), cache


def static_cache(model: torch.nn.Module, prefilled: Any, *, max_cache_len: int) -> Any:
    """A preallocated ``transformers.StaticCache`` of ``max_cache_len`` columns holding ``prefilled`` (a cache
    from :func:`shared_prefix_cache`, or ``None``) in its first columns; ``prefilled`` unchanged when the
    model's config cannot build one. ``generate``'s default cache copies every layer at every new token."""
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


def cut_at_end_of_turn(generated: list[list[int]], eot: int) -> tuple[list[list[int]], list[bool]]:
    """Keep each row up to and including its first end-of-turn token; flag rows that never emit it."""
    cut = [row[: row.index(eot) + 1] if eot in row else row for row in generated]
    return cut, [eot not in row for row in generated]

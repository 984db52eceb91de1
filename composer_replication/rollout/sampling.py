"""G samples per prompt, with the sampling policy's log-probs recorded at sampling time.

:func:`sample_rollouts` samples through :func:`~composer_replication.rollout.generate.generate_responses`, lays
the samples out as ``[left padding | prompt | response | right padding]`` and scores them right away, under
``no_grad`` with the same model and the training kernel (``losses.token_logprobs_for``, untempered as
``compose_loss``'s), so the GRPO ratio compares like with like.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_replication.batching import pad_id, pad_rows
from composer_replication.rollout.environment import Prompt
from composer_replication.rollout.generate import generate_responses

__all__ = ["RolloutBatch", "sample_rollouts"]

log = logging.getLogger(__name__)


@dataclass
class RolloutBatch:
    """Sampled rollouts and their tensors (the channel-1 part of the batch contract).

    Attributes:
        prompt_index: ``[B]`` which prompt (index into the ``prompts`` given) each sample answers.
        prompt_ids: ``[B]`` lists: each sample's prompt token ids (unpadded).
        response_ids: ``[B]`` lists: each sample's response token ids, end-of-turn included.
        texts: ``[B]`` decoded responses (special tokens skipped), what environments score.
        truncated: ``[B]`` True where the response hit ``max_new_tokens`` without end-of-turn.
        group_ids: ``[B]`` long, ``group_offset + prompt_index`` (one group per prompt).
        input_ids: ``[B, T]`` long, ``[pad | prompt | response | pad]``.
        attention_mask: ``[B, T]`` long, 1 on prompt and response tokens.
        response_mask: ``[B, T]`` long, 1 on response tokens.
        old_logprobs: ``[B, T]`` float32 aligned log-probs of the sampling model, 0 off the response; ``None``
            when not computed (``old_logprobs=False``: the batch is trained on-policy, see ``losses.GRPO``).
        prompt_length: ``P``, the column where every response starts.
        num_generations: samples per prompt (``G``).
        timings: seconds spent in ``generate`` and in the ``old_logprobs`` pass.
    """

    prompt_index: list[int]
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    texts: list[str]
    truncated: list[bool]
    group_ids: torch.Tensor
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    response_mask: torch.Tensor
    old_logprobs: torch.Tensor | None
    prompt_length: int
    num_generations: int
    timings: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.texts)


def sample_rollouts(
    model: torch.nn.Module, tokenizer: Any, prompts: Sequence[Prompt | Sequence[Mapping[str, Any]]], *,
    num_generations: int, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0,
    chunk_size: int | None = 1024, group_offset: int = 0, old_logprobs: bool = True,
) -> RolloutBatch:
    """Sample ``num_generations`` responses for every prompt and record their old log-probs.

    Args:
        model: a Hugging Face causal LM (put in eval mode for sampling, its mode restored after).
        tokenizer: its tokenizer (chat template, ``pad_token_id``).
        prompts: :class:`Prompt` objects or plain message lists.
        num_generations: samples per prompt (``G``, at least 1; GRPO needs at least 2).
        max_new_tokens: the longest response, end-of-turn included.
        temperature: sampling temperature (> 0). top_p: nucleus mass in (0, 1] (1: off; top-k is always off).
        seed: seed of the local RNG used for sampling (the caller's RNG is untouched).
        chunk_size: token chunk of the log-prob kernel (``None``: full logits).
        group_offset: added to ``prompt_index`` to form ``group_ids`` (unique ids across calls).
        old_logprobs: score the samples after generation (one more forward pass). Skip it when the batch gets
            exactly one optimizer step (the old policy is then the current one).

    Returns:
        A :class:`RolloutBatch` on the model's device.

    Raises:
        ValueError: no prompts, or a non-positive count / limit, or ``top_p`` outside (0, 1].
    """
    _check(prompts, num_generations, max_new_tokens, temperature, top_p)
    device = next(model.parameters()).device
    t0 = time.perf_counter()
    gen = generate_responses(model, tokenizer, [p.messages if isinstance(p, Prompt) else p for p in prompts],
                             max_new_tokens=max_new_tokens, repeat=num_generations, do_sample=True,
                             temperature=temperature, top_p=top_p, seed=seed)
    index = [i for i in range(len(prompts)) for _ in range(num_generations)]
    P, responses = gen.prompt_ids.shape[1], gen.responses
    fill, width = pad_id(tokenizer), max(1, max(len(r) for r in responses))
    tails = [pad_rows(responses, fill, width=width)[0], pad_rows([[1] * len(r) for r in responses], 0, width=width)[0]]
    input_ids = torch.cat([gen.prompt_ids, tails[0]], 1).to(device)  # [B, P + L]
    attention_mask = torch.cat([gen.prompt_mask, tails[1]], 1).to(device)
    response_mask = torch.cat([torch.zeros_like(gen.prompt_mask), tails[1]], 1).to(device)
    t1 = time.perf_counter()
    old = _old_logprobs(model, input_ids, attention_mask, response_mask, chunk_size) if old_logprobs else None
    return RolloutBatch(
        prompt_index=index, prompt_ids=[gen.rendered[i] for i in index], response_ids=responses,
        texts=[tokenizer.decode(r, skip_special_tokens=True) for r in responses], truncated=gen.truncated,
        group_ids=torch.tensor([group_offset + i for i in index], dtype=torch.long, device=device),
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask, old_logprobs=old,
        prompt_length=P, num_generations=num_generations,
        timings={"generate": t1 - t0, "old_logprobs": time.perf_counter() - t1},
    )


@torch.no_grad()
def _old_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                  response_mask: torch.Tensor, chunk_size: int | None) -> torch.Tensor:
    """Aligned float32 log-probs ``[B, T]`` of the model in eval mode, 0 outside ``response_mask``."""
    from composer_replication.losses import token_logprobs_for

    was_training = model.training
    model.eval()
    try:
        lp = token_logprobs_for(model, input_ids, attention_mask, response_mask=response_mask, chunk_size=chunk_size)
    finally:
        model.train(was_training)
    return torch.where(response_mask.bool(), lp.float(), torch.zeros((), dtype=torch.float32, device=lp.device))


def _check(prompts: Sequence[Any], g: int, max_new: int, temperature: float, top_p: float) -> None:
    if len(prompts) == 0:
        raise ValueError("sample_rollouts: prompts is empty; pass at least one Prompt or message list.")
    if not isinstance(g, int) or g < 1:
        raise ValueError(f"num_generations must be an int >= 1, got {g!r} (GRPO needs >= 2 per prompt).")
    if g == 1:
        log.warning("num_generations=1: every group has one sample, so all GRPO advantages are 0")
    if not isinstance(max_new, int) or max_new < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new!r}.")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}; use a small value for near-greedy.")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}; 1.0 disables nucleus sampling.")

"""G samples per prompt, with the sampling policy's log-probs recorded at sampling time.

:func:`sample_rollouts` renders every prompt with the shared chat format
(``chat_format.build_prompt_ids``), repeats it ``num_generations`` times, left-pads the
prompts, samples with ``model.generate`` and cuts every response after its first end-of-turn token
(``<|im_end|>`` for ChatML; a response that never emits it is kept whole and flagged
``truncated``). Right after sampling, under ``no_grad`` and with the same model, it computes the
per-token log-probs of the sampled responses with the training kernel
(``loss.token_logprobs_for``), so the GRPO ratio compares like with like. Old log-probs are those
of the untempered model (temperature 1), as ``compose_loss`` computes the current ones; with
``temperature != 1`` the samples come from the tempered distribution.

Determinism without global seeding: generation runs inside ``torch.random.fork_rng`` seeded with
``seed``, so the caller's RNG state is restored afterwards and the same seed gives the same samples.

Layout of the batch (``B = len(prompts) * num_generations``, sample ``b`` answers prompt
``b // num_generations``): ``[left padding | prompt | response | right padding]``; the prompt
always ends at column ``prompt_length``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_replication.batching import generate_responses, pad_id
from composer_replication.rollout.environment import Prompt

__all__ = ["RolloutBatch", "sample_rollouts", "compute_token_logprobs"]

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
    """Seconds spent in ``generate`` and in the ``old_logprobs`` pass."""

    def __len__(self) -> int:
        return len(self.texts)


def sample_rollouts(
    model: torch.nn.Module,
    tokenizer: Any,
    prompts: Sequence[Prompt | Sequence[Mapping[str, Any]]],
    *,
    num_generations: int,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    seed: int = 0,
    chunk_size: int | None = 1024,
    group_offset: int = 0,
    old_logprobs: bool = True,
) -> RolloutBatch:
    """Sample ``num_generations`` responses for every prompt and record their old log-probs.

    Args:
        model: a Hugging Face causal LM (put in eval mode for sampling, its mode restored after).
        tokenizer: its tokenizer (chat template, ``pad_token_id``).
        prompts: :class:`Prompt` objects or plain message lists.
        num_generations: samples per prompt (``G``, at least 1; GRPO needs at least 2).
        max_new_tokens: the longest response, end-of-turn included.
        temperature: sampling temperature (> 0).
        top_p: nucleus sampling mass in (0, 1] (1 disables it; top-k is always off).
        seed: seed of the local RNG used for sampling.
        chunk_size: token chunk of the log-prob kernel (``None``: full logits).
        group_offset: added to ``prompt_index`` to form ``group_ids`` (unique ids across calls).
        old_logprobs: score the samples with the model after generation (one more forward pass). Skip it
            when the batch gets exactly one optimizer step (the old policy is then the current one).

    Returns:
        A :class:`RolloutBatch` on the model's device.

    Raises:
        ValueError: no prompts, or a non-positive count / limit, or ``top_p`` outside (0, 1].
    """
    _check(prompts, num_generations, max_new_tokens, temperature, top_p)
    device = next(model.parameters()).device
    fill = pad_id(tokenizer)
    messages = [p.messages if isinstance(p, Prompt) else p for p in prompts]
    t0 = time.perf_counter()
    gen = generate_responses(model, tokenizer, messages, max_new_tokens=max_new_tokens, repeat=num_generations,
                             do_sample=True, temperature=temperature, top_p=top_p, seed=seed)
    index = [i for i in range(len(prompts)) for _ in range(num_generations)]
    P, responses = gen.prompt_ids.shape[1], gen.responses
    input_ids, attention_mask, response_mask = _layout(gen.prompt_ids, gen.prompt_mask, responses, fill)
    input_ids, attention_mask, response_mask = (t.to(device) for t in (input_ids, attention_mask, response_mask))
    t1 = time.perf_counter()
    old = None
    if old_logprobs:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                old = compute_token_logprobs(model, input_ids, attention_mask, response_mask, chunk_size=chunk_size)
        finally:
            model.train(was_training)
    timings = {"generate": t1 - t0, "old_logprobs": time.perf_counter() - t1}
    return RolloutBatch(
        prompt_index=index, prompt_ids=[gen.rendered[i] for i in index], response_ids=responses,
        texts=[tokenizer.decode(r, skip_special_tokens=True) for r in responses], truncated=gen.truncated,
        group_ids=torch.tensor([group_offset + i for i in index], dtype=torch.long, device=device),
        input_ids=input_ids, attention_mask=attention_mask, response_mask=response_mask,
        old_logprobs=None if old is None else old.detach(), prompt_length=P, num_generations=num_generations, timings=timings,
    )


def compute_token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    chunk_size: int | None = 1024,
) -> torch.Tensor:
    """Aligned per-token log-probs ``[B, T]`` (float32) of ``input_ids``, 0 outside ``response_mask``.

    Uses ``composer_replication.loss.token_logprobs_for``, the kernel ``compose_loss`` trains with.
    Runs with grad when grad is enabled (wrap in ``torch.no_grad()`` for old log-probs).

    Args:
        model: a causal LM.
        input_ids: ``[B, T]`` long.
        attention_mask: ``[B, T]`` 1 on real tokens.
        response_mask: ``[B, T]`` 1 on the tokens to score.
        chunk_size: token chunk (``None``: full logits).
    """
    from composer_replication.losses import token_logprobs_for

    lp = token_logprobs_for(model, input_ids, attention_mask, response_mask=response_mask, chunk_size=chunk_size)
    return torch.where(response_mask.bool(), lp.float(), torch.zeros((), dtype=torch.float32, device=lp.device))


# ---------------------------------------------------------------------------- helpers


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


def _layout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: list[list[int]], pad: int
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[pad | prompt | response | pad]`` ids ``[B, T]``, attention mask and response mask."""
    B, P = prompt_ids.shape
    L = max(1, max(len(r) for r in responses))
    input_ids = torch.full((B, P + L), pad, dtype=torch.long)
    input_ids[:, :P] = prompt_ids
    attention_mask = torch.zeros_like(input_ids)
    attention_mask[:, :P] = prompt_mask
    response_mask = torch.zeros_like(input_ids)
    for b, r in enumerate(responses):
        if r:
            input_ids[b, P : P + len(r)] = torch.tensor(r)
            attention_mask[b, P : P + len(r)] = 1
            response_mask[b, P : P + len(r)] = 1
    return input_ids, attention_mask, response_mask

"""Rollouts + scores -> a ``compose_loss`` batch (channel 1, and channel 2 at rollout error sites).

Channel 1 (GRPO): the rollout tensors, the rewards, the group ids and the group-relative advantages
(``losses.group_advantages``). Channel 2: every rollout whose :class:`Score` names an ``error_kind`` for which
the hint function returns a hint is an error site; its hinted row is ``prompt(history + [hint as a user
message]) + exactly that rollout's response ids`` (``chat_format.build_hinted_teacher_sequence``), index-aligned
with the student batch by ``batching.hinted_batch``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from composer_replication.batching import HintedRow, hinted_batch, pad_id
from composer_replication.chat_format import build_hinted_teacher_sequence
from composer_replication.rollout.environment import Prompt, Score
from composer_replication.rollout.sampling import RolloutBatch

__all__ = ["assemble_batch", "rollout_stats"]

HintFn = Callable[[str, dict], "str | None"]


def assemble_batch(
    tokenizer: Any, rollouts: RolloutBatch, scores: Sequence[Score], *,
    prompts: Sequence[Prompt | Sequence[Mapping[str, Any]]], hint_fn: HintFn | None = None,
    scale_rewards: str = "group", enable_sdpo: bool = True,
) -> dict[str, torch.Tensor]:
    """Build the training batch for ``compose_loss`` from scored rollouts.

    Args:
        tokenizer: the policy's tokenizer.
        rollouts: from :func:`~composer_replication.rollout.sampling.sample_rollouts`.
        scores: one :class:`Score` per rollout, in order.
        prompts: the prompts given to ``sample_rollouts`` (their messages are the histories).
        hint_fn: ``(error_kind, error_meta) -> hint | None`` (default ``hint_generator.dispatch``).
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"`` (see ``losses.group_advantages``).
        enable_sdpo: build channel-2 keys at error sites.

    Returns:
        Channel 1: ``input_ids``, ``attention_mask``, ``response_mask``, ``old_logprobs`` (when the rollouts have
        them) ``[B, T]``; ``rewards [B]`` float32, ``group_ids [B]`` long, ``advantages [B]``. Channel 2, when an
        error site got a hint: ``ctx_teacher_input_ids``, ``ctx_teacher_attention_mask``, ``sdpo_loss_mask``
        ``[B2, Tt]``, ``sdpo_student_index`` and ``sdpo_teacher_index`` ``[N, 2]`` long.

    Raises:
        ValueError: ``scores`` does not have one entry per rollout, or a prompt index is out of range.
    """
    if len(scores) != len(rollouts):
        raise ValueError(f"assemble_batch: got {len(scores)} scores for {len(rollouts)} rollouts; score every "
                         "rollout (environment.score_texts(env, prompts, rollouts.prompt_index, rollouts.texts)).")
    if rollouts.prompt_index and max(rollouts.prompt_index) >= len(prompts):
        raise ValueError(f"assemble_batch: rollouts refer to prompt {max(rollouts.prompt_index)} but {len(prompts)} "
                         "prompts were given; pass the same prompts as to sample_rollouts.")
    from composer_replication.losses import group_advantages

    device = rollouts.input_ids.device
    rewards = torch.tensor([s.reward for s in scores], dtype=torch.float32, device=device)
    batch: dict[str, torch.Tensor] = {
        "input_ids": rollouts.input_ids, "attention_mask": rollouts.attention_mask,
        "response_mask": rollouts.response_mask, "rewards": rewards, "group_ids": rollouts.group_ids,
        "advantages": group_advantages(rewards, rollouts.group_ids, scale_rewards=scale_rewards),
    }
    if rollouts.old_logprobs is not None:
        batch["old_logprobs"] = rollouts.old_logprobs
    if not enable_sdpo:
        return batch
    if hint_fn is None:
        from composer_replication.hint_generator import dispatch as hint_fn
    rows: list[HintedRow] = []
    for b, score in enumerate(scores):
        response = rollouts.response_ids[b]
        if score.error_kind is None or not response:
            continue
        hint = hint_fn(score.error_kind, {"error_kind": score.error_kind, **(score.error_meta or {})})
        if hint:
            prompt = prompts[rollouts.prompt_index[b]]
            history = list(prompt.messages if isinstance(prompt, Prompt) else prompt)
            ids, start = build_hinted_teacher_sequence(tokenizer, history, hint, response)
            rows.append(HintedRow(tuple(ids), start, b, rollouts.prompt_length))
    return {**batch, **hinted_batch(rows, pad_id(tokenizer), device=device)}


def rollout_stats(rollouts: RolloutBatch, scores: Sequence[Score], batch: Mapping[str, torch.Tensor]
                  ) -> dict[str, float]:
    """Scalar metrics of one rollout batch, for ``metrics.jsonl``.

    Keys: ``rollout/reward_max``, ``rollout/num_samples``, ``rollout/num_error_sites`` (scores with an error
    kind), ``rollout/num_hinted`` (hinted rows built), ``rollout/frac_truncated``, ``rollout/response_len_mean``
    and ``rollout/errors/<kind>`` counts. The reward mean and std are ``reward/*`` (``engine.evaluate``).
    """
    n = len(scores)
    stats = {
        "rollout/reward_max": max((s.reward for s in scores), default=0.0),
        "rollout/num_samples": float(n),
        "rollout/num_error_sites": float(sum(s.error_kind is not None for s in scores)),
        "rollout/num_hinted": float(batch["ctx_teacher_input_ids"].shape[0]) if "ctx_teacher_input_ids" in batch else 0.0,
        "rollout/frac_truncated": sum(rollouts.truncated) / max(1, len(rollouts.truncated)),
        "rollout/response_len_mean": sum(map(len, rollouts.response_ids)) / max(1, len(rollouts.response_ids)),
    }
    stats.update({f"rollout/errors/{k}": float(c) for k, c in Counter(s.error_kind for s in scores if s.error_kind).items()})
    return stats

"""Rollouts + scores -> a ``compose_loss`` batch (channel 1, and channel 2 at rollout error sites).

Channel 1 (GRPO): the rollout tensors (``input_ids``, ``attention_mask``, ``response_mask``,
``old_logprobs``), the rewards, the group ids and the group-relative advantages
(``grpo.group_advantages``).

Channel 2 (self-distillation at error sites): every rollout whose :class:`Score` names an
``error_kind`` for which the hint function returns a hint becomes an error site. Its teacher
sequence is ``prompt(history + [hint as a user message]) + exactly that rollout's response ids``
(``chat_format.build_hinted_teacher_sequence``, the one function that builds it), and
``sdpo_student_index`` / ``sdpo_teacher_index`` pair each response token in the student batch
with the same token in the teacher batch, as the batch contract requires.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from composer_replication.batching import TeacherRow, pad_id, teacher_batch
from composer_replication.chat_format import build_hinted_teacher_sequence
from composer_replication.rollout.environment import Prompt, Score
from composer_replication.rollout.sampling import RolloutBatch

__all__ = ["assemble_batch", "rollout_stats"]

log = logging.getLogger(__name__)

HintFn = Callable[[str, dict], "str | None"]


def assemble_batch(
    tokenizer: Any,
    rollouts: RolloutBatch,
    scores: Sequence[Score],
    *,
    prompts: Sequence[Prompt | Sequence[Mapping[str, Any]]],
    hint_fn: HintFn | None = None,
    scale_rewards: str = "group",
    enable_sdpo: bool = True,
) -> dict[str, torch.Tensor]:
    """Build the training batch for ``compose_loss`` from scored rollouts.

    Args:
        tokenizer: the policy's tokenizer (chat template, ``pad_token_id``).
        rollouts: the output of :func:`~composer_replication.rollout.sampling.sample_rollouts`.
        scores: one :class:`Score` per rollout, in order.
        prompts: the prompts given to ``sample_rollouts`` (their messages are the histories).
        hint_fn: ``(error_kind, error_meta) -> hint | None`` (default ``hint_generator.dispatch``).
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"`` (see ``grpo.group_advantages``).
        enable_sdpo: build channel-2 keys at error sites.

    Returns:
        Channel 1: ``input_ids [B, T]``, ``attention_mask [B, T]``, ``response_mask [B, T]``,
        ``old_logprobs [B, T]`` (when the rollouts have them), ``rewards [B]`` float32, ``group_ids [B]`` long, ``advantages [B]``.
        Channel 2, when at least one error site has a hint: ``ctx_teacher_input_ids [B2, Tt]``,
        ``ctx_teacher_attention_mask [B2, Tt]``, ``sdpo_loss_mask [B2, Tt]``,
        ``sdpo_student_index [N, 2]`` and ``sdpo_teacher_index [N, 2]`` long.

    Raises:
        ValueError: ``scores`` does not have one entry per rollout, or a prompt index is out of range.
    """
    if len(scores) != len(rollouts):
        raise ValueError(
            f"assemble_batch: got {len(scores)} scores for {len(rollouts)} rollouts; score every rollout "
            "(environment.score_texts(env, prompts, rollouts.prompt_index, rollouts.texts))."
        )
    if rollouts.prompt_index and max(rollouts.prompt_index) >= len(prompts):
        raise ValueError(
            f"assemble_batch: rollouts refer to prompt {max(rollouts.prompt_index)} but {len(prompts)} prompts "
            "were given; pass the same prompts as to sample_rollouts."
        )
    from composer_replication.losses import group_advantages

    device = rollouts.input_ids.device
    rewards = torch.tensor([s.reward for s in scores], dtype=torch.float32, device=device)
    batch: dict[str, torch.Tensor] = {
        "input_ids": rollouts.input_ids,
        "attention_mask": rollouts.attention_mask,
        "response_mask": rollouts.response_mask,
        "rewards": rewards,
        "group_ids": rollouts.group_ids,
        "advantages": group_advantages(rewards, rollouts.group_ids, scale_rewards=scale_rewards),
    }
    if rollouts.old_logprobs is not None:
        batch["old_logprobs"] = rollouts.old_logprobs
    if enable_sdpo:
        if hint_fn is None:
            from composer_replication.hint_generator import dispatch as hint_fn
        batch.update(_channel2(tokenizer, rollouts, scores, prompts, hint_fn, device))
    return batch


def _channel2(
    tokenizer: Any, rollouts: RolloutBatch, scores: Sequence[Score],
    prompts: Sequence[Prompt | Sequence[Mapping[str, Any]]], hint_fn: HintFn, device: torch.device,
) -> dict[str, torch.Tensor]:
    rows: list[TeacherRow] = []
    for b, score in enumerate(scores):
        response = rollouts.response_ids[b]
        if score.error_kind is None or not response:
            continue
        meta = dict(score.error_meta or {})
        meta.setdefault("error_kind", score.error_kind)
        hint = hint_fn(score.error_kind, meta)
        if not hint:
            continue
        prompt = prompts[rollouts.prompt_index[b]]
        history = list(prompt.messages if isinstance(prompt, Prompt) else prompt)
        ids, start = build_hinted_teacher_sequence(tokenizer, history, hint, response)
        rows.append(TeacherRow(tuple(ids), start, b, rollouts.prompt_length))
    return teacher_batch(rows, pad_id(tokenizer), device=device)


def rollout_stats(rollouts: RolloutBatch, scores: Sequence[Score], batch: Mapping[str, torch.Tensor]
                  ) -> dict[str, float]:
    """Scalar metrics of one rollout batch, for ``metrics.jsonl``.

    Keys: ``rollout/reward_max``, ``rollout/num_samples``, ``rollout/num_error_sites`` (scores with an error kind),
    ``rollout/num_hinted`` (teacher rows built), ``rollout/frac_truncated``,
    ``rollout/response_len_mean`` and ``rollout/errors/<kind>`` counts. The reward mean and std are
    ``reward/*`` (``engine.evaluate.reward_stats``), defined once.
    """
    rewards = torch.tensor([s.reward for s in scores], dtype=torch.float64)
    n = len(scores)
    stats = {
        "rollout/reward_max": float(rewards.max()) if n else 0.0,
        "rollout/num_samples": float(n),
        "rollout/num_error_sites": float(sum(s.error_kind is not None for s in scores)),
        "rollout/num_hinted": float(batch["ctx_teacher_input_ids"].shape[0]) if "ctx_teacher_input_ids" in batch else 0.0,
        "rollout/frac_truncated": sum(rollouts.truncated) / max(1, len(rollouts.truncated)),
        "rollout/response_len_mean": sum(map(len, rollouts.response_ids)) / max(1, len(rollouts.response_ids)),
    }
    for kind, count in Counter(s.error_kind for s in scores if s.error_kind).items():
        stats[f"rollout/errors/{kind}"] = float(count)
    return stats

"""Sampled episodes -> the three channels' rows (``compose_loss``'s batch contract) and the step's metrics.

- Channel 1 (:func:`assemble_episode_batch`): one right-padded row per episode; ``response_mask`` is 1 exactly on
  the tokens the student sampled, across all its turns (system, user and tool tokens are 0); the advantage is the
  episode reward normalized within its group (the task's G episodes, ``losses.group_advantages``).
- Channel 2: every failed tool call is an error site (``StepResult.error_site``). The hint for it
  (``hint_generator.dispatch``) goes in as a user message where the failing turn began: the teacher row is the chat
  before that turn, the hint, then exactly the tokens the student sampled at that turn, index-aligned with their
  columns in the student row (``batching.hinted_batch``) -- the same model, told what went wrong, scoring what it wrote.
- Channel 3 (:func:`solution_pair_rows`): where an unsolved episode first departs from its task's
  ``solution_actions``, the solution's call is ``chosen`` and the student's sampled turn ``rejected``, at their
  shared history (the ``recorded`` teacher of a task); a chosen call the degeneracy filter refuses makes no pair.
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from composer_replication.actions import canonical_action, format_tool_use
from composer_replication.batching import (
    BatchingStats,
    HintedRow,
    TokenizedPair,
    fit_prompt,
    hinted_batch,
    pad_id,
    pad_rows,
)
from composer_replication.chat_format import (
    build_hinted_teacher_sequence,
    build_prompt_ids,
    build_response_ids,
)
from composer_replication.rollout.agent.episode import MALFORMED
from composer_replication.rollout.agent.rollouts import EpisodeRollout

__all__ = ["assemble_episode_batch", "solution_pair_rows", "episode_stats"]

HintFn = Callable[[str, dict], "str | None"]


def assemble_episode_batch(
    tokenizer: Any, episodes: Sequence[EpisodeRollout], *, scale_rewards: str = "group", enable_sdpo: bool = True,
    hint_fn: HintFn | None = None, device: torch.device | str | None = None,
) -> tuple[dict[str, torch.Tensor], Counter]:
    """Channels 1 and 2 of sampled episodes (see the module notes).

    Returns:
        ``(batch, hints)``: ``input_ids``, ``attention_mask``, ``response_mask`` ``[B, T]``; ``rewards [B]``
        float32, ``group_ids [B]`` long, ``advantages [B]``; with hinted error sites, ``ctx_teacher_input_ids``,
        ``ctx_teacher_attention_mask``, ``sdpo_loss_mask`` ``[B2, Tt]``, ``sdpo_student_index`` and
        ``sdpo_teacher_index`` ``[N, 2]``. ``hints`` counts the hinted error sites by the failed call's ``failure``.

    Raises:
        ValueError: no episodes.
    """
    from composer_replication.losses import group_advantages

    if not episodes:
        raise ValueError("assemble_episode_batch: no episodes; sample them with rollout.agent.sample_episodes")
    fill = pad_id(tokenizer)
    masks = [[0] * len(e.ids) for e in episodes]
    for mask, e in zip(masks, episodes):
        for s, t in e.spans:
            mask[s:t] = [1] * (t - s)
    rewards = torch.tensor([e.reward for e in episodes], dtype=torch.float32)
    groups = torch.tensor([e.group for e in episodes], dtype=torch.long)
    batch = {"input_ids": pad_rows([e.ids for e in episodes], fill)[0],
             "attention_mask": pad_rows([[1] * len(e.ids) for e in episodes], 0)[0],
             "response_mask": pad_rows(masks, 0)[0], "rewards": rewards, "group_ids": groups,
             "advantages": group_advantages(rewards, groups, scale_rewards=scale_rewards)}
    hints: Counter = Counter()
    if enable_sdpo:
        if hint_fn is None:
            from composer_replication.hint_generator import dispatch as hint_fn
        rows: list[HintedRow] = []
        for b, e in enumerate(episodes):
            for step in e.steps:
                s, t = e.spans[step.turn]
                if step.error_site is None or t <= s:
                    continue
                hint = hint_fn(step.error_kind, {"error_kind": step.error_kind, **step.error_site})
                if hint:
                    ids, start = build_hinted_teacher_sequence(tokenizer, e.messages[:step.message_index], hint,
                                                               e.ids[s:t])
                    rows.append(HintedRow(tuple(ids), start, b, s))
                    hints[next(r.failure for r in step.results if r.failure)] += 1
        batch.update(hinted_batch(rows, fill))
    return {k: v.to(device) for k, v in batch.items()}, hints


def solution_pair_rows(
    tokenizer: Any, episodes: Sequence[EpisodeRollout], *, max_pairs: int, max_seq_len: int,
    over_length: str = "truncate_left", rng: random.Random | None = None, stats: BatchingStats | None = None,
) -> list[TokenizedPair]:
    """Channel-3 rows where unsolved episodes departed from their task's ``solution_actions`` (module notes): at
    most ``max_pairs`` (drawn with ``rng`` when more), each ``TokenizedPair(f"{task_id}::turn{k}", prompt, chosen,
    rejected)`` with ``rejected`` the sampled ids of turn ``k``."""
    from composer_replication.replaysim.normalize import degeneracy

    rows = []
    for e in episodes:
        solution = e.task.solution_actions
        if e.solved or not solution:
            continue
        for k, ((s, t), text) in enumerate(zip(e.spans, e.texts)):
            if k >= len(solution):
                break
            chosen = format_tool_use(solution[k]["name"], solution[k]["input"])
            if canonical_action(text) == canonical_action(chosen):
                continue  # the student took the solution's step: compare the next one
            if degeneracy(chosen) is None and t > s:
                response = build_response_ids(tokenizer, chosen)
                prompt = fit_prompt(build_prompt_ids(tokenizer, e.messages[:e.steps[k].message_index]),
                                    max(len(response), t - s), max_seq_len=max_seq_len, over_length=over_length,
                                    stats=stats)
                if prompt is not None:
                    rows.append(TokenizedPair(f"{e.task.task_id}::turn{k}", tuple(prompt), tuple(response),
                                              tuple(e.ids[s:t])))
            break
    if len(rows) > max_pairs:
        rows = (rng or random.Random(0)).sample(rows, max_pairs)
    return rows


def episode_stats(episodes: Sequence[EpisodeRollout], hints: Counter | None = None, *, prefix: str = "rollout/"
                  ) -> dict[str, float]:
    """Means over episodes: ``{prefix}solve_rate``, ``mean_reward``, ``turns``, ``tool_calls`` and ``tool_errors``
    (failed calls) per episode, ``tool_error_rate`` (failed / all calls), ``well_formed_call_rate`` (turns with a call
    that was not malformed / all turns), ``malformed_calls``, ``num_episodes``, ``error_sites`` (per episode),
    ``end/<why>`` counts; with ``hints``, ``hints/<failure>`` counts (no prefix)."""
    n = max(len(episodes), 1)
    calls = sum(e.components.get("tool_calls", 0) for e in episodes)
    turns = [s for e in episodes for s in e.steps]
    well_formed = sum(any(r.failure not in MALFORMED for r in s.results) for s in turns)
    out = {f"{prefix}solve_rate": sum(e.solved for e in episodes) / n,
           f"{prefix}mean_reward": sum(e.reward for e in episodes) / n,
           f"{prefix}turns": len(turns) / n,
           f"{prefix}tool_calls": calls / n,
           f"{prefix}well_formed_call_rate": well_formed / max(len(turns), 1),
           f"{prefix}tool_errors": sum(e.components.get("tool_errors", 0) for e in episodes) / n,
           f"{prefix}tool_error_rate": sum(e.components.get("tool_errors", 0) for e in episodes) / max(calls, 1),
           f"{prefix}malformed_calls": sum(e.components.get("malformed_calls", 0) for e in episodes) / n,
           f"{prefix}error_sites": sum(s.error_site is not None for e in episodes for s in e.steps) / n,
           f"{prefix}num_episodes": float(len(episodes))}
    out.update({f"{prefix}end/{k}": float(v) for k, v in Counter(e.end for e in episodes).items()})
    out.update({f"hints/{k}": float(v) for k, v in (hints or {}).items()})
    return out

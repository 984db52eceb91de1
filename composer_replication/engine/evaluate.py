"""Evaluation helpers: greedy answers to fixed prompts, and reward statistics of scores."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from composer_replication.batching import generate_responses
from composer_replication.chat_format import end_of_turn_id

__all__ = ["greedy_texts", "reward_stats"]


@torch.no_grad()
def greedy_texts(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[Any], *, max_new_tokens: int) -> list[str]:
    """Greedy-decoded response text for each prompt (``rollout.Prompt`` or message list), cut at end-of-turn.

    Uses :func:`composer_replication.batching.generate_responses` (the one generate helper).
    """
    from composer_replication.rollout import Prompt

    if not prompts:
        return []
    messages = [p.messages if isinstance(p, Prompt) else p for p in prompts]
    gen = generate_responses(model, tokenizer, messages, max_new_tokens=max_new_tokens)
    eot = end_of_turn_id(tokenizer)
    return [tokenizer.decode(r[:-1] if r and r[-1] == eot else r, skip_special_tokens=True) for r in gen.responses]


def reward_stats(scores: Sequence[Any], prefix: str = "reward/") -> dict[str, float]:
    """``{prefix}mean``, ``{prefix}std`` (population), ``{prefix}error_rate`` and ``{prefix}num_scored``.

    The one definition of reward statistics: training rows use ``reward/``, evaluation rows ``eval/``.
    Empty ``scores`` give NaN statistics and ``num_scored = 0``.
    """
    n = len(scores)
    if n == 0:
        nan = float("nan")
        return {f"{prefix}mean": nan, f"{prefix}std": nan, f"{prefix}error_rate": nan, f"{prefix}num_scored": 0.0}
    rewards = torch.tensor([float(s.reward) for s in scores], dtype=torch.float64)
    errors = sum(1 for s in scores if getattr(s, "error_kind", None))
    return {
        f"{prefix}mean": float(rewards.mean()),
        f"{prefix}std": float(rewards.std(unbiased=False)),
        f"{prefix}error_rate": errors / n,
        f"{prefix}num_scored": float(n),
    }

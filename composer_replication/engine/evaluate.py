"""Evaluation helpers: greedy answers to fixed prompts, and reward statistics of scores."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["greedy_texts", "reward_stats"]


@torch.no_grad()
def greedy_texts(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[Any], *, max_new_tokens: int) -> list[str]:
    """Greedy-decoded response text for each prompt (``rollout.Prompt`` or message list), cut at end-of-turn.

    Prompts are rendered with the shared chat format (``chat_format.build_prompt_ids``) and
    left-padded; the model's train/eval mode is restored afterwards.
    """
    from composer_replication.chat_format import build_prompt_ids, end_of_turn_id
    from composer_replication.rollout import Prompt

    if not prompts:
        return []
    device = next(model.parameters()).device
    eot = end_of_turn_id(tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eot
    rendered = [build_prompt_ids(tokenizer, p.messages if isinstance(p, Prompt) else p) for p in prompts]
    P = max(len(r) for r in rendered)
    ids = torch.full((len(rendered), P), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rendered):
        ids[i, P - len(r) :] = torch.tensor(r, dtype=torch.long)
        mask[i, P - len(r) :] = 1
    was_training = model.training
    model.eval()
    try:
        out = model.generate(
            input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False, max_new_tokens=max_new_tokens,
            eos_token_id=eot, pad_token_id=pad, temperature=None, top_p=None, top_k=None,
        )
    finally:
        model.train(was_training)
    texts = []
    for row in out[:, P:].tolist():
        cut = row.index(eot) if eot in row else len(row)
        texts.append(tokenizer.decode(row[:cut], skip_special_tokens=True))
    return texts


def reward_stats(scores: Sequence[Any], prefix: str = "") -> dict[str, float]:
    """``{prefix}reward_mean``, ``reward_std`` (population), ``error_rate`` and ``n_scored`` of ``Score`` records.

    Empty ``scores`` give NaN statistics and ``n_scored = 0``.
    """
    n = len(scores)
    if n == 0:
        nan = float("nan")
        return {f"{prefix}reward_mean": nan, f"{prefix}reward_std": nan, f"{prefix}error_rate": nan,
                f"{prefix}n_scored": 0.0}
    rewards = torch.tensor([float(s.reward) for s in scores], dtype=torch.float64)
    errors = sum(1 for s in scores if getattr(s, "error_kind", None))
    return {
        f"{prefix}reward_mean": float(rewards.mean()),
        f"{prefix}reward_std": float(rewards.std(unbiased=False)),
        f"{prefix}error_rate": errors / n,
        f"{prefix}n_scored": float(n),
    }

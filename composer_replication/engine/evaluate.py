"""Evaluation helpers: greedy answers to fixed prompts, reward statistics, and next-action agreement.

What a run's evaluation measures (``StudentTrainerCore.evaluate``, rows ``eval/*``): one greedy answer
per held-out prompt, scored by the environment that offers the prompt. For next-action prompts of
held-out sessions the reference is the session's recorded action, and :func:`next_action_stats` reads
the environment's own score components (``rollout.next_action``: one definition of agreement):

- ``eval/agreement``: the answer agrees fully with the recorded action (the same tool calls with equal
  arguments, in order; for a text action, the same words);
- ``eval/agreement_partial``: the mean agreement component (partial credit per call);
- ``eval/tool_choice_rate``: the answer calls the same tools, in the same order, as the recorded action;
- ``eval/well_formed_call_rate``: among states whose recorded action calls a tool, the answer makes at
  least one call and every call names an offered tool with a JSON-object argument;
- ``eval/mean`` / ``eval/std`` / ``eval/error_rate`` / ``eval/num_scored``: :func:`reward_stats`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from composer_replication.actions import parse_action
from composer_replication.batching import generate_in_length_order
from composer_replication.chat_format import end_of_turn_id

__all__ = ["greedy_texts", "reward_stats", "next_action_stats"]


@torch.inference_mode()
def greedy_texts(model: torch.nn.Module, tokenizer: Any, prompts: Sequence[Any], *, max_new_tokens: int,
                 batch_size: int = 64) -> list[str]:
    """Greedy-decoded response text for each prompt (``rollout.Prompt`` or message list), cut at end-of-turn.

    Prompts are decoded ``batch_size`` at a time, grouped by length (less padding), through
    :func:`composer_replication.batching.generate_in_length_order` (the one generate helper); the texts
    come back in the order of ``prompts``.
    """
    from composer_replication.rollout import Prompt

    messages = [p.messages if isinstance(p, Prompt) else p for p in prompts]
    eot = end_of_turn_id(tokenizer)
    responses = generate_in_length_order(model, tokenizer, messages, max_new_tokens=max_new_tokens,
                                         batch_size=batch_size)
    return [tokenizer.decode(r[:-1] if r and r[-1] == eot else r, skip_special_tokens=True) for r in responses]


def next_action_stats(prompts: Sequence[Any], texts: Sequence[str], scores: Sequence[Any],
                      prefix: str = "eval/") -> dict[str, float]:
    """Agreement and call-format rates of answers to next-action prompts (see the module docstring).

    ``prompts[i]`` was answered with ``texts[i]`` and scored ``scores[i]`` by a next-action environment
    (its ``details`` hold ``format``, ``json`` and ``agreement``). Prompts scored otherwise (a Python task)
    are left out. The keys are always there, so every evaluation of a run has the same ones: NaN when no
    answer was scored by a next-action environment (``well_formed_call_rate``: when no recorded action
    calls a tool).
    """
    rows = [(p, t, s) for p, t, s in zip(prompts, texts, scores, strict=True)
            if "agreement" in (getattr(s, "details", None) or {})]
    if not rows:
        keys = ("agreement", "agreement_partial", "tool_choice_rate", "well_formed_call_rate")
        return {f"{prefix}{k}": float("nan") for k in keys}
    agreement = [float(s.details["agreement"]) for _, _, s in rows]
    same_tools, well_formed = [], []
    for prompt, text, score in rows:
        ref_names = [b.name for b in parse_action(prompt.reference or "") if b.kind == "tool_use"]
        names = [b.name for b in parse_action(text) if b.kind == "tool_use"]
        same_tools.append(float(names == ref_names))
        if ref_names:
            well_formed.append(float(score.details["format"] and score.details["json"]))
    n = len(rows)
    return {
        f"{prefix}agreement": sum(a == 1.0 for a in agreement) / n,
        f"{prefix}agreement_partial": sum(agreement) / n,
        f"{prefix}tool_choice_rate": sum(same_tools) / n,
        f"{prefix}well_formed_call_rate": sum(well_formed) / len(well_formed) if well_formed else float("nan"),
    }


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

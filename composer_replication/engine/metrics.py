"""The one metrics scheme (``docs/recipes.md``): ``reward/*`` and ``eval/*`` (:func:`reward_stats`,
:func:`next_action_stats`), ``loss/*`` (each channel under the name of its loss, folded over micro-batches) and
``perf/*`` (tokens, seconds per phase).

A run's evaluation (``StudentTrainerCore.evaluate``) scores one greedy answer per held-out prompt with the
environment that offers it; for held-out sessions the reference is the recorded action, and
:func:`next_action_stats` reads the environment's own score components (``rollout.next_action``):

- ``eval/agreement``: full agreement (the same tool calls with equal arguments, in order; for text, the same words);
- ``eval/agreement_partial``: the mean agreement component (partial credit per call);
- ``eval/tool_choice_rate``: the same tools, in the same order, as the recorded action;
- ``eval/well_formed_call_rate``: where the recorded action calls a tool, the answer makes at least one call and
  every call names an offered tool with a JSON-object argument;
- ``eval/mean`` / ``eval/std`` / ``eval/error_rate`` / ``eval/num_scored``: :func:`reward_stats`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from composer_replication.actions import parse_action
from composer_replication.losses.components import DISTILL_COMPONENTS, REPLAY_COMPONENTS

__all__ = []

_CHANNEL_OF = {"grpo": 0, "lm_ce": 0, **{c.name: 1 for c in DISTILL_COMPONENTS.values()},
               **{c.name: 2 for c in REPLAY_COMPONENTS.values()}}


def next_action_stats(prompts: Sequence[Any], texts: Sequence[str], scores: Sequence[Any],
                      prefix: str = "eval/") -> dict[str, float]:
    """Agreement and call-format rates of answers to next-action prompts (see the module docstring).

    ``prompts[i]`` was answered ``texts[i]``, scored ``scores[i]`` (``details``: ``format``, ``json``, ``agreement``);
    answers scored otherwise (a Python task) are left out. The keys are always there: NaN when no answer was scored
    by a next-action environment (``well_formed_call_rate``: when no recorded action calls a tool).
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
    return {f"{prefix}agreement": sum(a == 1.0 for a in agreement) / n, f"{prefix}agreement_partial": sum(agreement) / n,
            f"{prefix}tool_choice_rate": sum(same_tools) / n,
            f"{prefix}well_formed_call_rate": sum(well_formed) / len(well_formed) if well_formed else float("nan")}


def reward_stats(scores: Sequence[Any], prefix: str = "reward/") -> dict[str, float]:
    """``{prefix}mean``, ``{prefix}std`` (population), ``{prefix}error_rate``, ``{prefix}num_scored``: the one
    definition of reward statistics (``reward/`` in training rows, ``eval/`` in evaluation rows; NaN when empty)."""
    n = len(scores)
    if n == 0:
        nan = float("nan")
        return {f"{prefix}mean": nan, f"{prefix}std": nan, f"{prefix}error_rate": nan, f"{prefix}num_scored": 0.0}
    rewards = torch.tensor([float(s.reward) for s in scores], dtype=torch.float64)
    errors = sum(1 for s in scores if getattr(s, "error_kind", None))
    return {f"{prefix}mean": float(rewards.mean()), f"{prefix}std": float(rewards.std(unbiased=False)),
            f"{prefix}error_rate": errors / n, f"{prefix}num_scored": float(n)}


def loss_metrics(comps: Any, loss: Any) -> dict[str, float]:
    """The ``loss/*`` metrics of one ``LossComponents``: ``comps.metrics()`` (``loss/total``, every channel that
    ran under the name of its loss, each component's own metrics as ``loss/<channel>/<metric>``), plus 0 under
    the configured name of a channel 2 or 3 that did not run this step (no error sites, no pairs), so that
    every step reports the same channels.
    """
    out = comps.metrics()
    for name in (DISTILL_COMPONENTS[loss.sdpo_wrapper].name, REPLAY_COMPONENTS[loss.dpo_variant].name):
        out.setdefault(f"loss/{name}", 0.0)
    return out


def combine_loss_metrics(parts: list[tuple[dict[str, float], list[float], float]]) -> dict[str, float]:
    """Fold the ``loss/*`` metrics of micro-batches (``parts``: ``(loss_metrics, [w1, w2, w3], weighted total)``
    each): each channel's values weighted by its share, counts (``num_*``) summed."""
    out: dict[str, float] = {"loss/total": sum(total for _, _, total in parts)}
    for metrics, w, _ in parts:
        for key, value in metrics.items():
            if key == "loss/total":
                continue
            name = key.split("/")[1]
            weight = 1.0 if key.rsplit("/", 1)[-1].startswith("num_") else w[_CHANNEL_OF.get(name, 0)]
            out[key] = out.get(key, 0.0) + weight * value
    return out


def count_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Real tokens of every sequence a step puts through the model: student, hinted teacher and pair rows."""
    total = 0
    for key in ("attention_mask", "ctx_teacher_attention_mask", "dpo_chosen_attention_mask",
                "dpo_rejected_attention_mask"):
        if key in batch:
            total += int(batch[key].sum())
        elif key == "attention_mask" and "input_ids" in batch:
            total += batch["input_ids"].numel()
    return total


class PhaseTimer:
    """Adds up the seconds spent in named phases (``with timer.phase("generate"): ...``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block and add it to ``name``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to phase ``name``."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def metrics(self) -> dict[str, float]:
        """``perf/<phase>_s`` for every phase timed."""
        return {f"perf/{name}_s": value for name, value in self.seconds.items()}

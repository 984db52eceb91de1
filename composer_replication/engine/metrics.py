"""The ``loss/*`` metrics of a step: each channel under the name of its loss, folded over micro-batches.

Part of the one metrics scheme (``docs/recipes.md``); ``perf/*`` token counts are here too.
"""

from __future__ import annotations

from typing import Any

import torch

from composer_replication.losses import DISTILL_COMPONENTS, REPLAY_COMPONENTS

__all__ = ["loss_metrics", "combine_loss_metrics", "count_tokens"]

_CHANNEL_OF = {"grpo": 0, "lm_ce": 0, **{c.name: 1 for c in DISTILL_COMPONENTS.values()},
               **{c.name: 2 for c in REPLAY_COMPONENTS.values()}}


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
    """Fold the ``loss/*`` metrics of micro-batches: each channel's values weighted by its share (counts summed).

    ``parts``: ``(loss_metrics, [w1, w2, w3], weighted total)`` per micro-batch.
    """
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

"""The learning-rate schedule of the inner optimizer (warm-up, then constant, linear or cosine decay)."""

from __future__ import annotations

import math

__all__ = ["build_lr_lambda"]


def build_lr_lambda(*, warmup_steps: int, num_steps: int, scheduler: str):
    """The LR multiplier ``f(s)`` for ``LambdaLR`` (``s`` = optimizer steps taken so far).

    Linear warm-up ``(s + 1) / (warmup_steps + 1)`` for ``s < warmup_steps``, then ``constant`` 1,
    ``linear`` decay to 0 at ``num_steps``, or ``cosine`` decay to 0 at ``num_steps``.
    """

    def lr_lambda(s: int) -> float:
        if s < warmup_steps:
            return (s + 1) / (warmup_steps + 1)
        if scheduler == "constant":
            return 1.0
        progress = min(1.0, (s - warmup_steps) / max(1, num_steps - warmup_steps))
        if scheduler == "linear":
            return max(0.0, 1.0 - progress)
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return lr_lambda

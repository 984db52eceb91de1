"""The ``Reducer`` actor: averages tensors and metrics across trainer replicas.

Two plain functions (:func:`mean_tensors`, :func:`mean_metrics`, unit-tested without Monarch) that the actor wraps.
Every step's and evaluation's per-replica metrics are folded here, DiLoCo's sync keys included; DiLoCo's
pseudo-gradients are averaged by torchft's allreduce between the replicas themselves (no hop through this actor).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from monarch.actor import Actor, current_rank

from meshes.supervision import rank_endpoint

endpoint = rank_endpoint("reducer")  # errors name "reducer rank <r>"

__all__ = ["Reducer", "mean_tensors", "mean_metrics"]


def mean_tensors(replicas: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Elementwise mean of ``{name: tensor}`` dicts, one per replica (float64 accumulation, input dtype out).

    Raises:
        ValueError: no replicas, or replicas with different names or shapes.
    """
    import torch

    if not replicas:
        raise ValueError("mean_tensors needs at least one replica's tensors, got none")
    names = list(replicas[0])
    for i, rep in enumerate(replicas[1:], start=1):
        if list(rep) != names:
            raise ValueError(f"replica {i} sends names {sorted(rep)[:5]}..., replica 0 sends {sorted(names)[:5]}...")
    out: dict[str, Any] = {}
    for name in names:
        shapes = {tuple(rep[name].shape) for rep in replicas}
        if len(shapes) != 1:
            raise ValueError(f"tensor {name!r} has different shapes across replicas: {sorted(shapes)}")
        acc = torch.zeros(replicas[0][name].shape, dtype=torch.float64)
        for rep in replicas:
            acc += rep[name].detach().to("cpu", torch.float64)
        out[name] = (acc / len(replicas)).to(replicas[0][name].dtype)
    return out


def mean_metrics(replicas: Sequence[dict[str, float]]) -> dict[str, float]:
    """Per-key mean of metric dicts over replicas, ignoring NaN values; counts and throughputs are summed.

    Summed: ``*/num_*`` counts, ``rollout/errors/*``, ``replay/truncated``, ``replay/skipped/*``,
    ``perf/tokens`` and ``perf/tokens_per_s`` (the replicas run in parallel), ``hints/*``, ``rollout/end/*``. A key
    missing or NaN on every replica gives NaN. ``episodes`` (agentic episode records) are concatenated, in replica
    order. DiLoCo's sync keys (``diloco/outer_step``, ``participants``, ``committed``, ``fragment``) are the largest
    among the replicas that synced this step (``diloco/synced``), and left out when none did.
    """
    keys: list[str] = []
    for rep in replicas:
        keys.extend(k for k in rep if k not in keys)
    out: dict[str, Any] = {}
    if "episodes" in keys:
        keys.remove("episodes")
        out["episodes"] = [e for rep in replicas for e in rep.get("episodes", [])]
    synced = [rep for rep in replicas if rep.get("diloco/synced")]
    out.update({k: max(v) for k in keys if k in _SYNC_KEYS and (v := [float(r[k]) for r in synced if k in r])})
    keys = [k for k in keys if k not in _SYNC_KEYS]
    for key in keys:
        vals = [float(rep[key]) for rep in replicas if key in rep and not math.isnan(float(rep[key]))]
        out[key] = (float(sum(vals)) if _is_summed(key) else sum(vals) / len(vals)) if vals else float("nan")
    return out


_SYNC_KEYS = ("diloco/outer_step", "diloco/participants", "diloco/committed", "diloco/fragment")


def _is_summed(key: str) -> bool:
    """Counts and throughputs add up across replicas; everything else is averaged."""
    leaf = key.rsplit("/", 1)[-1]
    return (leaf.startswith("num_") or key.startswith(("rollout/errors/", "replay/skipped/", "hints/", "rollout/end/"))
            or key in ("replay/truncated", "perf/tokens", "perf/tokens_per_s"))


class Reducer(Actor):
    """Averages what the trainer replicas send (one instance; stateless apart from a call counter)."""

    def __init__(self) -> None:
        self.rank = int(current_rank().rank)
        self.calls = 0

    @endpoint
    def average(self, replicas: list[dict[str, Any]]) -> dict[str, Any]:
        """:func:`mean_tensors` over the replicas' ``{name: tensor}`` dicts."""
        self.calls += 1
        return mean_tensors(replicas)

    @endpoint
    def aggregate_metrics(self, replicas: list[dict[str, float]]) -> dict[str, float]:
        """:func:`mean_metrics` over the replicas' step metrics."""
        self.calls += 1
        return mean_metrics(replicas)

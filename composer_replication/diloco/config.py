"""DiLoCo configuration: how many replicas train one model, how often they sync, and what a failure costs.

One ``@dataclass(kw_only=True)`` tree, checked in ``__post_init__`` (every error names the ``diloco.*`` key
and the fix), so a recipe rejects a bad setting before it spawns anything. ``replicas: 1`` means plain
training (no manager, no lighthouse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["DilocoConfig"]


@dataclass(kw_only=True)
class DilocoConfig:
    """DiLoCo across trainer replicas (torchft ``Manager`` + lighthouse; Douillard et al., arXiv 2311.08105)."""

    replicas: int = 1
    """Replicas that train one model (one process each); 1 = plain training, no DiLoCo."""
    sync_every: int = 8
    """Inner (AdamW) steps per outer round; with fragments, one fragment syncs every ``sync_every/fragments``."""
    fragments: int = 1
    """Streaming DiLoCo (arXiv 2501.18512): the model's parameters split into this many fragments that sync in turn."""
    fragment_sync_delay: int = 0
    """Steps by which a fragment's allreduce starts early (must be < ``sync_every/fragments``)."""
    fragment_update_alpha: float = 0.0
    """After a sync: ``theta = global + alpha * (local - global)`` (0 takes the global weights)."""
    outer_lr: float = 0.7
    """Outer SGD learning rate (DiLoCo: 0.7)."""
    outer_momentum: float = 0.9
    """Outer SGD momentum (DiLoCo: 0.9)."""
    nesterov: bool = True
    """Nesterov momentum on the outer SGD."""
    min_replicas: int = 1
    """Fewest replicas an outer step commits with; the run stops (exit 1) when fewer are alive and none can come back."""
    quorum_timeout_s: float = 60.0
    """How long a replica waits for a quorum (must exceed one round, so a joining replica can catch up)."""
    heartbeat_timeout_ms: int = 2000
    """A replica that has not heartbeated to the lighthouse for this long is left out of the next quorum."""
    pg_timeout_s: float = 10.0
    """Timeout of one gloo allreduce between replicas (bounds a hang on a dead peer)."""
    max_restarts: int = 2
    """Restarts allowed per replica (a death, an error, a lost host); one more stops the run with exit 1."""
    on_host_loss: Literal["replace", "shrink", "stop"] = "replace"
    """A worker (host) that stops answering: ``replace`` the replica on a spare worker (``mesh.spare_workers``, a
    new address each), ``shrink`` (go on with fewer replicas), or ``stop`` (exit 1 naming the host)."""

    def __post_init__(self) -> None:
        for key in ("replicas", "sync_every", "fragments", "min_replicas"):
            if getattr(self, key) < 1:
                raise ValueError(f"'diloco.{key}' must be >= 1, got {getattr(self, key)!r}")
        if self.max_restarts < 0:
            raise ValueError(f"'diloco.max_restarts' must be >= 0, got {self.max_restarts!r}")
        if self.min_replicas > self.replicas:
            raise ValueError(
                f"'diloco.min_replicas' ({self.min_replicas}) cannot exceed 'diloco.replicas' ({self.replicas}); "
                "lower min_replicas or add replicas"
            )
        if self.sync_every % self.fragments:
            raise ValueError(
                f"'diloco.sync_every' ({self.sync_every}) must be a multiple of 'diloco.fragments' "
                f"({self.fragments}): one fragment syncs every sync_every/fragments steps"
            )
        if not 0 <= self.fragment_sync_delay < self.sync_every // self.fragments:
            raise ValueError(
                f"'diloco.fragment_sync_delay' must be in [0, sync_every/fragments = "
                f"{self.sync_every // self.fragments}), got {self.fragment_sync_delay!r}; lower it or raise sync_every"
            )
        if not 0.0 <= self.fragment_update_alpha <= 1.0:
            raise ValueError(
                f"'diloco.fragment_update_alpha' must be in [0, 1], got {self.fragment_update_alpha!r}"
            )
        if not self.outer_lr > 0:
            raise ValueError(f"'diloco.outer_lr' must be > 0 (DiLoCo uses 0.7), got {self.outer_lr!r}")
        if not 0.0 <= self.outer_momentum < 1.0:
            raise ValueError(f"'diloco.outer_momentum' must be in [0, 1), got {self.outer_momentum!r}")
        if self.nesterov and self.outer_momentum == 0.0:
            raise ValueError(
                "'diloco.nesterov' needs 'diloco.outer_momentum' > 0; set nesterov: false or momentum 0.9"
            )
        for key in ("quorum_timeout_s", "pg_timeout_s"):
            if not getattr(self, key) > 0:
                raise ValueError(f"'diloco.{key}' must be > 0 seconds, got {getattr(self, key)!r}")
        if self.heartbeat_timeout_ms < 100:
            raise ValueError(
                f"'diloco.heartbeat_timeout_ms' must be >= 100, got {self.heartbeat_timeout_ms!r}"
            )
        if self.heartbeat_timeout_ms >= self.quorum_timeout_s * 1000:
            raise ValueError(
                f"'diloco.heartbeat_timeout_ms' ({self.heartbeat_timeout_ms}) must be below 'diloco.quorum_timeout_s' "
                f"({self.quorum_timeout_s} s): a dead replica must drop out of a quorum before the quorum times out"
            )

    @property
    def enabled(self) -> bool:
        """Whether DiLoCo runs at all (``replicas > 1``)."""
        return self.replicas > 1

    @property
    def period(self) -> int:
        """Inner steps between two fragment syncs (``sync_every // fragments``)."""
        return self.sync_every // self.fragments

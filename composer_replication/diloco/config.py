"""DiLoCo configuration: how many replicas train one model, how often they sync, and what a failure costs.

One ``@dataclass(kw_only=True)`` tree, checked in ``__post_init__`` (every error names the ``diloco.*`` key
and the fix), so a recipe rejects a bad setting before it spawns anything. ``replicas: 1`` means plain
training (no manager, no lighthouse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from composer_replication.losses.config import check_ranges, shown

__all__ = ["DilocoConfig"]

_RANGES = {  # beyond these a value is a typo, refused before anything is spawned
    "replicas": "[1, 1024]", "sync_every": "[1, 1e6]", "fragments": "[1, 1024]", "fragment_sync_delay": "[0, 1e6]",
    "fragment_update_alpha": "[0, 1]", "outer_lr": "[1e-9, 100]", "outer_momentum": "[0, 1)",
    "min_replicas": "[1, 1024]", "quorum_timeout_s": "[0.1, 86400]", "heartbeat_timeout_ms": "[100, 86400000]",
    "pg_timeout_s": "[0.1, 86400]", "max_restarts": "[0, 1000]", "max_nonfinite_rounds": "[0, 1000]",
}


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
    max_nonfinite_rounds: int = 2
    """Consecutive syncs a replica may send a non-finite pseudo-gradient (each is left out of the mean); one more
    raises ``NonFiniteReplicaError``, and the replica is restarted from the survivors' state."""
    on_host_loss: Literal["replace", "shrink", "stop"] = "replace"
    """A worker (host) that stops answering: ``replace`` the replica on a spare worker (``mesh.spare_workers``, a
    new address each), ``shrink`` (go on with fewer replicas), or ``stop`` (exit 1 naming the host)."""

    def __post_init__(self) -> None:
        check_ranges(self, "diloco", _RANGES)
        d, period = self, self.sync_every // self.fragments
        checks = [
            (d.min_replicas <= d.replicas, f"'diloco.min_replicas' ({d.min_replicas}) cannot exceed 'diloco.replicas' "
             f"({d.replicas}); lower min_replicas or add replicas"),
            (d.sync_every % d.fragments == 0, f"'diloco.sync_every' ({d.sync_every}) must be a multiple of "
             f"'diloco.fragments' ({d.fragments}): one fragment syncs every sync_every/fragments steps"),
            (d.fragment_sync_delay < period, f"'diloco.fragment_sync_delay' must be in [0, sync_every/fragments = "
             f"{period}), got {d.fragment_sync_delay!r}; lower it or raise sync_every"),
            (not d.nesterov or d.outer_momentum > 0, "'diloco.nesterov' needs 'diloco.outer_momentum' > 0; set "
             "nesterov: false or momentum 0.9"),
            (d.heartbeat_timeout_ms < d.quorum_timeout_s * 1000, f"'diloco.heartbeat_timeout_ms' "
             f"({d.heartbeat_timeout_ms}) must be below 'diloco.quorum_timeout_s' ({d.quorum_timeout_s} s): a dead "
             "replica must drop out of a quorum before the quorum times out"),
            (d.on_host_loss in ("replace", "shrink", "stop"), f"'diloco.on_host_loss' must be replace, shrink or "
             f"stop, got {shown(d.on_host_loss)}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def enabled(self) -> bool:
        """Whether DiLoCo runs at all (``replicas > 1``)."""
        return self.replicas > 1

    @property
    def period(self) -> int:
        """Inner steps between two fragment syncs (``sync_every // fragments``)."""
        return self.sync_every // self.fragments

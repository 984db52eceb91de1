"""The spec's import path for the pluggable distillation and preference losses: re-exports of
:mod:`composer_replication.losses` (:mod:`~composer_replication.losses.simpo`,
:mod:`~composer_replication.losses.taid`, :mod:`~composer_replication.losses.entropy_aware_opd`).
"""

from composer_replication.losses.entropy_aware_opd import (
    entropy_aware_opd_loss,
    entropy_aware_opd_per_token,
    teacher_entropy,
)
from composer_replication.losses.simpo import avg_sequence_logprob, simpo_loss
from composer_replication.losses.taid import TAIDScheduler, taid_loss, taid_per_token

__all__ = [
    "simpo_loss",
    "avg_sequence_logprob",
    "taid_loss",
    "taid_per_token",
    "TAIDScheduler",
    "teacher_entropy",
    "entropy_aware_opd_loss",
    "entropy_aware_opd_per_token",
]

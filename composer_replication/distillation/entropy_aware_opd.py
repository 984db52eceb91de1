"""The spec's import path ``composer_replication.distillation.entropy_aware_opd``: a re-export of
:mod:`composer_replication.losses.entropy_aware_opd`."""

from composer_replication.losses.entropy_aware_opd import (
    entropy_aware_opd_loss,
    entropy_aware_opd_per_token,
    teacher_entropy,
)

__all__ = ["teacher_entropy", "entropy_aware_opd_loss", "entropy_aware_opd_per_token"]

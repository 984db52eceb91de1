"""The spec's import path ``composer_replication.distillation.simpo``: a re-export of :mod:`composer_replication.losses.simpo`."""

from composer_replication.losses.simpo import avg_sequence_logprob, simpo_loss

__all__ = ["simpo_loss", "avg_sequence_logprob"]

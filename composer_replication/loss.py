"""The spec's import path for the three-channel loss: a re-export of :mod:`composer_replication.losses`."""

from composer_replication.losses.compose import LossComponents, compose_loss, self_distillation_loss
from composer_replication.losses.config import LossConfig
from composer_replication.losses.sequences import sequence_logprobs_for, token_logprobs_for

__all__ = [
    "LossComponents",
    "LossConfig",
    "compose_loss",
    "self_distillation_loss",
    "token_logprobs_for",
    "sequence_logprobs_for",
]

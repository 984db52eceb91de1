"""The loss library: the three-channel ``compose_loss`` and the losses it calls (modules: ``docs/losses.md``).

Here: what a user calls; the components, per-token forms and kernels are imported from their modules.
"""

from composer_replication.losses.compose import LossComponents, compose_loss, self_distillation_loss
from composer_replication.losses.config import GRPOLossConfig, LossConfig
from composer_replication.losses.dpo import dpo_loss
from composer_replication.losses.entropy_aware_opd import entropy_aware_opd_loss, teacher_entropy
from composer_replication.losses.grpo import group_advantages, grpo_loss
from composer_replication.losses.jsd import generalized_jsd_loss
from composer_replication.losses.sequences import sequence_logprobs_for, token_logprobs_for
from composer_replication.losses.simpo import avg_sequence_logprob, simpo_loss
from composer_replication.losses.taid import TAIDScheduler, taid_loss

__all__ = ["LossConfig", "GRPOLossConfig", "LossComponents", "compose_loss", "self_distillation_loss",
           "token_logprobs_for", "sequence_logprobs_for", "group_advantages", "grpo_loss", "dpo_loss", "simpo_loss",
           "avg_sequence_logprob", "generalized_jsd_loss", "taid_loss", "TAIDScheduler", "entropy_aware_opd_loss",
           "teacher_entropy"]

"""Import path of the GRPO loss: a re-export of :mod:`composer_replication.losses.grpo`."""

from composer_replication.losses.grpo import GRPOLossConfig, group_advantages, grpo_loss

__all__ = ["GRPOLossConfig", "group_advantages", "grpo_loss"]

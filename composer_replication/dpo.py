"""Import path of the DPO loss: a re-export of :mod:`composer_replication.losses.dpo`."""

from composer_replication.losses.dpo import dpo_loss, per_token_logprobs, sequence_logprobs

__all__ = ["per_token_logprobs", "sequence_logprobs", "dpo_loss"]

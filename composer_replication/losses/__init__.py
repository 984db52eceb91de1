"""The loss library: the three-channel ``compose_loss``, its components, and the losses they call.

- :mod:`.config`: ``LossConfig`` (every channel's options) and ``GRPOLossConfig`` (its GRPO part).
- :mod:`.compose`: ``compose_loss`` -> ``LossComponents``; ``self_distillation_loss`` (channel 2 alone).
- :mod:`.components`: one component per loss, each reporting under its name: ``grpo`` / ``lm_ce``
  (channel 1), ``jsd`` / ``taid`` / ``entropy_opd`` (channel 2), ``dpo`` / ``simpo`` (channel 3).
- Losses, tensors in and tensors out: :mod:`.grpo` (GRPO, group advantages), :mod:`.dpo` (DPO, per-token
  and sequence log-probs), :mod:`.simpo`, :mod:`.jsd` (generalized JSD), :mod:`.taid` (+ ``TAIDScheduler``),
  :mod:`.entropy_aware_opd`.
- Kernels: :mod:`.logprobs` (chunked log-prob, cross-entropy and distillation over final hidden states,
  on the chunking base :mod:`.chunked`), :mod:`.sequences` (one decoder pass; ``token_logprobs_for``,
  ``sequence_logprobs_for``).

The spec's import paths (``composer_replication.loss``, ``.opsd``, ``.distillation``, ``.grpo``, ``.dpo``,
``.logprobs``) re-export these names. See ``docs/losses.md``.
"""

from composer_replication.losses.components import (
    DISTILL_COMPONENTS,
    DPO,
    GRPO,
    JSD,
    REPLAY_COMPONENTS,
    TAID,
    EntropyOPD,
    LMCrossEntropy,
    LossComponent,
    LossContext,
    SimPO,
    policy_component,
)
from composer_replication.losses.compose import (
    LossComponents,
    compose_loss,
    resolve_loss_config,
    self_distillation_loss,
)
from composer_replication.losses.config import GRPOLossConfig, LossConfig
from composer_replication.losses.dpo import dpo_loss, per_token_logprobs, sequence_logprobs
from composer_replication.losses.entropy_aware_opd import (
    entropy_aware_opd_loss,
    entropy_aware_opd_per_token,
    teacher_entropy,
)
from composer_replication.losses.grpo import group_advantages, grpo_loss
from composer_replication.losses.jsd import generalized_jsd_loss, generalized_jsd_per_token
from composer_replication.losses.logprobs import (
    DEFAULT_CHUNK_SIZE,
    chunked_cross_entropy,
    chunked_distillation,
    chunked_distillation_loss,
    chunked_row_logprobs,
    chunked_token_logprobs,
    decoder_of,
    hidden_states,
    output_head,
    predicted_positions,
)
from composer_replication.losses.sequences import sequence_logprobs_for, token_logprobs_for
from composer_replication.losses.simpo import avg_sequence_logprob, simpo_loss
from composer_replication.losses.taid import TAIDScheduler, taid_loss, taid_per_token

__all__ = [
    # compose
    "LossConfig",
    "GRPOLossConfig",
    "LossComponents",
    "compose_loss",
    "self_distillation_loss",
    "resolve_loss_config",
    # components
    "LossComponent",
    "LossContext",
    "GRPO",
    "LMCrossEntropy",
    "JSD",
    "TAID",
    "EntropyOPD",
    "DPO",
    "SimPO",
    "policy_component",
    "DISTILL_COMPONENTS",
    "REPLAY_COMPONENTS",
    # losses
    "group_advantages",
    "grpo_loss",
    "dpo_loss",
    "per_token_logprobs",
    "sequence_logprobs",
    "simpo_loss",
    "avg_sequence_logprob",
    "generalized_jsd_loss",
    "generalized_jsd_per_token",
    "taid_loss",
    "taid_per_token",
    "TAIDScheduler",
    "teacher_entropy",
    "entropy_aware_opd_loss",
    "entropy_aware_opd_per_token",
    # kernels
    "DEFAULT_CHUNK_SIZE",
    "hidden_states",
    "decoder_of",
    "output_head",
    "predicted_positions",
    "chunked_token_logprobs",
    "chunked_row_logprobs",
    "chunked_cross_entropy",
    "chunked_distillation",
    "chunked_distillation_loss",
    "token_logprobs_for",
    "sequence_logprobs_for",
]

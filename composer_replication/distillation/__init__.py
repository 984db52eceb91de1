"""Pluggable distillation and preference losses (pure PyTorch, tensors in, tensors out).

- :mod:`.simpo`: SimPO (arXiv 2405.14734), reference-free length-normalized preference loss.
- :mod:`.taid`: TAID (arXiv 2501.16937), interpolated-target distillation and its adaptive ``t`` schedule.
- :mod:`.entropy_aware_opd`: entropy-gated forward/reverse KL distillation (arXiv 2603.07079).

The generalized JSD lives in :mod:`composer_replication.opsd`. Each distillation loss has a
``*_per_token`` form on flattened ``[N, V]`` rows for the chunked kernels of ``composer_replication.logprobs``.
"""

from composer_replication.distillation.entropy_aware_opd import (
    entropy_aware_opd_loss,
    entropy_aware_opd_per_token,
    teacher_entropy,
)
from composer_replication.distillation.simpo import avg_sequence_logprob, simpo_loss
from composer_replication.distillation.taid import TAIDScheduler, taid_loss, taid_per_token

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

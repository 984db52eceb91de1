"""Entropy-aware on-policy distillation: forward KL where the teacher is uncertain, reverse KL elsewhere.

Paper: Jin et al., "Entropy-Aware On-Policy Distillation of Language Models" (arXiv 2603.07079, ICML 2026).
The paper augments reverse KL with forward KL on high-teacher-entropy tokens; its exact gate is not public,
so this is the spec's smooth gate (no gradient through ``w``), on ``softmax(z / temperature)``::

    w_t = clamp(H(pi_T(. | s_t)) / h_max, 0, 1)               # nats; h_max = log V by default
    l_t = w_t * KL(pi_T || pi_S) + (1 - w_t) * KL(pi_S || pi_T)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from composer_replication.losses import jsd

__all__ = ["teacher_entropy", "entropy_aware_opd_loss"]


def teacher_entropy(teacher_logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of ``softmax(teacher_logits)``: ``[..., V] -> [...]``."""
    jsd._require(isinstance(teacher_logits, torch.Tensor) and teacher_logits.dim() >= 1 and teacher_logits.is_floating_point(),
                 f"teacher_logits must be a floating tensor [..., V], got {getattr(teacher_logits, 'shape', None)}")
    logp = F.log_softmax(jsd._upcast(teacher_logits), dim=-1)
    return -jsd._kl_rows(logp, torch.zeros_like(logp))


def entropy_aware_opd_per_token(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    h_max: float | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token ``w * KL(T || S) + (1 - w) * KL(S || T)``: ``[N, V]`` (any ``[..., V]``) -> ``[N]``; ``h_max``:
    the entropy normaliser in nats (``> 0``; ``None`` = ``log V``); ``temperature > 0`` tempers both (and the
    entropy). The teacher is not detached here."""
    jsd._check_logit_pair(student_logits, teacher_logits)
    jsd._check_temperature(temperature)
    if h_max is None:
        jsd._require(student_logits.shape[-1] >= 2, "h_max=None means log(V), which is 0 for V=1; pass h_max > 0 explicitly")
        h_max = math.log(student_logits.shape[-1])
    jsd._require(jsd._number(h_max) and h_max > 0 and math.isfinite(h_max),
                 f"h_max must be None (log V) or a finite number > 0, got {h_max!r}")
    s_logp = F.log_softmax(jsd._upcast(student_logits) / temperature, dim=-1)
    t_logp = F.log_softmax(jsd._upcast(teacher_logits) / temperature, dim=-1)
    with torch.no_grad():
        w = (-jsd._kl_rows(t_logp, torch.zeros_like(t_logp)) / h_max).clamp(0.0, 1.0)  # H(T) / h_max
    return w * jsd._kl_rows(t_logp, s_logp) + (1.0 - w) * jsd._kl_rows(s_logp, t_logp)


def entropy_aware_opd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    h_max: float | None = None,
    temperature: float = 1.0,
    reduction: str = "batchmean",
) -> torch.Tensor:
    """Entropy-gated forward/reverse KL (arXiv 2603.07079) over ``[B, T, V]``, reduced as
    :func:`~composer_replication.losses.jsd.generalized_jsd_loss` (V' = V); ``labels``: a 0/1 (or bool) token
    mask ``[B, T]`` (a ``-100`` label tensor raises). Returns a scalar, or ``[B, T]`` for ``"none"``."""
    jsd._check_reduction(reduction)
    jsd._check_logit_pair(student_logits, teacher_logits)
    mask = jsd._mask_from(labels, student_logits, binary=True)
    per_token = entropy_aware_opd_per_token(student_logits, teacher_logits, h_max=h_max, temperature=temperature)
    return jsd._reduce_per_token(per_token, mask, reduction, student_logits.shape[-1])

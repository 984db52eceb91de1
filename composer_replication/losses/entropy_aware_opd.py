"""Entropy-aware on-policy distillation: forward KL where the teacher is uncertain, reverse KL elsewhere.

Paper: Jin et al., "Entropy-Aware On-Policy Distillation of Language Models" (arXiv 2603.07079,
ICML 2026). The paper augments reverse KL with forward KL on high-teacher-entropy tokens; its exact
gate is not public, so we use the spec's smooth gate:

    w_t  = clamp(H(pi_T(. | s_t)) / h_max, 0, 1)          # teacher entropy in nats; h_max = log V by default
    l_t  = w_t * KL(pi_T || pi_S) + (1 - w_t) * KL(pi_S || pi_T)

High-entropy tokens get mode-covering forward KL, confident tokens mode-seeking reverse KL. Both
distributions use ``softmax(z / temperature)``. The gate ``w`` is computed without gradient.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from composer_replication.losses.jsd import (
    REDUCTIONS,
    _check_logit_pair,
    _check_temperature,
    _kl_rows,
    _reduce_per_token,
    _upcast,
)

__all__ = ["teacher_entropy", "entropy_aware_opd_loss", "entropy_aware_opd_per_token"]


def teacher_entropy(teacher_logits: torch.Tensor) -> torch.Tensor:
    """Entropy in nats of ``softmax(teacher_logits)`` over the last dim: ``[..., V] -> [...]``.

    Raises:
        ValueError: not a floating tensor with at least one dim.

    Example:
        >>> teacher_entropy(torch.zeros(2, 3, 8))  # log(8) everywhere
    """
    if (
        not isinstance(teacher_logits, torch.Tensor)
        or teacher_logits.dim() < 1
        or not teacher_logits.is_floating_point()
    ):
        raise ValueError(
            f"teacher_logits must be a floating tensor [..., V], got {getattr(teacher_logits, 'shape', None)}"
        )
    logp = F.log_softmax(_upcast(teacher_logits), dim=-1)
    plogp = torch.where(torch.isneginf(logp), torch.zeros_like(logp), logp.exp() * logp)
    return -plogp.sum(-1)


def entropy_aware_opd_per_token(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    h_max: float | None = None,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token ``w * KL(T || S) + (1 - w) * KL(S || T)``, ``w = clamp(H(T) / h_max, 0, 1)`` (no grad).

    Args:
        student_logits: ``[N, V]`` (or ``[..., V]``) student logits, with grad.
        teacher_logits: ``[N, V]`` teacher logits (not detached here).
        h_max: entropy normaliser in nats, ``> 0``; ``None`` means ``log V`` (the maximum entropy).
        temperature: ``> 0``, applied to both logits (the entropy is the tempered teacher's).

    Returns:
        ``[N]`` (or ``[...]``).

    Raises:
        ValueError: shape mismatch, ``temperature <= 0``, ``h_max <= 0``, or ``V == 1`` with ``h_max=None``.
    """
    _check_logit_pair(student_logits, teacher_logits)
    _check_temperature(temperature)
    vocab = student_logits.shape[-1]
    if h_max is None:
        if vocab < 2:
            raise ValueError("h_max=None means log(V), which is 0 for V=1; pass h_max > 0 explicitly")
        h_max = math.log(vocab)
    elif not isinstance(h_max, (int, float)) or not (h_max > 0 and math.isfinite(h_max)):
        raise ValueError(f"h_max must be None (log V) or a finite number > 0, got {h_max!r}")
    s_logp = F.log_softmax(_upcast(student_logits) / temperature, dim=-1)
    t_logp = F.log_softmax(_upcast(teacher_logits) / temperature, dim=-1)
    with torch.no_grad():
        w = (_kl_rows(t_logp, torch.zeros_like(t_logp)).neg() / h_max).clamp(0.0, 1.0)  # H(T) / h_max
    return w * _kl_rows(t_logp, s_logp) + (1.0 - w) * _kl_rows(s_logp, t_logp)


def entropy_aware_opd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    labels: torch.Tensor | None = None,
    h_max: float | None = None,
    temperature: float = 1.0,
    reduction: str = "batchmean",
) -> torch.Tensor:
    """Entropy-gated forward/reverse KL distillation loss (arXiv 2603.07079), reduced like the JSD loss.

    Reductions (same rules as :func:`composer_replication.losses.jsd.generalized_jsd_loss`):
    ``"batchmean"`` = sum / #tokens with ``labels == 1`` (clamped at 1), or sum / B without labels;
    ``"sum"``; ``"mean"`` = sum / (#tokens * V); ``"none"`` = per-token ``[B, T]`` (masked positions 0).

    Args:
        student_logits: ``[B, T, V]`` student logits (with grad).
        teacher_logits: ``[B, T, V]`` teacher logits (no grad expected).
        labels: ``[B, T]`` 0/1 (or bool) token mask, or None for every token. Unlike the JSD loss this is
            *not* a ``-100`` label tensor: any other value raises.
        h_max, temperature: see :func:`entropy_aware_opd_per_token`.
        reduction: ``"batchmean"``, ``"sum"``, ``"mean"`` or ``"none"``.

    Returns:
        Scalar, or ``[B, T]`` for ``reduction="none"``.

    Raises:
        ValueError: shape mismatch (student vs teacher, labels vs tokens), labels not 0/1, unknown
            ``reduction``, out-of-range ``h_max`` / ``temperature``, ``"mean"`` over an empty mask.

    Example:
        >>> entropy_aware_opd_loss(torch.randn(2, 4, 16, requires_grad=True), torch.randn(2, 4, 16)).backward()
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    _check_logit_pair(student_logits, teacher_logits)
    mask = None
    if labels is not None:
        if not isinstance(labels, torch.Tensor) or labels.shape != student_logits.shape[:-1]:
            raise ValueError(
                f"labels must be a 0/1 mask of shape {tuple(student_logits.shape[:-1])}, got "
                f"{getattr(labels, 'shape', type(labels).__name__)}"
            )
        if labels.dtype != torch.bool and not bool(((labels == 0) | (labels == 1)).all()):
            raise ValueError(
                "labels must be a 0/1 (or bool) token mask for entropy_aware_opd_loss; got other values "
                "(a -100 label tensor? pass labels != -100 instead)"
            )
        mask = labels.bool()
    per_token = entropy_aware_opd_per_token(
        student_logits, teacher_logits, h_max=h_max, temperature=temperature
    )
    return _reduce_per_token(per_token, mask, reduction, student_logits.shape[-1], arg="labels")

"""Generalized Jensen-Shannon divergence for on-policy (self-)distillation.

Papers: GKD, Agarwal et al. (arXiv 2306.13649, Eq. 1); OPSD, Zhao et al. (arXiv 2601.18734), which adds
``top_k``, ``token_clip`` and ``logits_are_probs``. Convention of TRL's ``GKDTrainer.generalized_jsd_loss``
and Liger::

    S = log_softmax(z_s / tau),  T = log_softmax(z_t / tau)          # [N, V]
    M = log(beta * e^T + (1 - beta) * e^S)
    JSD_beta = beta * KL(T || M) + (1 - beta) * KL(S || M)              # summed over the vocabulary
    beta == 0 -> KL(T || S) (forward KL),  beta == 1 -> KL(S || T) (reverse KL), special-cased

Neither function detaches the teacher: pass teacher logits computed under ``torch.no_grad()``. The private
helpers here are shared by the other distillation losses.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["generalized_jsd_loss"]

REDUCTIONS = ("batchmean", "sum", "mean", "none")
_PROB_FLOOR = 1e-8  # OPSD: log(p.clamp_min(1e-8)) when the inputs are probabilities


def _require(ok: object, message: str) -> None:
    """``ValueError(message)`` unless ``ok``: the one form of the losses' argument checks."""
    if not ok:
        raise ValueError(message)


def _number(x: object) -> bool:
    """An int or float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_logit_pair(student: torch.Tensor, teacher: torch.Tensor) -> None:
    """``ValueError`` unless student and teacher are floating tensors of one shape ``[..., V]`` (``V >= 1``)."""
    _require(isinstance(student, torch.Tensor) and isinstance(teacher, torch.Tensor), "student_logits and "
             f"teacher_logits must be torch.Tensor, got {type(student).__name__} and {type(teacher).__name__}")
    _require(student.dim() >= 2 and student.shape[-1] >= 1, "student_logits must have shape [N, V] or [B, T, V] "
             f"(at least 2 dims, V >= 1), got {tuple(student.shape)}")
    _require(student.shape == teacher.shape, "student_logits and teacher_logits must have the same shape, got "
             f"{tuple(student.shape)} and {tuple(teacher.shape)}")
    _require(student.is_floating_point() and teacher.is_floating_point(), "student_logits and teacher_logits must "
             f"be floating point, got {student.dtype} and {teacher.dtype}")


def _check_temperature(temperature: float) -> None:
    _require(_number(temperature) and math.isfinite(temperature) and temperature > 0,
             f"temperature must be a finite number > 0, got {temperature!r}")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Half-precision inputs are computed in float32; float32/float64 are kept."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _kl_rows(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``sum_v p (log p - log q)``: ``[..., V] -> [...]``; ``p == 0`` entries give 0 (and finite gradients)."""
    return (logp.exp() * torch.where(torch.isneginf(logp), torch.zeros_like(logp), logp - logq)).sum(-1)


def _mask_from(labels: torch.Tensor | None, logits: torch.Tensor, *, binary: bool) -> torch.Tensor | None:
    """The bool token mask ``[B, T]`` of ``labels``: ``labels != -100`` (JSD) or a 0/1 mask (``binary``)."""
    if labels is None:
        return None
    _require(isinstance(labels, torch.Tensor) and labels.shape == logits.shape[:-1], f"labels must be "
             f"{'a 0/1 mask' if binary else 'a tensor'} of shape {tuple(logits.shape[:-1])} (the logits without the "
             f"vocab dim), got {tuple(getattr(labels, 'shape', ())) or type(labels).__name__}")
    if not binary:
        return labels != -100
    _require(labels.dtype == torch.bool or bool(((labels == 0) | (labels == 1)).all()), "labels must be a 0/1 (or "
             "bool) token mask; got other values (a -100 label tensor? pass labels != -100 instead)")
    return labels.bool()


def _check_reduction(reduction: str) -> None:
    _require(reduction in REDUCTIONS, f"reduction must be one of {REDUCTIONS}, got {reduction!r}")


def _reduce_per_token(per_token: torch.Tensor, mask: torch.Tensor | None, reduction: str, num_classes: int) -> torch.Tensor:
    """Mask and reduce ``[B, T]`` like TRL: batchmean = sum / #unmasked (clamped at 1; sum / B without a mask),
    sum, mean = sum / (#unmasked * ``num_classes``), none = ``[B, T]`` with masked positions 0."""
    if mask is not None:
        per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    if reduction == "none":
        return per_token
    if reduction == "sum":
        return per_token.sum()
    if reduction == "batchmean":
        return per_token.sum() / (mask.sum().clamp_min(1) if mask is not None else max(per_token.shape[0], 1))
    num_tokens = int(mask.sum()) if mask is not None else per_token.numel()
    _require(num_tokens, 'reduction="mean" is undefined when labels masks every token; pass a non-empty mask')
    return per_token.sum() / (num_tokens * num_classes)


def generalized_jsd_per_token(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    *,
    beta: float = 0.5,
    temperature: float = 1.0,
    logits_are_probs: bool = False,
    top_k: int | None = None,
    token_clip: float | None = None,
) -> torch.Tensor:
    """Per-token generalized JSD (module docstring) summed over the vocabulary: ``[N, V]`` (any ``[..., V]``) ->
    ``[N]`` (float32 for half precision). ``beta`` in ``[0, 1]``; ``temperature > 0`` divides both logits (1.0 with
    ``logits_are_probs``: the inputs are probabilities); ``top_k`` keeps the teacher's top-k entries, both
    renormalized; ``token_clip > 0`` clamps each token's summed divergence (OPSD clamps the pointwise terms).
    """
    _check_logit_pair(student_logits, teacher_logits)
    _require(_number(beta) and 0.0 <= beta <= 1.0,
             f"beta must be a number in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta!r}")
    _check_temperature(temperature)
    _require(not logits_are_probs or temperature == 1.0, f"temperature={temperature!r} has no effect when "
             "logits_are_probs=True; pass temperature=1.0 or apply the temperature before converting logits to probabilities")
    vocab = student_logits.shape[-1]
    _require(top_k is None or (isinstance(top_k, int) and not isinstance(top_k, bool) and 1 <= top_k <= vocab),
             f"top_k must be None or an int in [1, V={vocab}], got {top_k!r}")
    _require(token_clip is None or (_number(token_clip) and token_clip > 0),
             f"token_clip must be None or a number > 0, got {token_clip!r}")

    s, t = _upcast(student_logits), _upcast(teacher_logits)
    if not logits_are_probs:
        s, t = s / temperature, t / temperature
    if top_k is not None:
        idx = torch.topk(t, k=top_k, dim=-1).indices  # the teacher's top-k, [..., k]
        s, t = s.gather(-1, idx), t.gather(-1, idx)
    if logits_are_probs:
        if top_k is not None:
            s, t = (p / p.sum(-1, keepdim=True).clamp_min(_PROB_FLOOR) for p in (s, t))
        s_logp, t_logp = s.clamp_min(_PROB_FLOOR).log(), t.clamp_min(_PROB_FLOOR).log()
    else:
        s_logp, t_logp = F.log_softmax(s, dim=-1), F.log_softmax(t, dim=-1)
    if beta == 0:
        jsd = _kl_rows(t_logp, s_logp)
    elif beta == 1:
        jsd = _kl_rows(s_logp, t_logp)
    else:  # where both are -inf, feed logaddexp finite values so its backward stays finite
        both = torch.isneginf(s_logp) & torch.isneginf(t_logp)
        s_m, t_m = (torch.where(both, torch.zeros_like(x), x) for x in (s_logp, t_logp))
        m_logp = torch.logaddexp(s_m + math.log1p(-beta), t_m + math.log(beta))
        jsd = beta * _kl_rows(t_logp, m_logp) + (1.0 - beta) * _kl_rows(s_logp, m_logp)
    return jsd if token_clip is None else jsd.clamp(max=token_clip)


def generalized_jsd_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    labels: torch.Tensor | None = None,
    beta: float = 0.5,
    temperature: float = 1.0,
    reduction: str = "batchmean",
    logits_are_probs: bool = False,
    top_k: int | None = None,
    token_clip: float | None = None,
) -> torch.Tensor:
    """Generalized JSD distillation loss (the spec's signature), reduced like TRL 1.16's.

    ``student_logits`` / ``teacher_logits [B, T, V]`` (the teacher's computed under no_grad), ``labels [B, T]`` or
    None (``-100`` ignored); ``reduction``: ``"batchmean"`` (sum / #unmasked, clamped at 1; sum / B without
    labels), ``"sum"``, ``"mean"`` (sum / (#unmasked * V'), V' = ``top_k`` or V), ``"none"`` (``[B, T]``, masked
    0); the rest as :func:`generalized_jsd_per_token`. Returns a scalar (``[B, T]`` for ``"none"``); ``ValueError``
    for bad shapes or arguments, and ``"mean"`` with every token masked.
    """
    _check_reduction(reduction)
    _check_logit_pair(student_logits, teacher_logits)
    mask = _mask_from(labels, student_logits, binary=False)
    per_token = generalized_jsd_per_token(student_logits, teacher_logits, beta=beta, temperature=temperature,
                                          logits_are_probs=logits_are_probs, top_k=top_k, token_clip=token_clip)
    return _reduce_per_token(per_token, mask, reduction, top_k if top_k is not None else student_logits.shape[-1])

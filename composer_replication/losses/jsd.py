"""Generalized Jensen-Shannon divergence for on-policy (self-)distillation.

Papers: GKD, Agarwal et al., "On-Policy Distillation of Language Models: Learning from Self-Generated
Mistakes" (arXiv 2306.13649, Eq. 1); OPSD, Zhao et al. (arXiv 2601.18734), which adds ``top_k``,
``token_clip`` and ``logits_are_probs``.

Convention (identical to TRL ``trl/experimental/gkd/gkd_trainer.py::generalized_jsd_loss`` and Liger):

    S = log_softmax(z_s / tau),  T = log_softmax(z_t / tau)          # [N, V]
    M = log(beta * e^T + (1 - beta) * e^S)                              # mixture, log space
    JSD_beta = beta * KL(T || M) + (1 - beta) * KL(S || M)              # summed over the vocabulary
    beta == 0  ->  KL(T || S)   (forward KL, special-cased)
    beta == 1  ->  KL(S || T)   (reverse KL, special-cased)

Because JSD_beta ~ beta * KL(T || S) as beta -> 0, the magnitude is discontinuous at the special cases.

``generalized_jsd_per_token`` is the one implementation; ``generalized_jsd_loss`` masks and reduces it.
The chunked kernels of ``composer_replication.losses.logprobs`` call the per-token form on flattened rows.
Neither function detaches the teacher: pass teacher logits computed under ``torch.no_grad()``.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F

__all__ = ["generalized_jsd_loss", "generalized_jsd_per_token"]

logger = logging.getLogger(__name__)

REDUCTIONS = ("batchmean", "sum", "mean", "none")
_PROB_FLOOR = 1e-8  # OPSD: log(p.clamp_min(1e-8)) when the inputs are probabilities


# ---------------------------------------------------------------------------------------------------------
# Shared private helpers (also used by the dpo, taid and entropy_aware_opd modules)
# ---------------------------------------------------------------------------------------------------------


def _check_logit_pair(student: torch.Tensor, teacher: torch.Tensor, what: str = "logits") -> None:
    """Raise ``ValueError`` unless student and teacher are floating tensors of one shape ``[..., V]``."""
    if not isinstance(student, torch.Tensor) or not isinstance(teacher, torch.Tensor):
        raise ValueError(
            f"student_{what} and teacher_{what} must be torch.Tensor, got "
            f"{type(student).__name__} and {type(teacher).__name__}"
        )
    if student.dim() < 2:
        raise ValueError(
            f"student_{what} must have shape [N, V] or [B, T, V] (at least 2 dims), got shape "
            f"{tuple(student.shape)}"
        )
    if student.shape != teacher.shape:
        raise ValueError(
            f"student_{what} and teacher_{what} must have the same shape, got {tuple(student.shape)} "
            f"and {tuple(teacher.shape)}"
        )
    if not student.is_floating_point() or not teacher.is_floating_point():
        raise ValueError(
            f"student_{what} and teacher_{what} must be floating point, got {student.dtype} and {teacher.dtype}"
        )
    if student.shape[-1] < 1:
        raise ValueError(f"the vocabulary dimension of student_{what} is empty: shape {tuple(student.shape)}")


def _check_temperature(temperature: float) -> None:
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """Half-precision inputs are computed in float32; float32/float64 are kept."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _kl_rows(logp: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """``sum_v p (log p - log q)`` over the last dim ``[..., V] -> [...]``; entries with ``p == 0`` give 0.

    The ``where`` on the difference (not on the product) keeps gradients finite when ``log p = -inf``.
    """
    diff = torch.where(torch.isneginf(logp), torch.zeros_like(logp), logp - logq)
    return (logp.exp() * diff).sum(-1)


def _reduce_per_token(
    per_token: torch.Tensor, mask: torch.Tensor | None, reduction: str, num_classes: int, arg: str
) -> torch.Tensor:
    """Mask and reduce a per-token loss ``[B, T]`` the way TRL's ``generalized_jsd_loss`` reduces.

    ``mask`` is a bool tensor of ``per_token``'s shape or ``None``. ``num_classes`` is the size of the
    summed (vocabulary) axis, used by ``"mean"`` (TRL's ``jsd.mean()`` averages over tokens *and* vocab).
    ``arg`` names the mask argument in errors.
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if mask is not None:
        per_token = torch.where(mask, per_token, torch.zeros_like(per_token))
    if reduction == "none":
        return per_token
    total = per_token.sum()
    if reduction == "sum":
        return total
    if reduction == "batchmean":
        # TRL: sum / #unmasked tokens (clamped at 1: an empty mask gives 0 with a valid grad path);
        # without a mask, sum / size(0), i.e. divided by B for [B, T] (F.kl_div's "batchmean").
        denom = mask.sum().clamp_min(1) if mask is not None else max(per_token.shape[0], 1)
        return total / denom
    # "mean": TRL's jsd.mean() over the unmasked (token, vocab) entries.
    num_tokens = int(mask.sum()) if mask is not None else per_token.numel()
    if num_tokens == 0:
        raise ValueError(f'reduction="mean" is undefined when {arg} masks every token; pass a non-empty mask')
    return total / (num_tokens * num_classes)


# ---------------------------------------------------------------------------------------------------------
# Generalized JSD
# ---------------------------------------------------------------------------------------------------------


def _log_probs_pair(
    student: torch.Tensor,
    teacher: torch.Tensor,
    temperature: float,
    logits_are_probs: bool,
    top_k: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Student and teacher log-probs ``[..., V']`` (``V' = top_k`` or ``V``) after temperature / top-k."""
    student, teacher = _upcast(student), _upcast(teacher)
    if logits_are_probs:
        if top_k is not None:
            idx = torch.topk(teacher, k=top_k, dim=-1).indices
            student = torch.gather(student, -1, idx)
            teacher = torch.gather(teacher, -1, idx)
            student = student / student.sum(-1, keepdim=True).clamp_min(_PROB_FLOOR)
            teacher = teacher / teacher.sum(-1, keepdim=True).clamp_min(_PROB_FLOOR)
        return torch.log(student.clamp_min(_PROB_FLOOR)), torch.log(teacher.clamp_min(_PROB_FLOOR))
    student = student / temperature
    teacher = teacher / temperature
    if top_k is not None:
        idx = torch.topk(teacher, k=top_k, dim=-1).indices  # teacher's top-k, [..., k]
        student = torch.gather(student, -1, idx)
        teacher = torch.gather(teacher, -1, idx)
    return F.log_softmax(student, dim=-1), F.log_softmax(teacher, dim=-1)


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
    """Per-token generalized JSD (GKD arXiv 2306.13649 Eq. 1; TRL/OPSD convention), summed over the vocab.

    ``JSD_beta = beta * KL(T || M) + (1 - beta) * KL(S || M)`` with ``M = beta * T + (1 - beta) * S``;
    ``beta == 0`` is ``KL(T || S)`` and ``beta == 1`` is ``KL(S || T)`` (special cases, as in TRL).

    Args:
        student_logits: ``[N, V]`` (any leading dims ``[..., V]`` work) student logits, with grad.
        teacher_logits: ``[N, V]`` teacher logits (not detached here; compute them under no_grad).
        beta: in ``[0, 1]``: 0 = forward KL(teacher || student), 1 = reverse KL(student || teacher).
        temperature: ``> 0``; both logits are divided by it before the softmax.
        logits_are_probs: the inputs are probabilities: ``log(p.clamp_min(1e-8))`` is used and
            ``temperature`` must be 1.0.
        top_k: keep only the teacher's top-k vocabulary entries (``1 <= top_k <= V``); both
            distributions are renormalized over those k entries before the divergence.
        token_clip: if set (``> 0``), each token's vocab-summed divergence is clamped at
            ``max=token_clip``. Note: OPSD clamps the pointwise ``[.., V]`` terms before the vocab sum; here
            the clamp is per token, as our contract specifies.

    Returns:
        ``[N]`` (or ``[...]``) divergence per token, float32 for half-precision inputs.

    Raises:
        ValueError: on shape/dtype mismatch or any out-of-range argument.
    """
    _check_logit_pair(student_logits, teacher_logits)
    if not isinstance(beta, (int, float)) or not 0.0 <= beta <= 1.0:
        raise ValueError(f"beta must be a number in [0, 1] (0 = forward KL, 1 = reverse KL), got {beta!r}")
    _check_temperature(temperature)
    if logits_are_probs and temperature != 1.0:
        raise ValueError(
            f"temperature={temperature!r} has no effect when logits_are_probs=True; pass temperature=1.0 "
            "or apply the temperature before converting logits to probabilities"
        )
    vocab = student_logits.shape[-1]
    if top_k is not None and (
        isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= vocab
    ):
        raise ValueError(f"top_k must be None or an int in [1, V={vocab}], got {top_k!r}")
    if token_clip is not None and (not isinstance(token_clip, (int, float)) or not token_clip > 0):
        raise ValueError(f"token_clip must be None or a number > 0, got {token_clip!r}")

    s_logp, t_logp = _log_probs_pair(student_logits, teacher_logits, temperature, logits_are_probs, top_k)
    if beta == 0:
        jsd = _kl_rows(t_logp, s_logp)  # KL(T || S)
    elif beta == 1:
        jsd = _kl_rows(s_logp, t_logp)  # KL(S || T)
    else:
        # Entries where both are -inf have zero mass in every term; feed logaddexp finite values there so
        # its backward stays finite (d logaddexp at (-inf, -inf) is 0/0).
        both = torch.isneginf(s_logp) & torch.isneginf(t_logp)
        s_m = torch.where(both, torch.zeros_like(s_logp), s_logp)
        t_m = torch.where(both, torch.zeros_like(t_logp), t_logp)
        m_logp = torch.logaddexp(s_m + math.log1p(-beta), t_m + math.log(beta))
        jsd = beta * _kl_rows(t_logp, m_logp) + (1.0 - beta) * _kl_rows(s_logp, m_logp)
    if token_clip is not None:
        jsd = jsd.clamp(max=token_clip)
    return jsd


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
    """Generalized JSD distillation loss (GKD arXiv 2306.13649; OPSD arXiv 2601.18734), TRL's reductions.

    The per-token divergence is :func:`generalized_jsd_per_token`; this function masks and reduces it:

    - ``"batchmean"``: sum / #tokens with ``labels != -100`` (clamped at 1, so an empty mask gives 0);
      without ``labels``: sum / B (TRL divides by ``size(0)``, like ``F.kl_div(reduction="batchmean")``).
    - ``"sum"``: sum over unmasked tokens.
    - ``"mean"``: TRL's ``jsd.mean()``: sum / (#unmasked tokens * V'), V' = ``top_k`` or V.
    - ``"none"``: per-token ``[B, T]``, masked positions set to 0.

    Args:
        student_logits: ``[B, T, V]`` student logits (with grad).
        teacher_logits: ``[B, T, V]`` teacher logits (no grad in SDPO; not detached here).
        labels: ``[B, T]`` or None; positions equal to ``-100`` are ignored (HF convention).
        beta, temperature, logits_are_probs, top_k, token_clip: see :func:`generalized_jsd_per_token`.
        reduction: ``"batchmean"``, ``"sum"``, ``"mean"`` or ``"none"``.

    Returns:
        Scalar tensor, or ``[B, T]`` for ``reduction="none"``.

    Raises:
        ValueError: unknown ``reduction``, shape mismatches, out-of-range arguments, or
            ``reduction="mean"`` with every token masked.

    Example:
        >>> s = torch.randn(2, 8, 32, requires_grad=True); t = torch.randn(2, 8, 32)
        >>> generalized_jsd_loss(s, t, beta=0.5).backward()
    """
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    _check_logit_pair(student_logits, teacher_logits)
    mask = None
    if labels is not None:
        if not isinstance(labels, torch.Tensor) or labels.shape != student_logits.shape[:-1]:
            got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
            raise ValueError(
                f"labels must be a tensor of shape {tuple(student_logits.shape[:-1])} (the logits without the "
                f"vocab dim), got {got}"
            )
        mask = labels != -100
    per_token = generalized_jsd_per_token(
        student_logits,
        teacher_logits,
        beta=beta,
        temperature=temperature,
        logits_are_probs=logits_are_probs,
        top_k=top_k,
        token_clip=token_clip,
    )
    num_classes = top_k if top_k is not None else student_logits.shape[-1]
    return _reduce_per_token(per_token, mask, reduction, num_classes, arg="labels")

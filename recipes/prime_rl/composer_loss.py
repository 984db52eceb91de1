"""PRIME-RL custom loss: PRIME-RL's default DPPO + KL loss, plus composer self-distillation (channel 2).

Users who train with PRIME-RL (its trainer, its orchestrator, a vLLM inference server) add our channel 2
without moving to our recipe. Wire it through PRIME-RL's ``CustomLossConfig`` (``import_path`` + kwargs)::

    [trainer.loss]
    type = "custom"
    import_path = "recipes.prime_rl.composer_loss.composer_loss"

    [trainer.loss.kwargs]            # every key optional; the defaults are PRIME-RL's DefaultLossConfig
    alpha_sdpo = 0.1                 # channel-2 weight
    teacher_source = "ref_logprobs"  # inside PRIME-RL the teacher's log-probs travel as ref_logprobs

Transcribed from PrimeIntellect-ai/prime-rl at commit 559b44772e471d1538537b8805cc77f3824a5e64
(2026-08-21): ``src/prime_rl/trainer/rl/loss.py`` (``LossInputs``, ``LossOutputs``, ``default_loss_fn``,
``ref_kl_loss_fn``) and ``packages/prime-rl-configs/src/prime_rl/configs/trainer.py`` (``DefaultLossConfig``,
``CustomLossConfig``). The policy term is PRIME-RL's ``default_loss_fn``: DPPO-Binary TV
(arXiv 2602.04879) with the Kimi-K2.5 KL (arXiv 2602.02276). Per token, with ``log r = lp - lp_inf``::

    dp      = exp(lp) - exp(lp_inf)                         # probability-space difference, not log r
    masked  = dp > dppo_mask_high  where A > 0              # the mask follows the sign of the advantage
              dp < -dppo_mask_low  elsewhere
    keep    = loss_mask & ~masked
    policy  = -keep * (adv_tau * A) * r + kl_tau * loss_mask * (log r)^2

Channel 2 (SDPO / OPSD self-distillation, arXiv 2601.20802 / 2601.18734) in PRIME-RL's per-token interface:
the loss sees only the sampled tokens' log-probs, so the generalized JSD over the vocabulary is out of reach
(it needs trainer changes); the sampled-token reverse-KL estimator is what fits. It is PRIME-RL's own
``ref_kl`` form (its ``opd`` / ``opsd`` algorithms) with the hint-conditioned teacher as the target::

    dkeep   = loss_mask & teacher_mask & ~(dp < -distill_mask_low)
    distill = -dkeep * stopgrad(lp_teacher - lp) * r        # gradient: -(lp_T - lp) * r * grad lp

    loss = sum_t (policy + alpha_sdpo * distill) * loss_weights        # SUM; PRIME-RL divides by its count

With no teacher log-probs (or ``alpha_sdpo = 0``) the loss, its gradient and its metrics are PRIME-RL's
default loss exactly (``tests/recipes/test_prime_rl_loss.py`` checks this against a transcription).

Shapes. PRIME-RL calls the loss once per sample: every tensor is 1-D ``[seq]``. A batched ``[B, T]`` input
raises ``ValueError`` (TROUBLESHOOTING §7); slice the batch per row instead.

Where the teacher log-probs come from (``teacher_source``):
- ``"teacher_logprobs"`` (default): ``ComposerLossInputs.teacher_logprobs`` (``[seq]``, with an optional
  ``teacher_mask``), for runners of your own. PRIME-RL's ``LossInputs`` has no such field, so inside PRIME-RL
  this source finds no teacher and the loss is PRIME-RL's default.
- ``"ref_logprobs"``: ``LossInputs.ref_logprobs``, the one extra per-token stream PRIME-RL ships. Score the
  sample's tokens under the hinted context (hint + the same response tokens) and put them there. PRIME-RL
  packs samples without reference log-probs as zeros; a sample whose ``ref_logprobs`` are all exactly
  ``0.0`` on its loss tokens is read as "no teacher" and skips channel 2.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from torch import Tensor

try:  # the real classes when PRIME-RL is installed, so PRIME-RL's runner and ours share them
    from prime_rl.trainer.rl.loss import LossInputs, LossOutputs

    PRIME_RL_AVAILABLE = True
except ImportError:  # a mirror of PRIME-RL's dataclasses (same fields, same order, same defaults)
    PRIME_RL_AVAILABLE = False

    @dataclass
    class LossInputs:  # type: ignore[no-redef]
        """PRIME-RL's per-sample loss inputs; every tensor is ``[seq]``.

        ``loss_mask`` selects the tokens of the receiving loss component; ``loss_weights`` is its per-token
        weight stream (``None`` means 1.0 everywhere).
        """

        trainer_logprobs: Tensor
        inference_logprobs: Tensor
        ref_logprobs: Tensor | None
        advantages: Tensor
        loss_mask: Tensor
        loss_weights: Tensor | None = field(default=None)

    @dataclass
    class LossOutputs:  # type: ignore[no-redef]
        """PRIME-RL's per-sample loss output: a scalar ``loss`` (a sum over tokens) and scalar ``metrics``."""

        loss: Tensor
        metrics: dict[str, Tensor]


__all__ = [
    "ComposerLossInputs",
    "DPPOMaskWarning",
    "LossInputs",
    "LossOutputs",
    "PRIME_RL_AVAILABLE",
    "TEACHER_SOURCES",
    "composer_loss",
]

TEACHER_SOURCES = ("teacher_logprobs", "ref_logprobs")


@dataclass
class ComposerLossInputs(LossInputs):
    """``LossInputs`` plus the hint-conditioned teacher's log-probs, for runners that call the loss directly.

    Attributes:
        teacher_logprobs: ``[seq]`` log-probs of the sample's own tokens under the hinted context, without
            grad; ``None`` when the sample has no hint (channel 2 skips it).
        teacher_mask: ``[seq]`` bool, the tokens the teacher scored; ``None`` means every loss token.
    """

    teacher_logprobs: Tensor | None = None
    teacher_mask: Tensor | None = None


class DPPOMaskWarning(UserWarning):
    """The DPPO mask dropped every loss token of a sample (TROUBLESHOOTING §10)."""


def _check_shapes(inputs: LossInputs, teacher: Tensor | None, teacher_mask: Tensor | None) -> None:
    """Every tensor ``[seq]`` of one length, ``loss_mask`` / ``teacher_mask`` bool; else a ``ValueError``."""
    named = {
        "trainer_logprobs": inputs.trainer_logprobs,
        "inference_logprobs": inputs.inference_logprobs,
        "ref_logprobs": inputs.ref_logprobs,
        "advantages": inputs.advantages,
        "loss_mask": inputs.loss_mask,
        "loss_weights": inputs.loss_weights,
        "teacher_logprobs": teacher,
        "teacher_mask": teacher_mask,
    }
    named = {k: v for k, v in named.items() if v is not None}
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape (seq,), got {type(t).__name__}")
        if t.dim() != 1:
            got = "(B, T)" if t.dim() == 2 else f"{t.dim()}-D"
            raise ValueError(
                f"expected (seq,) shape, got {got} {tuple(t.shape)} for {name}: PRIME-RL calls the loss once "
                "per sample with 1-D tensors. Pass one sample per call, e.g. "
                "LossInputs(trainer_logprobs=x.trainer_logprobs[b], ..., loss_mask=x.loss_mask[b]) for each "
                "row b (TROUBLESHOOTING §7)"
            )
    seq = inputs.trainer_logprobs.shape[0]
    wrong = {k: t.shape[0] for k, t in named.items() if t.shape[0] != seq}
    if wrong:
        raise ValueError(f"every tensor must have the length of trainer_logprobs ({seq}), got {wrong}")
    for name in ("loss_mask", "teacher_mask"):
        if name in named and named[name].dtype != torch.bool:
            raise ValueError(f"{name} must be a bool tensor, got {named[name].dtype}; pass mask.bool()")


def _check_kwargs(**values: float) -> None:
    """PRIME-RL declares these ``Field(..., ge=0)``; the same rule here."""
    for name, value in values.items():
        if not value >= 0:
            raise ValueError(f"{name} must be >= 0 (as in PRIME-RL's DefaultLossConfig), got {value!r}")


def _teacher(inputs: LossInputs, source: str) -> tuple[Tensor | None, Tensor | None]:
    """The teacher log-probs ``[seq]`` and mask ``[seq]`` (or ``None``) from the chosen source."""
    if source not in TEACHER_SOURCES:
        raise ValueError(f"teacher_source must be one of {TEACHER_SOURCES}, got {source!r}")
    if source == "teacher_logprobs":
        return getattr(inputs, "teacher_logprobs", None), getattr(inputs, "teacher_mask", None)
    return inputs.ref_logprobs, None


def _safe_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over a bool ``mask`` (0 when the mask is empty), as PRIME-RL computes its metrics."""
    return values[mask].sum() / torch.clamp_min(mask.sum(), 1)


def _warn_if_all_masked(loss_mask: torch.Tensor, keep_mask: torch.Tensor, low: float, high: float) -> None:
    """``DPPOMaskWarning`` when the DPPO mask dropped every loss token of the sample (TROUBLESHOOTING §10)."""
    if bool(loss_mask.any()) and not bool(keep_mask.any()):
        warnings.warn(
            f"the DPPO mask dropped all {int(loss_mask.sum())} loss tokens of this sample (|exp(lp) - "
            f"exp(lp_inf)| beyond dppo_mask_high={high} / dppo_mask_low={low}), so its "
            "policy-gradient term is 0 and only the KL term trains. The trainer and inference log-probs "
            "disagree (dtype, stale rollouts, chat template): inspect the quantiles of |probs_diff|. Widening "
            "the bounds only hides it (TROUBLESHOOTING §10)",
            DPPOMaskWarning,
            stacklevel=3,
        )


def composer_loss(
    inputs: LossInputs,
    *,
    dppo_mask_low: float = 0.2,
    dppo_mask_high: float = 0.2,
    adv_tau: float = 1.0,
    kl_tau: float = 1e-3,
    alpha_sdpo: float = 0.1,
    teacher_source: str = "teacher_logprobs",
    distill_mask_low: float = 0.2,
    warn_all_masked: bool = True,
) -> LossOutputs:
    """PRIME-RL's default loss on one sample, plus ``alpha_sdpo`` x the channel-2 distillation term.

    Args:
        inputs: one sample: ``trainer_logprobs`` ``[seq]`` (with grad), ``inference_logprobs`` ``[seq]``,
            ``ref_logprobs`` ``[seq]`` or ``None``, ``advantages`` ``[seq]``, ``loss_mask`` ``[seq]`` bool,
            ``loss_weights`` ``[seq]`` or ``None``; a ``ComposerLossInputs`` may add ``teacher_logprobs`` /
            ``teacher_mask`` ``[seq]``.
        dppo_mask_low: a token with a non-positive advantage leaves the policy term when
            ``exp(lp) - exp(lp_inf) < -dppo_mask_low`` (an additive probability bound, not PPO's ratio clip).
        dppo_mask_high: a token with a positive advantage leaves it when ``exp(lp) - exp(lp_inf) > dppo_mask_high``.
        adv_tau: scale of the advantage term.
        kl_tau: scale of the ``(lp - lp_inf)^2`` trainer/inference mismatch term (every loss token).
        alpha_sdpo: channel-2 weight (``0`` turns it off).
        teacher_source: ``"teacher_logprobs"`` or ``"ref_logprobs"`` (module docstring).
        distill_mask_low: channel 2 drops tokens with ``exp(lp) - exp(lp_inf) < -distill_mask_low``
            (PRIME-RL's ``ref_kl`` trust region, 0.2 there).
        warn_all_masked: warn (``DPPOMaskWarning``) when the DPPO mask drops every loss token; the check
            costs one device sync per sample.

    Returns:
        ``LossOutputs(loss, metrics)``: ``loss`` a scalar SUM over tokens (PRIME-RL normalizes by its global
        token count); ``metrics`` scalars: PRIME-RL's seven default-loss metrics under their names, plus
        ``composer/distill_tokens`` (channel-2 tokens), ``composer/distill_kl`` (mean ``lp - lp_teacher`` over
        the teacher's tokens), ``composer/distill_is_masked`` (fraction of those dropped by the trust region).

    Raises:
        ValueError: a tensor that is not ``[seq]`` (a batched ``[B, T]`` input says to pass one sample per
            call), lengths that differ, a non-bool mask, a negative coefficient, an unknown ``teacher_source``.
    """
    _check_kwargs(dppo_mask_low=dppo_mask_low, dppo_mask_high=dppo_mask_high, adv_tau=adv_tau, kl_tau=kl_tau,
                  alpha_sdpo=alpha_sdpo, distill_mask_low=distill_mask_low)
    teacher, teacher_mask = _teacher(inputs, teacher_source)
    _check_shapes(inputs, teacher, teacher_mask)
    lp, lp_inf, advantages, loss_mask = inputs.trainer_logprobs, inputs.inference_logprobs, inputs.advantages, inputs.loss_mask

    # ---- policy term: PRIME-RL's default_loss_fn, in its order of operations ----
    log_ratio = lp - lp_inf
    ratio = torch.exp(log_ratio)
    mismatch_kl = ratio - log_ratio - 1
    probs_diff = torch.exp(lp) - torch.exp(lp_inf)
    invalid_high = probs_diff > dppo_mask_high
    invalid_low = probs_diff < -dppo_mask_low
    positive, negative = advantages > 0, advantages < 0
    is_masked = torch.where(positive, invalid_high, invalid_low)  # [seq]
    drop_mask = loss_mask & is_masked
    keep_mask = loss_mask & ~is_masked
    per_token = -(keep_mask * (adv_tau * advantages) * ratio) + kl_tau * (loss_mask * log_ratio**2)

    # ---- channel 2: sampled-token reverse KL to the hint-conditioned teacher ----
    distill_metrics, per_token = _add_distillation(per_token, lp, ratio, probs_diff, loss_mask, teacher, teacher_mask,
                                                   teacher_source, alpha_sdpo=alpha_sdpo, distill_mask_low=distill_mask_low)
    if inputs.loss_weights is not None:
        per_token = per_token * inputs.loss_weights
    loss = per_token.sum()

    if warn_all_masked:
        _warn_if_all_masked(loss_mask, keep_mask, dppo_mask_low, dppo_mask_high)
    metrics = {
        "masked_mismatch_kl": _safe_mean(mismatch_kl, loss_mask & is_masked),
        "unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep_mask),
        "is_masked": _safe_mean(is_masked, loss_mask),
        "is_masked_low": _safe_mean(negative & invalid_low, loss_mask),
        "is_masked_high": _safe_mean(positive & invalid_high, loss_mask),
        "masked_advantage_positive": _safe_mean(positive, drop_mask),
        "masked_advantage_negative": _safe_mean(negative, drop_mask),
        **distill_metrics,
    }
    return LossOutputs(loss=loss, metrics=metrics)


def _add_distillation(
    per_token: Tensor,
    lp: Tensor,
    ratio: Tensor,
    probs_diff: Tensor,
    loss_mask: Tensor,
    teacher: Tensor | None,
    teacher_mask: Tensor | None,
    teacher_source: str,
    *,
    alpha_sdpo: float,
    distill_mask_low: float,
) -> tuple[dict[str, Tensor], Tensor]:
    """Channel-2 metrics and ``per_token + alpha_sdpo * distill`` (``per_token`` unchanged without a teacher).

    All tensors ``[seq]``; ``teacher`` is detached here (the teacher is a target, never trained through).
    """
    zero = lp.detach().new_zeros(())
    members = loss_mask if teacher_mask is None else loss_mask & teacher_mask
    if teacher is not None and teacher_source == "ref_logprobs" and not bool((teacher[members] != 0).any()):
        teacher = None  # PRIME-RL's zero filler for a sample that has no reference log-probs
    if teacher is None or alpha_sdpo == 0:
        return {
            "composer/distill_tokens": zero,
            "composer/distill_kl": zero,
            "composer/distill_is_masked": zero,
        }, per_token
    teacher = teacher.detach()
    dropped = probs_diff < -distill_mask_low
    keep = members & ~dropped
    gap = teacher - lp.detach()  # [seq]; > 0 where the teacher finds the token likelier than the policy
    per_token = per_token + alpha_sdpo * -(keep * gap * ratio)
    metrics = {
        "composer/distill_tokens": keep.sum().to(zero.dtype),
        "composer/distill_kl": _safe_mean(-gap, members),
        "composer/distill_is_masked": _safe_mean(dropped, members),
    }
    return metrics, per_token

"""PRIME-RL custom loss: PRIME-RL's default DPPO + KL loss, plus composer self-distillation (channel 2).

For users who train with PRIME-RL (its trainer, orchestrator and vLLM server) and want channel 2 without our
recipe. Wire it through PRIME-RL's ``CustomLossConfig``::

    [trainer.loss]
    type = "custom"
    import_path = "recipes.prime_rl.composer_loss.loss_fn"   # or .composer_loss (the same function)

    [trainer.loss.kwargs]            # every key optional; the defaults are PRIME-RL's DefaultLossConfig
    alpha_sdpo = 0.1                 # channel-2 weight
    teacher_source = "ref_logprobs"  # inside PRIME-RL the teacher's log-probs travel as ref_logprobs

Transcribed from PrimeIntellect-ai/prime-rl 559b447 (2026-08-21): ``src/prime_rl/trainer/rl/loss.py``
(``LossInputs``, ``LossOutputs``, ``default_loss_fn``, ``ref_kl_loss_fn``) and ``prime-rl-configs``
(``DefaultLossConfig``). The policy term is PRIME-RL's ``default_loss_fn``: DPPO-Binary TV (arXiv 2602.04879)
with the Kimi-K2.5 KL (arXiv 2602.02276). Per token, with ``log r = lp - lp_inf``::

    dp      = exp(lp) - exp(lp_inf)                         # probability-space difference, not log r
    masked  = dp > dppo_mask_high where A > 0, else dp < -dppo_mask_low
    keep    = loss_mask & ~masked
    policy  = -keep * (adv_tau * A) * r + kl_tau * loss_mask * (log r)^2

Channel 2 (SDPO / OPSD, arXiv 2601.20802 / 2601.18734): the loss sees only the sampled tokens' log-probs, so the
vocabulary JSD is out of reach; the sampled-token reverse-KL estimator is PRIME-RL's own ``ref_kl`` form (its
``opd`` / ``opsd``) with the hint-conditioned teacher as the target::

    dkeep   = loss_mask & teacher_mask & ~(dp < -distill_mask_low)
    distill = -dkeep * stopgrad(lp_teacher - lp) * r
    loss    = sum_t (policy + alpha_sdpo * distill) * loss_weights        # a SUM: PRIME-RL divides by its count

Without teacher log-probs (or with ``alpha_sdpo = 0``) the loss, gradient and metrics are PRIME-RL's default
loss exactly. PRIME-RL calls the loss once per sample, every tensor ``[seq]``; a batched ``[B, T]`` input raises
``ValueError`` (TROUBLESHOOTING §7). ``teacher_source``: ``"teacher_logprobs"`` (default) reads
``ComposerLossInputs.teacher_logprobs`` / ``teacher_mask`` (runners of your own; PRIME-RL's ``LossInputs`` has no
such field, so there the loss is the default one); ``"ref_logprobs"`` reads ``LossInputs.ref_logprobs``, the one
extra per-token stream PRIME-RL ships (score the sample's tokens under the hinted context); a sample whose
``ref_logprobs`` are all exactly 0 on its loss tokens (PRIME-RL's filler) has no teacher.
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
        """PRIME-RL's per-sample loss inputs, every tensor ``[seq]`` (``loss_weights`` ``None`` = 1.0)."""

        trainer_logprobs: Tensor
        inference_logprobs: Tensor
        ref_logprobs: Tensor | None
        advantages: Tensor
        loss_mask: Tensor
        loss_weights: Tensor | None = field(default=None)

    @dataclass
    class LossOutputs:  # type: ignore[no-redef]
        """PRIME-RL's per-sample output: a scalar ``loss`` (a sum over tokens) and scalar ``metrics``."""

        loss: Tensor
        metrics: dict[str, Tensor]


__all__ = ["ComposerLossInputs", "DPPOMaskWarning", "LossInputs", "LossOutputs", "PRIME_RL_AVAILABLE",
           "composer_loss", "loss_fn"]

TEACHER_SOURCES = ("teacher_logprobs", "ref_logprobs")


@dataclass
class ComposerLossInputs(LossInputs):
    """``LossInputs`` plus the hint-conditioned teacher: ``teacher_logprobs [seq]`` (the sample's own tokens under the
    hinted context, no grad; ``None``: no hint) and ``teacher_mask [seq]`` bool (``None``: every loss token)."""

    teacher_logprobs: Tensor | None = None
    teacher_mask: Tensor | None = None


class DPPOMaskWarning(UserWarning):
    """The DPPO mask dropped every loss token of a sample (TROUBLESHOOTING §10)."""


def _check_shapes(inputs: LossInputs, teacher: Tensor | None, teacher_mask: Tensor | None) -> None:
    """Every tensor ``[seq]`` of one length, ``loss_mask`` / ``teacher_mask`` bool; else a ``ValueError``."""
    fields = ("trainer_logprobs", "inference_logprobs", "ref_logprobs", "advantages", "loss_mask", "loss_weights")
    named = {k: getattr(inputs, k) for k in fields} | {"teacher_logprobs": teacher, "teacher_mask": teacher_mask}
    named = {k: v for k, v in named.items() if v is not None}
    for name, t in named.items():
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor of shape (seq,), got {type(t).__name__}")
        if t.dim() != 1:
            got = "(B, T)" if t.dim() == 2 else f"{t.dim()}-D"
            raise ValueError(f"expected (seq,) shape, got {got} {tuple(t.shape)} for {name}: PRIME-RL calls the loss "
                             "once per sample with 1-D tensors. Pass one sample per call, e.g. LossInputs("
                             "trainer_logprobs=x.trainer_logprobs[b], ..., loss_mask=x.loss_mask[b]) for each row b "
                             "(TROUBLESHOOTING §7)")
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
        warnings.warn(f"the DPPO mask dropped all {int(loss_mask.sum())} loss tokens of this sample (|exp(lp) - "
                      f"exp(lp_inf)| beyond dppo_mask_high={high} / dppo_mask_low={low}), so its policy-gradient "
                      "term is 0 and only the KL term trains. The trainer and inference log-probs disagree (dtype, "
                      "stale rollouts, chat template): inspect the quantiles of |probs_diff|. Widening the bounds "
                      "only hides it (TROUBLESHOOTING §10)", DPPOMaskWarning, stacklevel=3)


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
    """PRIME-RL's default loss on one sample, plus ``alpha_sdpo`` x the channel-2 term (module docstring).

    Args:
        inputs: one sample, every tensor ``[seq]``: ``trainer_logprobs`` (with grad), ``inference_logprobs``,
            ``ref_logprobs`` or ``None``, ``advantages``, ``loss_mask`` bool, ``loss_weights`` or ``None``; a
            ``ComposerLossInputs`` may add ``teacher_logprobs`` / ``teacher_mask``.
        dppo_mask_low / dppo_mask_high: additive probability bounds of the DPPO mask (not PPO's ratio clip).
        adv_tau: scale of the advantage term. kl_tau: scale of the ``(lp - lp_inf)^2`` mismatch term.
        alpha_sdpo: channel-2 weight (0: off). teacher_source: ``"teacher_logprobs"`` or ``"ref_logprobs"``.
        distill_mask_low: channel 2 drops tokens with ``exp(lp) - exp(lp_inf) < -distill_mask_low`` (PRIME-RL's
            ``ref_kl`` trust region). warn_all_masked: ``DPPOMaskWarning`` when the mask drops every loss token
            (one device sync per sample).

    Returns:
        ``LossOutputs(loss, metrics)``: a scalar SUM over tokens; PRIME-RL's seven default-loss metrics, plus
        ``composer/distill_tokens``, ``composer/distill_kl`` (mean ``lp - lp_teacher`` on the teacher's tokens),
        ``composer/distill_is_masked``. ``ValueError`` for a tensor that is not ``[seq]`` (a batched input says to
        pass one sample per call), lengths that differ, a non-bool mask, a negative coefficient, a bad source.
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


def _add_distillation(per_token: Tensor, lp: Tensor, ratio: Tensor, probs_diff: Tensor, loss_mask: Tensor,
                      teacher: Tensor | None, teacher_mask: Tensor | None, teacher_source: str, *, alpha_sdpo: float,
                      distill_mask_low: float) -> tuple[dict[str, Tensor], Tensor]:
    """Channel-2 metrics and ``per_token + alpha_sdpo * distill`` (all ``[seq]``; unchanged without a teacher)."""
    zero = lp.detach().new_zeros(())
    members = loss_mask if teacher_mask is None else loss_mask & teacher_mask
    if teacher is not None and teacher_source == "ref_logprobs" and not bool((teacher[members] != 0).any()):
        teacher = None  # PRIME-RL's zero filler for a sample that has no reference log-probs
    if teacher is None or alpha_sdpo == 0:
        return dict.fromkeys(("composer/distill_tokens", "composer/distill_kl", "composer/distill_is_masked"), zero), \
            per_token
    teacher = teacher.detach()
    dropped = probs_diff < -distill_mask_low
    keep = members & ~dropped
    gap = teacher - lp.detach()  # [seq]; > 0 where the teacher finds the token likelier than the policy
    metrics = {"composer/distill_tokens": keep.sum().to(zero.dtype), "composer/distill_kl": _safe_mean(-gap, members),
               "composer/distill_is_masked": _safe_mean(dropped, members)}
    return metrics, per_token + alpha_sdpo * -(keep * gap * ratio)


loss_fn = composer_loss
"""The spec's name of this loss (TROUBLESHOOTING §7, §11): ``loss_fn(inputs, **kwargs) -> LossOutputs``."""

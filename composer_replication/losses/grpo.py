"""GRPO policy loss and group-relative advantages, with the formulas of TRL's ``GRPOTrainer``.

Papers: GRPO, Shao et al., DeepSeekMath (arXiv 2402.03300); DAPO, Yu et al. (arXiv 2503.14476);
Dr. GRPO, Liu et al., "Understanding R1-Zero-Like Training" (arXiv 2503.20783); GSPO (sequence-level
ratio), Zheng et al. (arXiv 2507.18071). Reference code: ``trl/trainer/grpo_trainer.py`` (trl 1.16),
``_generate_and_score_completions`` (advantages) and ``_compute_loss`` (loss).

Per token (shapes ``[B, T]``, log-probs aligned with input positions, see the batch contract):

    rho   = exp(lp - lp_old)                         (token)   or exp(masked mean_t (lp - lp_old)) (sequence)
    l     = -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) + kl_beta * KL3
    KL3   = exp(ref - lp) - (ref - lp) - 1

Aggregation: grpo = mean_b(sum_t l*m / len_b); bnpo = dapo = sum l*m / sum m (single process);
dr_grpo = sum l*m / (B * max_completion_length).
"""

from __future__ import annotations

import logging

import torch

from composer_replication.losses.config import SCALE_REWARDS, GRPOLossConfig

__all__ = ["GRPOLossConfig", "group_advantages", "grpo_loss"]

logger = logging.getLogger(__name__)

_STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4)


def group_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, *, scale_rewards: str = "group"
) -> torch.Tensor:
    """Group-relative advantages ``A = (r - mean_group(r)) / (std + 1e-4)`` (TRL GRPOTrainer).

    ``std`` is TRL's ``nanstd``: Bessel-corrected (unbiased), per group for ``"group"``, over the whole
    batch (around the batch mean) for ``"batch"``; ``"none"`` skips the division (Dr. GRPO). The mean is
    always the group mean. NaN rewards mark unscorable samples: they are left out of every mean and std
    and get advantage 0. Groups with a single (scorable) member get advantage 0.

    Args:
        rewards: ``[B]`` float rewards (NaN = unscorable).
        group_ids: ``[B]`` integer group of each sample (any values; samples of one prompt share an id).
        scale_rewards: ``"group"``, ``"batch"`` or ``"none"``.

    Returns:
        ``[B]`` advantages, rewards' dtype.

    Raises:
        ValueError: shapes, dtypes, infinite rewards, or unknown ``scale_rewards``.

    Example:
        >>> group_advantages(torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1]))
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 1 or not rewards.is_floating_point():
        raise ValueError(
            f"rewards must be a float [B] tensor, got {getattr(rewards, 'shape', None)} "
            f"{getattr(rewards, 'dtype', type(rewards).__name__)}"
        )
    if (
        not isinstance(group_ids, torch.Tensor)
        or group_ids.shape != rewards.shape
        or group_ids.is_floating_point()
        or group_ids.dtype == torch.bool
    ):
        raise ValueError(
            f"group_ids must be an integer tensor of shape {tuple(rewards.shape)}, got "
            f"{getattr(group_ids, 'shape', None)} {getattr(group_ids, 'dtype', None)}"
        )
    if bool(torch.isinf(rewards).any()):
        raise ValueError("rewards contain +-inf; use NaN to mark an unscorable sample")
    valid = ~torch.isnan(rewards)
    r0 = torch.where(valid, rewards, torch.zeros_like(rewards))
    _, inv = torch.unique(group_ids, return_inverse=True)
    num_groups = int(inv.max()) + 1 if inv.numel() else 0
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device).index_add_(
        0, inv, valid.to(rewards.dtype)
    )
    total = torch.zeros_like(count).index_add_(0, inv, r0)
    mean = total / count.clamp(min=1)
    centered = torch.where(valid, rewards - mean[inv], torch.zeros_like(rewards))
    if scale_rewards == "none":
        return centered
    if scale_rewards == "group":
        sq = torch.zeros_like(count).index_add_(0, inv, centered**2)
        std_g = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(count))
        std = std_g[inv]
    else:  # "batch": nanstd over the batch, around the batch mean
        n = int(valid.sum())
        if n > 1:
            batch_mean = r0.sum() / n
            dev = torch.where(valid, rewards - batch_mean, torch.zeros_like(rewards))
            std = ((dev**2).sum() / (n - 1)).sqrt().expand_as(rewards)
        else:
            std = torch.zeros_like(rewards)
    return centered / (std + _STD_EPS)


def _check_bt(name: str, x: torch.Tensor | None, shape: torch.Size) -> None:
    if not isinstance(x, torch.Tensor) or x.shape != shape:
        raise ValueError(
            f"{name} must have shape {tuple(shape)} ([B, T], like logprobs), got "
            f"{getattr(x, 'shape', type(x).__name__)}"
        )


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over mask entries (``x [B, T]``) or over rows (``x [B, 1]``, sequence level)."""
    if x.shape != mask.shape:
        return float(x.double().mean())
    return float((x.double() * mask).sum() / mask.sum().clamp(min=1))


def _check_inputs(logprobs, old_logprobs, advantages, response_mask, config, ref_logprobs, max_completion_length) -> None:
    """The argument checks of :func:`grpo_loss` (``ValueError`` naming the argument and the fix)."""
    if not isinstance(config, GRPOLossConfig):
        raise ValueError(f"config must be a GRPOLossConfig, got {type(config).__name__}")
    if not isinstance(logprobs, torch.Tensor) or logprobs.dim() != 2:
        raise ValueError(f"logprobs must be a [B, T] tensor, got {getattr(logprobs, 'shape', None)}")
    shape = logprobs.shape
    _check_bt("old_logprobs", old_logprobs, shape)
    _check_bt("response_mask", response_mask, shape)
    if ref_logprobs is not None:
        _check_bt("ref_logprobs", ref_logprobs, shape)
    elif config.kl_beta > 0:
        raise ValueError(
            f"config.kl_beta={config.kl_beta} > 0 needs ref_logprobs [B, T]; pass them or set kl_beta=0.0"
        )
    if max_completion_length is not None and (
        isinstance(max_completion_length, bool) or not isinstance(max_completion_length, int) or max_completion_length < 1
    ):
        raise ValueError(f"max_completion_length must be None or an int >= 1, got {max_completion_length!r}")
    if not isinstance(advantages, torch.Tensor) or advantages.shape not in (shape[:1], shape):
        raise ValueError(
            f"advantages must have shape ({shape[0]},) or {tuple(shape)}, got "
            f"{getattr(advantages, 'shape', None)}"
        )


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, lengths: torch.Tensor, loss_type: str,
               max_completion_length: int | None) -> torch.Tensor:
    """``[B, T]`` masked per-token losses -> the scalar of ``loss_type`` (TRL's aggregations)."""
    if loss_type == "grpo":  # per-sequence token mean, then the mean over sequences
        return (per_token.sum(-1) / lengths.clamp(min=1).to(per_token.dtype)).mean()
    if loss_type in ("bnpo", "dapo"):  # token mean over the batch
        return per_token.sum() / mask.sum().clamp(min=1)
    max_len = max_completion_length if max_completion_length is not None else per_token.shape[1]  # dr_grpo
    if int(lengths.max()) > max_len:
        raise ValueError(
            f"max_completion_length={max_len} is shorter than a response in the batch "
            f"({int(lengths.max())} tokens); pass a larger max_completion_length"
        )
    return per_token.sum() / (per_token.shape[0] * max_len)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    config: GRPOLossConfig,
    ref_logprobs: torch.Tensor | None = None,
    max_completion_length: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped-surrogate GRPO loss (+ k3 KL) aggregated per ``config.loss_type`` (TRL ``_compute_loss``).

    Args:
        logprobs: ``[B, T]`` current policy log-probs of the sampled tokens (with grad).
        old_logprobs: ``[B, T]`` sampling-policy log-probs (no grad).
        advantages: ``[B]`` (or per-token ``[B, T]``) advantages, e.g. from :func:`group_advantages`.
        response_mask: ``[B, T]`` 0/1 or bool, 1 on policy-generated tokens; positions outside it are
            ignored whatever their values.
        config: :class:`GRPOLossConfig` (or a ``LossConfig``, which is one).
        ref_logprobs: ``[B, T]`` reference log-probs; required when ``config.kl_beta > 0`` (with 0 they
            only feed the ``grpo/kl`` metric).
        max_completion_length: Dr. GRPO's constant normalizer (the sampling ``max_new_tokens``); ``None``
            means the batch's T. In the aligned convention T includes the prompt, so pass it for the
            paper's normalizer. Only ``loss_type="dr_grpo"`` reads it.

    Returns:
        ``(loss, metrics)``: scalar loss; metrics ``grpo/loss``, ``grpo/ratio_mean``, ``grpo/clip_ratio``,
        ``grpo/clip_ratio_low``, ``grpo/clip_ratio_high`` (masked token means; per-sequence means at
        sequence level), ``grpo/kl`` when ``ref_logprobs`` is given.

    Raises:
        ValueError: shape mismatches, ``kl_beta > 0`` without ``ref_logprobs``, an all-zero ``response_mask``,
            or ``max_completion_length`` not an int >= 1 or shorter than a row's response.
    """
    _check_inputs(logprobs, old_logprobs, advantages, response_mask, config, ref_logprobs, max_completion_length)
    shape = logprobs.shape
    mask_b = response_mask.bool()
    lengths = mask_b.sum(-1)
    if int(lengths.sum()) == 0:
        raise ValueError("response_mask is all zero: the GRPO loss is undefined without response tokens")
    mask = mask_b.to(logprobs.dtype)
    zeros = torch.zeros_like(logprobs)
    adv = advantages.to(logprobs.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv

    log_ratio = torch.where(mask_b, logprobs - old_logprobs, zeros)
    if config.importance_sampling_level == "sequence":
        log_ratio = (log_ratio.sum(-1) / lengths.clamp(min=1).to(logprobs.dtype)).unsqueeze(-1)  # [B, 1]
    ratio = torch.exp(log_ratio)
    clipped = torch.clamp(ratio, 1 - config.epsilon_low, 1 + config.epsilon_high)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None
    if ref_logprobs is not None:
        diff = torch.where(mask_b, ref_logprobs - logprobs, zeros)
        kl = torch.exp(diff) - diff - 1
        if config.kl_beta > 0:
            per_token = per_token + config.kl_beta * kl
    per_token = torch.where(mask_b, per_token.expand(shape), zeros)

    loss = _aggregate(per_token, mask, lengths, config.loss_type, max_completion_length)

    with torch.no_grad():
        low = (ratio < 1 - config.epsilon_low) & (adv < 0)
        high = (ratio > 1 + config.epsilon_high) & (adv > 0)
        metrics = {
            "grpo/loss": float(loss.detach()),
            "grpo/ratio_mean": _masked_mean(ratio, mask),
            "grpo/clip_ratio": _masked_mean((low | high).float(), mask),
            "grpo/clip_ratio_low": _masked_mean(low.float(), mask),
            "grpo/clip_ratio_high": _masked_mean(high.float(), mask),
        }
        if kl is not None:
            metrics["grpo/kl"] = _masked_mean(kl, mask)
    return loss, metrics

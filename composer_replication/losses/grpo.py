"""GRPO policy loss and group-relative advantages, with the formulas of TRL's ``GRPOTrainer``.

Papers: GRPO, Shao et al. (arXiv 2402.03300); DAPO, Yu et al. (arXiv 2503.14476); Dr. GRPO, Liu et al.
(arXiv 2503.20783); GSPO (sequence-level ratio), Zheng et al. (arXiv 2507.18071). Reference code:
``trl/trainer/grpo_trainer.py`` (trl 1.16). Per token (``[B, T]``, log-probs aligned with input positions)::

    rho = exp(lp - lp_old)   (token)   or   exp(masked mean_t (lp - lp_old))   (sequence)
    l   = -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A) + kl_beta KL3,   KL3 = e^(ref - lp) - (ref - lp) - 1

Aggregation: grpo = mean_b(sum_t l m / len_b); bnpo = dapo = sum l m / sum m (one process);
dr_grpo = sum l m / (B * max_completion_length).
"""

from __future__ import annotations

import torch

from composer_replication.losses.config import SCALE_REWARDS, GRPOLossConfig
from composer_replication.losses.jsd import _require

__all__ = ["GRPOLossConfig", "group_advantages", "grpo_loss"]

_STD_EPS = 1e-4  # TRL: advantages / (std + 1e-4)


def group_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, *, scale_rewards: str = "group") -> torch.Tensor:
    """Group-relative advantages ``A = (r - mean_group(r)) / (std + 1e-4)`` (TRL GRPOTrainer).

    ``std`` is TRL's Bessel-corrected ``nanstd``, per group (``"group"``) or over the batch around the batch mean
    (``"batch"``); ``"none"`` skips the division (Dr. GRPO). NaN rewards mark unscorable samples: left out of
    every mean and std, advantage 0; so do groups with a single scorable member. ``rewards [B]`` float,
    ``group_ids [B]`` integer (one prompt's samples share an id) -> ``[B]`` advantages, rewards' dtype.
    """
    _require(scale_rewards in SCALE_REWARDS, f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    _require(isinstance(rewards, torch.Tensor) and rewards.dim() == 1 and rewards.is_floating_point(), "rewards must "
             f"be a float [B] tensor, got {getattr(rewards, 'shape', None)} {getattr(rewards, 'dtype', type(rewards).__name__)}")
    _require(isinstance(group_ids, torch.Tensor) and group_ids.shape == rewards.shape and not group_ids.is_floating_point()
             and group_ids.dtype != torch.bool, f"group_ids must be an integer tensor of shape {tuple(rewards.shape)}, "
             f"got {getattr(group_ids, 'shape', None)} {getattr(group_ids, 'dtype', None)}")
    _require(not bool(torch.isinf(rewards).any()), "rewards contain +-inf; use NaN to mark an unscorable sample")
    valid = ~torch.isnan(rewards)
    r0 = torch.where(valid, rewards, torch.zeros_like(rewards))
    _, inv = torch.unique(group_ids, return_inverse=True)
    count = torch.zeros(int(inv.max()) + 1 if inv.numel() else 0, dtype=rewards.dtype, device=rewards.device)
    count.index_add_(0, inv, valid.to(rewards.dtype))
    mean = torch.zeros_like(count).index_add_(0, inv, r0) / count.clamp(min=1)
    centered = torch.where(valid, rewards - mean[inv], torch.zeros_like(rewards))
    if scale_rewards == "none":
        return centered
    if scale_rewards == "group":
        sq = torch.zeros_like(count).index_add_(0, inv, centered**2)
        std = torch.where(count > 1, (sq / (count - 1).clamp(min=1)).sqrt(), torch.zeros_like(count))[inv]
    else:  # "batch"
        n = int(valid.sum())
        dev = torch.where(valid, rewards - r0.sum() / max(n, 1), torch.zeros_like(rewards))
        std = ((dev**2).sum() / (n - 1)).sqrt().expand_as(rewards) if n > 1 else torch.zeros_like(rewards)
    return centered / (std + _STD_EPS)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    """Mean over mask entries (``x [B, T]``) or over rows (``x [B, 1]``, sequence level)."""
    if x.shape != mask.shape:
        return float(x.double().mean())
    return float((x.double() * mask).sum() / mask.sum().clamp(min=1))


def _check_inputs(logprobs, old_logprobs, advantages, response_mask, config, ref_logprobs, max_completion_length) -> None:
    _require(isinstance(config, GRPOLossConfig), f"config must be a GRPOLossConfig, got {type(config).__name__}")
    _require(isinstance(logprobs, torch.Tensor) and logprobs.dim() == 2,
             f"logprobs must be a [B, T] tensor, got {getattr(logprobs, 'shape', None)}")
    shape = logprobs.shape
    for name, x in (("old_logprobs", old_logprobs), ("response_mask", response_mask), ("ref_logprobs", ref_logprobs)):
        _require((x is None and name == "ref_logprobs") or (isinstance(x, torch.Tensor) and x.shape == shape),
                 f"{name} must have shape {tuple(shape)} ([B, T], like logprobs), got {getattr(x, 'shape', type(x).__name__)}")
    _require(ref_logprobs is not None or config.kl_beta <= 0,
             f"config.kl_beta={config.kl_beta} > 0 needs ref_logprobs [B, T]; pass them or set kl_beta=0.0")
    mcl = max_completion_length
    _require(mcl is None or (isinstance(mcl, int) and not isinstance(mcl, bool) and mcl >= 1),
             f"max_completion_length must be None or an int >= 1, got {mcl!r}")
    _require(isinstance(advantages, torch.Tensor) and advantages.shape in (shape[:1], shape), "advantages must have "
             f"shape ({shape[0]},) or {tuple(shape)}, got {getattr(advantages, 'shape', None)}")


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
        logprobs: ``[B, T]`` current log-probs of the sampled tokens (with grad). old_logprobs: ``[B, T]``.
        advantages: ``[B]`` (or ``[B, T]``). response_mask: ``[B, T]`` 0/1 or bool (outside it: ignored).
        config: a :class:`GRPOLossConfig` (a ``LossConfig`` is one).
        ref_logprobs: ``[B, T]``; required when ``config.kl_beta > 0`` (else they only feed ``grpo/kl``).
        max_completion_length: Dr. GRPO's normalizer (the sampling ``max_new_tokens``); ``None``: the batch's T.

    Returns ``(loss, metrics)``: ``grpo/loss``, ``grpo/ratio_mean``, ``grpo/clip_ratio(_low/_high)`` (masked token
    means; per sequence at sequence level), ``grpo/kl`` with ``ref_logprobs``. ``ValueError`` for shapes, a missing
    reference, an all-zero mask, or a ``max_completion_length`` shorter than a response.
    """
    _check_inputs(logprobs, old_logprobs, advantages, response_mask, config, ref_logprobs, max_completion_length)
    shape, mask_b = logprobs.shape, response_mask.bool()
    lengths = mask_b.sum(-1)
    _require(int(lengths.sum()), "response_mask is all zero: the GRPO loss is undefined without response tokens")
    mask, zeros = mask_b.to(logprobs.dtype), torch.zeros_like(logprobs)
    adv = advantages.to(logprobs.dtype)
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv
    log_ratio = torch.where(mask_b, logprobs - old_logprobs, zeros)
    if config.importance_sampling_level == "sequence":
        log_ratio = (log_ratio.sum(-1) / lengths.clamp(min=1).to(logprobs.dtype)).unsqueeze(-1)  # [B, 1]
    ratio = torch.exp(log_ratio)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - config.epsilon_low, 1 + config.epsilon_high) * adv)
    kl = None
    if ref_logprobs is not None:
        diff = torch.where(mask_b, ref_logprobs - logprobs, zeros)
        kl = torch.exp(diff) - diff - 1
        if config.kl_beta > 0:
            per_token = per_token + config.kl_beta * kl
    per_token = torch.where(mask_b, per_token.expand(shape), zeros)
    if config.loss_type == "grpo":  # per-sequence token mean, then the mean over sequences
        loss = (per_token.sum(-1) / lengths.clamp(min=1).to(per_token.dtype)).mean()
    elif config.loss_type in ("bnpo", "dapo"):  # token mean over the batch
        loss = per_token.sum() / mask.sum().clamp(min=1)
    else:  # dr_grpo
        max_len, longest = max_completion_length if max_completion_length is not None else shape[1], int(lengths.max())
        _require(longest <= max_len, f"max_completion_length={max_len} is shorter than a response in the batch "
                 f"({longest} tokens); pass a larger max_completion_length")
        loss = per_token.sum() / (shape[0] * max_len)
    with torch.no_grad():
        low = (ratio < 1 - config.epsilon_low) & (adv < 0)
        high = (ratio > 1 + config.epsilon_high) & (adv > 0)
        metrics = {"grpo/loss": float(loss.detach()), "grpo/ratio_mean": _masked_mean(ratio, mask),
                   "grpo/clip_ratio": _masked_mean((low | high).float(), mask),
                   "grpo/clip_ratio_low": _masked_mean(low.float(), mask),
                   "grpo/clip_ratio_high": _masked_mean(high.float(), mask)}
        if kl is not None:
            metrics["grpo/kl"] = _masked_mean(kl, mask)
    return loss, metrics

"""SimPO: simple preference optimization with a reference-free, length-normalized reward.

Paper: Meng, Xia, Chen, "SimPO: Simple Preference Optimization with a Reference-Free Reward"
(NeurIPS 2024, arXiv 2405.14734).

    L = -log sigmoid( beta * (avg_logp(y_w) - avg_logp(y_l)) - gamma )

where ``avg_logp(y) = (1/|y|) sum_t log pi(y_t | x, y_<t)`` over the response tokens. There is no
reference model. ``gamma`` is the absolute target margin (TRL CPO's ``simpo_gamma``); princeton-nlp's
script instead takes ``gamma_beta_ratio`` with ``gamma = beta * gamma_beta_ratio``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["simpo_loss", "avg_sequence_logprob"]


def avg_sequence_logprob(model_logprobs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Average per-token log-prob over each row's response tokens.

    Args:
        model_logprobs: ``[B, T]`` per-token log-probs (aligned convention of the batch contract).
        response_mask: ``[B, T]`` 0/1 or bool, 1 on response tokens.

    Returns:
        ``[B]``: ``sum_t lp[b, t] * mask[b, t] / sum_t mask[b, t]``.

    Raises:
        ValueError: shape mismatch, or a row without any response token (its average is undefined).

    Example:
        >>> avg_sequence_logprob(torch.randn(2, 8), torch.ones(2, 8)).shape
        torch.Size([2])
    """
    if not isinstance(model_logprobs, torch.Tensor) or model_logprobs.dim() != 2:
        raise ValueError(
            f"model_logprobs must be a [B, T] tensor, got {getattr(model_logprobs, 'shape', None)}"
        )
    if not isinstance(response_mask, torch.Tensor) or response_mask.shape != model_logprobs.shape:
        raise ValueError(
            f"response_mask must have model_logprobs' shape {tuple(model_logprobs.shape)}, got "
            f"{getattr(response_mask, 'shape', None)}"
        )
    mask = response_mask.bool()
    counts = mask.sum(-1)
    if bool((counts == 0).any()):
        rows = torch.nonzero(counts == 0).flatten().tolist()
        raise ValueError(
            f"response_mask has no response token in rows {rows}; the average log-prob is undefined there "
            "(drop those rows before calling avg_sequence_logprob)"
        )
    summed = torch.where(mask, model_logprobs, torch.zeros_like(model_logprobs)).sum(-1)
    return summed / counts.to(summed.dtype)


def simpo_loss(
    chosen_avg_logprobs: torch.Tensor,
    rejected_avg_logprobs: torch.Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 1.0,
) -> torch.Tensor:
    """SimPO loss ``mean_b -log sigmoid(beta * (avg_c[b] - avg_r[b]) - gamma)`` (arXiv 2405.14734).

    Args:
        chosen_avg_logprobs: ``[B]`` average response log-prob of the chosen sequences
            (see :func:`avg_sequence_logprob`).
        rejected_avg_logprobs: ``[B]`` same for the rejected sequences.
        beta: reward scale, ``> 0`` (paper default 2.0).
        gamma: absolute target margin, ``>= 0``.

    Returns:
        Scalar: mean over the B pairs.

    Raises:
        ValueError: shapes differ or are not ``[B]`` with ``B >= 1``; ``beta <= 0``; ``gamma < 0``.

    Example:
        >>> simpo_loss(torch.tensor([-2.1, -1.8]), torch.tensor([-3.0, -2.5]), beta=2.0, gamma=1.0)
    """
    for name, x in (
        ("chosen_avg_logprobs", chosen_avg_logprobs),
        ("rejected_avg_logprobs", rejected_avg_logprobs),
    ):
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.numel() == 0:
            raise ValueError(
                f"{name} must be a non-empty [B] tensor, got {getattr(x, 'shape', type(x).__name__)}"
            )
    if chosen_avg_logprobs.shape != rejected_avg_logprobs.shape:
        raise ValueError(
            f"chosen_avg_logprobs and rejected_avg_logprobs must have the same shape [B], got "
            f"{tuple(chosen_avg_logprobs.shape)} and {tuple(rejected_avg_logprobs.shape)}"
        )
    if not isinstance(beta, (int, float)) or not beta > 0:
        raise ValueError(f"beta must be a number > 0 (paper default 2.0), got {beta!r}")
    if not isinstance(gamma, (int, float)) or not gamma >= 0:
        raise ValueError(f"gamma must be a number >= 0 (the target reward margin), got {gamma!r}")
    logits = beta * (chosen_avg_logprobs - rejected_avg_logprobs) - gamma
    return -F.logsigmoid(logits).mean()

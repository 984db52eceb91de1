"""SimPO: simple preference optimization with a reference-free, length-normalized reward.

Paper: Meng, Xia, Chen (NeurIPS 2024, arXiv 2405.14734). No reference model::

    L = -log sigmoid(beta * (avg_logp(y_w) - avg_logp(y_l)) - gamma),   avg_logp(y) = (1/|y|) sum_t log pi(y_t | .)

``gamma`` is the absolute target margin (TRL CPO's ``simpo_gamma``); princeton-nlp's ``gamma_beta_ratio`` is
``gamma / beta``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from composer_replication.losses.jsd import _number, _require

__all__ = ["simpo_loss", "avg_sequence_logprob"]


def avg_sequence_logprob(model_logprobs: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Mean log-prob over each row's response tokens: ``[B, T]``, ``[B, T]`` (0/1 or bool) -> ``[B]``; values
    outside the mask are ignored (even NaN); a row without a response token raises ``ValueError``."""
    _require(isinstance(model_logprobs, torch.Tensor) and model_logprobs.dim() == 2,
             f"model_logprobs must be a [B, T] tensor, got {getattr(model_logprobs, 'shape', None)}")
    _require(isinstance(response_mask, torch.Tensor) and response_mask.shape == model_logprobs.shape, "response_mask "
             f"must have model_logprobs' shape {tuple(model_logprobs.shape)}, got {getattr(response_mask, 'shape', None)}")
    mask = response_mask.bool()
    counts = mask.sum(-1)
    if bool((counts == 0).any()):
        raise ValueError(f"response_mask has no response token in rows {(counts == 0).nonzero().flatten().tolist()}; "
                         "the average log-prob is undefined there (drop those rows first)")
    return torch.where(mask, model_logprobs, torch.zeros_like(model_logprobs)).sum(-1) / counts.to(model_logprobs.dtype)


def simpo_loss(
    chosen_avg_logprobs: torch.Tensor,
    rejected_avg_logprobs: torch.Tensor,
    *,
    beta: float = 2.0,
    gamma: float = 1.0,
) -> torch.Tensor:
    """SimPO ``mean_b -log sigmoid(beta * (avg_c[b] - avg_r[b]) - gamma)`` over ``[B]`` inputs (the spec's);
    ``beta > 0`` (paper default 2.0), ``gamma >= 0``; ``ValueError`` for shapes that differ or are not ``[B >= 1]``."""
    for name, x in (("chosen_avg_logprobs", chosen_avg_logprobs), ("rejected_avg_logprobs", rejected_avg_logprobs)):
        _require(isinstance(x, torch.Tensor) and x.dim() == 1 and x.numel(),
                 f"{name} must be a non-empty [B] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    _require(chosen_avg_logprobs.shape == rejected_avg_logprobs.shape, "chosen_avg_logprobs and rejected_avg_logprobs"
             f" must have the same shape [B], got {tuple(chosen_avg_logprobs.shape)} and {tuple(rejected_avg_logprobs.shape)}")
    _require(_number(beta) and beta > 0, f"beta must be a number > 0 (paper default 2.0), got {beta!r}")
    _require(_number(gamma) and gamma >= 0, f"gamma must be a number >= 0 (the target reward margin), got {gamma!r}")
    return -F.logsigmoid(beta * (chosen_avg_logprobs - rejected_avg_logprobs) - gamma).mean()

"""DPO (sigmoid loss, conservative label smoothing) and the per-token / per-sequence log-probs it uses.

Papers: Rafailov et al. (arXiv 2305.18290); label smoothing is Mitchell's conservative DPO (2023), TRL's sigmoid
loss before 1.x (with ``label_smoothing=0`` TRL 1.16 agrees)::

    Delta = (logp(y_w) - ref(y_w)) - (logp(y_l) - ref(y_l))            # summed response log-probs
    L     = mean_p [ -(1 - eps) log sigmoid(beta Delta) - eps log sigmoid(-beta Delta) ]

Per-token log-probs are aligned with input positions: ``lp[:, t]`` is the log-prob of token ``t``, ``lp[:, 0] = 0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from composer_replication.losses.jsd import _check_temperature, _number, _require, _upcast

__all__ = ["dpo_loss"]


def per_token_logprobs(logits: torch.Tensor, input_ids: torch.Tensor, *, temperature: float = 1.0) -> torch.Tensor:
    """``lp[b, t] = log_softmax(logits[b, t - 1] / temperature)[input_ids[b, t]]``, ``lp[b, 0] = 0``, no mask:
    ``logits [B, T, V]``, integer ``input_ids [B, T]`` in ``[0, V)`` -> ``[B, T]`` (float32 for half precision)."""
    _require(isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.is_floating_point(),
             f"logits must be a float [B, T, V] tensor, got {getattr(logits, 'shape', None)}")
    _require(isinstance(input_ids, torch.Tensor) and input_ids.shape == logits.shape[:2], f"input_ids must have "
             f"shape {tuple(logits.shape[:2])} (logits' [B, T]), got {getattr(input_ids, 'shape', None)}")
    _require(not input_ids.is_floating_point() and input_ids.dtype != torch.bool,
             f"input_ids must be an integer tensor, got {input_ids.dtype}")
    _check_temperature(temperature)
    (lo, hi), vocab = (int(input_ids.min()), int(input_ids.max())) if input_ids.numel() else (0, 0), logits.shape[-1]
    _require(0 <= lo and hi < vocab, f"input_ids must lie in [0, V={vocab}), got range [{lo}, {hi}]")
    z = _upcast(logits[:, :-1]) / temperature  # [B, T-1, V] predicts tokens 1..T-1
    lp = z.gather(-1, input_ids[:, 1:].long().unsqueeze(-1)).squeeze(-1) - torch.logsumexp(z, dim=-1)
    return F.pad(lp, (1, 0), value=0.0)  # [B, T]


def sequence_logprobs(per_token: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Summed response log-prob of each row: ``[B, T]``, ``[B, T]`` -> ``[B]`` (values outside the mask ignored)."""
    _require(isinstance(per_token, torch.Tensor) and per_token.dim() == 2,
             f"per_token must be a [B, T] tensor, got {getattr(per_token, 'shape', None)}")
    _require(isinstance(response_mask, torch.Tensor) and response_mask.shape == per_token.shape, "response_mask must "
             f"have per_token's shape {tuple(per_token.shape)}, got {getattr(response_mask, 'shape', None)}")
    return torch.where(response_mask.bool(), per_token, torch.zeros_like(per_token)).sum(-1)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sigmoid DPO with conservative label smoothing, mean over P pairs: summed response log-probs ``[P]`` of the
    policy (with grad) and the frozen reference (no grad); ``beta > 0`` (TRL default 0.1), ``label_smoothing``
    ``eps`` in ``[0, 0.5)``. Returns ``(loss, metrics)``, the metrics detached scalar tensors (no host sync):
    ``dpo/loss``, ``dpo/reward_margin`` (mean ``beta * Delta``), ``dpo/reward_accuracy``, ``dpo/chosen_reward``,
    ``dpo/rejected_reward``."""
    named = {"policy_chosen_logps": policy_chosen_logps, "policy_rejected_logps": policy_rejected_logps,
             "ref_chosen_logps": ref_chosen_logps, "ref_rejected_logps": ref_rejected_logps}
    for name, x in named.items():
        _require(isinstance(x, torch.Tensor) and x.dim() == 1 and x.numel(),
                 f"{name} must be a non-empty [P] tensor, got {getattr(x, 'shape', type(x).__name__)}")
        _require(x.shape == policy_chosen_logps.shape, f"{name} has shape {tuple(x.shape)} but policy_chosen_logps "
                 f"has {tuple(policy_chosen_logps.shape)}; all four must be [P]")
    _require(_number(beta) and beta > 0, f"beta must be a number > 0 (TRL default 0.1), got {beta!r}")
    _require(_number(label_smoothing) and 0.0 <= label_smoothing < 0.5,
             f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    chosen = beta * (policy_chosen_logps - ref_chosen_logps)
    rejected = beta * (policy_rejected_logps - ref_rejected_logps)
    logits = chosen - rejected  # beta * Delta
    loss = (-(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)).mean()
    with torch.no_grad():
        metrics = {"dpo/loss": loss.detach(), "dpo/reward_margin": logits.mean(),
                   "dpo/reward_accuracy": (chosen > rejected).float().mean(),
                   "dpo/chosen_reward": chosen.mean(), "dpo/rejected_reward": rejected.mean()}
    return loss, metrics

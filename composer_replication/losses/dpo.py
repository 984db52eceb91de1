"""DPO (sigmoid loss with conservative label smoothing) and the per-token / per-sequence log-probs it uses.

Papers: Rafailov et al., "Direct Preference Optimization" (arXiv 2305.18290); label smoothing is the
conservative DPO of Mitchell (2023, "A note on DPO with noisy preferences"), as in TRL's sigmoid loss
before 1.x (TRL 1.16 moved label smoothing to its "robust"/"aot" losses; with ``label_smoothing=0`` the two agree).

    Delta = (logp(y_w) - ref(y_w)) - (logp(y_l) - ref(y_l))         # summed response log-probs
    L     = mean_p [ -(1 - eps) * log sigmoid(beta * Delta) - eps * log sigmoid(-beta * Delta) ]

Per-token log-probs follow the batch contract: aligned with input positions, ``lp[:, 0] = 0``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from composer_replication.losses.jsd import _check_temperature, _upcast

__all__ = ["per_token_logprobs", "sequence_logprobs", "dpo_loss"]


def per_token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, *, temperature: float = 1.0
) -> torch.Tensor:
    """Log-prob of each input token under the logits of the previous position (aligned convention).

    ``lp[b, t] = log_softmax(logits[b, t - 1] / temperature)[input_ids[b, t]]`` for ``t >= 1``; ``lp[b, 0] = 0``.
    No response mask is applied: mask with :func:`sequence_logprobs` (or multiply) downstream.

    Args:
        logits: ``[B, T, V]`` model logits (position t predicts token t + 1).
        input_ids: ``[B, T]`` integer token ids in ``[0, V)``.
        temperature: ``> 0``.

    Returns:
        ``[B, T]`` (float32 for half-precision logits).

    Raises:
        ValueError: shapes, non-integer ids, ids out of range, ``temperature <= 0``.

    Example:
        >>> per_token_logprobs(torch.randn(2, 6, 10), torch.randint(0, 10, (2, 6))).shape
        torch.Size([2, 6])
    """
    if not isinstance(logits, torch.Tensor) or logits.dim() != 3 or not logits.is_floating_point():
        raise ValueError(f"logits must be a float [B, T, V] tensor, got {getattr(logits, 'shape', None)}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.shape != logits.shape[:2]:
        raise ValueError(
            f"input_ids must have shape {tuple(logits.shape[:2])} (logits' [B, T]), got "
            f"{getattr(input_ids, 'shape', None)}"
        )
    if input_ids.is_floating_point() or input_ids.dtype == torch.bool:
        raise ValueError(f"input_ids must be an integer tensor, got {input_ids.dtype}")
    _check_temperature(temperature)
    vocab = logits.shape[-1]
    if input_ids.numel() and (int(input_ids.min()) < 0 or int(input_ids.max()) >= vocab):
        raise ValueError(
            f"input_ids must lie in [0, V={vocab}), got range [{int(input_ids.min())}, "
            f"{int(input_ids.max())}]"
        )
    z = _upcast(logits[:, :-1]) / temperature  # [B, T-1, V] predicts tokens 1..T-1
    target = input_ids[:, 1:].long().unsqueeze(-1)  # [B, T-1, 1]
    lp = torch.gather(z, -1, target).squeeze(-1) - torch.logsumexp(z, dim=-1)  # [B, T-1]
    return F.pad(lp, (1, 0), value=0.0)  # [B, T], lp[:, 0] = 0


def sequence_logprobs(per_token: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Summed log-prob of each row's response: ``sum_t per_token[b, t] * mask[b, t]``.

    Args:
        per_token: ``[B, T]`` aligned per-token log-probs.
        response_mask: ``[B, T]`` 0/1 or bool.

    Returns:
        ``[B]``. Positions outside the mask are ignored whatever their values.

    Raises:
        ValueError: shape mismatch.
    """
    if not isinstance(per_token, torch.Tensor) or per_token.dim() != 2:
        raise ValueError(f"per_token must be a [B, T] tensor, got {getattr(per_token, 'shape', None)}")
    if not isinstance(response_mask, torch.Tensor) or response_mask.shape != per_token.shape:
        raise ValueError(
            f"response_mask must have per_token's shape {tuple(per_token.shape)}, got "
            f"{getattr(response_mask, 'shape', None)}"
        )
    return torch.where(response_mask.bool(), per_token, torch.zeros_like(per_token)).sum(-1)


def dpo_loss(
    policy_chosen_logps: torch.Tensor,
    policy_rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sigmoid DPO loss with conservative label smoothing (arXiv 2305.18290), mean over P pairs.

    Args:
        policy_chosen_logps: ``[P]`` summed response log-probs of the chosen sequences (with grad).
        policy_rejected_logps: ``[P]`` same for the rejected sequences.
        ref_chosen_logps: ``[P]`` reference model's summed log-probs of the chosen sequences (no grad).
        ref_rejected_logps: ``[P]`` same for the rejected sequences.
        beta: ``> 0`` (TRL default 0.1).
        label_smoothing: ``eps`` in ``[0, 0.5)``: assumed probability that a preference label is flipped.

    Returns:
        ``(loss, metrics)``; metrics ``dpo/reward_margin`` (mean of ``beta * Delta``), ``dpo/reward_accuracy``
        (fraction with chosen reward > rejected reward), ``dpo/chosen_reward``, ``dpo/rejected_reward``.

    Raises:
        ValueError: the four inputs are not ``[P]`` tensors of one shape (``P >= 1``), or ``beta`` /
            ``label_smoothing`` out of range.

    Example:
        >>> loss, m = dpo_loss(torch.tensor([-5.0]), torch.tensor([-9.0]), torch.tensor([-6.0]), torch.tensor([-8.0]))
    """
    named = {
        "policy_chosen_logps": policy_chosen_logps,
        "policy_rejected_logps": policy_rejected_logps,
        "ref_chosen_logps": ref_chosen_logps,
        "ref_rejected_logps": ref_rejected_logps,
    }
    for name, x in named.items():
        if not isinstance(x, torch.Tensor) or x.dim() != 1 or x.numel() == 0:
            raise ValueError(
                f"{name} must be a non-empty [P] tensor, got {getattr(x, 'shape', type(x).__name__)}"
            )
        if x.shape != policy_chosen_logps.shape:
            raise ValueError(
                f"{name} has shape {tuple(x.shape)} but policy_chosen_logps has "
                f"{tuple(policy_chosen_logps.shape)}; all four must be [P]"
            )
    if not isinstance(beta, (int, float)) or not beta > 0:
        raise ValueError(f"beta must be a number > 0 (TRL default 0.1), got {beta!r}")
    if not isinstance(label_smoothing, (int, float)) or not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5), got {label_smoothing!r}")
    chosen_rewards = beta * (policy_chosen_logps - ref_chosen_logps)
    rejected_rewards = beta * (policy_rejected_logps - ref_rejected_logps)
    logits = chosen_rewards - rejected_rewards  # beta * Delta
    losses = -(1.0 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    loss = losses.mean()
    with torch.no_grad():
        metrics = {
            "dpo/loss": float(loss),
            "dpo/reward_margin": float(logits.mean()),
            "dpo/reward_accuracy": float((chosen_rewards > rejected_rewards).float().mean()),
            "dpo/chosen_reward": float(chosen_rewards.mean()),
            "dpo/rejected_reward": float(rejected_rewards.mean()),
        }
    return loss, metrics

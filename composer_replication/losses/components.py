"""The loss components: one per loss that can run in a channel, each reporting under its own name.

Channel 1: ``grpo`` (rollout keys in the batch) or ``lm_ce``; channel 2 by ``LossConfig.sdpo_wrapper``: ``jsd``,
``taid``, ``entropy_opd``; channel 3 by ``LossConfig.dpo_variant``: ``dpo``, ``simpo`` (table: docs/losses.md).
A component maps the :class:`LossContext` of one ``compose_loss`` call to ``(unweighted scalar loss, its own
metrics under bare names)``; the formulas are in the modules it calls.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from composer_replication.losses.config import LossConfig
from composer_replication.losses.dpo import dpo_loss, sequence_logprobs
from composer_replication.losses.entropy_aware_opd import entropy_aware_opd_per_token
from composer_replication.losses.grpo import group_advantages, grpo_loss
from composer_replication.losses.jsd import generalized_jsd_per_token
from composer_replication.losses.logprobs import (
    chunked_cross_entropy,
    chunked_distillation_loss,
    predicted_positions,
)
from composer_replication.losses.sequences import SequenceBatch, batch_tensor, distill_index, optional_tensor
from composer_replication.losses.simpo import simpo_loss
from composer_replication.losses.taid import taid_per_token

__all__ = []

_DPO_KEYS = ("dpo_chosen_input_ids", "dpo_chosen_response_mask", "dpo_rejected_input_ids", "dpo_rejected_response_mask")
_REF_KEYS = ("dpo_chosen_ref_logprobs", "dpo_rejected_ref_logprobs")


@dataclass
class LossContext:
    """What the components of one ``compose_loss`` call share."""

    model: torch.nn.Module
    inputs: dict[str, torch.Tensor]  # the batch (keys: docs/losses.md)
    config: LossConfig
    student: SequenceBatch  # the one decoder pass over input_ids [B, T]
    response_mask: torch.Tensor  # [B, T] 1 on the student's response tokens
    head: tuple[torch.Tensor, torch.Tensor | None]  # (lm_head weight [V, H], bias [V] or None)
    taid_t: float | None = None  # TAID's t of this step
    max_completion_length: int | None = None  # Dr. GRPO's normalizer; None = the batch's T


class LossComponent:
    """One loss of one channel, called as ``(ctx) -> (scalar loss, {metric: value})``: ``name`` is what it
    reports under, ``metric_names`` what it may report."""

    name: ClassVar[str]
    metric_names: ClassVar[tuple[str, ...]]


def _own(metrics: dict, prefix: str) -> dict[str, float]:
    """A loss's ``{"<prefix>/x": v}`` metrics as bare floats, without ``<prefix>/loss``."""
    return {k.split("/", 1)[1]: float(v) for k, v in metrics.items() if k != f"{prefix}/loss"}


# ---------------------------------------------------------------------------- channel 1


class LMCrossEntropy(LossComponent):
    """The spec's LM cross-entropy on the response tokens (channel 1 when the batch has no rollout data)."""

    name, metric_names = "lm_ce", ("num_tokens",)

    def __call__(self, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        student, smoothing = ctx.student, ctx.config.lm_ce_label_smoothing
        rows, pos = predicted_positions(ctx.response_mask, student.attn)
        targets, metrics = student.ids[rows, pos], {"num_tokens": float(rows.numel())}
        if rows.numel() == 0:
            return student.hidden.sum() * 0.0, metrics
        if student.full is not None:
            return F.cross_entropy(student.full[rows, pos - 1], targets, label_smoothing=smoothing), metrics
        return chunked_cross_entropy(student.rows(rows, pos), student.w, targets, chunk_size=student.chunk_size,
                                     label_smoothing=smoothing, bias=student.b), metrics


class GRPO(LossComponent):
    """GRPO on rollouts: ``old_logprobs [B, T]`` + ``advantages [B]`` (or ``rewards`` / ``group_ids [B]``); without
    ``old_logprobs`` the batch is on-policy (TRL's ``num_iterations=1``): old = logprobs.detach(), ratio 1."""

    name, metric_names = "grpo", ("ratio_mean", "clip_ratio", "clip_ratio_low", "clip_ratio_high", "kl")

    def __call__(self, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        inputs, cfg = ctx.inputs, ctx.config
        B, T = ctx.student.ids.shape
        old, ref = (optional_tensor(inputs, key, ctx.student.ids) for key in ("old_logprobs", "ref_logprobs"))
        if "advantages" in inputs:
            adv = batch_tensor(inputs, "advantages", (B,))
        else:
            rewards, gids = batch_tensor(inputs, "rewards", (B,)), batch_tensor(inputs, "group_ids", (B,))
            adv = group_advantages(rewards, gids, scale_rewards=cfg.scale_rewards)
        lp, _ = ctx.student.token_logprobs(ctx.response_mask)
        loss, m = grpo_loss(lp, lp.detach() if old is None else old, adv, ctx.response_mask, config=cfg,
                            ref_logprobs=ref, max_completion_length=ctx.max_completion_length)
        return loss, _own(m, "grpo")


def policy_component(inputs: dict[str, torch.Tensor]) -> LossComponent:
    """Channel 1: :class:`GRPO` when ``inputs`` carries rollout data (``advantages``, or ``old_logprobs`` with
    ``rewards`` / ``group_ids``), else :class:`LMCrossEntropy`."""
    rollout = "advantages" in inputs or ("old_logprobs" in inputs and {"rewards", "group_ids"} <= inputs.keys())
    return GRPO() if rollout else LMCrossEntropy()


# ---------------------------------------------------------------------------- channel 2


class _Distillation(LossComponent):
    """Token mean (``sdpo_token_weight [N]``-weighted if given) of a per-token divergence between the student and
    its hinted self, the no-grad teacher, at the positions that predict the same tokens."""

    metric_names: ClassVar[tuple[str, ...]] = ("num_tokens",)

    def per_token_fn(self, ctx: LossContext):
        """``(student_logits [n, V], teacher_logits [n, V]) -> [n]`` with this component's options."""
        raise NotImplementedError

    def __call__(self, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        fn, student, inputs, chunk_size = self.per_token_fn(ctx), ctx.student, ctx.inputs, ctx.config.chunk_size
        t_ids = batch_tensor(inputs, "ctx_teacher_input_ids")
        if t_ids.dim() != 2:
            raise ValueError(f"ctx_teacher_input_ids must be [B2, Tt]; got {tuple(t_ids.shape)}")
        s_idx, t_idx = distill_index(inputs, student.ids, t_ids, ctx.response_mask)
        n = s_idx.shape[0]
        weights = batch_tensor(inputs, "sdpo_token_weight", (n,)) if "sdpo_token_weight" in inputs else None
        metrics = {"num_tokens": float(n), **({"t": float(ctx.taid_t)} if "t" in self.metric_names else {})}
        if n == 0:
            return student.hidden.sum() * 0.0, metrics
        teacher = SequenceBatch(ctx.model, t_ids, optional_tensor(inputs, "ctx_teacher_attention_mask", t_ids), ctx.head,
                                chunk_size, grad=False, share_prefix=ctx.config.share_prefix)
        if chunk_size is None:
            d = fn(student.full[s_idx[:, 0], s_idx[:, 1] - 1], teacher.full[t_idx[:, 0], t_idx[:, 1] - 1])
            return (d.mean() if weights is None else (d * weights).sum() / weights.sum()), metrics
        loss, _ = chunked_distillation_loss(student.rows(s_idx[:, 0], s_idx[:, 1]), teacher.rows(t_idx[:, 0], t_idx[:, 1]),
                                            student.w, fn, weights=weights, chunk_size=chunk_size, bias=student.b)
        return loss, metrics


class JSD(_Distillation):
    """Generalized JSD (``sdpo_jsd_beta``: 0 forward KL, 1 reverse KL), with temperature, top-k, token clip."""

    name = "jsd"

    def per_token_fn(self, ctx: LossContext):
        c = ctx.config
        return functools.partial(generalized_jsd_per_token, beta=c.sdpo_jsd_beta, temperature=c.sdpo_temperature,
                                 top_k=c.sdpo_top_k, token_clip=c.sdpo_token_clip)


class TAID(_Distillation):
    """TAID: KL to the interpolation of teacher and (detached) student at ``t`` (``compose_loss(taid_t=)``)."""

    name, metric_names = "taid", ("num_tokens", "t")

    def per_token_fn(self, ctx: LossContext):
        return functools.partial(taid_per_token, t=ctx.taid_t)


class EntropyOPD(_Distillation):
    """Entropy-aware OPD: forward KL where the teacher is uncertain, reverse KL elsewhere."""

    name = "entropy_opd"

    def per_token_fn(self, ctx: LossContext):
        c = ctx.config
        return functools.partial(entropy_aware_opd_per_token, h_max=c.entropy_opd_h_max, temperature=c.sdpo_temperature)


DISTILL_COMPONENTS: dict[str, type[_Distillation]] = {"none": JSD, "taid": TAID, "entropy_opd": EntropyOPD}
"""Channel 2 by ``LossConfig.sdpo_wrapper``."""


# ---------------------------------------------------------------------------- channel 3


def _pair_logprobs(ctx: LossContext) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Summed response log-probs ``[P]`` and response token counts ``[P]`` of the chosen and rejected rows, through
    one decoder pass (``[2P, T]``, the shorter side right-padded) so that a pair's prompt is decoded once."""
    inputs, sides = ctx.inputs, []
    for key in _DPO_KEYS:
        batch_tensor(inputs, key, what="for the trace-replay channel")
    for side in ("chosen", "rejected"):
        ids = inputs[f"dpo_{side}_input_ids"]
        attn = optional_tensor(inputs, f"dpo_{side}_attention_mask", ids)
        sides.append((ids, torch.ones_like(ids) if attn is None else attn,
                      batch_tensor(inputs, f"dpo_{side}_response_mask", ids.shape)))
    P, n_rejected = sides[0][0].shape[0], sides[1][0].shape[0]
    if P != n_rejected:
        raise ValueError(f"chosen and rejected must hold the same number of pairs; got {P} and {n_rejected}")
    width = max(ids.shape[1] for ids, _, _ in sides)
    ids, attn, mask = (torch.cat([F.pad(side[k], (0, width - side[k].shape[1])) for side in sides]) for k in range(3))
    lp, valid = SequenceBatch(ctx.model, ids, attn, ctx.head, ctx.config.chunk_size,
                              share_prefix=ctx.config.share_prefix).token_logprobs(mask)  # [2P, T]
    sums, counts = sequence_logprobs(lp, valid), valid.sum(-1).to(lp.dtype)
    return [sums[:P], sums[P:]], [counts[:P], counts[P:]]


def _with_chosen_nll(loss, sums, counts, alpha: float) -> tuple[torch.Tensor, dict[str, float]]:
    """``loss + alpha * NLL(chosen)`` (RPO, TRL's ``rpo_alpha``), the NLL a token mean; ``alpha == 0``: nothing."""
    if alpha <= 0:
        return loss, {}
    nll = -sums[0].sum() / counts[0].sum().clamp(min=1)
    return loss + alpha * nll, {"chosen_nll": float(nll.detach())}


class DPO(LossComponent):
    """Sigmoid DPO on summed response log-probs against the frozen reference's (``dpo_*_ref_logprobs [P]``)."""

    name = "dpo"
    metric_names = ("num_pairs", "reward_margin", "reward_accuracy", "chosen_reward", "rejected_reward", "chosen_nll")

    def __call__(self, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        inputs, cfg = ctx.inputs, ctx.config
        missing = [k for k in _REF_KEYS if k not in inputs]
        if missing:
            raise ValueError(f"dpo_variant='dpo' needs the reference log-probs {missing} (summed over each response, "
                             "from the frozen reference: sequence_logprobs_for(ref_model, ...) under no_grad); or use "
                             "dpo_variant='simpo', or beta_replay=0.")
        sums, counts = _pair_logprobs(ctx)
        P = sums[0].shape[0]
        rc, rr = (batch_tensor(inputs, k, (P,)) for k in _REF_KEYS)
        loss, m = dpo_loss(sums[0], sums[1], rc, rr, beta=cfg.replay_dpo_beta, label_smoothing=cfg.dpo_label_smoothing)
        loss, nll = _with_chosen_nll(loss, sums, counts, cfg.rpo_alpha)
        return loss, {"num_pairs": float(P), **_own(m, "dpo"), **nll}


class SimPO(LossComponent):
    """Reference-free SimPO on length-normalized response log-probs (reference keys are ignored)."""

    name, metric_names = "simpo", ("num_pairs", "reward_margin", "reward_accuracy", "chosen_nll")

    def __call__(self, ctx: LossContext) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = ctx.config
        sums, counts = _pair_logprobs(ctx)
        chosen, rejected = sums[0] / counts[0].clamp(min=1), sums[1] / counts[1].clamp(min=1)
        loss, nll = _with_chosen_nll(simpo_loss(chosen, rejected, beta=cfg.simpo_beta, gamma=cfg.simpo_gamma),
                                     sums, counts, cfg.rpo_alpha)
        with torch.no_grad():
            margin = cfg.simpo_beta * (chosen - rejected)  # [P] reward difference, before gamma
            return loss, {"num_pairs": float(chosen.shape[0]), "reward_margin": float(margin.mean()),
                          "reward_accuracy": float((margin > 0).float().mean()), **nll}


REPLAY_COMPONENTS: dict[str, type[LossComponent]] = {"dpo": DPO, "simpo": SimPO}
"""Channel 3 by ``LossConfig.dpo_variant``."""

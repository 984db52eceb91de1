"""The three-channel Composer loss: policy + self-distillation + trace replay.

``total = policy + alpha_sdpo * distill + beta_replay * replay`` (DESIGN.md section 1), where

1. *policy* is GRPO (Shao et al., arXiv 2402.03300; TRL's loss types) when the batch carries rollout
   data (``old_logprobs`` + ``advantages`` or ``rewards``/``group_ids``), else the spec's LM
   cross-entropy on response tokens, reported as ``lm_ce``;
2. *distill* is on-policy self-distillation at error sites (SDPO, arXiv 2601.20802; OPSD, arXiv
   2601.18734): the same model, given a hint, is the no-grad teacher of the same response tokens,
   compared position by position through gather indices (generalized JSD, TAID or entropy-aware OPD);
3. *replay* is DPO (Rafailov et al., arXiv 2305.18290) or SimPO (Meng et al., arXiv 2405.14734) on
   (chosen, rejected) pairs from teacher replay.

Each distinct sequence batch goes through the decoder once (student ids, teacher ids under no_grad,
chosen ids, rejected ids); the logits are produced chunk by chunk from the hidden states by
:mod:`composer_replication.logprobs` (``chunk_size=None``: naive full logits). The batch keys are
those of ``batch_contract.md`` (see ``docs/architecture.md``).
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from composer_replication.distillation import entropy_aware_opd_per_token, simpo_loss, taid_per_token
from composer_replication.dpo import dpo_loss, per_token_logprobs, sequence_logprobs
from composer_replication.grpo import GRPOLossConfig, group_advantages, grpo_loss
from composer_replication.logprobs import (
    DEFAULT_CHUNK_SIZE,
    chunked_cross_entropy,
    chunked_distillation_loss,
    chunked_token_logprobs,
    hidden_states,
    output_head,
    predicted_positions,
)
from composer_replication.opsd import generalized_jsd_per_token

__all__ = ["LossComponents", "compose_loss", "self_distillation_loss", "token_logprobs_for", "sequence_logprobs_for"]

log = logging.getLogger(__name__)

_DPO_KEYS = ("dpo_chosen_input_ids", "dpo_chosen_response_mask", "dpo_rejected_input_ids", "dpo_rejected_response_mask")
_REF_KEYS = ("dpo_chosen_ref_logprobs", "dpo_rejected_ref_logprobs")


@dataclass
class LossComponents:
    """Per-channel breakdown of the total loss; all tensors are scalars (``shape=()``).

    ``lm_ce`` keeps the spec's field name but holds channel 1's loss whatever its kind; ``policy_name``
    says which ("grpo" or "lm_ce") and :meth:`detached` reports it under that name.
    """

    lm_ce: torch.Tensor
    """Channel 1 (policy) loss: GRPO or LM cross-entropy, see ``policy_name``."""
    sdpo_jsd: torch.Tensor
    """Channel 2 (self-distillation) loss, unweighted; 0 when the channel is off."""
    trace_replay_dpo: torch.Tensor
    """Channel 3 (DPO or SimPO) loss, unweighted; 0 when the channel is off."""
    total: torch.Tensor
    """``lm_ce + alpha_sdpo * sdpo_jsd + beta_replay * trace_replay_dpo``."""
    policy_name: str = "lm_ce"
    """``"grpo"`` when rollout data made channel 1 GRPO, else ``"lm_ce"``."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Extra scalars from the channels (token counts, GRPO clip fractions, DPO margins, ...)."""

    @property
    def policy(self) -> torch.Tensor:
        """Channel 1's loss (alias of ``lm_ce``)."""
        return self.lm_ce

    def detached(self) -> dict[str, float]:
        """Python floats of every channel under its true name: ``grpo`` or ``lm_ce``, ``sdpo_jsd``,
        ``trace_replay_dpo``, ``total``."""
        return {
            self.policy_name: float(self.lm_ce.detach()),
            "sdpo_jsd": float(self.sdpo_jsd.detach()),
            "trace_replay_dpo": float(self.trace_replay_dpo.detach()),
            "total": float(self.total.detach()),
        }


# ---------------------------------------------------------------------------- one sequence batch


class _Seqs:
    """One decoder pass over a sequence batch; logits of selected rows, chunked or naive."""

    def __init__(self, model, ids, attn, head, chunk_size, *, grad: bool = True) -> None:
        self.ids, self.attn, (self.w, self.b), self.chunk_size = ids, attn, head, chunk_size
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            self.hidden = hidden_states(model, ids, attn)  # [B, T, H]
            self.full = None if chunk_size is not None else F.linear(self.hidden, self.w, self.b).float()

    def rows(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[N, H]`` predicting tokens ``(rows, pos)`` (taken at ``pos - 1``)."""
        return self.hidden[rows, pos - 1]

    def token_logprobs(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lp [B, T], valid [B, T])``: aligned log-probs on the predictable tokens of ``mask``, 0 elsewhere."""
        rows, pos = predicted_positions(mask, self.attn)
        valid = torch.zeros_like(mask, dtype=torch.bool).index_put((rows, pos), torch.ones_like(rows, dtype=torch.bool))
        if self.full is None:
            lp = chunked_token_logprobs(
                self.hidden, self.w, self.ids, chunk_size=self.chunk_size, attention_mask=self.attn, mask=mask, bias=self.b
            )
        else:  # naive: log-softmax over the full [B, T, V] logits
            lp = torch.where(valid, per_token_logprobs(self.full, self.ids), 0.0)
        return lp, valid


def _get(inputs: dict, key: str, shape: tuple | None = None, what: str = "") -> torch.Tensor:
    if key not in inputs:
        raise ValueError(f"inputs lacks {key!r}, required {what}; add it to the batch (see batch_contract.md)")
    t = inputs[key]
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"inputs[{key!r}] must have shape {tuple(shape)}; got {tuple(t.shape)}")
    return t


def _attn(inputs: dict, key: str, ids: torch.Tensor) -> torch.Tensor | None:
    return _get(inputs, key, ids.shape) if key in inputs else None


# ---------------------------------------------------------------------------- channel 1


def _policy(student: _Seqs, inputs, resp, grpo_cfg, label_smoothing, metrics) -> tuple[torch.Tensor, str]:
    B, T = student.ids.shape
    rows, pos = predicted_positions(resp, student.attn)
    rollout = "old_logprobs" in inputs and ("advantages" in inputs or {"rewards", "group_ids"} <= inputs.keys())
    if not rollout:
        targets = student.ids[rows, pos]
        metrics["lm_ce/num_tokens"] = float(rows.numel())
        if rows.numel() == 0:
            return student.hidden.sum() * 0.0, "lm_ce"
        if student.full is None:
            loss = chunked_cross_entropy(
                student.rows(rows, pos), student.w, targets, chunk_size=student.chunk_size,
                label_smoothing=label_smoothing, bias=student.b,
            )
        else:
            loss = F.cross_entropy(student.full[rows, pos - 1], targets, label_smoothing=label_smoothing)
        return loss, "lm_ce"
    old = _get(inputs, "old_logprobs", (B, T))
    if "advantages" in inputs:
        adv = _get(inputs, "advantages", (B,))
    else:
        rewards, gids = _get(inputs, "rewards", (B,)), _get(inputs, "group_ids", (B,))
        adv = group_advantages(rewards, gids, scale_rewards=grpo_cfg.scale_rewards)
    ref = _get(inputs, "ref_logprobs", (B, T)) if "ref_logprobs" in inputs else None
    lp, _ = student.token_logprobs(resp)
    loss, m = grpo_loss(lp, old, adv, resp, config=grpo_cfg, ref_logprobs=ref)
    metrics.update({k: float(v) for k, v in m.items()})
    return loss, "grpo"


# ---------------------------------------------------------------------------- channel 2


def _sdpo_index(inputs, student: _Seqs, teacher_ids, resp) -> tuple[torch.Tensor, torch.Tensor]:
    """``(student_index [N, 2], teacher_index [N, 2])``, given or derived from the masks."""
    if "sdpo_student_index" in inputs or "sdpo_teacher_index" in inputs:
        s_idx = _get(inputs, "sdpo_student_index", what="with sdpo_teacher_index").long()
        t_idx = _get(inputs, "sdpo_teacher_index", what="with sdpo_student_index").long()
        if s_idx.dim() != 2 or s_idx.shape[1] != 2 or s_idx.shape != t_idx.shape:
            raise ValueError(
                f"sdpo_student_index and sdpo_teacher_index must both be [N, 2]; got {tuple(s_idx.shape)} "
                f"and {tuple(t_idx.shape)}"
            )
    else:
        B = student.ids.shape[0]
        if teacher_ids.shape[0] != B:
            raise ValueError(
                f"without sdpo_student_index/sdpo_teacher_index the teacher batch must have B={B} rows; got "
                f"{teacher_ids.shape[0]}. Pass the index keys."
            )
        t_mask = _get(inputs, "sdpo_loss_mask", teacher_ids.shape, "when the sdpo index keys are absent")
        s_idx, t_idx = resp.nonzero(), t_mask.nonzero()  # row-major
        s_cnt, t_cnt = torch.bincount(s_idx[:, 0], minlength=B), torch.bincount(t_idx[:, 0], minlength=B)
        if not torch.equal(s_cnt, t_cnt):
            raise ValueError(
                f"per-row counts of response_mask {s_cnt.tolist()} and sdpo_loss_mask {t_cnt.tolist()} differ; "
                "the teacher must hold exactly the student's response tokens, or pass sdpo_student_index and "
                "sdpo_teacher_index."
            )
    for name, idx, ids in (("sdpo_student_index", s_idx, student.ids), ("sdpo_teacher_index", t_idx, teacher_ids)):
        if idx.numel() and not (
            (idx[:, 0] >= 0).all() and (idx[:, 0] < ids.shape[0]).all() and (idx[:, 1] >= 1).all() and (idx[:, 1] < ids.shape[1]).all()
        ):
            raise ValueError(f"{name} out of range for ids of shape {tuple(ids.shape)} (positions must be >= 1)")
    same = student.ids[s_idx[:, 0], s_idx[:, 1]] == teacher_ids[t_idx[:, 0], t_idx[:, 1]]
    if not bool(same.all()):
        raise ValueError(
            f"{int((~same).sum())} of {same.numel()} distilled tokens differ between the student and teacher "
            "sequences; the teacher sequence must end with exactly the student's response tokens."
        )
    return s_idx, t_idx


def _distill_fn(wrapper, *, jsd_beta, temperature, token_clip, top_k, taid_t, h_max):
    if wrapper == "taid":
        return functools.partial(taid_per_token, t=taid_t)
    if wrapper == "entropy_opd":
        return functools.partial(entropy_aware_opd_per_token, h_max=h_max, temperature=temperature)
    return functools.partial(
        generalized_jsd_per_token, beta=jsd_beta, temperature=temperature, top_k=top_k, token_clip=token_clip
    )


def _distill(model, student: _Seqs, inputs, resp, fn, head, chunk_size, metrics) -> torch.Tensor:
    t_ids = _get(inputs, "ctx_teacher_input_ids")
    if t_ids.dim() != 2:
        raise ValueError(f"ctx_teacher_input_ids must be [B2, Tt]; got {tuple(t_ids.shape)}")
    s_idx, t_idx = _sdpo_index(inputs, student, t_ids, resp)
    n = s_idx.shape[0]
    weights = _get(inputs, "sdpo_token_weight", (n,)) if "sdpo_token_weight" in inputs else None
    metrics["sdpo/num_tokens"] = float(n)
    if n == 0:
        return student.hidden.sum() * 0.0
    teacher = _Seqs(model, t_ids, _attn(inputs, "ctx_teacher_attention_mask", t_ids), head, chunk_size, grad=False)
    if chunk_size is None:
        s_logits = student.full[s_idx[:, 0], s_idx[:, 1] - 1]
        t_logits = teacher.full[t_idx[:, 0], t_idx[:, 1] - 1]
        d = fn(s_logits, t_logits)
        return d.mean() if weights is None else (d * weights).sum() / weights.sum()
    loss, _ = chunked_distillation_loss(
        student.rows(s_idx[:, 0], s_idx[:, 1]), teacher.rows(t_idx[:, 0], t_idx[:, 1]), student.w, fn,
        weights=weights, chunk_size=chunk_size, bias=student.b,
    )
    return loss


# ---------------------------------------------------------------------------- channel 3


def _replay(model, inputs, head, chunk_size, variant, *, dpo_beta, dpo_ls, simpo_beta, simpo_gamma, metrics):
    for key in _DPO_KEYS:
        _get(inputs, key, what="for the trace-replay channel")
    if variant == "dpo":
        missing = [k for k in _REF_KEYS if k not in inputs]
        if missing:
            raise ValueError(
                f"dpo_variant='dpo' needs the reference log-probs {missing} (summed over each response, from "
                "the frozen reference: sequence_logprobs_for(ref_model, ...) under no_grad); or use "
                "dpo_variant='simpo', or beta_replay=0."
            )
    sums, counts = [], []
    for side in ("chosen", "rejected"):
        ids = inputs[f"dpo_{side}_input_ids"]
        mask = _get(inputs, f"dpo_{side}_response_mask", ids.shape)
        seqs = _Seqs(model, ids, _attn(inputs, f"dpo_{side}_attention_mask", ids), head, chunk_size)
        lp, valid = seqs.token_logprobs(mask)
        sums.append(sequence_logprobs(lp, valid))
        counts.append(valid.sum(-1).to(lp.dtype))
    if sums[0].shape != sums[1].shape:
        raise ValueError(f"chosen and rejected must hold the same number of pairs; got {sums[0].shape[0]} and {sums[1].shape[0]}")
    metrics["replay/num_pairs"] = float(sums[0].shape[0])
    if variant == "simpo":
        return simpo_loss(sums[0] / counts[0].clamp(min=1), sums[1] / counts[1].clamp(min=1), beta=simpo_beta, gamma=simpo_gamma)
    P = sums[0].shape[0]
    rc, rr = (_get(inputs, k, (P,)) for k in _REF_KEYS)
    loss, m = dpo_loss(sums[0], sums[1], rc, rr, beta=dpo_beta, label_smoothing=dpo_ls)
    metrics.update({k: float(v) for k, v in m.items()})
    return loss


# ---------------------------------------------------------------------------- entry points


def _check_options(dpo_variant, sdpo_wrapper, taid_t, alpha_sdpo, beta_replay, label_smoothing, chunk_size) -> None:
    if dpo_variant not in ("dpo", "simpo"):
        raise ValueError(f"dpo_variant must be 'dpo' or 'simpo'; got {dpo_variant!r}")
    if sdpo_wrapper not in ("none", "taid", "entropy_opd"):
        raise ValueError(f"sdpo_wrapper must be 'none', 'taid' or 'entropy_opd'; got {sdpo_wrapper!r}")
    if sdpo_wrapper == "taid":
        if taid_t is None:
            raise ValueError("sdpo_wrapper='taid' needs taid_t (a float in [0, 1], e.g. TAIDScheduler.t); got None")
        if not 0.0 <= float(taid_t) <= 1.0:
            raise ValueError(f"taid_t must be in [0, 1]; got {taid_t!r}")
    if alpha_sdpo < 0 or beta_replay < 0:
        raise ValueError(f"alpha_sdpo and beta_replay must be >= 0 (0 disables); got {alpha_sdpo!r}, {beta_replay!r}")
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"lm_ce_label_smoothing must be in [0, 1); got {label_smoothing!r}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None (naive full logits); got {chunk_size!r}")


def compose_loss(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    *,
    alpha_sdpo: float = 0.1,
    beta_replay: float = 0.05,
    sdpo_jsd_beta: float = 0.5,
    sdpo_temperature: float = 1.0,
    sdpo_token_clip: float | None = None,
    replay_dpo_beta: float = 0.1,
    lm_ce_label_smoothing: float = 0.0,
    dpo_variant: Literal["dpo", "simpo"] = "dpo",
    sdpo_wrapper: Literal["none", "taid", "entropy_opd"] = "none",
    taid_t: float | None = None,
    simpo_beta: float = 2.0,
    simpo_gamma: float = 1.0,
    entropy_opd_h_max: float | None = None,
    grpo: GRPOLossConfig | None = None,
    sdpo_top_k: int | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    dpo_label_smoothing: float = 0.0,
) -> LossComponents:
    """``total = policy + alpha_sdpo * distill + beta_replay * replay`` on one batch (batch_contract.md).

    Args:
        model: Hugging Face causal LM (decoder via ``get_decoder()``, head via ``get_output_embeddings()``).
        inputs: required ``input_ids [B, T]``, ``response_mask [B, T]``; optional ``attention_mask``;
            GRPO keys (``old_logprobs [B, T]`` + ``advantages [B]`` or ``rewards [B]``/``group_ids [B]``,
            ``ref_logprobs [B, T]``); channel-2 keys (``ctx_teacher_input_ids [B2, Tt]``,
            ``ctx_teacher_attention_mask``, ``sdpo_loss_mask``, ``sdpo_student_index [N, 2]``,
            ``sdpo_teacher_index [N, 2]``, ``sdpo_token_weight [N]``); channel-3 keys (``dpo_{chosen,rejected}_
            {input_ids,attention_mask,response_mask} [P, T*]``, ``dpo_{chosen,rejected}_ref_logprobs [P]``).
        alpha_sdpo / beta_replay: channel weights; 0 (or absent keys) turns a channel off, with no forward pass.
        sdpo_jsd_beta / sdpo_temperature / sdpo_token_clip / sdpo_top_k: generalized JSD options.
        replay_dpo_beta / dpo_label_smoothing: DPO options. simpo_beta / simpo_gamma: SimPO options.
        lm_ce_label_smoothing: label smoothing of the LM cross-entropy fallback.
        dpo_variant: ``"dpo"`` or ``"simpo"``. sdpo_wrapper: ``"none"`` (JSD), ``"taid"``, ``"entropy_opd"``.
        taid_t: TAID interpolation in ``[0, 1]`` (required for ``"taid"``). entropy_opd_h_max: ``None`` = log V.
        grpo: GRPO loss configuration (``None`` = ``GRPOLossConfig()``).
        chunk_size: rows of logits per chunk; ``None`` = naive full ``[B, T, V]`` logits.

    Returns:
        :class:`LossComponents`.

    Raises:
        ValueError: unknown ``dpo_variant``/``sdpo_wrapper``, ``taid`` without ``taid_t`` or with ``taid_t``
            outside ``[0, 1]``, missing required keys, bad shapes, mismatched channel-2 tokens.
    """
    _check_options(dpo_variant, sdpo_wrapper, taid_t, alpha_sdpo, beta_replay, lm_ce_label_smoothing, chunk_size)
    ids = _get(inputs, "input_ids", what="(student token ids [B, T])")
    if ids.dim() != 2:
        raise ValueError(f"inputs['input_ids'] must be [B, T]; got shape {tuple(ids.shape)}")
    resp = _get(inputs, "response_mask", ids.shape, "(1 on response tokens)")
    head = output_head(model)
    metrics: dict[str, float] = {}

    student = _Seqs(model, ids, _attn(inputs, "attention_mask", ids), head, chunk_size)
    policy, name = _policy(student, inputs, resp, grpo or GRPOLossConfig(), lm_ce_label_smoothing, metrics)
    zero = torch.zeros((), dtype=torch.float32, device=ids.device)

    distill = zero
    if alpha_sdpo != 0 and "ctx_teacher_input_ids" in inputs:
        fn = _distill_fn(
            sdpo_wrapper, jsd_beta=sdpo_jsd_beta, temperature=sdpo_temperature, token_clip=sdpo_token_clip,
            top_k=sdpo_top_k, taid_t=taid_t, h_max=entropy_opd_h_max,
        )
        distill = _distill(model, student, inputs, resp, fn, head, chunk_size, metrics)

    replay = zero
    if beta_replay != 0 and "dpo_chosen_input_ids" in inputs:
        replay = _replay(
            model, inputs, head, chunk_size, dpo_variant, dpo_beta=replay_dpo_beta, dpo_ls=dpo_label_smoothing,
            simpo_beta=simpo_beta, simpo_gamma=simpo_gamma, metrics=metrics,
        )

    total = policy + alpha_sdpo * distill + beta_replay * replay
    return LossComponents(
        lm_ce=policy, sdpo_jsd=distill, trace_replay_dpo=replay, total=total, policy_name=name, metrics=metrics
    )


def self_distillation_loss(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    *,
    sdpo_jsd_beta: float = 0.5,
    sdpo_temperature: float = 1.0,
    sdpo_token_clip: float | None = None,
    sdpo_wrapper: Literal["none", "taid", "entropy_opd"] = "none",
    taid_t: float | None = None,
    entropy_opd_h_max: float | None = None,
    sdpo_top_k: int | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Channel 2 of :func:`compose_loss` alone: no channel-1 loss is computed, so no lm_head pass is wasted.

    For trainers that compute the policy loss themselves (``ComposerReplicationTrainer`` on TRL's GRPO).
    Same code path and same options as ``compose_loss``'s channel 2: one student forward over
    ``input_ids`` and one teacher forward (no grad) over ``ctx_teacher_input_ids``, compared at the
    positions that predict the same response tokens.

    Args:
        model: causal LM whose logits are ``lm_head(hidden)``.
        inputs: ``input_ids [B, T]``, ``response_mask [B, T]``, optional ``attention_mask [B, T]``, and the
            channel-2 keys ``ctx_teacher_input_ids [B2, Tt]``, ``sdpo_loss_mask [B2, Tt]`` (rows aligned with
            the student's when ``sdpo_*_index`` are absent), optional ``ctx_teacher_attention_mask``,
            ``sdpo_student_index [N, 2]``, ``sdpo_teacher_index [N, 2]``, ``sdpo_token_weight [N]``.
        The options: as in :func:`compose_loss`.

    Returns:
        ``(loss, metrics)``: the scalar token-mean divergence and ``{"sdpo/num_tokens": N, ...}``.

    Raises:
        ValueError: missing keys, bad shapes, mismatched student/teacher tokens, bad options.
    """
    _check_options("dpo", sdpo_wrapper, taid_t, 1.0, 0.0, 0.0, chunk_size)
    ids = _get(inputs, "input_ids", what="(student token ids [B, T])")
    if ids.dim() != 2:
        raise ValueError(f"inputs['input_ids'] must be [B, T]; got shape {tuple(ids.shape)}")
    resp = _get(inputs, "response_mask", ids.shape, "(1 on response tokens)")
    _get(inputs, "ctx_teacher_input_ids", what="(hinted teacher token ids [B2, Tt])")
    head = output_head(model)
    metrics: dict[str, float] = {}
    student = _Seqs(model, ids, _attn(inputs, "attention_mask", ids), head, chunk_size)
    fn = _distill_fn(
        sdpo_wrapper, jsd_beta=sdpo_jsd_beta, temperature=sdpo_temperature, token_clip=sdpo_token_clip,
        top_k=sdpo_top_k, taid_t=taid_t, h_max=entropy_opd_h_max,
    )
    return _distill(model, student, inputs, resp, fn, head, chunk_size, metrics), metrics


def token_logprobs_for(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    response_mask: torch.Tensor | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Per-token log-probs ``[B, T]`` (aligned: position 0 and positions outside ``response_mask`` are 0).

    The same kernel as :func:`compose_loss`; call it under ``torch.no_grad()`` for old/reference log-probs.

    Args:
        model: causal LM. input_ids: ``[B, T]``. attention_mask: ``[B, T]`` or ``None``.
        response_mask: ``[B, T]`` positions wanted (``None``: every real token).
        chunk_size: rows per chunk (``None`` = naive). temperature: softmax temperature.
    """
    weight, bias = output_head(model)
    hidden = hidden_states(model, input_ids, attention_mask)
    return chunked_token_logprobs(
        hidden, weight, input_ids, chunk_size=chunk_size, temperature=temperature,
        attention_mask=attention_mask, mask=response_mask, bias=bias,
    )


def sequence_logprobs_for(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Summed response log-probs ``[B]`` (e.g. DPO reference log-probs under ``torch.no_grad()``).

    Args:
        model: causal LM. input_ids / response_mask / attention_mask: ``[B, T]``.
        chunk_size: rows per chunk (``None`` = naive). temperature: softmax temperature.
    """
    lp = token_logprobs_for(
        model, input_ids, attention_mask, response_mask=response_mask, chunk_size=chunk_size, temperature=temperature
    )
    return lp.sum(-1)

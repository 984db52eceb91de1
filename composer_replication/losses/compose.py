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

Each channel's loss is a component of :mod:`.components` that reports under its own name (``grpo`` or
``lm_ce``; ``jsd``, ``taid`` or ``entropy_opd``; ``dpo`` or ``simpo``) with its own metrics. Options
come from one typed :class:`~composer_replication.losses.config.LossConfig`. Each distinct sequence batch
goes through the decoder once (student ids, teacher ids under no_grad, chosen ids, rejected ids); the
logits are produced chunk by chunk from the hidden states by :mod:`.logprobs` (``chunk_size=None``:
naive full logits). The batch keys are listed in ``docs/losses.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_replication.losses.components import (
    DISTILL_COMPONENTS,
    REPLAY_COMPONENTS,
    LossComponent,
    LossContext,
    policy_component,
)
from composer_replication.losses.config import LossConfig
from composer_replication.losses.logprobs import DEFAULT_CHUNK_SIZE, output_head
from composer_replication.losses.sequences import SequenceBatch, batch_tensor, optional_tensor

__all__ = ["LossComponents", "compose_loss", "self_distillation_loss", "resolve_loss_config"]

_OPTIONS = frozenset(f.name for f in dataclasses.fields(LossConfig))
_KEYWORD_DEFAULTS: dict[str, Any] = {"chunk_size": DEFAULT_CHUNK_SIZE}
"""Where the keyword form's default differs from ``LossConfig``'s (``chunk_size``: 256 vs 1024)."""


@dataclass
class LossComponents:
    """Per-channel breakdown of the total loss; all tensors are scalars (``shape=()``).

    The four tensor fields are the spec's, kept for compatibility: each holds its channel's loss
    *whatever loss ran* in it. The true names are ``policy_name``, ``distill_name`` and ``replay_name``,
    and :meth:`metrics` reports every channel that ran under its true name (``loss/grpo``, ``loss/taid``,
    ``loss/simpo``, ...); :meth:`detached` keeps the spec's four keys.
    """

    lm_ce: torch.Tensor
    """Spec field: channel 1 (policy) loss, GRPO or LM cross-entropy (see ``policy_name``)."""
    sdpo_jsd: torch.Tensor
    """Spec field: channel 2 (self-distillation) loss, unweighted, JSD, TAID or entropy-aware OPD (see
    ``distill_name``); 0 when the channel is off."""
    trace_replay_dpo: torch.Tensor
    """Spec field: channel 3 (trace replay) loss, unweighted, DPO or SimPO (see ``replay_name``); 0 when off."""
    total: torch.Tensor
    """``lm_ce + alpha_sdpo * sdpo_jsd + beta_replay * trace_replay_dpo``."""
    policy_name: str = "lm_ce"
    """Channel 1's component: ``"grpo"`` when rollout data made it GRPO, else ``"lm_ce"``."""
    distill_name: str | None = None
    """Channel 2's component (``"jsd"``, ``"taid"``, ``"entropy_opd"``), ``None`` when it did not run."""
    replay_name: str | None = None
    """Channel 3's component (``"dpo"``, ``"simpo"``), ``None`` when it did not run."""
    channel_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    """Each component that ran: its name -> its own metrics under bare names (``{"grpo": {"clip_ratio": 0.1}}``)."""

    @property
    def policy(self) -> torch.Tensor:
        """Channel 1's loss (alias of ``lm_ce``)."""
        return self.lm_ce

    def channels(self) -> dict[str, torch.Tensor]:
        """``{name: loss}`` of the channels that ran, by their true names, in channel order."""
        out = {self.policy_name: self.lm_ce}
        if self.distill_name is not None:
            out[self.distill_name] = self.sdpo_jsd
        if self.replay_name is not None:
            out[self.replay_name] = self.trace_replay_dpo
        return out

    def metrics(self) -> dict[str, float]:
        """Python floats in the project's metrics scheme: ``loss/total``, ``loss/<name>`` for each channel
        that ran (``loss/grpo``, ``loss/taid``, ...) and each component's own metrics as
        ``loss/<name>/<metric>`` (``loss/grpo/clip_ratio``, ``loss/dpo/reward_accuracy``, ...)."""
        out = {f"loss/{name}": float(loss.detach()) for name, loss in self.channels().items()}
        out["loss/total"] = float(self.total.detach())
        for name, own in self.channel_metrics.items():
            out.update({f"loss/{name}/{k}": float(v) for k, v in own.items()})
        return out

    def detached(self) -> dict[str, float]:
        """Python floats of the four spec fields under the spec's keys: ``lm_ce``, ``sdpo_jsd``,
        ``trace_replay_dpo``, ``total`` (channel 1 is under ``lm_ce`` even when it is GRPO; use
        :meth:`metrics` for the true names)."""
        return {
            "lm_ce": float(self.lm_ce.detach()),
            "sdpo_jsd": float(self.sdpo_jsd.detach()),
            "trace_replay_dpo": float(self.trace_replay_dpo.detach()),
            "total": float(self.total.detach()),
        }


# ---------------------------------------------------------------------------- options


def resolve_loss_config(
    config: LossConfig | None, options: dict[str, Any], caller: str = "compose_loss"
) -> LossConfig:
    """The :class:`LossConfig` of a call: ``config`` itself, or one built from keyword ``options``.

    Keyword options are ``LossConfig`` field names (the spec's ``alpha_sdpo``, ``beta_replay``, ...);
    unset ones take ``LossConfig``'s defaults, except ``chunk_size`` (``DEFAULT_CHUNK_SIZE``, 256).

    Raises:
        TypeError: both ``config`` and options, a ``config`` that is not a ``LossConfig``, or an unknown option.
        ValueError: an option out of range (from ``LossConfig``, naming the key).
    """
    if config is not None:
        if options:
            raise TypeError(
                f"{caller}() takes a LossConfig or keyword options, not both; got config and {sorted(options)}. "
                f"Put them in the config: dataclasses.replace(config, {', '.join(f'{k}=...' for k in sorted(options))})"
            )
        if not isinstance(config, LossConfig):
            raise TypeError(f"{caller}() config must be a LossConfig, got {type(config).__name__}")
        return config
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise TypeError(
            f"{caller}() got unknown option(s) {unknown}; the options are LossConfig's fields: "
            f"{', '.join(sorted(_OPTIONS))}"
        )
    return LossConfig(**{**_KEYWORD_DEFAULTS, **options})


def _check_taid_t(config: LossConfig, taid_t: float | None) -> None:
    if config.sdpo_wrapper != "taid":
        return
    if taid_t is None:
        raise ValueError(
            "sdpo_wrapper='taid' needs taid_t (a float in [0, 1], e.g. TAIDScheduler.t); got None"
        )
    if not 0.0 <= float(taid_t) <= 1.0:
        raise ValueError(f"taid_t must be in [0, 1]; got {taid_t!r}")


def _context(model, inputs, config, *, taid_t=None, max_completion_length=None) -> LossContext:
    """Checks the student keys and runs the one student decoder pass."""
    ids = batch_tensor(inputs, "input_ids", what="(student token ids [B, T])")
    if ids.dim() != 2:
        raise ValueError(f"inputs['input_ids'] must be [B, T]; got shape {tuple(ids.shape)}")
    resp = batch_tensor(inputs, "response_mask", ids.shape, "(1 on response tokens)")
    head = output_head(model)
    student = SequenceBatch(
        model, ids, optional_tensor(inputs, "attention_mask", ids), head, config.chunk_size,
        share_prefix=config.share_prefix,
    )
    return LossContext(
        model=model,
        inputs=inputs,
        config=config,
        student=student,
        response_mask=resp,
        head=head,
        taid_t=taid_t,
        max_completion_length=max_completion_length,
    )


# ---------------------------------------------------------------------------- entry points


def compose_loss(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    config: LossConfig | None = None,
    *,
    taid_t: float | None = None,
    max_completion_length: int | None = None,
    **options: Any,
) -> LossComponents:
    """``total = policy + alpha_sdpo * distill + beta_replay * replay`` on one batch.

    Two forms: ``compose_loss(model, inputs, config)`` with a :class:`LossConfig`, or the spec's
    keywords ``compose_loss(model, inputs, alpha_sdpo=0.1, ...)``, which build one (a thin wrapper:
    ``compose_loss(model, inputs, **kw) == compose_loss(model, inputs, LossConfig(chunk_size=256, **kw))``).

    Args:
        model: Hugging Face causal LM (decoder via ``get_decoder()``, head via ``get_output_embeddings()``).
        inputs: required ``input_ids [B, T]``, ``response_mask [B, T]``; optional ``attention_mask``;
            GRPO keys (``old_logprobs [B, T]`` + ``advantages [B]`` or ``rewards [B]``/``group_ids [B]``,
            ``ref_logprobs [B, T]``); channel-2 keys (``ctx_teacher_input_ids [B2, Tt]``,
            ``ctx_teacher_attention_mask``, ``sdpo_loss_mask``, ``sdpo_student_index [N, 2]``,
            ``sdpo_teacher_index [N, 2]``, ``sdpo_token_weight [N]``); channel-3 keys (``dpo_{chosen,rejected}_
            {input_ids,attention_mask,response_mask} [P, T*]``, ``dpo_{chosen,rejected}_ref_logprobs [P]``).
        config: every channel's options; ``alpha_sdpo`` / ``beta_replay`` = 0 (or absent keys) turn a
            channel off, with no forward pass.
        taid_t: TAID interpolation in ``[0, 1]`` of this step (required for ``sdpo_wrapper="taid"``).
        max_completion_length: Dr. GRPO's normalizer, the rollout's ``max_new_tokens`` (``None``: T).
        **options: instead of ``config``, its fields as keywords: the spec's ``alpha_sdpo=0.1``,
            ``beta_replay=0.05``, ``sdpo_jsd_beta=0.5``, ``sdpo_temperature=1.0``, ``sdpo_token_clip=None``,
            ``replay_dpo_beta=0.1``, ``lm_ce_label_smoothing=0.0``, ``dpo_variant="dpo"``, ``sdpo_wrapper="none"``,
            ``simpo_beta=2.0``, ``simpo_gamma=1.0``, ``entropy_opd_h_max=None``, and ``sdpo_top_k``,
            ``dpo_label_smoothing``, ``chunk_size`` (default 256; ``None`` = naive full logits), the GRPO
            fields (``loss_type``, ``epsilon_low``, ``epsilon_high``, ``importance_sampling_level``,
            ``kl_beta``, ``scale_rewards``).

    Returns:
        :class:`LossComponents` (``.metrics()``: ``loss/<channel>`` and each channel's own metrics).

    Raises:
        TypeError: both ``config`` and options, or an unknown option.
        ValueError: an option out of range (naming it), ``taid`` without ``taid_t`` or with ``taid_t``
            outside ``[0, 1]``, missing required keys, bad shapes, mismatched channel-2 tokens.
    """
    config = resolve_loss_config(config, options)
    _check_taid_t(config, taid_t)
    ctx = _context(model, inputs, config, taid_t=taid_t, max_completion_length=max_completion_length)

    ran: dict[str, dict[str, float]] = {}

    def run(component: LossComponent) -> torch.Tensor:
        loss, own = component(ctx)
        ran[component.name] = own
        return loss

    policy_part = policy_component(inputs)
    policy = run(policy_part)
    zero = torch.zeros((), dtype=torch.float32, device=ctx.student.ids.device)
    distill, distill_name = zero, None
    if config.alpha_sdpo != 0 and "ctx_teacher_input_ids" in inputs:
        part = DISTILL_COMPONENTS[config.sdpo_wrapper]()
        distill, distill_name = run(part), part.name
    replay, replay_name = zero, None
    if config.beta_replay != 0 and "dpo_chosen_input_ids" in inputs:
        part = REPLAY_COMPONENTS[config.dpo_variant]()
        replay, replay_name = run(part), part.name

    total = policy + config.alpha_sdpo * distill + config.beta_replay * replay
    return LossComponents(
        lm_ce=policy,
        sdpo_jsd=distill,
        trace_replay_dpo=replay,
        total=total,
        policy_name=policy_part.name,
        distill_name=distill_name,
        replay_name=replay_name,
        channel_metrics=ran,
    )


def self_distillation_loss(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    config: LossConfig | None = None,
    *,
    taid_t: float | None = None,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Channel 2 of :func:`compose_loss` alone: no channel-1 loss is computed, so no lm_head pass is wasted.

    For trainers that compute the policy loss themselves (``ComposerReplicationTrainer`` on TRL's GRPO).
    Same component and options as ``compose_loss``'s channel 2 (``config.sdpo_wrapper`` chooses JSD, TAID
    or entropy-aware OPD; the weights ``alpha_sdpo`` / ``beta_replay`` are not read): one student forward
    over ``input_ids`` and one teacher forward (no grad) over ``ctx_teacher_input_ids``, compared at the
    positions that predict the same response tokens.

    Args:
        model: causal LM whose logits are ``lm_head(hidden)``.
        inputs: ``input_ids [B, T]``, ``response_mask [B, T]``, optional ``attention_mask [B, T]``, and the
            channel-2 keys ``ctx_teacher_input_ids [B2, Tt]``, ``sdpo_loss_mask [B2, Tt]`` (rows aligned with
            the student's when ``sdpo_*_index`` are absent), optional ``ctx_teacher_attention_mask``,
            ``sdpo_student_index [N, 2]``, ``sdpo_teacher_index [N, 2]``, ``sdpo_token_weight [N]``.
        config / taid_t / **options: as in :func:`compose_loss` (a ``LossConfig``, or its fields as keywords).

    Returns:
        ``(loss, metrics)``: the scalar token-mean divergence and, in the metrics scheme,
        ``{"loss/<name>": loss, "loss/<name>/num_tokens": N, ...}`` with ``<name>`` the component that ran.

    Raises:
        TypeError / ValueError: as :func:`compose_loss` (bad options, missing keys, bad shapes, mismatched tokens).
    """
    config = resolve_loss_config(config, options, "self_distillation_loss")
    _check_taid_t(config, taid_t)
    batch_tensor(inputs, "ctx_teacher_input_ids", what="(hinted teacher token ids [B2, Tt])")
    ctx = _context(model, inputs, config, taid_t=taid_t)
    part = DISTILL_COMPONENTS[config.sdpo_wrapper]()
    loss, own = part(ctx)
    metrics = {
        f"loss/{part.name}": float(loss.detach()),
        **{f"loss/{part.name}/{k}": v for k, v in own.items()},
    }
    return loss, metrics

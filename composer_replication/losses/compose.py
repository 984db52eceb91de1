"""The three-channel Composer loss: ``total = policy + alpha_sdpo * distill + beta_replay * replay``.

1. *policy*: GRPO (arXiv 2402.03300) on rollout data, else the spec's LM cross-entropy on the response;
2. *distill*: self-distillation at error sites (SDPO arXiv 2601.20802, OPSD arXiv 2601.18734): the same model
   given a hint is the no-grad teacher of the same response tokens (generalized JSD, TAID or entropy-aware OPD);
3. *replay*: DPO (arXiv 2305.18290) or SimPO (arXiv 2405.14734) on teacher-replay pairs.

Each channel is a component of :mod:`.components`; each sequence batch goes through the decoder once, logits chunk
by chunk (:mod:`.logprobs`). Batch keys: ``docs/losses.md``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_replication.losses.components import (
    DISTILL_COMPONENTS,
    REPLAY_COMPONENTS,
    LossContext,
    policy_component,
)
from composer_replication.losses.config import LossConfig
from composer_replication.losses.logprobs import DEFAULT_CHUNK_SIZE, output_head
from composer_replication.losses.sequences import SequenceBatch, batch_tensor, optional_tensor

__all__ = ["LossComponents", "compose_loss", "self_distillation_loss"]

_OPTIONS = frozenset(f.name for f in dataclasses.fields(LossConfig))


@dataclass
class LossComponents:
    """Per-channel breakdown of the total loss (the spec's record); every tensor is a scalar (``shape=()``).

    The spec's four tensor fields each hold their channel's loss *whatever loss ran* in it (unweighted; 0 when
    off); ``*_name`` are the true names (``None``: the channel did not run). :meth:`metrics` reports under the
    true names, :meth:`detached` under the spec's four keys.
    """

    lm_ce: torch.Tensor  # channel 1: GRPO or LM cross-entropy
    sdpo_jsd: torch.Tensor  # channel 2: JSD, TAID or entropy-aware OPD
    trace_replay_dpo: torch.Tensor  # channel 3: DPO or SimPO
    total: torch.Tensor  # LossConfig.combine(lm_ce, sdpo_jsd, trace_replay_dpo)
    policy_name: str = "lm_ce"  # "grpo" or "lm_ce"
    distill_name: str | None = None  # "jsd", "taid", "entropy_opd"
    replay_name: str | None = None  # "dpo", "simpo"
    channel_metrics: dict[str, dict[str, float]] = field(default_factory=dict)
    """Each component that ran -> its own metrics under bare names (``{"grpo": {"clip_ratio": 0.1}}``)."""

    @property
    def policy(self) -> torch.Tensor:
        """Channel 1's loss (the spec's ``lm_ce``)."""
        return self.lm_ce

    def channels(self) -> dict[str, torch.Tensor]:
        """``{true name: loss}`` of the channels that ran, in channel order."""
        named = ((self.policy_name, self.lm_ce), (self.distill_name, self.sdpo_jsd), (self.replay_name, self.trace_replay_dpo))
        return {name: loss for name, loss in named if name is not None}

    def metrics(self) -> dict[str, float]:
        """Floats in the metrics scheme: ``loss/total``, ``loss/<name>`` per channel that ran, and each component's
        own metrics as ``loss/<name>/<metric>`` (``loss/grpo/clip_ratio``, ``loss/dpo/reward_accuracy``, ...)."""
        out = {f"loss/{name}": float(loss.detach()) for name, loss in self.channels().items()}
        out["loss/total"] = float(self.total.detach())
        for name, own in self.channel_metrics.items():
            out.update({f"loss/{name}/{k}": float(v) for k, v in own.items()})
        return out

    def detached(self) -> dict[str, float]:
        """The spec's four fields as floats under the spec's keys (channel 1 under ``lm_ce`` even when GRPO)."""
        return {k: float(getattr(self, k).detach()) for k in ("lm_ce", "sdpo_jsd", "trace_replay_dpo", "total")}


def resolve_loss_config(config: LossConfig | None, options: dict[str, Any], caller: str = "compose_loss") -> LossConfig:
    """``config``, or a ``LossConfig`` of keyword ``options`` (``chunk_size`` defaulting to 256). ``TypeError`` for
    both, a non-``LossConfig`` or an unknown option; ``ValueError`` (naming the key) for one out of range."""
    if config is not None:
        if options:
            raise TypeError(f"{caller}() takes a LossConfig or keyword options, not both; got config and "
                            f"{sorted(options)}. Put them in the config: dataclasses.replace(config, "
                            f"{', '.join(f'{k}=...' for k in sorted(options))})")
        if not isinstance(config, LossConfig):
            raise TypeError(f"{caller}() config must be a LossConfig, got {type(config).__name__}")
        return config
    unknown = sorted(set(options) - _OPTIONS)
    if unknown:
        raise TypeError(f"{caller}() got unknown option(s) {unknown}; the options are LossConfig's fields: "
                        f"{', '.join(sorted(_OPTIONS))}")
    return LossConfig(**{"chunk_size": DEFAULT_CHUNK_SIZE, **options})


def _context(model, inputs, config: LossConfig, taid_t, max_completion_length=None) -> LossContext:
    """Checks ``taid_t`` and the student keys, and runs the one student decoder pass."""
    if config.sdpo_wrapper == "taid" and taid_t is None:
        raise ValueError("sdpo_wrapper='taid' needs taid_t (a float in [0, 1], e.g. TAIDScheduler.t); got None")
    if config.sdpo_wrapper == "taid" and not 0.0 <= float(taid_t) <= 1.0:
        raise ValueError(f"taid_t must be in [0, 1]; got {taid_t!r}")
    ids = batch_tensor(inputs, "input_ids", what="(student token ids [B, T])")
    if ids.dim() != 2:
        raise ValueError(f"inputs['input_ids'] must be [B, T]; got shape {tuple(ids.shape)}")
    resp = batch_tensor(inputs, "response_mask", ids.shape, "(1 on response tokens)")
    head = output_head(model)
    student = SequenceBatch(model, ids, optional_tensor(inputs, "attention_mask", ids), head, config.chunk_size,
                            share_prefix=config.share_prefix)
    return LossContext(model=model, inputs=inputs, config=config, student=student, response_mask=resp, head=head,
                       taid_t=taid_t, max_completion_length=max_completion_length)


def compose_loss(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    config: LossConfig | None = None,
    *,
    taid_t: float | None = None,
    max_completion_length: int | None = None,
    **options: Any,
) -> LossComponents:
    """``total = policy + alpha_sdpo * distill + beta_replay * replay`` on one batch (the spec's entry point).

    ``compose_loss(model, inputs, config)`` with a :class:`LossConfig`, or with the spec's keywords
    (``alpha_sdpo=0.1, beta_replay=0.05, sdpo_jsd_beta=0.5, sdpo_temperature=1.0, sdpo_token_clip=None,
    replay_dpo_beta=0.1, lm_ce_label_smoothing=0.0, dpo_variant="dpo", sdpo_wrapper="none", simpo_beta=2.0,
    simpo_gamma=1.0, entropy_opd_h_max=None``, any other ``LossConfig`` field; ``chunk_size`` 256, ``None`` =
    naive full logits), which build the config.

    Args:
        model: Hugging Face causal LM (decoder via ``get_decoder()``, head via ``get_output_embeddings()``).
        inputs: ``input_ids [B, T]``, ``response_mask [B, T]``, optional ``attention_mask``; GRPO: ``old_logprobs
            [B, T]`` + ``advantages [B]`` (or ``rewards [B]`` / ``group_ids [B]``), ``ref_logprobs [B, T]``;
            channel 2: ``ctx_teacher_input_ids [B2, Tt]``, ``ctx_teacher_attention_mask``, ``sdpo_loss_mask``,
            ``sdpo_student_index`` / ``sdpo_teacher_index [N, 2]``, ``sdpo_token_weight [N]``; channel 3:
            ``dpo_{chosen,rejected}_{input_ids,attention_mask,response_mask} [P, T*]``, ``dpo_*_ref_logprobs [P]``.
            A channel whose weight is 0 or whose keys are absent is off (no forward pass).
        taid_t: TAID's ``t`` in ``[0, 1]`` (required for ``sdpo_wrapper="taid"``).
        max_completion_length: Dr. GRPO's normalizer (the rollout's ``max_new_tokens``; ``None``: T).

    Raises ``TypeError`` (config with options, unknown option) and ``ValueError`` (an option out of range, a bad
    ``taid_t``, missing keys, bad shapes, mismatched tokens).
    """
    config = resolve_loss_config(config, options)
    ctx = _context(model, inputs, config, taid_t, max_completion_length)
    parts = [policy_component(inputs),
             DISTILL_COMPONENTS[config.sdpo_wrapper]() if config.alpha_sdpo != 0 and "ctx_teacher_input_ids" in inputs else None,
             REPLAY_COMPONENTS[config.dpo_variant]() if config.beta_replay != 0 and "dpo_chosen_input_ids" in inputs else None]
    ran = {part.name: part(ctx) for part in parts if part is not None}  # name -> (loss, own metrics), in order
    zero = torch.zeros((), dtype=torch.float32, device=ctx.student.ids.device)
    losses = [zero if part is None else ran[part.name][0] for part in parts]
    names = [None if part is None else part.name for part in parts]
    return LossComponents(lm_ce=losses[0], sdpo_jsd=losses[1], trace_replay_dpo=losses[2], total=config.combine(*losses),
                          policy_name=names[0], distill_name=names[1], replay_name=names[2],
                          channel_metrics={name: own for name, (_, own) in ran.items()})


def self_distillation_loss(
    model: torch.nn.Module,
    inputs: dict[str, torch.Tensor],
    config: LossConfig | None = None,
    *,
    taid_t: float | None = None,
    **options: Any,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Channel 2 of :func:`compose_loss` alone (weights not read), for trainers computing the policy loss themselves:
    the student over ``input_ids [B, T]`` / ``response_mask [B, T]``, the no-grad teacher over
    ``ctx_teacher_input_ids [B2, Tt]`` (channel-2 keys as :func:`compose_loss`, which it raises as).

    Returns ``(loss, {"loss/<name>": loss.detach(), "loss/<name>/num_tokens": N, ...})`` (no host sync).
    """
    config = resolve_loss_config(config, options, "self_distillation_loss")
    batch_tensor(inputs, "ctx_teacher_input_ids", what="(hinted teacher token ids [B2, Tt])")
    part = DISTILL_COMPONENTS[config.sdpo_wrapper]()
    loss, own = part(_context(model, inputs, config, taid_t))
    return loss, {f"loss/{part.name}": loss.detach(), **{f"loss/{part.name}/{k}": v for k, v in own.items()}}

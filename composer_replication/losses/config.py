"""The loss configuration: one typed tree for the three channels of ``compose_loss``.

:class:`GRPOLossConfig` holds the GRPO fields (TRL's ``GRPOConfig`` names, except ``kl_beta`` for TRL's
``beta``) and is the one GRPO configuration: :func:`~composer_replication.losses.grpo.grpo_loss` reads it.
:class:`LossConfig` is a ``GRPOLossConfig`` plus the weights and options of channels 2 and 3, so the
GRPO component of ``compose_loss`` reads its fields from the ``LossConfig`` itself (no copy).
The Dr. GRPO normalizer ``max_completion_length`` is not a config field: it is the rollout's
``max_new_tokens``, passed by the caller.

Field errors name the dotted key (``'loss.sdpo_jsd_beta' must be in [0, 1], got 1.5``), as in the
engine's ``StudentConfig`` tree where this config sits under ``loss``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["GRPOLossConfig", "LossConfig", "LOSS_TYPES", "IS_LEVELS", "SCALE_REWARDS"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IS_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")


def check_key(cond: bool, key: str, msg: str) -> None:
    """Raise ``ValueError("'<key>' <msg>")`` unless ``cond``: the one form of a config check's error."""
    if not cond:
        raise ValueError(f"'{key}' {msg}")


def check_choice(value: Any, key: str, choices: tuple[str, ...]) -> None:
    """:func:`check_key` that ``value`` is one of ``choices`` (the message lists them)."""
    check_key(value in choices, key, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")


_check, _check_choice = check_key, check_choice


@dataclass(kw_only=True)
class GRPOLossConfig:
    """Channel 1's GRPO loss (TRL ``GRPOConfig`` names and defaults, except ``loss_type`` and ``kl_beta``)."""

    loss_type: Literal["grpo", "bnpo", "dr_grpo", "dapo"] = "dapo"
    """GRPO aggregation (TRL names): "grpo" (per-sequence mean, then batch mean), "bnpo" (token mean over the
    batch), "dr_grpo" (sum / (B * max_completion_length)), "dapo" (token mean; global count in TRL, local here)."""
    epsilon_low: float = 0.2
    """GRPO lower clip range: the ratio is clipped at ``1 - epsilon_low``; in ``[0, 1)``."""
    epsilon_high: float = 0.2
    """GRPO upper clip range: the ratio is clipped at ``1 + epsilon_high``; ``>= 0`` (DAPO's clip-higher uses 0.28)."""
    importance_sampling_level: Literal["token", "sequence"] = "token"
    """GRPO importance ratio per ``token``, or per ``sequence`` (GSPO: exp of the masked mean log-ratio)."""
    kl_beta: float = 0.0
    """Weight of the k3 KL to the frozen reference inside GRPO (TRL's ``beta``; 0 disables the reference
    pass; > 0 requires ``ref_logprobs``)."""
    scale_rewards: Literal["group", "batch", "none"] = "group"
    """Advantage normalisation: by the group std, the batch std, or none (Dr. GRPO)."""

    def __post_init__(self) -> None:
        _check(self.kl_beta >= 0, "loss.kl_beta", f"must be >= 0, got {self.kl_beta!r}")
        _check_choice(self.loss_type, "loss.loss_type", LOSS_TYPES)
        _check(0 <= self.epsilon_low < 1, "loss.epsilon_low", f"must be in [0, 1), got {self.epsilon_low!r}")
        _check(self.epsilon_high >= 0, "loss.epsilon_high", f"must be >= 0, got {self.epsilon_high!r}")
        _check_choice(self.importance_sampling_level, "loss.importance_sampling_level", IS_LEVELS)
        _check_choice(self.scale_rewards, "loss.scale_rewards", SCALE_REWARDS)


@dataclass(kw_only=True)
class LossConfig(GRPOLossConfig):
    """Every knob of ``compose_loss``: ``total = policy + alpha_sdpo * distill + beta_replay * replay``.

    Channel 1 (GRPO) options are the inherited :class:`GRPOLossConfig` fields; the TAID schedule fields
    configure the ``TAIDScheduler`` whose ``t`` the caller passes to ``compose_loss(..., taid_t=)``.
    """

    alpha_sdpo: float = 0.1
    """Weight of channel 2 (self-distillation at error sites)."""
    beta_replay: float = 0.05
    """Weight of channel 3 (trace-replay DPO / SimPO)."""
    sdpo_jsd_beta: float = 0.5
    """Generalized JSD beta (TRL convention: 0 forward KL, 1 reverse KL)."""
    sdpo_temperature: float = 1.0
    """Softmax temperature of the distillation loss."""
    sdpo_token_clip: float | None = None
    """Elementwise clamp of pointwise JSD terms (OPSD ``jsd_token_clip``); ``None`` disables it."""
    sdpo_top_k: int | None = None
    """Keep only the teacher's top-k logits (renormalized); ``None`` uses the full vocabulary."""
    sdpo_wrapper: Literal["none", "taid", "entropy_opd"] = "none"
    """Distillation loss of channel 2: ``none`` (plain generalized JSD), ``taid`` (scheduled interpolation,
    ``t`` from a ``TAIDScheduler``) or ``entropy_opd`` (entropy-aware on-policy distillation)."""
    taid_t_start: float = 0.4
    """TAID: initial interpolation coefficient ``t``."""
    taid_t_end: float = 1.0
    """TAID: final ``t`` (hard ceiling)."""
    taid_alpha: float = 5e-4
    """TAID: adaptive bump magnitude."""
    taid_beta: float = 0.99
    """TAID: EMA decay of the relative loss change."""
    replay_dpo_beta: float = 0.1
    """DPO beta of channel 3."""
    dpo_variant: Literal["dpo", "simpo"] = "dpo"
    """Channel 3 loss: ``dpo`` (needs reference log-probs) or reference-free ``simpo``."""
    simpo_beta: float = 2.0
    """SimPO beta."""
    simpo_gamma: float = 1.0
    """SimPO absolute target margin gamma (TRL convention)."""
    entropy_opd_h_max: float | None = None
    """Entropy-aware OPD normaliser; ``None`` means ``log(V)``."""
    chunk_size: int | None = 1024
    """Tokens per chunk in the chunked log-prob / distillation kernels (memory); ``null`` = naive full logits."""
    share_prefix: bool = True
    """Decode a prefix shared by several rows once (a GRPO group's prompt, a pair's prompt; ``losses.prefix``):
    the same loss up to float rounding, ~2-3x fewer decoder tokens at agent-trace sizes. ``false``: whole rows."""
    lm_ce_label_smoothing: float = 0.0
    """Label smoothing of the LM cross-entropy fallback of channel 1."""
    dpo_label_smoothing: float = 0.0
    """Label smoothing (conservative DPO) of channel 3."""
    rpo_alpha: float = 0.0
    """Weight of the negative log-likelihood of the chosen responses (token mean) added to channel 3, with DPO or
    SimPO (RPO, arXiv 2404.19733; TRL's ``rpo_alpha``): the pull towards the chosen action that a preference
    loss alone loses once it saturates. 0 disables it."""

    def __post_init__(self) -> None:
        for key in ("alpha_sdpo", "beta_replay", "rpo_alpha"):
            _check(getattr(self, key) >= 0, f"loss.{key}", f"must be >= 0, got {getattr(self, key)!r}")
        for key in ("replay_dpo_beta", "simpo_beta"):  # the preference losses' temperature: 0 makes them constant
            _check(getattr(self, key) > 0, f"loss.{key}", f"must be > 0, got {getattr(self, key)!r}")
        _check(
            0 <= self.sdpo_jsd_beta <= 1,
            "loss.sdpo_jsd_beta",
            f"must be in [0, 1], got {self.sdpo_jsd_beta!r}",
        )
        _check(
            self.sdpo_temperature > 0, "loss.sdpo_temperature", f"must be > 0, got {self.sdpo_temperature!r}"
        )
        _check(
            self.sdpo_token_clip is None or self.sdpo_token_clip > 0,
            "loss.sdpo_token_clip",
            f"must be > 0 or null, got {self.sdpo_token_clip!r}",
        )
        _check(
            self.sdpo_top_k is None or self.sdpo_top_k >= 1,
            "loss.sdpo_top_k",
            f"must be >= 1 or null, got {self.sdpo_top_k!r}",
        )
        _check_choice(self.sdpo_wrapper, "loss.sdpo_wrapper", ("none", "taid", "entropy_opd"))
        _check(
            0 <= self.taid_t_start <= self.taid_t_end <= 1,
            "loss.taid_t_start",
            f"and 'loss.taid_t_end' must satisfy 0 <= t_start <= t_end <= 1, got "
            f"{self.taid_t_start!r} and {self.taid_t_end!r}",
        )
        _check_choice(self.dpo_variant, "loss.dpo_variant", ("dpo", "simpo"))
        _check(
            self.entropy_opd_h_max is None or self.entropy_opd_h_max > 0,
            "loss.entropy_opd_h_max",
            f"must be > 0 or null, got {self.entropy_opd_h_max!r}",
        )
        _check(
            self.chunk_size is None or (isinstance(self.chunk_size, int) and self.chunk_size >= 1),
            "loss.chunk_size",
            f"must be an int >= 1 or null, got {self.chunk_size!r}",
        )
        for key in ("lm_ce_label_smoothing", "dpo_label_smoothing"):
            _check(
                0 <= getattr(self, key) < 1, f"loss.{key}", f"must be in [0, 1), got {getattr(self, key)!r}"
            )
        super().__post_init__()  # the GRPO fields, checked last as before

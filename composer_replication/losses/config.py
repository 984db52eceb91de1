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

import functools
import typing
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["GRPOLossConfig", "LossConfig"]

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
IS_LEVELS = ("token", "sequence")
SCALE_REWARDS = ("group", "batch", "none")


def check_key(cond: bool, key: str, msg: str) -> None:
    """``ValueError("'<key>' <msg>")`` unless ``cond``: the one form of a config check's error."""
    if not cond:
        raise ValueError(f"'{key}' {msg}")


def check_choice(value: Any, key: str, choices: tuple[str, ...]) -> None:
    """:func:`check_key` that ``value`` is one of ``choices`` (the message lists them)."""
    check_key(value in choices, key, f"must be one of {', '.join(map(repr, choices))}, got {value!r}")


def shown(value: Any) -> str:
    """``repr(value)`` cut to 200 characters: what an error message shows of a rejected value."""
    try:
        text = repr(value)
    except ValueError:  # an int beyond Python's 4300-digit str() limit
        text = f"<an int of about {value.bit_length() * 0.30103:.0f} digits>"
    return text if len(text) <= 200 else text[:200] + "..."


@functools.cache
def _kinds(cls: type) -> dict[str, tuple[Any, ...]]:
    return {k: typing.get_args(t) or (t,) for k, t in typing.get_type_hints(cls).items()}


def check_ranges(config: Any, section: str, ranges: dict[str, str]) -> None:
    """Each field of ``config`` named in ``ranges`` (``{"lr": "(0, 10]"}``: an interval) holds a number in it: an
    int (never a bool) for an ``int`` field, a finite number otherwise; every item of a tuple; ``None`` where the
    annotation allows it. ``ValueError("'<section>.<field>' must be ... in <interval>, got <value>")``."""
    kinds = _kinds(type(config))
    for name, interval in ranges.items():
        value, kind = getattr(config, name), kinds[name]
        lo, hi = (float(b) for b in interval[1:-1].split(","))
        for v in value if isinstance(value, tuple | list) else (value,):
            if v is None and type(None) in kind:
                continue
            ok = not isinstance(v, bool) and isinstance(v, int if int in kind else (int, float))
            ok = ok and (lo < v if interval[0] == "(" else lo <= v) and (v < hi if interval[-1] == ")" else v <= hi)
            check_key(ok, f"{section}.{name}" if section else name,
                      f"must be {'an integer' if int in kind else 'a number'} in {interval}, got {shown(value)}")


_check, _check_choice = check_key, check_choice
_LOSS_RANGES = {
    "epsilon_low": "[0, 1)", "epsilon_high": "[0, 1e6]", "kl_beta": "[0, 100]", "alpha_sdpo": "[0, 1000]",
    "beta_replay": "[0, 1000]", "rpo_alpha": "[0, 1000]", "sdpo_jsd_beta": "[0, 1]", "sdpo_temperature": "(0, 100]",
    "sdpo_token_clip": "(0, 1e6]", "sdpo_top_k": "[1, 1e7]", "taid_t_start": "[0, 1]", "taid_t_end": "[0, 1]",
    "taid_alpha": "[0, 1]", "taid_beta": "[0, 1)", "replay_dpo_beta": "(0, 1000]", "simpo_beta": "(0, 1000]",
    "simpo_gamma": "[0, 1000]", "entropy_opd_h_max": "(0, 1e6]", "chunk_size": "[1, 1e8]",
    "lm_ce_label_smoothing": "[0, 1)", "dpo_label_smoothing": "[0, 0.5)",
}
"""Every number of the loss tree: its interval (the GRPO fields' too), checked before anything else."""


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
        check_ranges(self, "loss", {k: v for k, v in _LOSS_RANGES.items() if k in _kinds(type(self))})
        _check_choice(self.loss_type, "loss.loss_type", LOSS_TYPES)
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
        super().__post_init__()  # every range (the table), the GRPO choices
        _check_choice(self.sdpo_wrapper, "loss.sdpo_wrapper", ("none", "taid", "entropy_opd"))
        _check(self.taid_t_start <= self.taid_t_end, "loss.taid_t_start",
               f"and 'loss.taid_t_end' must satisfy 0 <= t_start <= t_end <= 1, got {self.taid_t_start!r} and "
               f"{self.taid_t_end!r}")
        _check_choice(self.dpo_variant, "loss.dpo_variant", ("dpo", "simpo"))

    def combine(self, policy: Any, distill: Any, replay: Any, *, shares: tuple[float, float, float] = (1.0, 1.0, 1.0)
                ) -> Any:
        """The one formula of the total: ``s0 * policy + alpha_sdpo * s1 * distill + beta_replay * s2 * replay``.

        Scalar tensors (``shape=()``) or floats. ``shares``: each channel's share of its denominator when a batch
        is split into micro-batches (``engine.accumulate``: one step's shares add up to 1 per channel), or
        ``(1, 1 / GA, 1 / GA)`` in the TRL trainer (TRL's policy loss comes already scaled). ``compose_loss``,
        the engine and the TRL trainer all use it.
        """
        s0, s1, s2 = shares
        return s0 * policy + self.alpha_sdpo * s1 * distill + self.beta_replay * s2 * replay

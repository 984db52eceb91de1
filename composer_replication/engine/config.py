"""Training configuration: typed ``@dataclass(kw_only=True)`` trees, built from plain dicts (YAML).

One tree describes one student trainer (:class:`StudentConfig`); recipes nest it inside their own
top-level tree and reuse the generic helpers of :mod:`composer_replication.engine.tree` (re-exported here):
``from_dict`` (typed, names the dotted key of a bad value), ``to_dict``, ``apply_overrides`` (``key.sub=value``)
and ``yaml_error_text``.

Cross-field checks live in each class's ``__post_init__`` and name the key they reject.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Literal

import torch

from composer_replication.engine.tree import apply_overrides, from_dict, to_dict, yaml_error_text
from composer_replication.losses.config import LossConfig  # the loss library's config, under ``loss``
from composer_replication.losses.config import check_choice as _check_choice
from composer_replication.losses.config import check_key as _check

__all__ = [
    "OptimConfig",
    "LossConfig",
    "RolloutConfig",
    "StudentConfig",
    "from_dict",
    "to_dict",
    "apply_overrides",
    "yaml_error_text",
    "resolve_device",
    "resolve_dtype",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ---------------------------------------------------------------------------- config trees


@dataclass(kw_only=True)
class OptimConfig:
    """AdamW and its learning-rate schedule (the inner optimizer of the student)."""

    lr: float = 1e-5
    """Peak learning rate reached after warm-up."""
    weight_decay: float = 0.0
    """AdamW decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW ``(beta1, beta2)``."""
    eps: float = 1e-8
    """AdamW epsilon."""
    warmup_steps: int = 0
    """Steps of linear warm-up from ``lr / (warmup_steps + 1)`` to ``lr``."""
    scheduler: Literal["constant", "linear", "cosine"] = "constant"
    """Shape after warm-up: ``constant``; ``linear`` decay to 0 at ``num_steps``; ``cosine`` decay to 0."""
    max_grad_norm: float = 1.0
    """Gradient clipping threshold on the global L2 norm; ``0`` disables clipping (the norm is still reported)."""
    grad_accum_steps: int = 1
    """Micro-batches per optimizer step: the step's batch (built once) is split by whole prompt groups and
    pairs, and each channel is weighted by its share, so the update equals the whole batch's
    (``engine.accumulate``). Lowers peak memory; at most ``rollout.prompts_per_step``."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optim.lr", f"must be > 0, got {self.lr!r}")
        _check(self.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {self.weight_decay!r}")
        _check(
            len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
            "optim.betas",
            f"must be two numbers in [0, 1), got {self.betas!r}",
        )
        _check(self.eps > 0, "optim.eps", f"must be > 0, got {self.eps!r}")
        _check(self.warmup_steps >= 0, "optim.warmup_steps", f"must be >= 0, got {self.warmup_steps!r}")
        _check_choice(self.scheduler, "optim.scheduler", ("constant", "linear", "cosine"))
        _check(self.max_grad_norm >= 0, "optim.max_grad_norm", f"must be >= 0, got {self.max_grad_norm!r}")
        _check(self.grad_accum_steps >= 1, "optim.grad_accum_steps", f"must be >= 1, got {self.grad_accum_steps!r}")


@dataclass(kw_only=True)
class RolloutConfig:
    """On-policy sampling and the data drawn per step."""

    environment: Literal["next_action", "python_tasks", "mixed"] = "next_action"
    """Reward environment: next-action prediction on trace states, bundled Python tasks, or both."""
    prompts_per_step: int = 4
    """Distinct prompts per step and per rank."""
    num_generations: int = 4
    """Samples per prompt (the GRPO group size G)."""
    max_new_tokens: int = 64
    """Generation length limit per sample."""
    temperature: float = 1.0
    """Sampling temperature (> 0; greedy decoding is only used by ``evaluate``)."""
    top_p: float = 1.0
    """Nucleus sampling threshold in (0, 1]."""
    old_logprob_pass: bool = False
    """Score the samples again after generation for GRPO's old log-probs (one more forward pass over the
    rollouts). Off by default: each rollout batch gets exactly one optimizer step, so the old policy is the
    current one and GRPO uses the current log-probs, detached (ratio 1), as TRL does with one iteration."""
    pairs_per_step: int = 2
    """Trace-replay DPO pairs per step and per rank (0 disables channel 3)."""
    pair_refresh_every: int = 0
    """Re-sample the rejected side of ``recorded``-teacher pairs (student samples) from the current student every
    N steps, dropping pairs the student now agrees with (``engine.refresh``); the rejected sides are then at most
    N - 1 optimizer steps old. 0 never refreshes (they stay the replay's samples of the initial student)."""

    def __post_init__(self) -> None:
        _check_choice(self.environment, "rollout.environment", ("next_action", "python_tasks", "mixed"))
        for key in ("prompts_per_step", "num_generations", "max_new_tokens"):
            _check(getattr(self, key) >= 1, f"rollout.{key}", f"must be >= 1, got {getattr(self, key)!r}")
        _check(self.temperature > 0, "rollout.temperature", f"must be > 0, got {self.temperature!r}")
        _check(0 < self.top_p <= 1, "rollout.top_p", f"must be in (0, 1], got {self.top_p!r}")
        _check(self.pairs_per_step >= 0, "rollout.pairs_per_step", f"must be >= 0, got {self.pairs_per_step!r}")
        _check(self.pair_refresh_every >= 0, "rollout.pair_refresh_every",
               f"must be >= 0 (0: never), got {self.pair_refresh_every!r}")


@dataclass(kw_only=True)
class StudentConfig:
    """One student trainer: model, device, schedule, optimizer, loss and rollouts."""

    model: str = "smollm2-135m"
    """``smollm2-135m`` (embedded default), ``tiny`` (tests), or a local Hugging Face model folder."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype of the student and the reference."""
    device: str = "auto"
    """``auto`` (``cuda:<local rank>`` when CUDA is available, else ``cpu``), ``cpu``, ``cuda`` or ``cuda:N``."""
    seed: int = 0
    """Seed of the model init (``tiny``), data order and sampling; combined with (step, rank)."""
    num_steps: int = 100
    """Planned optimizer steps (sets the LR schedule and the TAID floor)."""
    max_seq_len: int = 2048
    """Longest preference row (prompt + response) the trainer accepts (see ``over_length``)."""
    over_length: Literal["truncate_left", "skip"] = "truncate_left"
    """Over-length policy of preference rows (``composer_replication.batching``): cut the history from the left,
    or skip the pair; a response that alone reaches ``max_seq_len`` is always skipped. Counted in the metrics."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer and LR schedule."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Loss channels and their weights."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Sampling and per-step data."""

    def __post_init__(self) -> None:
        _check(bool(self.model), "model", "must be a non-empty model name or folder")
        _check_choice(self.dtype, "dtype", tuple(_DTYPES))
        _check(
            self.device in ("auto", "cpu", "cuda") or _is_cuda_n(self.device),
            "device",
            f"must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}",
        )
        _check(self.num_steps >= 1, "num_steps", f"must be >= 1, got {self.num_steps!r}")
        _check(self.max_seq_len >= 8, "max_seq_len", f"must be >= 8, got {self.max_seq_len!r}")
        _check_choice(self.over_length, "over_length", ("truncate_left", "skip"))
        _check(
            self.optim.warmup_steps <= self.num_steps,
            "optim.warmup_steps",
            f"must be <= 'num_steps' ({self.num_steps}), got {self.optim.warmup_steps}",
        )
        _check(
            self.optim.grad_accum_steps <= self.rollout.prompts_per_step,
            "optim.grad_accum_steps",
            f"must be <= 'rollout.prompts_per_step' ({self.rollout.prompts_per_step}): micro-batches hold whole "
            f"prompt groups; got {self.optim.grad_accum_steps}",
        )


def _is_cuda_n(device: str) -> bool:
    head, _, idx = device.partition(":")
    return head == "cuda" and idx.isdigit()


def resolve_dtype(name: str) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16"`` -> the torch dtype (``ValueError`` otherwise)."""
    _check_choice(name, "dtype", tuple(_DTYPES))
    return _DTYPES[name]


def resolve_device(device: str, *, local_rank: int | None = None) -> torch.device:
    """Resolve a config device string to a ``torch.device``.

    ``"auto"`` gives ``cuda:<local_rank % device_count>`` when CUDA is available, else ``cpu``.
    ``local_rank`` defaults to the ``LOCAL_RANK`` environment variable, else 0.

    Raises:
        ValueError: a CUDA device is requested but CUDA is unavailable, or the string is malformed.
    """
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", "0") or 0)
    if device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    if device == "cpu":
        return torch.device("cpu")
    if device == "cuda" or _is_cuda_n(device):
        if not torch.cuda.is_available():
            raise ValueError(
                f"'device' is {device!r} but CUDA is not available on this machine; use 'auto' or 'cpu'."
            )
        return torch.device(device)
    raise ValueError(f"'device' must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}")

"""TAID: temporally adaptive interpolated distillation.

Paper: Shing et al. (ICLR 2025, arXiv 2501.16937); reference code SakanaAI/TAID (``src/distil_losses/taid.py``)::

    p_t = softmax((1 - t) * sg(z_student) + t * z_teacher)       # interpolation in logit space
    L   = -sum_v p_t(v) * log q_theta(v)                          # masked-token mean (= KL(p_t || q) + const)

``t`` grows from ``t_start`` to ``t_end`` under :class:`TAIDScheduler` (upstream ``TAID.update_t``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from composer_replication.losses.jsd import _check_logit_pair, _number, _require, _upcast

__all__ = ["taid_loss", "TAIDScheduler"]


def _scalar(name: str, x: float | torch.Tensor) -> torch.Tensor | float:
    """``x`` checked to be a number or a one-element tensor (``ValueError`` naming ``name``)."""
    _require(not isinstance(x, torch.Tensor) or x.numel() == 1,
             f"{name} must be a scalar, got a tensor of shape {tuple(getattr(x, 'shape', ()))}")
    _require(isinstance(x, torch.Tensor) or _number(x), f"{name} must be a float or scalar tensor, got {type(x).__name__}")
    return x.detach() if isinstance(x, torch.Tensor) else float(x)


def _check_t(t: float | torch.Tensor) -> float:
    value = float(_scalar("t", t))
    _require(0.0 <= value <= 1.0, f"t must be in [0, 1] (0 = detached student, 1 = teacher), got {value!r}")
    return value


def taid_per_token(student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, t: float | torch.Tensor) -> torch.Tensor:
    """Per-token TAID cross-entropy ``-sum_v p_t(v) log q_theta(v)``: ``[N, V]`` (any ``[..., V]``) -> ``[N]``.

    Only ``log q_theta`` carries gradient (the anchor ``sg(z_student)`` is detached); vocabulary entries with an
    infinite student logit contribute 0 (upstream ``inf_mask``). ``t`` in ``[0, 1]``.
    """
    _check_logit_pair(student_logits, teacher_logits)
    t_val = _check_t(t)
    student, teacher = _upcast(student_logits), _upcast(teacher_logits)
    p_t = F.softmax((1.0 - t_val) * student.detach() + t_val * teacher, dim=-1)
    logq = F.log_softmax(student, dim=-1)
    return -(p_t * torch.where(torch.isinf(student), torch.zeros_like(logq), logq)).sum(-1)


def taid_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    t: float | torch.Tensor,
) -> torch.Tensor:
    """TAID loss (the spec's signature): masked-token mean of :func:`taid_per_token` over ``[B, T, V]``;
    ``mask [B, T]`` 0/1 or bool (``None``: every token; all zero: ``ValueError``)."""
    _check_logit_pair(student_logits, teacher_logits)
    per_token = taid_per_token(student_logits, teacher_logits, t=t)
    if mask is None:
        return per_token.mean()
    _require(isinstance(mask, torch.Tensor) and mask.shape == per_token.shape, f"mask must have shape "
             f"{tuple(per_token.shape)} (the logits without the vocab dim), got {getattr(mask, 'shape', type(mask).__name__)}")
    keep = mask.bool()
    _require(bool(keep.any()), "mask selects no token; the TAID loss is undefined for an empty mask")
    return torch.where(keep, per_token, torch.zeros_like(per_token)).sum() / keep.sum()


class TAIDScheduler:
    """Adaptive schedule of TAID's ``t`` (upstream ``TAID.update_t``; algorithms.md section 3).

    ``update_t(loss, global_step)`` after every loss: a non-finite loss is ignored and the first finite one seeds
    ``prev`` (both return None); then ``rel = (prev - loss) / (prev + 1e-15)``, ``m <- beta m + (1 - beta) rel``,
    ``delta = alpha sigmoid(m) (1 - t)``, ``t_lin = t_start + (t_end - t_start) min(global_step / num_train_steps,
    1)``, ``t <- min(t_end, max(t_lin, t + delta))`` (``max(t, t_lin)`` with ``disable_adaptive``), ``prev <-
    loss``; returns ``delta`` (float64). ``state_dict`` carries ``t``, ``prev_loss`` and the momentum (a resumed
    run continues identically). ``num_train_steps >= 1``; ``0 <= t_start <= t_end <= 1`` (paper 0.4 / 1.0);
    ``alpha >= 0`` (5e-4); ``beta`` in ``[0, 1)`` (0.99); ``device``: where the state tensors live.
    """

    _CONFIG_KEYS = ("num_train_steps", "t_start", "t_end", "alpha", "beta", "disable_adaptive")

    def __init__(self, num_train_steps: int, *, t_start: float = 0.4, t_end: float = 1.0, alpha: float = 5e-4,
                 beta: float = 0.99, disable_adaptive: bool = False, device: torch.device | str = "cpu") -> None:
        _require(isinstance(num_train_steps, int) and not isinstance(num_train_steps, bool) and num_train_steps >= 1,
                 f"num_train_steps must be an int >= 1, got {num_train_steps!r}")
        _require(_number(t_start) and _number(t_end) and 0.0 <= t_start <= t_end <= 1.0,
                 f"need 0 <= t_start <= t_end <= 1, got t_start={t_start!r}, t_end={t_end!r}")
        _require(_number(alpha) and alpha >= 0 and math.isfinite(alpha), f"alpha must be a finite number >= 0, got {alpha!r}")
        _require(_number(beta) and 0.0 <= beta < 1.0, f"beta (momentum decay) must be in [0, 1), got {beta!r}")
        self.num_train_steps, self.t_start, self.t_end = num_train_steps, float(t_start), float(t_end)
        self.alpha, self.beta, self.disable_adaptive = float(alpha), float(beta), bool(disable_adaptive)
        self.device = torch.device(device)
        self._t, self._prev_loss, self._momentum = self._state(self.t_start, math.inf, 0.0)  # inf: not seeded

    def _state(self, *values) -> list[torch.Tensor]:
        return [torch.as_tensor(v, dtype=torch.float64, device=self.device).reshape(()) for v in values]

    @property
    def t(self) -> float:
        """Current interpolation coefficient."""
        return float(self._t)

    def update_t(self, loss: torch.Tensor | float, global_step: int) -> torch.Tensor | None:
        """Advance ``t`` from the (detached) loss of step ``global_step`` (class docstring)."""
        _require(isinstance(global_step, int) and not isinstance(global_step, bool) and global_step >= 0,
                 f"global_step must be an int >= 0, got {global_step!r}")
        (value,) = self._state(_scalar("loss", loss))
        if not bool(torch.isfinite(value)):
            return None
        if bool(torch.isinf(self._prev_loss)):
            self._prev_loss = value
            return None
        rel = (self._prev_loss - value) / (self._prev_loss + 1e-15)
        self._momentum = self.beta * self._momentum + (1.0 - self.beta) * rel
        delta = self.alpha * torch.sigmoid(self._momentum) * (1.0 - self._t)
        (t_lin,) = self._state(self.t_start + (self.t_end - self.t_start) * min(global_step / self.num_train_steps, 1.0))
        if self.disable_adaptive:
            self._t = torch.maximum(self._t, t_lin)
        else:
            self._t = torch.clamp(torch.maximum(t_lin, self._t + delta), max=self.t_end)
        self._prev_loss = value
        return delta

    def state_dict(self) -> dict:
        """The config values and the ``t``, ``prev_loss``, ``momentum`` tensors (on CPU)."""
        tensors = {"t": self._t, "prev_loss": self._prev_loss, "momentum": self._momentum}
        return {**{k: getattr(self, k) for k in self._CONFIG_KEYS}, **{k: v.cpu().clone() for k, v in tensors.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`; ``ValueError`` for a missing key or a different config."""
        missing = [k for k in (*self._CONFIG_KEYS, "t", "prev_loss", "momentum") if k not in state]
        _require(not missing, f"TAIDScheduler state_dict is missing keys {missing}")
        for key in self._CONFIG_KEYS:
            _require(state[key] == getattr(self, key), f"TAIDScheduler state_dict has {key}={state[key]!r} but this "
                     f"scheduler has {key}={getattr(self, key)!r}; construct the scheduler with the checkpoint's arguments")
        self._t, self._prev_loss, self._momentum = self._state(state["t"], state["prev_loss"], state["momentum"])

"""TAID: temporally adaptive interpolated distillation.

Paper: Shing et al., "TAID: Temporally Adaptive Interpolated Distillation for Efficient Knowledge
Transfer in Language Models" (ICLR 2025, arXiv 2501.16937); reference code SakanaAI/TAID
(``src/distil_losses/taid.py``, ``fkl.py``).

    p_t = softmax((1 - t) * sg(z_student) + t * z_teacher)       # interpolation in logit space
    L   = - sum_v p_t(v) * log q_theta(v)                          # masked-token mean (= KL(p_t || q) + const)

``t`` grows from ``t_start`` to ``t_end`` under :class:`TAIDScheduler` (upstream ``TAID.update_t``).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from composer_replication.losses.jsd import _check_logit_pair, _upcast

__all__ = ["taid_loss", "taid_per_token", "TAIDScheduler"]


def _check_t(t: float | torch.Tensor) -> float:
    if isinstance(t, torch.Tensor):
        if t.numel() != 1:
            raise ValueError(f"t must be a scalar in [0, 1], got a tensor of shape {tuple(t.shape)}")
        value = float(t.detach())
    elif isinstance(t, (int, float)) and not isinstance(t, bool):
        value = float(t)
    else:
        raise ValueError(f"t must be a float or scalar tensor in [0, 1], got {type(t).__name__}")
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"t must be in [0, 1] (0 = detached student, 1 = teacher), got {value!r}")
    return value


def taid_per_token(
    student_logits: torch.Tensor, teacher_logits: torch.Tensor, *, t: float | torch.Tensor
) -> torch.Tensor:
    """Per-token TAID cross-entropy ``-sum_v p_t(v) log q_theta(v)`` (arXiv 2501.16937).

    Args:
        student_logits: ``[N, V]`` (or ``[..., V]``) student logits, with grad. Only ``log q_theta`` carries
            gradient: the interpolation anchor ``sg(z_student)`` is detached.
        teacher_logits: ``[N, V]`` teacher logits (not detached here).
        t: interpolation coefficient in ``[0, 1]``.

    Returns:
        ``[N]`` (or ``[...]``); vocabulary entries where the student logit is infinite contribute 0
        (upstream ``inf_mask``).

    Raises:
        ValueError: shape mismatch or ``t`` outside ``[0, 1]``.
    """
    _check_logit_pair(student_logits, teacher_logits)
    t_val = _check_t(t)
    student, teacher = _upcast(student_logits), _upcast(teacher_logits)
    p_t = F.softmax((1.0 - t_val) * student.detach() + t_val * teacher, dim=-1)
    logq = F.log_softmax(student, dim=-1)
    logq = torch.where(torch.isinf(student), torch.zeros_like(logq), logq)
    return -(p_t * logq).sum(-1)


def taid_loss(
    student_logits: torch.Tensor,
    teacher_logits: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    t: float | torch.Tensor,
) -> torch.Tensor:
    """TAID loss: masked-token mean of :func:`taid_per_token` (arXiv 2501.16937).

    Args:
        student_logits: ``[B, T, V]`` student logits (with grad).
        teacher_logits: ``[B, T, V]`` teacher logits.
        mask: ``[B, T]`` 0/1 or bool token mask; ``None`` means every token.
        t: interpolation coefficient in ``[0, 1]`` (e.g. ``TAIDScheduler.t``).

    Returns:
        Scalar ``sum(per_token * mask) / sum(mask)``.

    Raises:
        ValueError: shape mismatch, ``t`` out of range, or an all-zero ``mask``.

    Example:
        >>> taid_loss(torch.randn(2, 5, 11, requires_grad=True), torch.randn(2, 5, 11), t=0.4).backward()
    """
    _check_logit_pair(student_logits, teacher_logits)
    per_token = taid_per_token(student_logits, teacher_logits, t=t)
    if mask is None:
        return per_token.mean()
    if not isinstance(mask, torch.Tensor) or mask.shape != per_token.shape:
        raise ValueError(
            f"mask must have shape {tuple(per_token.shape)} (the logits without the vocab dim), got "
            f"{getattr(mask, 'shape', type(mask).__name__)}"
        )
    keep = mask.bool()
    count = int(keep.sum())
    if count == 0:
        raise ValueError("mask selects no token; the TAID loss is undefined for an empty mask")
    return torch.where(keep, per_token, torch.zeros_like(per_token)).sum() / count


class TAIDScheduler:
    """Adaptive schedule of TAID's ``t`` (upstream ``TAID.update_t``, transcribed in algorithms.md section 3).

    After every loss, ``update_t(loss, global_step)``:

    - non-finite loss: ignored (no state change, returns None);
    - first finite call: ``prev <- loss``, returns None (t stays ``t_start``);
    - otherwise: ``rel = (prev - loss) / (prev + 1e-15)``, ``m <- beta * m + (1 - beta) * rel``,
      ``delta = alpha * sigmoid(m) * (1 - t)``,
      ``t_lin = t_start + (t_end - t_start) * min(global_step / num_train_steps, 1)``,
      ``t <- min(t_end, max(t_lin, t + delta))`` (``t <- max(t, t_lin)`` if ``disable_adaptive``),
      ``prev <- loss``; returns ``delta`` (a float64 tensor).

    ``t`` therefore never decreases and never exceeds ``t_end``. ``state_dict`` / ``load_state_dict``
    carry ``t``, ``prev_loss`` and the momentum so a resumed run continues identically.

    Args:
        num_train_steps: total planned optimizer steps (``>= 1``); sets the linear floor.
        t_start: initial ``t`` in ``[0, t_end]`` (paper default 0.4).
        t_end: final ``t`` in ``[t_start, 1]``; a hard ceiling.
        alpha: adaptive step size, ``>= 0`` (default 5e-4).
        beta: momentum decay in ``[0, 1)`` (default 0.99).
        disable_adaptive: follow the linear schedule only.
        device: where the state tensors live.

    Example:
        >>> sched = TAIDScheduler(num_train_steps=100)
        >>> sched.update_t(torch.tensor(2.0), global_step=0)  # seeds, returns None
        >>> loss = taid_loss(s, t, mask, t=sched.t)
    """

    def __init__(
        self,
        num_train_steps: int,
        *,
        t_start: float = 0.4,
        t_end: float = 1.0,
        alpha: float = 5e-4,
        beta: float = 0.99,
        disable_adaptive: bool = False,
        device: torch.device | str = "cpu",
    ) -> None:
        if isinstance(num_train_steps, bool) or not isinstance(num_train_steps, int) or num_train_steps < 1:
            raise ValueError(f"num_train_steps must be an int >= 1, got {num_train_steps!r}")
        if not (isinstance(t_start, (int, float)) and isinstance(t_end, (int, float))) or not (
            0.0 <= t_start <= t_end <= 1.0
        ):
            raise ValueError(f"need 0 <= t_start <= t_end <= 1, got t_start={t_start!r}, t_end={t_end!r}")
        if not isinstance(alpha, (int, float)) or not (alpha >= 0 and math.isfinite(alpha)):
            raise ValueError(f"alpha must be a finite number >= 0, got {alpha!r}")
        if not isinstance(beta, (int, float)) or not 0.0 <= beta < 1.0:
            raise ValueError(f"beta (momentum decay) must be in [0, 1), got {beta!r}")
        self.num_train_steps = num_train_steps
        self.t_start = float(t_start)
        self.t_end = float(t_end)
        self.alpha = float(alpha)
        self.beta = float(beta)
        self.disable_adaptive = bool(disable_adaptive)
        self.device = torch.device(device)
        kw = {"dtype": torch.float64, "device": self.device}
        self._t = torch.tensor(self.t_start, **kw)
        self._prev_loss = torch.tensor(math.inf, **kw)  # inf = not seeded yet (as upstream)
        self._momentum = torch.zeros((), **kw)

    @property
    def t(self) -> float:
        """Current interpolation coefficient as a Python float."""
        return float(self._t)

    def update_t(self, loss: torch.Tensor | float, global_step: int) -> torch.Tensor | None:
        """Advance ``t`` from the (detached) loss of step ``global_step``; see the class docstring.

        Returns None on the seeding call and for a non-finite loss, else ``delta`` (float64 scalar tensor).

        Raises:
            ValueError: ``loss`` is not a scalar, or ``global_step`` is not an int ``>= 0``.
        """
        if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
            raise ValueError(f"global_step must be an int >= 0, got {global_step!r}")
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"loss must be a scalar, got a tensor of shape {tuple(loss.shape)}")
            value = loss.detach().reshape(()).to(dtype=torch.float64, device=self.device)
        elif isinstance(loss, (int, float)) and not isinstance(loss, bool):
            value = torch.tensor(float(loss), dtype=torch.float64, device=self.device)
        else:
            raise ValueError(f"loss must be a scalar tensor or float, got {type(loss).__name__}")
        if not bool(torch.isfinite(value)):
            return None
        if bool(torch.isinf(self._prev_loss)):
            self._prev_loss = value
            return None
        rel = (self._prev_loss - value) / (self._prev_loss + 1e-15)
        self._momentum = self.beta * self._momentum + (1.0 - self.beta) * rel
        delta = self.alpha * torch.sigmoid(self._momentum) * (1.0 - self._t)
        frac = min(global_step / self.num_train_steps, 1.0)
        t_lin = torch.tensor(
            self.t_start + (self.t_end - self.t_start) * frac, dtype=torch.float64, device=self.device
        )
        if self.disable_adaptive:
            self._t = torch.maximum(self._t, t_lin)
        else:
            self._t = torch.clamp(torch.maximum(t_lin, self._t + delta), max=self.t_end)
        self._prev_loss = value
        return delta

    _CONFIG_KEYS = ("num_train_steps", "t_start", "t_end", "alpha", "beta", "disable_adaptive")

    def state_dict(self) -> dict:
        """State to checkpoint: config values and the ``t``, ``prev_loss``, ``momentum`` tensors (on CPU)."""
        state = {k: getattr(self, k) for k in self._CONFIG_KEYS}
        state.update(
            t=self._t.cpu().clone(),
            prev_loss=self._prev_loss.cpu().clone(),
            momentum=self._momentum.cpu().clone(),
        )
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore from :meth:`state_dict`.

        Raises:
            ValueError: a key is missing or the checkpoint's config differs from this scheduler's.
        """
        missing = [k for k in (*self._CONFIG_KEYS, "t", "prev_loss", "momentum") if k not in state]
        if missing:
            raise ValueError(f"TAIDScheduler state_dict is missing keys {missing}")
        for key in self._CONFIG_KEYS:
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"TAIDScheduler state_dict has {key}={state[key]!r} but this scheduler has "
                    f"{key}={getattr(self, key)!r}; construct the scheduler with the checkpoint's arguments"
                )
        kw = {"dtype": torch.float64, "device": self.device}
        self._t = torch.as_tensor(state["t"]).to(**kw).reshape(())
        self._prev_loss = torch.as_tensor(state["prev_loss"]).to(**kw).reshape(())
        self._momentum = torch.as_tensor(state["momentum"]).to(**kw).reshape(())

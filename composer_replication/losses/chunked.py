"""The chunking base of the log-prob kernels: per-chunk heads and two autograd functions.

Liger-Kernel's scheme (Hsu et al., arXiv 2410.10989): one base owns the chunking, each loss writes only
its per-chunk *head* (logits ``[n, V]`` -> per-token values ``[n]``).

- :class:`_ChunkedRows` returns per-token values ``[N]`` and recomputes each chunk's logits in backward.
- :class:`_ChunkedWeightedSum` returns ``sum_t r_t * value_t`` for weights ``r [N]`` known in forward and
  computes the gradients during forward (no recompute).

Private to :mod:`composer_replication.losses.logprobs`, whose public kernels are built on it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

PerTokenFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


# ---------------------------------------------------------------------------- per-chunk heads


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    z = F.linear(h, weight, bias)  # [n, V]
    return z if z.dtype in (torch.float32, torch.float64) else z.float()


def _acc(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


class _LogProbHead:
    """Per-token smoothed log-likelihood ``(1 - eps) * log p(y) + eps * mean_v log p(v)`` at temperature ``tau``."""

    def __init__(self, targets: torch.Tensor, temperature: float, smoothing: float) -> None:
        self.targets, self.tau, self.eps = targets, float(temperature), float(smoothing)

    def value(self, logits: torch.Tensor, sl: slice) -> torch.Tensor:
        z = logits / self.tau if self.tau != 1.0 else logits
        lse = torch.logsumexp(z, dim=-1)
        val = z.gather(-1, self.targets[sl, None]).squeeze(-1) - lse
        if self.eps:
            val = (1.0 - self.eps) * val + self.eps * (z.mean(-1) - lse)
        return val

    def value_and_grad(
        self, logits: torch.Tensor, sl: slice, g: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Values ``[n]`` and d(sum g * value)/d logits ``[n, V]``, computed in place in ``logits``."""
        z = logits.div_(self.tau) if self.tau != 1.0 else logits
        lse = torch.logsumexp(z, dim=-1)
        y = self.targets[sl, None]
        val = z.gather(-1, y).squeeze(-1) - lse
        if self.eps:
            val = (1.0 - self.eps) * val + self.eps * (z.mean(-1) - lse)
        gs = g / self.tau
        p = z.sub_(lse[:, None]).exp_()  # softmax, in place
        grad = p.mul_(-gs[:, None])
        if self.eps:
            grad.add_((gs * self.eps / z.shape[-1])[:, None])
        grad.scatter_add_(-1, y, ((1.0 - self.eps) * gs)[:, None])
        return val, grad


class _DistillHead:
    """Per-token ``fn(student_logits, teacher_logits)``; the teacher's chunk is projected on demand, no grad."""

    def __init__(self, teacher_hidden: torch.Tensor, weight: torch.Tensor, bias, fn: PerTokenFn) -> None:
        self.teacher_hidden, self.weight, self.bias, self.fn = teacher_hidden, weight.detach(), bias, fn
        if bias is not None:
            self.bias = bias.detach()

    def _teacher(self, sl: slice) -> torch.Tensor:
        with torch.no_grad():
            return _logits(self.teacher_hidden[sl], self.weight, self.bias)

    def value(self, logits: torch.Tensor, sl: slice) -> torch.Tensor:
        return self.fn(logits, self._teacher(sl))

    def value_and_grad(
        self, logits: torch.Tensor, sl: slice, g: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        teacher = self._teacher(sl)
        with torch.enable_grad():
            s = logits.detach().requires_grad_(True)
            out = self.fn(s, teacher)
            (grad,) = torch.autograd.grad(out, s, grad_outputs=g.to(out.dtype))
        return out.detach(), grad


# ---------------------------------------------------------------------------- the chunking base


def _backprop_chunk(gz, h, weight, gh, gw, gb, sl) -> None:
    """Accumulate grads of a chunk from d loss / d logits ``gz [n, V]``."""
    if gh is not None:
        gh[sl] = (gz.to(weight.dtype) @ weight).to(gh.dtype)
    if gw is not None:
        gw.addmm_(gz.t().to(gw.dtype), h.to(gw.dtype))
    if gb is not None:
        gb.add_(gz.sum(0))


def _grad_buffers(hidden, weight, bias, need):
    gh = torch.zeros_like(hidden) if need[0] else None
    gw = torch.zeros(weight.shape, dtype=_acc(weight), device=weight.device) if need[1] else None
    gb = (
        torch.zeros(bias.shape, dtype=_acc(bias), device=bias.device)
        if (bias is not None and need[2])
        else None
    )
    return gh, gw, gb


class _ChunkedRows(torch.autograd.Function):
    """Per-token head values ``[N]``; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, head, chunk_size):
        out = torch.empty(hidden.shape[0], dtype=_acc(hidden), device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            out[sl] = head.value(_logits(hidden[sl], weight, bias), sl)
        ctx.save_for_backward(hidden, weight, bias)
        ctx.head, ctx.chunk_size = head, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias = ctx.saved_tensors
        gh, gw, gb = _grad_buffers(hidden, weight, bias, ctx.needs_input_grad)
        grad_out = grad_out.to(_acc(hidden))
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            sl = slice(start, start + ctx.chunk_size)
            h = hidden[sl]
            _, gz = ctx.head.value_and_grad(_logits(h, weight, bias), sl, grad_out[sl])
            _backprop_chunk(gz, h, weight, gh, gw, gb, sl)
        return (
            gh,
            None if gw is None else gw.to(weight.dtype),
            None if gb is None else gb.to(bias.dtype),
            None,
            None,
        )


class _ChunkedWeightedSum(torch.autograd.Function):
    """``(sum_t r_t * value_t, values [N])``; gradients are computed during forward (Liger's scheme)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, head, chunk_size, r, need):
        values = torch.empty(hidden.shape[0], dtype=_acc(hidden), device=hidden.device)
        gh, gw, gb = _grad_buffers(hidden, weight, bias, need)
        for start in range(0, hidden.shape[0], chunk_size):
            sl = slice(start, start + chunk_size)
            h = hidden[sl]
            z = _logits(h, weight, bias)
            if any(need):
                values[sl], gz = head.value_and_grad(z, sl, r[sl])
                _backprop_chunk(gz, h, weight, gh, gw, gb, sl)
            else:
                values[sl] = head.value(z, sl)
        ctx.save_for_backward(gh, gw, gb)  # freed after backward, kept by retain_graph
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        ctx.mark_non_differentiable(values)
        return (values * r).sum(), values

    @staticmethod
    def backward(ctx, grad_loss, _grad_values):
        gh, gw, gb = ctx.saved_tensors
        w_dtype, b_dtype = ctx.dtypes
        gh = None if gh is None else gh * grad_loss.to(gh.dtype)
        gw = None if gw is None else (gw * grad_loss).to(w_dtype)
        gb = None if gb is None else (gb * grad_loss).to(b_dtype)
        return gh, gw, gb, None, None, None, None


def _check_rows(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int | None, name: str) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"{name}: hidden must be [N, H] and lm_head_weight [V, H]; got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}"
        )
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None (naive path); got {chunk_size!r}")


def _need(hidden, weight, bias) -> tuple[bool, bool, bool]:
    if not torch.is_grad_enabled():
        return (False, False, False)
    return (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)

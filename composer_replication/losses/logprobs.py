"""Chunked log-prob, cross-entropy and distillation kernels over final hidden states.

Liger-Kernel's scheme (Hsu et al., arXiv 2410.10989): the decoder runs once to final hidden states ``[B, T, H]``;
the rows a loss needs go through the ``lm_head`` weight ``[V, H]`` one chunk at a time, so the float32 logits
``[B, T, V]`` never exist whole. Each loss writes only its per-chunk *head* (logits ``[n, V]`` -> values ``[n]``):
``_ChunkedRows`` returns values ``[N]`` and recomputes each chunk in backward (GRPO, DPO, SimPO);
``_ChunkedWeightedSum`` returns ``sum_t r_t value_t`` for weights known in forward, its gradients computed during
forward (cross-entropy, distillation). Gradients reach the hidden states, the head weight (tied or not) and bias;
logits are float32 (float64 kept). ``chunk_size=None`` is the naive path, the reference in tests and benchmarks.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from composer_replication.losses.prefix import can_pack, pack_rows, packed_hidden_states

__all__ = ["decoder_of", "hidden_states", "output_head", "chunked_token_logprobs"]

PerTokenFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

DEFAULT_CHUNK_SIZE = 256
"""Rows of logits per chunk. At SmolLM2's vocabulary (49152) a float32 chunk is 48 MiB; 256 rows meets the
memory target of DESIGN 4.5 (1024 rows did not: see docs/benchmarks.md)."""


# ---------------------------------------------------------------------------- model access


def hidden_states(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    share_prefix: bool = True,
) -> torch.Tensor:
    """Final hidden states ``[B, T, H]`` (after the final norm, the model's dtype) of ``input_ids [B, T]``.

    ``attention_mask [B, T]``: 1 on real tokens (default all), either padding side (``position_ids =
    clamp(cumsum(mask) - 1, 0)``). ``share_prefix``: a prefix several rows share (a group's or a pair's prompt) is
    decoded once when that saves a fifth of the tokens, the rows packed into their prefix tree (:mod:`.prefix`;
    SDPA or eager attention; padding columns may read zeros); else one whole-row pass.
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T]; got shape {tuple(input_ids.shape)}")
    attention_mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
    if attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}")
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    decoder = decoder_of(model)
    packed = pack_rows(input_ids, attention_mask) if share_prefix and can_pack(decoder) else None
    if packed is not None:
        return packed_hidden_states(decoder, packed)
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder (``input_ids [B, T]`` -> hidden ``[B, T, H]``): ``get_decoder()``, else ``.model``, else ``model``."""
    if hasattr(model, "get_decoder"):
        return model.get_decoder()
    return getattr(model, "model", model)


def output_head(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``lm_head`` weight ``[V, H]`` and bias ``[V]`` (or ``None``); ``ValueError`` for a model that
    post-processes its logits (soft-capping, a logit scale), which the kernels do not reproduce."""
    cfg = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale"):
        if cfg is not None and getattr(cfg, attr, None) not in (None, 1.0):
            raise ValueError(f"model config has {attr}={getattr(cfg, attr)!r}: its logits are not lm_head(hidden), "
                             "which the chunked kernels assume; use a model without logit post-processing.")
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"model {type(model).__name__} has no output embedding (lm_head) with a weight")
    return head.weight, getattr(head, "bias", None)


def predicted_positions(mask: torch.Tensor, attention_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows [N], positions [N])`` (row-major) of the tokens of ``mask [B, T]`` that get a log-prob: ``t >= 1``
    and both ``t`` and ``t - 1`` real in ``attention_mask [B, T]`` (the logits predicting ``t`` sit at ``t - 1``)."""
    valid = mask.bool().clone()
    valid[:, 0] = False
    if attention_mask is not None:
        att = attention_mask.bool()
        valid[:, 1:] &= att[:, 1:] & att[:, :-1]
    return valid.nonzero(as_tuple=True)


# ---------------------------------------------------------------------------- per-chunk heads


def _logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``[n, V]`` float32 logits (float64 kept); ``h`` cast to the head's dtype (TRL's ``cast_lm_head_to_fp32``)."""
    z = F.linear(h if h.dtype == weight.dtype else h.to(weight.dtype), weight, bias)  # [n, V]
    return z if z.dtype in (torch.float32, torch.float64) else z.float()


def _acc(x: torch.Tensor) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs."""
    return torch.promote_types(x.dtype, torch.float32)


class _LogProbHead:
    """Per-token ``(1 - eps) log p(y) + eps mean_v log p(v)`` at temperature ``tau``."""

    def __init__(self, targets: torch.Tensor, temperature: float, smoothing: float) -> None:
        self.targets, self.tau, self.eps = targets, float(temperature), float(smoothing)

    def _value(self, z: torch.Tensor, sl: slice) -> tuple[torch.Tensor, torch.Tensor]:
        lse = torch.logsumexp(z, dim=-1)
        val = z.gather(-1, self.targets[sl, None]).squeeze(-1) - lse
        return ((1.0 - self.eps) * val + self.eps * (z.mean(-1) - lse) if self.eps else val), lse

    def value(self, logits: torch.Tensor, sl: slice) -> torch.Tensor:
        return self._value(logits / self.tau if self.tau != 1.0 else logits, sl)[0]

    def value_and_grad(self, logits: torch.Tensor, sl: slice, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Values ``[n]`` and d(sum g * value)/d logits ``[n, V]``, computed in place in ``logits``."""
        z = logits.div_(self.tau) if self.tau != 1.0 else logits
        val, lse = self._value(z, sl)
        gs = g / self.tau
        grad = z.sub_(lse[:, None]).exp_().mul_(-gs[:, None])  # -g * softmax, in place
        if self.eps:
            grad.add_((gs * self.eps / z.shape[-1])[:, None])
        grad.scatter_add_(-1, self.targets[sl, None], ((1.0 - self.eps) * gs)[:, None])
        return val, grad


class _DistillHead:
    """Per-token ``fn(student_logits, teacher_logits)``; the teacher's chunk is projected on demand, no grad."""

    def __init__(self, teacher_hidden: torch.Tensor, weight: torch.Tensor, bias, fn: PerTokenFn) -> None:
        self.teacher_hidden, self.fn = teacher_hidden.detach(), fn
        self.weight, self.bias = weight.detach(), None if bias is None else bias.detach()

    def _teacher(self, sl: slice) -> torch.Tensor:
        with torch.no_grad():
            return _logits(self.teacher_hidden[sl], self.weight, self.bias)

    def value(self, logits: torch.Tensor, sl: slice) -> torch.Tensor:
        return self.fn(logits, self._teacher(sl))

    def value_and_grad(self, logits: torch.Tensor, sl: slice, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        teacher = self._teacher(sl)
        with torch.enable_grad():
            s = logits.detach().requires_grad_(True)
            out = self.fn(s, teacher)
            (grad,) = torch.autograd.grad(out, s, grad_outputs=g.to(out.dtype))
        return out.detach(), grad


# ---------------------------------------------------------------------------- the chunking base


def _chunks(n: int, size: int):
    return (slice(i, i + size) for i in range(0, n, size))


def _backprop_chunk(gz, h, weight, gh, gw, gb, sl) -> None:
    """Accumulate a chunk's gradients from d loss / d logits ``gz [n, V]``."""
    if gh is not None:
        gh[sl] = (gz.to(weight.dtype) @ weight).to(gh.dtype)
    if gw is not None:
        gw.addmm_(gz.t().to(gw.dtype), h.to(gw.dtype))
    if gb is not None:
        gb.add_(gz.sum(0))


def _grad_buffers(hidden, weight, bias, need):
    gh = torch.zeros_like(hidden) if need[0] else None
    gw = torch.zeros(weight.shape, dtype=_acc(weight), device=weight.device) if need[1] else None
    gb = torch.zeros(bias.shape, dtype=_acc(bias), device=bias.device) if bias is not None and need[2] else None
    return gh, gw, gb


class _ChunkedRows(torch.autograd.Function):
    """Per-token head values ``[N]``; backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, head, chunk_size):
        out = torch.empty(hidden.shape[0], dtype=_acc(hidden), device=hidden.device)
        for sl in _chunks(hidden.shape[0], chunk_size):
            out[sl] = head.value(_logits(hidden[sl], weight, bias), sl)
        ctx.save_for_backward(hidden, weight, bias)
        ctx.head, ctx.chunk_size = head, chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, bias = ctx.saved_tensors
        gh, gw, gb = _grad_buffers(hidden, weight, bias, ctx.needs_input_grad)
        grad_out = grad_out.to(_acc(hidden))
        for sl in _chunks(hidden.shape[0], ctx.chunk_size):
            _, gz = ctx.head.value_and_grad(_logits(hidden[sl], weight, bias), sl, grad_out[sl])
            _backprop_chunk(gz, hidden[sl], weight, gh, gw, gb, sl)
        return gh, None if gw is None else gw.to(weight.dtype), None if gb is None else gb.to(bias.dtype), None, None


class _ChunkedWeightedSum(torch.autograd.Function):
    """``(sum_t r_t value_t, values [N])``; the gradients are computed during forward (Liger's scheme)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, head, chunk_size, r, need):
        values = torch.empty(hidden.shape[0], dtype=_acc(hidden), device=hidden.device)
        gh, gw, gb = _grad_buffers(hidden, weight, bias, need)
        for sl in _chunks(hidden.shape[0], chunk_size):
            z = _logits(hidden[sl], weight, bias)
            if any(need):
                values[sl], gz = head.value_and_grad(z, sl, r[sl])
                _backprop_chunk(gz, hidden[sl], weight, gh, gw, gb, sl)
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
        return (None if gh is None else gh * grad_loss.to(gh.dtype), None if gw is None else (gw * grad_loss).to(w_dtype),
                None if gb is None else (gb * grad_loss).to(b_dtype), None, None, None, None)


def _check_rows(hidden: torch.Tensor, weight: torch.Tensor, chunk_size: int | None, name: str) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"{name}: hidden must be [N, H] and lm_head_weight [V, H]; got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None (naive path); got {chunk_size!r}")


def _need(hidden, weight, bias) -> tuple[bool, bool, bool]:
    if not torch.is_grad_enabled():
        return (False, False, False)
    return (hidden.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)


# ---------------------------------------------------------------------------- public kernels


def chunked_row_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``log softmax(hidden @ W.T / temperature)[targets]``: ``hidden [N, H]`` (shifted rows), ``lm_head_weight
    [V, H]``, ``targets [N]``, ``bias [V]`` -> ``[N]`` float32 (backward recomputes each chunk)."""
    _check_rows(hidden, lm_head_weight, chunk_size, "chunked_row_logprobs")
    head = _LogProbHead(targets, temperature, 0.0)
    if chunk_size is None:
        return head.value(_logits(hidden, lm_head_weight, bias), slice(None))
    if hidden.shape[0] == 0:
        return hidden.new_zeros(0, dtype=_acc(hidden)) + 0.0 * hidden.sum()
    return _ChunkedRows.apply(hidden, lm_head_weight, bias, head, chunk_size)


def chunked_token_logprobs(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    input_ids: torch.Tensor,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    attention_mask: torch.Tensor | None = None,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Aligned log-probs ``[B, T]``: ``lp[b, t] = log p(input_ids[b, t] | input_ids[b, :t])``, 0 at ``t = 0``,
    outside ``mask [B, T]`` (default: real tokens) and at padding; ``hidden [B, T, H]``, ``lm_head_weight [V, H]``."""
    if hidden.dim() != 3 or hidden.shape[:2] != input_ids.shape:
        raise ValueError(f"hidden must be [B, T, H] matching input_ids [B, T]; got {tuple(hidden.shape)} and "
                         f"{tuple(input_ids.shape)}")
    rows, pos = predicted_positions(torch.ones_like(input_ids) if mask is None else mask, attention_mask)
    vals = chunked_row_logprobs(hidden[rows, pos - 1], lm_head_weight, input_ids[rows, pos], chunk_size=chunk_size,
                                temperature=temperature, bias=bias)
    return torch.zeros(input_ids.shape, dtype=vals.dtype, device=hidden.device).index_put((rows, pos), vals)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    label_smoothing: float = 0.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean token cross-entropy (``F.cross_entropy``, the naive path) of ``hidden [N, H]`` against ``targets [N]``,
    its gradients computed chunk by chunk during forward."""
    _check_rows(hidden, lm_head_weight, chunk_size, "chunked_cross_entropy")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1); got {label_smoothing!r}")
    if chunk_size is None:
        return F.cross_entropy(_logits(hidden, lm_head_weight, bias), targets, label_smoothing=label_smoothing)
    n = hidden.shape[0]
    r = torch.full((n,), -1.0 / max(n, 1), dtype=_acc(hidden), device=hidden.device)
    head = _LogProbHead(targets, 1.0, label_smoothing)
    return _ChunkedWeightedSum.apply(hidden, lm_head_weight, bias, head, chunk_size, r, _need(hidden, lm_head_weight, bias))[0]


def chunked_distillation_loss(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    per_token_fn: PerTokenFn,
    *,
    weights: torch.Tensor | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sum_t w_t d_t / sum_t w_t, d [N] detached)`` for ``d = per_token_fn(student_logits [n, V], teacher_logits
    [n, V]) -> [n]``, its gradient computed chunk by chunk during forward. ``student_hidden [N, H]`` (grad) and
    ``teacher_hidden [N, H]`` (no grad) are row-aligned through ``lm_head_weight [V, H]``; ``weights [N]``: ones."""
    _check_rows(student_hidden, lm_head_weight, chunk_size, "chunked_distillation_loss")
    if teacher_hidden.shape != student_hidden.shape:
        raise ValueError(f"teacher_hidden {tuple(teacher_hidden.shape)} must match student_hidden "
                         f"{tuple(student_hidden.shape)}")
    n, acc = student_hidden.shape[0], _acc(student_hidden)
    w = torch.ones(n, dtype=acc, device=student_hidden.device) if weights is None else weights.to(acc)
    if w.shape != (n,):
        raise ValueError(f"weights must be [N]={n}; got shape {tuple(w.shape)}")
    head = _DistillHead(teacher_hidden, lm_head_weight, bias, per_token_fn)
    if chunk_size is None:
        d = head.value(_logits(student_hidden, lm_head_weight, bias), slice(None))
        return (d.mean() if weights is None else (d * w).sum() / w.sum()), d.detach()
    need = _need(student_hidden, lm_head_weight, bias)
    return _ChunkedWeightedSum.apply(student_hidden, lm_head_weight, bias, head, chunk_size, w / w.sum(), need)

"""Chunked log-prob, cross-entropy and distillation kernels over final hidden states.

Memory-efficient losses in the style of Liger-Kernel's chunked losses (Hsu et al., "Liger Kernel:
Efficient Triton Kernels for LLM Training", arXiv 2410.10989): run the decoder once to get the final
hidden states ``[B, T, H]``, keep only the rows whose logits a loss needs, and project them through the
``lm_head`` weight ``[V, H]`` one chunk of rows at a time, so the float32 logits ``[B, T, V]`` of the
student and of the teacher never exist at once.

One base owns the chunking (:mod:`.chunked`: ``_ChunkedRows`` and ``_ChunkedWeightedSum``); each loss writes
only its per-chunk function (a *head*: logits ``[n, V]`` -> per-token values ``[n]``):

- ``_ChunkedRows`` returns per-token values ``[N]`` and recomputes each chunk's logits in backward,
  so any downstream loss (GRPO, DPO, SimPO) can be applied to its output.
- ``_ChunkedWeightedSum`` returns ``sum_t r_t * value_t`` for weights ``r [N]`` known in forward and
  computes the gradients during forward (no recompute; Liger's scheme), for losses linear in the
  per-token values (LM cross-entropy, token-mean distillation).

Gradients flow to the hidden states and to the ``lm_head`` weight (tied embeddings included: the
tied parameter simply receives the weight gradient) and to an ``lm_head`` bias when the model has one.
Passing ``chunk_size=None`` selects the naive path (full logits of the selected rows), used as the
reference in tests and benchmarks.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from composer_replication.losses.chunked import (
    PerTokenFn,
    _acc,
    _check_rows,
    _ChunkedRows,
    _ChunkedWeightedSum,
    _DistillHead,
    _logits,
    _LogProbHead,
    _need,
)
from composer_replication.losses.prefix import (
    can_pack,
    pack_rows,
    packed_hidden_states,
    plan_prefix_split,
    shared_prefix_hidden_states,
)

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "hidden_states",
    "decoder_of",
    "output_head",
    "predicted_positions",
    "chunked_token_logprobs",
    "chunked_row_logprobs",
    "chunked_cross_entropy",
    "chunked_distillation",
    "chunked_distillation_loss",
]

log = logging.getLogger(__name__)

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
    """Final hidden states (after the final norm) of a causal LM's decoder, without the lm_head.

    Args:
        model: a Hugging Face causal LM (``model.get_decoder()`` or ``model.model`` is the decoder).
        input_ids: ``[B, T]`` token ids.
        attention_mask: ``[B, T]`` 1 on real tokens (default all ones). Either padding side works:
            ``position_ids = clamp(cumsum(mask) - 1, min=0)``.
        share_prefix: decode a prefix that several rows share once (:mod:`.prefix`: a GRPO group's prompt, a
            pair's prompt), when that saves at least a fifth of the decoder's tokens: the rows packed into
            their prefix tree (one row, no padding; SDPA or eager attention, up to ``PACK_MAX_TOKENS``
            tokens), else prefix levels over a KV cache. ``False``: one whole-row pass (bit-for-bit what
            other trainers compute).

    Returns:
        ``[B, T, H]`` hidden states (the model's dtype), differentiable when grad is enabled. With
        ``share_prefix`` the states of padding columns may be zeros (no loss reads them).
    """
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be [B, T]; got shape {tuple(input_ids.shape)}")
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    if attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )
    position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    decoder = decoder_of(model)
    packed = pack_rows(input_ids, attention_mask) if share_prefix and can_pack(decoder) else None
    if packed is not None:
        return packed_hidden_states(decoder, packed)
    plan = plan_prefix_split(input_ids, attention_mask) if share_prefix else None
    if plan is not None:
        return shared_prefix_hidden_states(decoder, input_ids, attention_mask, position_ids, plan)
    out = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False)
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]


def decoder_of(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder of a causal LM (``model.get_decoder()``; else ``model.model``; else ``model`` itself): the
    stack that maps ``input_ids [B, T]`` to final hidden states ``[B, T, H]``, without the ``lm_head``."""
    if hasattr(model, "get_decoder"):
        return model.get_decoder()
    return getattr(model, "model", model)


def output_head(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The ``lm_head`` weight ``[V, H]`` and bias ``[V]`` (or ``None``) of a causal LM.

    Raises:
        ValueError: the model post-processes its logits (soft-capping or a logit scale), which the
            kernels here do not reproduce.
    """
    cfg = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale"):
        if cfg is not None and getattr(cfg, attr, None) not in (None, 1.0):
            raise ValueError(
                f"model config has {attr}={getattr(cfg, attr)!r}: its logits are not lm_head(hidden), "
                "which the chunked kernels assume; use a model without logit post-processing."
            )
    head = model.get_output_embeddings()
    if head is None or not hasattr(head, "weight"):
        raise ValueError(f"model {type(model).__name__} has no output embedding (lm_head) with a weight")
    return head.weight, getattr(head, "bias", None)


def predicted_positions(
    mask: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows and positions ``t`` whose token gets a log-prob: ``mask[b, t] = 1``, ``t >= 1`` and both
    ``t`` and ``t - 1`` are real tokens (the logits predicting ``t`` sit at ``t - 1``).

    Args:
        mask: ``[B, T]`` tokens wanted (e.g. a response mask).
        attention_mask: ``[B, T]`` or ``None`` (all real).

    Returns:
        ``(rows [N], positions [N])`` long tensors, row-major order.
    """
    valid = mask.bool().clone()
    valid[:, 0] = False
    if attention_mask is not None:
        att = attention_mask.bool()
        valid[:, 1:] &= att[:, 1:] & att[:, :-1]
    return valid.nonzero(as_tuple=True)


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
    """``log softmax(hidden @ W.T / temperature)[targets]`` row by row.

    Args:
        hidden: ``[N, H]`` the hidden states that predict each target (already shifted).
        lm_head_weight: ``[V, H]``.
        targets: ``[N]`` long token ids.
        chunk_size: rows per chunk; ``None`` computes the full ``[N, V]`` logits (naive path).
        temperature: softmax temperature.
        bias: optional ``[V]`` lm_head bias.

    Returns:
        ``[N]`` float32 log-probs, differentiable w.r.t. ``hidden``, ``lm_head_weight`` and ``bias``.
    """
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
    """Per-token log-probs ``[B, T]`` in the project's aligned convention.

    ``lp[b, t] = log p(input_ids[b, t] | input_ids[b, :t])`` for ``t >= 1``; ``lp[b, 0] = 0``; positions
    outside ``mask`` (default: every real token), or whose previous token is padding, are 0.

    Args:
        hidden: ``[B, T, H]`` final hidden states (:func:`hidden_states`).
        lm_head_weight: ``[V, H]``.
        input_ids: ``[B, T]`` token ids.
        chunk_size: rows per chunk (``None`` = naive full logits).
        temperature: softmax temperature.
        attention_mask: ``[B, T]`` or ``None``.
        mask: ``[B, T]`` positions wanted (e.g. the response mask) or ``None`` for all.
        bias: optional ``[V]``.

    Returns:
        ``[B, T]`` float32, differentiable w.r.t. ``hidden`` and the head parameters.
    """
    if hidden.dim() != 3 or hidden.shape[:2] != input_ids.shape:
        raise ValueError(
            f"hidden must be [B, T, H] matching input_ids [B, T]; got {tuple(hidden.shape)} and "
            f"{tuple(input_ids.shape)}"
        )
    rows, pos = predicted_positions(torch.ones_like(input_ids) if mask is None else mask, attention_mask)
    vals = chunked_row_logprobs(
        hidden[rows, pos - 1], lm_head_weight, input_ids[rows, pos],
        chunk_size=chunk_size, temperature=temperature, bias=bias,
    )
    out = torch.zeros(input_ids.shape, dtype=vals.dtype, device=hidden.device)
    return out.index_put((rows, pos), vals)


def chunked_cross_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    label_smoothing: float = 0.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean token cross-entropy (``F.cross_entropy(..., label_smoothing=)`` semantics), chunked.

    Args:
        hidden: ``[N, H]`` hidden states predicting ``targets`` (already shifted).
        lm_head_weight: ``[V, H]``.
        targets: ``[N]`` long.
        chunk_size: rows per chunk (``None`` = ``F.cross_entropy`` on the full ``[N, V]`` logits).
        label_smoothing: in ``[0, 1)``.
        bias: optional ``[V]``.

    Returns:
        Scalar mean over the ``N`` rows; gradients are computed chunk by chunk during forward.
    """
    _check_rows(hidden, lm_head_weight, chunk_size, "chunked_cross_entropy")
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1); got {label_smoothing!r}")
    n = hidden.shape[0]
    if chunk_size is None:
        return F.cross_entropy(_logits(hidden, lm_head_weight, bias), targets, label_smoothing=label_smoothing)
    head = _LogProbHead(targets, 1.0, label_smoothing)
    r = torch.full((n,), -1.0 / max(n, 1), dtype=_acc(hidden), device=hidden.device)
    loss, _ = _ChunkedWeightedSum.apply(hidden, lm_head_weight, bias, head, chunk_size, r, _need(hidden, lm_head_weight, bias))
    return loss


def chunked_distillation(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    per_token_fn: PerTokenFn,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token distillation values ``per_token_fn(student_logits, teacher_logits)`` over chunks.

    Args:
        student_hidden: ``[N, H]`` (with grad) hidden states whose logits are the student's.
        teacher_hidden: ``[N, H]`` (no grad) the teacher's, row-aligned with the student's.
        lm_head_weight: ``[V, H]`` shared by student and teacher (no gradient through the teacher side).
        per_token_fn: ``(student_logits [n, V], teacher_logits [n, V]) -> [n]``; must be row-wise.
        chunk_size: rows per chunk (``None`` = full ``[N, V]`` logits).
        bias: optional ``[V]``.

    Returns:
        ``[N]`` float32 values; backward recomputes each chunk (student and teacher logits).
    """
    _check_rows(student_hidden, lm_head_weight, chunk_size, "chunked_distillation")
    if teacher_hidden.shape != student_hidden.shape:
        raise ValueError(
            f"teacher_hidden {tuple(teacher_hidden.shape)} must match student_hidden {tuple(student_hidden.shape)}"
        )
    head = _DistillHead(teacher_hidden.detach(), lm_head_weight, bias, per_token_fn)
    if chunk_size is None:
        return head.value(_logits(student_hidden, lm_head_weight, bias), slice(None))
    return _ChunkedRows.apply(student_hidden, lm_head_weight, bias, head, chunk_size)


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
    """Weighted token mean ``sum_t w_t d_t / sum_t w_t`` of ``d = per_token_fn(...)``, fused.

    Same arguments as :func:`chunked_distillation`, plus ``weights [N]`` (default ones). The gradient
    is computed chunk by chunk during forward (no recompute in backward).

    Returns:
        ``(loss scalar, per-token values [N] detached)``.
    """
    _check_rows(student_hidden, lm_head_weight, chunk_size, "chunked_distillation_loss")
    n = student_hidden.shape[0]
    acc = _acc(student_hidden)
    w = torch.ones(n, dtype=acc, device=student_hidden.device) if weights is None else weights.to(acc)
    if w.shape != (n,):
        raise ValueError(f"weights must be [N]={n}; got shape {tuple(w.shape)}")
    if chunk_size is None:
        d = chunked_distillation(student_hidden, teacher_hidden, lm_head_weight, per_token_fn, chunk_size=None, bias=bias)
        loss = d.mean() if weights is None else (d * w).sum() / w.sum()
        return loss, d.detach()
    if teacher_hidden.shape != student_hidden.shape:
        raise ValueError(
            f"teacher_hidden {tuple(teacher_hidden.shape)} must match student_hidden {tuple(student_hidden.shape)}"
        )
    head = _DistillHead(teacher_hidden.detach(), lm_head_weight, bias, per_token_fn)
    r = w / w.sum()
    need = _need(student_hidden, lm_head_weight, bias)
    return _ChunkedWeightedSum.apply(student_hidden, lm_head_weight, bias, head, chunk_size, r, need)

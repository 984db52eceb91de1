"""One decoder pass over a sequence batch (:class:`SequenceBatch`), the batch-key checks (keys: docs/losses.md),
and the model-level log-probs (old, reference, DPO; under ``torch.no_grad()``) through the training kernel.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from composer_replication.losses.dpo import per_token_logprobs
from composer_replication.losses.logprobs import (
    DEFAULT_CHUNK_SIZE,
    chunked_token_logprobs,
    hidden_states,
    output_head,
    predicted_positions,
)

__all__ = ["token_logprobs_for", "sequence_logprobs_for"]


class SequenceBatch:
    """One decoder pass over ``ids`` / ``attn [B, T]`` (``attn`` may be ``None``): ``hidden [B, T, H]``, and
    ``full [B, T, V]`` float32 logits when ``chunk_size is None``. ``head = (weight [V, H], bias)``; ``grad=False``
    for the no-grad teacher; ``share_prefix``: see ``hidden_states``."""

    def __init__(self, model, ids, attn, head, chunk_size, *, grad: bool = True, share_prefix: bool = True) -> None:
        self.ids, self.attn, (self.w, self.b), self.chunk_size = ids, attn, head, chunk_size
        with torch.set_grad_enabled(grad and torch.is_grad_enabled()):
            self.hidden = hidden_states(model, ids, attn, share_prefix=share_prefix)  # [B, T, H]
            self.full = None if chunk_size is not None else F.linear(self.hidden.to(self.w.dtype), self.w, self.b).float()

    def rows(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Hidden states ``[N, H]`` predicting tokens ``(rows, pos)`` (taken at ``pos - 1``)."""
        return self.hidden[rows, pos - 1]

    def token_logprobs(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lp [B, T], valid [B, T])``: aligned log-probs on the predictable tokens of ``mask``, 0 elsewhere."""
        rows, pos = predicted_positions(mask, self.attn)
        valid = torch.zeros_like(mask, dtype=torch.bool).index_put((rows, pos), torch.ones_like(rows, dtype=torch.bool))
        if self.full is not None:  # naive: log-softmax over the full [B, T, V] logits
            return torch.where(valid, per_token_logprobs(self.full, self.ids), 0.0), valid
        return chunked_token_logprobs(self.hidden, self.w, self.ids, chunk_size=self.chunk_size,
                                      attention_mask=self.attn, mask=mask, bias=self.b), valid


def batch_tensor(inputs: dict, key: str, shape: tuple | None = None, what: str = "") -> torch.Tensor:
    """``inputs[key]``; ``ValueError`` naming the key when it is missing or its shape is not ``shape``."""
    if key not in inputs:
        raise ValueError(f"inputs lacks {key!r}, required {what}; add it to the batch (the batch keys: docs/losses.md)")
    t = inputs[key]
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"inputs[{key!r}] must have shape {tuple(shape)}; got {tuple(t.shape)}")
    return t


def optional_tensor(inputs: dict, key: str, ids: torch.Tensor) -> torch.Tensor | None:
    """``inputs[key]`` checked to have ``ids``'s shape, or ``None`` when absent (e.g. an attention mask)."""
    return batch_tensor(inputs, key, ids.shape) if key in inputs else None


def distill_index(inputs: dict[str, torch.Tensor], student_ids: torch.Tensor, teacher_ids: torch.Tensor,
                  resp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(student_index [N, 2], teacher_index [N, 2])`` (row, position) of the distilled tokens: the batch's
    ``sdpo_student_index`` / ``sdpo_teacher_index``, else the row-major nonzeros of ``resp [B, T]`` and
    ``sdpo_loss_mask [B, Tt]``. ``ValueError`` for malformed or out-of-range indices, or counts or tokens that differ."""
    if "sdpo_student_index" in inputs or "sdpo_teacher_index" in inputs:
        s_idx = batch_tensor(inputs, "sdpo_student_index", what="with sdpo_teacher_index").long()
        t_idx = batch_tensor(inputs, "sdpo_teacher_index", what="with sdpo_student_index").long()
        if s_idx.dim() != 2 or s_idx.shape[1] != 2 or s_idx.shape != t_idx.shape:
            raise ValueError(f"sdpo_student_index and sdpo_teacher_index must both be [N, 2]; got "
                             f"{tuple(s_idx.shape)} and {tuple(t_idx.shape)}")
    else:
        B = student_ids.shape[0]
        if teacher_ids.shape[0] != B:
            raise ValueError(f"without sdpo_student_index/sdpo_teacher_index the teacher batch must have B={B} rows; "
                             f"got {teacher_ids.shape[0]}. Pass the index keys.")
        t_mask = batch_tensor(inputs, "sdpo_loss_mask", teacher_ids.shape, "when the sdpo index keys are absent")
        s_idx, t_idx = resp.nonzero(), t_mask.nonzero()  # row-major
        s_cnt, t_cnt = torch.bincount(s_idx[:, 0], minlength=B), torch.bincount(t_idx[:, 0], minlength=B)
        if not torch.equal(s_cnt, t_cnt):
            raise ValueError(f"per-row counts of response_mask {s_cnt.tolist()} and sdpo_loss_mask {t_cnt.tolist()} "
                             "differ; the teacher must hold exactly the student's response tokens, or pass "
                             "sdpo_student_index and sdpo_teacher_index.")
    for name, idx, ids in (("sdpo_student_index", s_idx, student_ids), ("sdpo_teacher_index", t_idx, teacher_ids)):
        rows, pos = idx[:, 0], idx[:, 1]
        if idx.numel() and not ((rows >= 0) & (rows < ids.shape[0]) & (pos >= 1) & (pos < ids.shape[1])).all():
            raise ValueError(f"{name} out of range for ids of shape {tuple(ids.shape)} (positions must be >= 1)")
    same = student_ids[s_idx[:, 0], s_idx[:, 1]] == teacher_ids[t_idx[:, 0], t_idx[:, 1]]
    if not bool(same.all()):
        raise ValueError(f"{int((~same).sum())} of {same.numel()} distilled tokens differ between the student and "
                         "teacher sequences; the teacher sequence must end with exactly the student's response tokens.")
    return s_idx, t_idx


def token_logprobs_for(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    response_mask: torch.Tensor | None = None,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
    share_prefix: bool = True,
) -> torch.Tensor:
    """Aligned log-probs ``[B, T]`` of ``input_ids [B, T]`` under ``model`` (0 at position 0 and outside
    ``response_mask [B, T]``), by the kernel ``compose_loss`` trains with (``share_prefix``: ``hidden_states``)."""
    weight, bias = output_head(model)
    hidden = hidden_states(model, input_ids, attention_mask, share_prefix=share_prefix)
    return chunked_token_logprobs(hidden, weight, input_ids, chunk_size=chunk_size, temperature=temperature,
                                  attention_mask=attention_mask, mask=response_mask, bias=bias)


def sequence_logprobs_for(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    response_mask: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    chunk_size: int | None = DEFAULT_CHUNK_SIZE,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Summed response log-probs ``[B]`` (e.g. DPO reference log-probs, under ``torch.no_grad()``); arguments as
    :func:`token_logprobs_for`."""
    return token_logprobs_for(model, input_ids, attention_mask, response_mask=response_mask, chunk_size=chunk_size,
                              temperature=temperature).sum(-1)

"""Gradient accumulation: one step's batch split into micro-batches whose weighted losses add up exactly.

:func:`split_batch` cuts the step's batch into ``parts``; :func:`channel_sizes` gives each part's denominator of
every channel, so ``sum_k (d_k / D) * loss_k`` is the whole batch's loss per channel (``1 x 8`` equals ``8 x 1``,
as in TRL). Channel 1 is split by whole GRPO groups (advantages come from the whole batch); its denominator is the
response-token count for token-mean losses (``dapo``, ``bnpo``, the LM cross-entropy fallback), the row count for
per-sequence ones (``grpo``, ``dr_grpo``). Channel 2 follows its student rows (index pairs renumbered), over the
aligned response tokens. Channel 3's pairs are split evenly, over the pair count.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = []

_ROW_KEYS = ("input_ids", "attention_mask", "response_mask", "old_logprobs", "rewards", "group_ids", "advantages",
             "ref_logprobs")
_TEACHER_KEYS = ("ctx_teacher_input_ids", "ctx_teacher_attention_mask", "sdpo_loss_mask")


def _chunks(n: int, parts: int) -> list[range]:
    """``parts`` contiguous ranges covering ``range(n)``, sizes differing by at most one."""
    base, extra = divmod(n, parts)
    bounds = [k * base + min(k, extra) for k in range(parts + 1)]
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def _row_ranges(batch: Mapping[str, torch.Tensor], parts: int) -> list[range]:
    """Contiguous row ranges of channel 1 holding whole groups (rows of a group are contiguous)."""
    B = batch["input_ids"].shape[0]
    if "group_ids" not in batch:
        if parts > B:
            raise ValueError(f"grad_accum_steps={parts} is larger than the {B} rows of the step; lower it")
        return _chunks(B, parts)
    gids = batch["group_ids"].tolist()
    starts = [i for i in range(B) if i == 0 or gids[i] != gids[i - 1]]
    if parts > len(starts):
        raise ValueError(f"grad_accum_steps={parts} is larger than the {len(starts)} prompt groups of the step; "
                         "lower optim.grad_accum_steps or raise rollout.prompts_per_step")
    bounds = [*starts, B]
    return [range(bounds[g.start], bounds[g.stop]) for g in _chunks(len(starts), parts)]


def split_batch(batch: Mapping[str, torch.Tensor], parts: int) -> list[dict[str, torch.Tensor]]:
    """Cut a ``compose_loss`` batch into ``parts`` micro-batches (``parts == 1``: the batch itself): channel-1 keys
    ``[B, ...]`` by whole groups, channel-2 rows with their student rows (``sdpo_student_index`` /
    ``sdpo_teacher_index`` ``[N, 2]`` renumbered), ``dpo_*`` keys ``[P, ...]`` evenly. ``ValueError``: ``parts < 1``,
    or more parts than groups (or rows, without groups).
    """
    if parts < 1:
        raise ValueError(f"grad_accum_steps must be >= 1, got {parts}")
    if parts == 1:
        return [dict(batch)]
    rows = _row_ranges(batch, parts)
    P = batch["dpo_chosen_input_ids"].shape[0] if "dpo_chosen_input_ids" in batch else 0
    out = []
    for r, pr in zip(rows, _chunks(P, parts)):
        micro = {k: batch[k][r.start : r.stop] for k in _ROW_KEYS if k in batch}
        micro.update(_teacher_part(batch, r))
        if len(pr):
            micro.update({k: v[pr.start : pr.stop] for k, v in batch.items() if k.startswith("dpo_")})
        out.append(micro)
    return out


def _teacher_part(batch: Mapping[str, torch.Tensor], rows: range) -> dict[str, torch.Tensor]:
    """The channel-2 rows whose student row is in ``rows``, indices renumbered for the micro-batch."""
    if "sdpo_student_index" not in batch:
        return {}
    s_idx, t_idx = batch["sdpo_student_index"], batch["sdpo_teacher_index"]  # [N, 2]
    keep = (s_idx[:, 0] >= rows.start) & (s_idx[:, 0] < rows.stop)
    if not bool(keep.any()):
        return {}
    teachers = torch.unique(t_idx[keep, 0])  # sorted teacher rows of this micro-batch
    remap = torch.full((batch["ctx_teacher_input_ids"].shape[0],), -1, dtype=torch.long, device=t_idx.device)
    remap[teachers] = torch.arange(len(teachers), device=t_idx.device)
    out = {k: batch[k][teachers] for k in _TEACHER_KEYS if k in batch}
    out["sdpo_student_index"] = torch.stack([s_idx[keep, 0] - rows.start, s_idx[keep, 1]], dim=1)
    out["sdpo_teacher_index"] = torch.stack([remap[t_idx[keep, 0]], t_idx[keep, 1]], dim=1)
    return out


def channel_sizes(micro: Mapping[str, torch.Tensor], *, loss_type: str) -> tuple[float, float, float]:
    """``(d1, d2, d3)``: the micro-batch's denominator of channel 1, 2 and 3 (see the module docstring)."""
    if "advantages" in micro and loss_type in ("grpo", "dr_grpo"):
        d1 = float(micro["input_ids"].shape[0])
    else:
        d1 = float(micro["response_mask"][:, 1:].sum()) if "response_mask" in micro else 0.0
    d2 = float(micro["sdpo_student_index"].shape[0]) if "sdpo_student_index" in micro else 0.0
    d3 = float(micro["dpo_chosen_input_ids"].shape[0]) if "dpo_chosen_input_ids" in micro else 0.0
    return d1, d2, d3

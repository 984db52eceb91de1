"""The spec's demo batch: :func:`build_batch`, a small real three-channel batch from a tokenizer's chat template.

A coding task rendered through the chat template gives every key of the batch contract (``docs/collator.md``):
two student attempts, each attempt's hinted teacher sequence (the same history plus one hint message, then exactly
the student's response tokens), and (chosen, rejected) pairs of a correct and a buggy solution. The draws come
from a local ``torch.Generator(seed)``.
"""

from __future__ import annotations

from typing import Any

import torch

from composer_replication.batching import pad_rows
from composer_replication.chat_format import build_prompt_ids, build_response_ids
from composer_replication.losses import sequence_logprobs_for

__all__ = ["VARIANTS", "build_batch"]

_TASKS: dict[str, dict[str, Any]] = {
    "factorial": {
        "prompt": "Write a Python function `factorial(n)` that returns n! for a non-negative integer n.",
        "attempts": [
            "def factorial(n):\n    result = 1\n    for i in range(n):\n        result *= i\n    return result",
            "def factorial(n):\n    return n * factorial(n - 1)",
            "def factorial(n):\n    if n == 1:\n        return 1\n    return n * factorial(n - 1)",
        ],
        "hints": [
            "Hint: range(n) starts at 0, so the product is always 0. Check the loop bounds and the base case.",
            "Hint: the recursion has no base case for n == 0; factorial(0) must return 1.",
        ],
        "chosen": [
            "def factorial(n):\n    result = 1\n    for i in range(2, n + 1):\n        result *= i\n    return result",
            "def factorial(n):\n    if n < 2:\n        return 1\n    return n * factorial(n - 1)",
        ],
        "rejected": [
            "def factorial(n):\n    result = 0\n    for i in range(1, n):\n        result *= i\n    return result",
            "def factorial(n):\n    return n * factorial(n - 1)",
        ],
    },
    "binary_search": {
        "prompt": "Write a Python function `binary_search(xs, target)` returning the index of target in the "
        "sorted list xs, or -1 if it is absent.",
        "attempts": [
            "def binary_search(xs, target):\n    lo, hi = 0, len(xs)\n    while lo < hi:\n        mid = (lo + hi) // 2\n"
            "        if xs[mid] < target:\n            lo = mid\n        else:\n            hi = mid\n    return lo",
            "def binary_search(xs, target):\n    lo, hi = 0, len(xs) - 1\n    while lo < hi:\n        mid = (lo + hi) // 2\n"
            "        if xs[mid] == target:\n            return mid\n        lo = mid + 1\n    return -1",
            "def binary_search(xs, target):\n    return xs.index(target)",
        ],
        "hints": [
            "Hint: `lo = mid` never advances when hi - lo == 1, so the loop can spin forever; and absent "
            "targets must return -1.",
            "Hint: the search must move `hi` down when xs[mid] > target, and the last element is never checked.",
        ],
        "chosen": [
            "def binary_search(xs, target):\n    lo, hi = 0, len(xs) - 1\n    while lo <= hi:\n        mid = (lo + hi) // 2\n"
            "        if xs[mid] == target:\n            return mid\n        if xs[mid] < target:\n            lo = mid + 1\n"
            "        else:\n            hi = mid - 1\n    return -1",
            "import bisect\n\ndef binary_search(xs, target):\n    i = bisect.bisect_left(xs, target)\n"
            "    return i if i < len(xs) and xs[i] == target else -1",
        ],
        "rejected": [
            "def binary_search(xs, target):\n    return xs.index(target)",
            "def binary_search(xs, target):\n    lo, hi = 0, len(xs)\n    while lo < hi:\n        mid = (lo + hi) // 2\n"
            "        if xs[mid] < target:\n            lo = mid\n        else:\n            hi = mid\n    return lo",
        ],
    },
}
VARIANTS = tuple(_TASKS)
_SYSTEM = "You are a careful Python programmer. Answer with code only."


def _pad(rows: list[tuple[list[int], list[int]]], pad_id: int, length: int | None = None, left: bool = False):
    """(prompt, response) pairs -> ``ids``, ``attention_mask``, ``response_mask`` ``[B, T]``; a row longer than
    ``length`` loses its first tokens (``align_sdpo_shapes``)."""
    T = length if length is not None else max(len(p) + len(r) for p, r in rows)
    seqs, masks = [(p + r)[-T:] for p, r in rows], [([0] * len(p) + [1] * len(r))[-T:] for p, r in rows]
    side = "left" if left else "right"
    return tuple(pad_rows(x, fill, side=side, width=T)[0] for x, fill in
                 ((seqs, pad_id), ([[1] * len(q) for q in seqs], 0), (masks, 0)))


def build_batch(
    tokenizer: Any,
    *,
    device: torch.device | str = "cpu",
    seed: int = 42,
    variant: str = "factorial",
    align_sdpo_shapes: bool = False,
    ref_model: torch.nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """The spec's demo batch (B = 2 student rows, P = 2 pairs) from a chat tokenizer (``apply_chat_template``).

    Args:
        variant: the coding task, one of :data:`VARIANTS`. seed: the local generator's (no global seeding).
        align_sdpo_shapes: legacy: left-pad / left-truncate the teacher rows to the student length ``T`` (the
            response stays at the end) for consumers that compare position by position; ``compose_loss`` does not.
        ref_model: frozen reference; ``dpo_*_ref_logprobs`` are its summed response log-probs (no grad). ``None``:
            the spec harness's placeholder zeros ``[P]``, which only exercise the wiring.

    Returns:
        ``input_ids``, ``attention_mask``, ``response_mask`` ``[2, T]``; ``ctx_teacher_input_ids``,
        ``ctx_teacher_attention_mask``, ``sdpo_loss_mask`` ``[2, Tt]``; ``dpo_{chosen,rejected}_{input_ids,
        attention_mask,response_mask}`` ``[2, T*]``; ``dpo_{chosen,rejected}_ref_logprobs`` ``[2]``; right-padded
        with the tokenizer's pad id, on ``device``. ``ValueError`` for an unknown ``variant``.
    """
    if variant not in _TASKS:
        raise ValueError(f"variant must be one of {list(VARIANTS)}; got {variant!r}")
    task = _TASKS[variant]
    gen = torch.Generator().manual_seed(seed)
    attempts = [task["attempts"][i] for i in torch.randperm(len(task["attempts"]), generator=gen)[:2].tolist()]
    hints = [task["hints"][i] for i in torch.randperm(len(task["hints"]), generator=gen).tolist()]
    pair_order = torch.randperm(len(task["chosen"]), generator=gen).tolist()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    history = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": task["prompt"]}]
    prompt = build_prompt_ids(tokenizer, history)
    responses = [build_response_ids(tokenizer, a) for a in attempts]
    student = _pad([(prompt, r) for r in responses], pad_id)
    hinted = [(build_prompt_ids(tokenizer, [*history, {"role": "user", "content": h}]), r) for h, r in zip(hints, responses)]
    batch = {}
    for prefix, (ids, att, mask), mask_key in (
        ("", student, "response_mask"),
        ("ctx_teacher_", _pad(hinted, pad_id, student[0].shape[1] if align_sdpo_shapes else None, align_sdpo_shapes),
         "sdpo_loss_mask"),
        *((f"dpo_{side}_", _pad([(prompt, build_response_ids(tokenizer, task[side][i])) for i in pair_order], pad_id),
           f"dpo_{side}_response_mask") for side in ("chosen", "rejected")),
    ):
        batch.update({f"{prefix}input_ids": ids.to(device), f"{prefix}attention_mask": att.to(device),
                      mask_key: mask.to(device)})
    for side in ("chosen", "rejected"):
        with torch.no_grad():
            batch[f"dpo_{side}_ref_logprobs"] = torch.zeros(len(pair_order), device=device) if ref_model is None else (
                sequence_logprobs_for(ref_model, batch[f"dpo_{side}_input_ids"], batch[f"dpo_{side}_response_mask"],
                                      batch[f"dpo_{side}_attention_mask"]).float())
    return batch

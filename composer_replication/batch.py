"""A small real three-channel batch built from a tokenizer's chat template (for smoke tests and demos).

:func:`build_batch` renders a coding task through the tokenizer's chat template and returns every key
of the training batch contract (``docs/collator.md``) for the three channels of
:func:`composer_replication.loss.compose_loss`:

1. two student attempts (prompt + response, ``response_mask`` on the response tokens);
2. for each attempt, the teacher sequence: the same history plus one hint message, followed by exactly
   the student's response tokens (``sdpo_loss_mask`` on them);
3. (chosen, rejected) pairs: a correct and a buggy solution of the same task.

Randomness (which attempts, hints and pairs are drawn) comes from a local ``torch.Generator(seed)``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from composer_replication.batching import pad_rows
from composer_replication.chat_format import build_prompt_ids, build_response_ids
from composer_replication.losses import sequence_logprobs_for

__all__ = ["VARIANTS", "build_batch"]

log = logging.getLogger(__name__)

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
    """(prompt, response) pairs -> ``ids``, ``attention_mask``, ``response_mask`` ``[B, T]`` (``batching.pad_rows``).

    With ``length`` shorter than a row, the row loses its first tokens (legacy ``align_sdpo_shapes``)."""
    T = length if length is not None else max(len(p) + len(r) for p, r in rows)
    seqs = [(p + r)[-T:] for p, r in rows]
    masks = [([0] * len(p) + [1] * len(r))[-T:] for p, r in rows]
    side = "left" if left else "right"
    ids = pad_rows(seqs, pad_id, side=side, width=T)[0]
    att = pad_rows([[1] * len(q) for q in seqs], 0, side=side, width=T)[0]
    return ids, att, pad_rows(masks, 0, side=side, width=T)[0]


def build_batch(
    tokenizer: Any,
    *,
    device: torch.device | str = "cpu",
    seed: int = 42,
    variant: str = "factorial",
    align_sdpo_shapes: bool = False,
    ref_model: torch.nn.Module | None = None,
) -> dict[str, torch.Tensor]:
    """Build a real three-channel batch (B = 2 student rows, P = 2 pairs) from a chat tokenizer.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (``apply_chat_template``, ``__call__``).
        device: where the returned tensors live.
        seed: seed of the local generator that draws the attempts, hints and pairs (no global seeding).
        variant: the coding task, one of :data:`VARIANTS` (``"factorial"``, ``"binary_search"``).
        align_sdpo_shapes: legacy switch for old consumers that compared the student and teacher
            position by position: left-pads or left-truncates the teacher rows to the student length
            ``T`` (the response tokens stay at the end). :func:`compose_loss` does not need it.
        ref_model: frozen reference model; when given, ``dpo_*_ref_logprobs`` are its summed response
            log-probs (computed under ``no_grad`` with :func:`~composer_replication.loss.sequence_logprobs_for`).
            When ``None`` they are the spec harness's placeholder: zeros ``[P]``, which only exercise the
            loss wiring; the training recipe always uses a real reference.

    Returns:
        ``input_ids``, ``attention_mask``, ``response_mask`` ``[2, T]``; ``ctx_teacher_input_ids``,
        ``ctx_teacher_attention_mask``, ``sdpo_loss_mask`` ``[2, Tt]``; ``dpo_{chosen,rejected}_input_ids``,
        ``dpo_{chosen,rejected}_attention_mask``, ``dpo_{chosen,rejected}_response_mask`` ``[2, T*]``;
        ``dpo_chosen_ref_logprobs``, ``dpo_rejected_ref_logprobs`` ``[2]``. Rows are right-padded with the
        tokenizer's pad id (teacher rows are left-padded when ``align_sdpo_shapes``).

    Raises:
        ValueError: ``variant`` is unknown.

    Example:
        >>> batch = build_batch(tokenizer, variant="binary_search")
        >>> compose_loss(model, batch).total.backward()
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
    teacher_rows = [
        (build_prompt_ids(tokenizer, history + [{"role": "user", "content": h}]), r) for h, r in zip(hints, responses)
    ]
    teacher = _pad(teacher_rows, pad_id, student[0].shape[1], left=True) if align_sdpo_shapes else _pad(teacher_rows, pad_id)
    chosen = _pad([(prompt, build_response_ids(tokenizer, task["chosen"][i])) for i in pair_order], pad_id)
    rejected = _pad([(prompt, build_response_ids(tokenizer, task["rejected"][i])) for i in pair_order], pad_id)

    batch = {}
    for prefix, (ids, att, mask), mask_key in (
        ("", student, "response_mask"),
        ("ctx_teacher_", teacher, "sdpo_loss_mask"),
        ("dpo_chosen_", chosen, "dpo_chosen_response_mask"),
        ("dpo_rejected_", rejected, "dpo_rejected_response_mask"),
    ):
        batch.update({f"{prefix}input_ids": ids, f"{prefix}attention_mask": att, mask_key: mask})
    batch = {k: v.to(device) for k, v in batch.items()}
    P = len(pair_order)
    if ref_model is None:
        batch["dpo_chosen_ref_logprobs"] = torch.zeros(P, device=device)
        batch["dpo_rejected_ref_logprobs"] = torch.zeros(P, device=device)
    else:
        with torch.no_grad():
            for side in ("chosen", "rejected"):
                batch[f"dpo_{side}_ref_logprobs"] = sequence_logprobs_for(
                    ref_model, batch[f"dpo_{side}_input_ids"], batch[f"dpo_{side}_response_mask"],
                    batch[f"dpo_{side}_attention_mask"],
                ).float()
    return batch

"""Channel-3 tensors: (chosen, rejected) pairs -> the ``dpo_*`` keys of the batch contract.

Each side is ``prompt(state_messages) + response(action text)`` built with the shared chat format's
``build_prompt_ids`` / ``build_response_ids`` (so prompts tokenize exactly as rollouts do), right
padded with the tokenizer's pad id. The reference model's **summed** response log-probs are added
by :func:`add_reference_logprobs` (no grad, one batched pass), or by a
:class:`ReferenceLogprobCache`, which a training loop keeps so that a pair drawn again in a later step
costs no reference forward pass.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["pair_texts", "build_replay_batch", "add_reference_logprobs", "ReferenceLogprobCache"]

log = logging.getLogger(__name__)


def _messages_to_action(messages: Any) -> str:
    from composer_replication.actions import tool_calls_to_action

    if isinstance(messages, str):
        return messages
    parts = []
    for msg in messages or []:
        if msg.get("role", "assistant") != "assistant":
            continue
        content = msg.get("content")
        if isinstance(content, list):  # content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(tool_calls_to_action(content, msg.get("tool_calls")))
    return "\n\n".join(p for p in parts if p)


def pair_texts(pair: Any) -> tuple[list[dict[str, Any]], str, str]:
    """``(state_messages, chosen_text, rejected_text)`` of a ``DPOPair`` dict or a ``NormalizedDPOPair``.

    Raises:
        ValueError: the pair has neither ``chosen``/``rejected`` texts nor ``*_messages``, or a side is empty.
    """
    rec = dataclasses.asdict(pair) if dataclasses.is_dataclass(pair) and not isinstance(pair, type) else pair
    if not isinstance(rec, dict):
        raise ValueError(f"a pair must be a DPOPair dict or a NormalizedDPOPair, got {type(pair).__name__}")
    state = rec.get("state_messages")
    if not isinstance(state, list):
        raise ValueError(f"pair {rec.get('state_id')!r}: 'state_messages' must be a list of messages")
    chosen = rec["chosen"] if "chosen" in rec else _messages_to_action(rec.get("chosen_messages"))
    rejected = rec["rejected"] if "rejected" in rec else _messages_to_action(rec.get("rejected_messages"))
    if not chosen or not rejected:
        raise ValueError(
            f"pair {rec.get('state_id')!r} has an empty chosen or rejected action; "
            "expected 'chosen'/'rejected' texts or 'chosen_messages'/'rejected_messages'"
        )
    return state, chosen, rejected


def _pad(rows: Sequence[list[int]], masks: Sequence[list[int]], pad_id: int) -> tuple[torch.Tensor, ...]:
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    resp = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, m) in enumerate(zip(rows, masks)):
        ids[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        attn[i, : len(r)] = 1
        resp[i, : len(m)] = torch.tensor(m, dtype=torch.long)
    return ids, attn, resp


def build_replay_batch(
    tokenizer: Any, pairs: Sequence[Any], *, max_seq_len: int | None = None
) -> tuple[dict[str, torch.Tensor], int]:
    """Tokenize pairs into ``dpo_{chosen,rejected}_{input_ids,attention_mask,response_mask}`` ``[P, T*]``.

    Pairs whose chosen or rejected sequence is longer than ``max_seq_len`` are skipped (with a
    warning; they are never truncated). Returns ``(batch, n_skipped)``; ``batch`` is empty when no
    pair remains.
    """
    from composer_replication.chat_format import build_prompt_ids, build_response_ids

    sides: dict[str, tuple[list[list[int]], list[list[int]]]] = {"chosen": ([], []), "rejected": ([], [])}
    skipped = 0
    for pair in pairs:
        state, chosen, rejected = pair_texts(pair)
        prompt = build_prompt_ids(tokenizer, state)
        seqs = {}
        for side, text in (("chosen", chosen), ("rejected", rejected)):
            resp = build_response_ids(tokenizer, text)
            seqs[side] = (prompt + resp, [0] * len(prompt) + [1] * len(resp))
        if max_seq_len is not None and max(len(s[0]) for s in seqs.values()) > max_seq_len:
            skipped += 1
            log.warning("skipping a pair longer than max_seq_len=%d tokens", max_seq_len)
            continue
        for side, (ids, mask) in seqs.items():
            sides[side][0].append(ids)
            sides[side][1].append(mask)
    if not sides["chosen"][0]:
        return {}, skipped
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batch: dict[str, torch.Tensor] = {}
    for side, (rows, masks) in sides.items():
        ids, attn, resp = _pad(rows, masks, pad_id)
        batch[f"dpo_{side}_input_ids"] = ids  # [P, T_side]
        batch[f"dpo_{side}_attention_mask"] = attn
        batch[f"dpo_{side}_response_mask"] = resp
    return batch, skipped


@torch.no_grad()
def add_reference_logprobs(batch: dict[str, torch.Tensor], reference: torch.nn.Module, *, chunk_size: int | None) -> None:
    """Add ``dpo_{chosen,rejected}_ref_logprobs [P]``: the reference's summed response log-probs (no grad).

    Chosen and rejected rows are scored in one forward pass (``[2P, max(Tc, Tr)]``, right padded).
    """
    from composer_replication.loss import sequence_logprobs_for

    P = batch["dpo_chosen_input_ids"].shape[0]
    width = max(batch["dpo_chosen_input_ids"].shape[1], batch["dpo_rejected_input_ids"].shape[1])

    def widen(t: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=fill)

    ids = torch.cat([widen(batch[f"dpo_{s}_input_ids"], 0) for s in ("chosen", "rejected")])  # [2P, T]
    attn = torch.cat([widen(batch[f"dpo_{s}_attention_mask"], 0) for s in ("chosen", "rejected")])
    resp = torch.cat([widen(batch[f"dpo_{s}_response_mask"], 0) for s in ("chosen", "rejected")])
    lp = sequence_logprobs_for(reference, ids, resp, attn, chunk_size=chunk_size).detach().float()  # [2P]
    batch["dpo_chosen_ref_logprobs"] = lp[:P]
    batch["dpo_rejected_ref_logprobs"] = lp[P:]


class ReferenceLogprobCache:
    """Summed reference response log-probs per sequence, computed once per distinct sequence.

    The reference is frozen, so a sequence's value never changes; pairs are redrawn step after step, so
    a training loop keeps one cache and pays one reference forward pass per distinct sequence. Each
    sequence is scored alone (``[1, T]``, no padding), so its value does not depend on which other pairs
    share its step: a resumed run, whose cache starts empty, recomputes exactly the same numbers.
    Keys are digests of the sequence's tokens and response mask (16 bytes each).

    Args:
        reference: the frozen reference model.
        chunk_size: rows per chunk of the log-prob kernel (``None`` = naive).
    """

    def __init__(self, reference: torch.nn.Module, *, chunk_size: int | None) -> None:
        self.reference = reference
        self.chunk_size = chunk_size
        self._values: dict[bytes, torch.Tensor] = {}

    def __len__(self) -> int:
        return len(self._values)

    @torch.no_grad()
    def fill(self, batch: dict[str, torch.Tensor]) -> None:
        """Add ``dpo_{chosen,rejected}_ref_logprobs [P]`` (float32) to a :func:`build_replay_batch` batch."""
        from composer_replication.loss import sequence_logprobs_for

        for side in ("chosen", "rejected"):
            ids, attn = batch[f"dpo_{side}_input_ids"], batch[f"dpo_{side}_attention_mask"]
            resp = batch[f"dpo_{side}_response_mask"]
            values = []
            for row in range(ids.shape[0]):
                keep = attn[row].bool()
                r_ids, r_resp = ids[row, keep][None], resp[row, keep][None]  # [1, T_row]
                key = hashlib.blake2b(
                    r_ids.cpu().numpy().tobytes() + b"|" + r_resp.cpu().numpy().tobytes(), digest_size=16
                ).digest()
                if key not in self._values:
                    lp = sequence_logprobs_for(self.reference, r_ids, r_resp, chunk_size=self.chunk_size)
                    self._values[key] = lp[0].float()
                values.append(self._values[key])
            batch[f"dpo_{side}_ref_logprobs"] = torch.stack(values)  # [P]


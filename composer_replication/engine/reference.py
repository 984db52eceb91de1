"""Channel-3 reference log-probs: the frozen reference's summed response log-probs, once per sequence.

The preference rows themselves come from :mod:`composer_replication.batching` (pairs tokenized once per
run); :class:`ReferenceLogprobCache` adds ``dpo_{chosen,rejected}_ref_logprobs`` to them, so that a pair
drawn again in a later step costs no reference forward pass.
"""

from __future__ import annotations

import hashlib
import logging

import torch

__all__ = ["ReferenceLogprobCache"]

log = logging.getLogger(__name__)


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
        """Add ``dpo_{chosen,rejected}_ref_logprobs [P]`` (float32) to a ``batching.preference_batch`` batch."""
        from composer_replication.losses import sequence_logprobs_for

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


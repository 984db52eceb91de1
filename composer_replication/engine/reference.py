"""Channel-3 reference log-probs: the frozen reference's summed response log-probs, once per sequence.

The preference rows themselves come from :mod:`composer_replication.batching` (pairs tokenized once per
run); :class:`ReferenceLogprobCache` adds ``dpo_{chosen,rejected}_ref_logprobs`` to them, so that a pair
drawn again in a later step costs no reference forward pass.

Both sides of a pair, and every re-sampled rejected side of it, share one prompt. The cache therefore
keeps the reference's KV cache of each prompt (within a byte budget) and decodes only the response
tokens of a new sequence over it: with the recorded teacher the rejected side is re-sampled every few
steps, and its reference pass shrinks from the whole sequence (~180 tokens at the default preset) to its
response (~35).
"""

from __future__ import annotations

import hashlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch

from composer_replication.losses import chunked_token_logprobs, decoder_of, output_head, sequence_logprobs_for

__all__ = ["ReferenceLogprobCache", "DEFAULT_PROMPT_CACHE_BYTES"]

log = logging.getLogger(__name__)

DEFAULT_PROMPT_CACHE_BYTES = 512 * 2**20
"""The prompts' KV caches the reference keeps (least recently used dropped first): 512 MiB."""


@dataclass
class _PromptState:
    """The reference's state after a prompt ``[1, P]``: its KV cache and its last hidden state ``[1, 1, H]``."""

    cache: Any
    last_hidden: torch.Tensor
    length: int
    nbytes: int


def _digest(*tensors: torch.Tensor) -> bytes:
    return hashlib.blake2b(b"|".join(t.cpu().numpy().tobytes() for t in tensors), digest_size=16).digest()


def _cache_nbytes(cache: Any, last_hidden: torch.Tensor) -> int:
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)] + [last_hidden]
    return sum(t.numel() * t.element_size() for t in tensors)


class ReferenceLogprobCache:
    """Summed reference response log-probs per sequence, computed once per distinct sequence.

    The reference is frozen, so a sequence's value never changes; pairs are redrawn step after step, so
    a training loop keeps one cache and pays one reference pass per distinct sequence. A sequence is
    scored in two fixed calls: its prompt alone (``[1, P]``; the tokens before the first response token,
    whose KV cache is kept and reused by every later sequence with the same prompt) and then its
    remaining ``[1, T - P]`` tokens over that cache. Neither call depends on which other pairs share its
    step or on what was cached before, so a resumed run, whose cache starts empty, recomputes exactly the
    same numbers. Keys are 16-byte digests of the tokens (and, for sequences, the response mask).

    Args:
        reference: the frozen reference model (a Hugging Face causal LM whose decoder returns a
            ``DynamicCache``; models without one are scored whole, ``[1, T]``).
        chunk_size: rows per chunk of the log-prob kernel (``None`` = naive).
        prompt_cache_bytes: the most bytes of prompt KV caches kept (least recently used dropped first;
            0 keeps none, and every sequence decodes its prompt again).
    """

    def __init__(self, reference: torch.nn.Module, *, chunk_size: int | None,
                 prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES) -> None:
        if prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be >= 0; got {prompt_cache_bytes}")
        self.reference = reference
        self.chunk_size = chunk_size
        self.prompt_cache_bytes = prompt_cache_bytes
        self._values: dict[bytes, torch.Tensor] = {}
        self._prompts: OrderedDict[bytes, _PromptState] = OrderedDict()
        self._prompt_bytes = 0
        self._reusable = True  # False once the decoder has returned no croppable, per-layer KV cache

    def __len__(self) -> int:
        return len(self._values)

    @property
    def num_prompts(self) -> int:
        """How many prompts' KV caches are kept now."""
        return len(self._prompts)

    @torch.no_grad()
    def fill(self, batch: dict[str, torch.Tensor]) -> None:
        """Add ``dpo_{chosen,rejected}_ref_logprobs [P]`` (float32) to a ``batching.preference_batch`` batch."""
        for side in ("chosen", "rejected"):
            ids, attn = batch[f"dpo_{side}_input_ids"], batch[f"dpo_{side}_attention_mask"]
            resp = batch[f"dpo_{side}_response_mask"]
            values = []
            for row in range(ids.shape[0]):
                keep = attn[row].bool()
                r_ids, r_resp = ids[row, keep], resp[row, keep]  # [T_row]
                key = _digest(r_ids, r_resp)
                if key not in self._values:
                    self._values[key] = self._score(r_ids, r_resp)
                values.append(self._values[key])
            batch[f"dpo_{side}_ref_logprobs"] = torch.stack(values)  # [P]

    def _score(self, ids: torch.Tensor, resp: torch.Tensor) -> torch.Tensor:
        """Summed log-probs of ``ids [T]`` at ``resp [T]`` (float32 scalar): prompt state, then the rest."""
        hits = resp.nonzero()
        if hits.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=ids.device)
        prompt_len = max(int(hits[0]), 1)  # position 0 is never scored, so a prompt has at least one token
        prompt = self._prompt_state(ids[:prompt_len]) if self._reusable else None
        if prompt is None:  # no reusable KV cache for this decoder: score the sequence whole
            return sequence_logprobs_for(self.reference, ids[None], resp[None], chunk_size=self.chunk_size)[0].float()
        rest = ids[prompt_len:]
        decoder = decoder_of(self.reference)
        position_ids = torch.arange(prompt_len, ids.shape[0], device=ids.device)[None]
        try:
            out = decoder(input_ids=rest[None], position_ids=position_ids, past_key_values=prompt.cache,
                          use_cache=True)
        finally:  # keep the prompt's own entries only, for the next sequence (a negative crop removes tokens)
            extra = prompt.cache.get_seq_length() - prompt.length
            if extra > 0:
                prompt.cache.crop(-extra)
        hidden = torch.cat([prompt.last_hidden, out.last_hidden_state], dim=1)  # [1, 1 + T - P, H]
        weight, bias = output_head(self.reference)
        lp = chunked_token_logprobs(hidden, weight, ids[None, prompt_len - 1:], chunk_size=self.chunk_size,
                                    mask=resp[None, prompt_len - 1:], bias=bias)
        return lp.sum().float()

    def _prompt_state(self, prompt: torch.Tensor) -> _PromptState | None:
        """The reference's KV cache after ``prompt [P]`` (cached, least recently used dropped first)."""
        key = _digest(prompt)
        state = self._prompts.get(key)
        if state is not None:
            self._prompts.move_to_end(key)
            return state
        out = decoder_of(self.reference)(input_ids=prompt[None], use_cache=True)
        cache = out.past_key_values
        if cache is None or not (hasattr(cache, "crop") and hasattr(cache, "layers")):
            self._reusable = False  # the same decoder never returns one: score every sequence whole from now on
            return None
        last = out.last_hidden_state[:, -1:].clone()  # [1, 1, H], not a view that keeps [1, P, H] alive
        state = _PromptState(cache, last, int(prompt.shape[0]), _cache_nbytes(cache, last))
        if state.nbytes <= self.prompt_cache_bytes:
            self._prompts[key] = state
            self._prompt_bytes += state.nbytes
            while self._prompt_bytes > self.prompt_cache_bytes:
                _, dropped = self._prompts.popitem(last=False)
                self._prompt_bytes -= dropped.nbytes
        return state

"""Channel 3 of a step: the pairs' rows and their reference log-probs.

:class:`PairRows`: a pair that stores its rejected side (frontier teachers: the recorded action) is tokenized once
per run. A ``recorded`` teacher's pair does not (``PreferencePair.rejected_from_rollout``): a step that draws it
also rolls out at its state (``engine.data.draw_step``), and its rejected side is one of those G samples whose
action differs from ``chosen`` (``actions.canonical_action``), picked with the step's RNG, as the sampled token ids
(same policy, zero staleness); when all G agree, the pair is skipped this step (``replay/pairs_agreed``). Its chosen
side and prompt (fitted to the longer of chosen and ``max_new_tokens``) are tokenized once per run.

:class:`ReferenceLogprobCache`: a pair's sides share its prompt, and a pair drawn again keeps it (the chosen side
repeats; a rollout-rejected side is new every step), so the frozen reference's KV cache of each prompt is kept
(within a byte budget) and a new sequence decodes only its response over it (~50 tokens, not ~250); values are kept.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from composer_replication.actions import canonical_action
from composer_replication.batching import BatchingStats, TokenizedPair, fit_prompt, tokenize_pair
from composer_replication.chat_format import build_prompt_ids, build_response_ids
from composer_replication.losses import sequence_logprobs_for
from composer_replication.losses.logprobs import chunked_token_logprobs, decoder_of, output_head
from composer_replication.types import PreferencePair

__all__ = ["PairRows", "ReferenceLogprobCache"]

DEFAULT_PROMPT_CACHE_BYTES = 512 * 2**20
"""The prompts' KV caches the reference keeps (least recently used dropped first): 512 MiB."""
_MAX_VALUES = 1 << 16  # sequence values kept (cleared when full: new rejected sides would grow it forever)


class _PromptState(NamedTuple):
    """The reference's state after a prompt ``[1, P]``: KV cache, last hidden state ``[1, 1, H]``, ``P``, bytes."""

    cache: Any
    last_hidden: torch.Tensor
    length: int
    nbytes: int


def _digest(*tensors: torch.Tensor) -> bytes:
    return hashlib.blake2b(b"|".join(t.cpu().numpy().tobytes() for t in tensors), digest_size=16).digest()


class ReferenceLogprobCache:
    """Summed reference response log-probs per sequence, computed once per distinct sequence.

    A sequence is scored in two fixed calls: its prompt alone (``[1, P]``, the tokens before its first response
    token; that KV cache and last hidden state are kept for later sequences with the same prompt), then its
    remaining ``[1, T - P]`` tokens over it. Neither call depends on the other pairs of the step or on what was
    cached before, so a resumed run (empty cache) recomputes the same numbers bit for bit.

    Args:
        reference: the frozen reference (a Hugging Face causal LM; a decoder that returns no croppable per-layer KV
            cache is detected on the first prompt, and every sequence is then scored whole, ``[1, T]``).
        chunk_size: rows per chunk of the log-prob kernel (``None`` = naive).
        prompt_cache_bytes: the most bytes of prompt KV caches kept (0 keeps none).
    """

    def __init__(self, reference: torch.nn.Module, *, chunk_size: int | None,
                 prompt_cache_bytes: int = DEFAULT_PROMPT_CACHE_BYTES) -> None:
        if prompt_cache_bytes < 0:
            raise ValueError(f"prompt_cache_bytes must be >= 0; got {prompt_cache_bytes}")
        self.reference, self.chunk_size, self.prompt_cache_bytes = reference, chunk_size, prompt_cache_bytes
        self._values: dict[bytes, torch.Tensor] = {}
        self._prompts: OrderedDict[bytes, _PromptState] = OrderedDict()
        self._prompt_bytes = 0
        self._reusable = True

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
            ids, attn, resp = (batch[f"dpo_{side}_{k}"] for k in ("input_ids", "attention_mask", "response_mask"))
            values = []
            for row in range(ids.shape[0]):
                keep = attn[row].bool()
                r_ids, r_resp = ids[row, keep], resp[row, keep]  # [T_row]
                key = _digest(r_ids, r_resp)
                if key not in self._values:
                    if len(self._values) >= _MAX_VALUES:
                        self._values.clear()
                    self._values[key] = self._score(r_ids, r_resp)
                values.append(self._values[key])
            batch[f"dpo_{side}_ref_logprobs"] = torch.stack(values)  # [P]

    def _score(self, ids: torch.Tensor, resp: torch.Tensor) -> torch.Tensor:
        """Summed log-probs of ``ids [T]`` at ``resp [T]`` (float32 scalar): prompt state, then the rest."""
        hits = resp.nonzero()
        if hits.numel() == 0:
            return torch.zeros((), dtype=torch.float32, device=ids.device)
        P = max(int(hits[0]), 1)  # position 0 is never scored, so a prompt has at least one token
        prompt = self._prompt_state(ids[:P]) if self._reusable else None
        if prompt is None:
            return sequence_logprobs_for(self.reference, ids[None], resp[None], chunk_size=self.chunk_size)[0].float()
        cache, last, length, _ = prompt
        positions = torch.arange(P, ids.shape[0], device=ids.device)[None]
        try:
            out = decoder_of(self.reference)(input_ids=ids[None, P:], position_ids=positions, past_key_values=cache,
                                             use_cache=True)
        finally:  # keep the prompt's own entries only (a negative crop removes tokens)
            if cache.get_seq_length() > length:
                cache.crop(length - cache.get_seq_length())
        hidden = torch.cat([last, out.last_hidden_state], dim=1)  # [1, 1 + T - P, H]
        weight, bias = output_head(self.reference)
        return chunked_token_logprobs(hidden, weight, ids[None, P - 1:], chunk_size=self.chunk_size,
                                      mask=resp[None, P - 1:], bias=bias).sum().float()

    def _prompt_state(self, prompt: torch.Tensor) -> _PromptState | None:
        """The reference's state after ``prompt [P]`` (cached; least recently used dropped first)."""
        key = _digest(prompt)
        if key in self._prompts:
            self._prompts.move_to_end(key)
            return self._prompts[key]
        out = decoder_of(self.reference)(input_ids=prompt[None], use_cache=True)
        cache = out.past_key_values
        if cache is None or not (hasattr(cache, "crop") and hasattr(cache, "layers")):
            self._reusable = False  # this decoder never returns one: score every sequence whole from now on
            return None
        last = out.last_hidden_state[:, -1:].clone()  # not a view that keeps [1, P, H] alive
        nbytes = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
        state = _PromptState(cache, last, int(prompt.shape[0]), nbytes + last.numel() * last.element_size())
        if state.nbytes <= self.prompt_cache_bytes:
            self._prompts[key] = state
            self._prompt_bytes += state.nbytes
            while self._prompt_bytes > self.prompt_cache_bytes:
                self._prompt_bytes -= self._prompts.popitem(last=False)[1].nbytes
        return state


class PairRows:
    """The run's pairs (``TrainingData.pairs``) as tokens, and each step's rows (see the module docstring).
    ``max_seq_len`` / ``over_length``: the over-length policy (``batching``; skips counted in ``stats``);
    ``max_new_tokens``: the rollouts' length limit (the longest rejected side of a rollout pair)."""

    def __init__(self, tokenizer: Any, pairs: Sequence[PreferencePair], *, max_seq_len: int, over_length: str,
                 max_new_tokens: int) -> None:
        self.pairs, self.stats = list(pairs), BatchingStats()
        self.tokens = [self._tokenize(tokenizer, p, max_seq_len, over_length, max_new_tokens) for p in self.pairs]
        self.chosen = [canonical_action(p.chosen) if p.rejected_from_rollout else None for p in self.pairs]

    def _tokenize(self, tokenizer: Any, pair: PreferencePair, max_seq_len: int, over_length: str,
                  max_new_tokens: int) -> TokenizedPair | None:
        if not pair.rejected_from_rollout:
            return tokenize_pair(tokenizer, pair, max_seq_len=max_seq_len, over_length=over_length, stats=self.stats)
        if not pair.chosen.strip():
            self.stats.skipped["empty_action"] += 1
            return None
        chosen = build_response_ids(tokenizer, pair.chosen)
        prompt = fit_prompt(build_prompt_ids(tokenizer, pair.state_messages), max(len(chosen), max_new_tokens),
                            max_seq_len=max_seq_len, over_length=over_length, stats=self.stats)
        return None if prompt is None else TokenizedPair(pair.state_id, tuple(prompt), tuple(chosen), ())

    def for_step(self, drawn: Sequence[int], prompts: Sequence[Any], rollouts: Any, rng: random.Random
                 ) -> tuple[list[TokenizedPair], int]:
        """The rows of the pairs ``drawn`` (indices into ``pairs``) and how many were skipped because every sample
        agreed with ``chosen``. ``rollouts`` is the step's ``rollout.RolloutBatch`` over ``prompts`` (``None``
        without prompts); a rollout pair's state is among ``prompts`` (``engine.data.draw_step``)."""
        at = {p.prompt_id: j for j, p in enumerate(prompts)} if rollouts is not None else {}
        actions = [canonical_action(t) for t in rollouts.texts] if at else []
        rows, agreed = [], 0
        for i in drawn:
            row = self.tokens[i]
            if row is not None and self.chosen[i] is not None:
                options = [b for b, j in enumerate(rollouts.prompt_index)
                           if j == at[row.state_id] and actions[b] != self.chosen[i]]
                if not options:
                    agreed += 1
                    continue
                row = dataclasses.replace(row, rejected=tuple(rollouts.response_ids[rng.choice(options)]))
            if row is not None:
                rows.append(row)
        return rows, agreed

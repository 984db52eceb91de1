"""A local Hugging Face teacher: ``local:<model>`` slugs generate in-process, offline, at cost 0.

``<model>`` is an embedded model of :func:`composer_replication.models.load_model_and_tokenizer`
(``smollm2-135m``, the default for a bare ``local:``, or ``tiny``) or a local model folder. The model
is loaded once, lazily, and kept on the :class:`LocalTeacher` instance (the replay keeps one instance
per slug; there is no module-level cache). Generation runs in a worker thread (``asyncio.to_thread``)
behind a per-model lock, with sampling drawn from a ``torch.Generator`` seeded from
``(seed, state_id)``, so the same state gives the same reply on every run and in any order.
``temperature <= 0`` decodes greedily. Prompts longer than the model's context keep their last tokens.

The same backend samples a *student's* own actions (:func:`sample_actions`,
:meth:`LocalTeacher.sample_actions`): the prompt is the state's history in the student's chat format
(``chat_format.build_prompt_ids``, as rollouts see it, not the teacher instruction), generated in
batches through the one generate helper (``batching.generate_responses``), exactly as the trainer
samples rollouts. The ``recorded`` teacher (:mod:`.recorded`) puts these samples on the rejected side.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["LOCAL_PREFIX", "DEFAULT_LOCAL_MODEL", "LocalGeneration", "LocalTeacher", "local_model_name",
           "sample_actions"]

log = logging.getLogger(__name__)

LOCAL_PREFIX = "local:"
DEFAULT_LOCAL_MODEL = "smollm2-135m"


def local_model_name(slug: str) -> str:
    """``"local:tiny"`` -> ``"tiny"``; ``"local:"`` -> the default model."""
    if not slug.startswith(LOCAL_PREFIX):
        raise ValueError(f"{slug!r} is not a local teacher slug; local slugs look like 'local:tiny'.")
    return slug[len(LOCAL_PREFIX) :].strip() or DEFAULT_LOCAL_MODEL


def _call_seed(seed: int, state_id: str) -> int:
    digest = hashlib.sha256(f"{seed}\x00{state_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def sample_actions(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[Sequence[dict[str, Any]]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    seed: int = 0,
    batch_size: int = 64,
) -> list[str]:
    """One sampled action per prompt (a chat-message history), as the student samples rollouts.

    Prompts go through ``chat_format.build_prompt_ids`` and ``batching.generate_in_length_order`` in batches
    of ``batch_size`` prompts of similar length (``batching.length_order``; the prefix all prompts share is
    prefilled once); batch ``k`` samples under a seed derived from ``(seed, k)``, so the result is a function
    of ``(weights, prompts, seed, batch_size)``. Batching pays even on a CPU: the default preset's 48 states
    (64 tokens, two threads) take about 22 s in one batch, 31 s in left-padded batches of 16.
    ``temperature <= 0`` decodes greedily. The
    model's train/eval mode and the caller's RNG are left as they were.

    Returns:
        The decoded responses (special tokens skipped, stripped), index-aligned with ``prompts``.

    Raises:
        ValueError: ``max_new_tokens`` or ``batch_size`` below 1.
    """
    from composer_replication.batching import generate_in_length_order

    if max_new_tokens < 1 or batch_size < 1:
        raise ValueError(f"need max_new_tokens >= 1 and batch_size >= 1, got {max_new_tokens} and {batch_size}")
    responses = generate_in_length_order(
        model, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size,
        do_sample=temperature > 0, temperature=max(temperature, 1e-6), top_p=top_p,
        batch_seed=lambda k: _call_seed(seed, f"batch:{k}"),
    )
    return [tokenizer.decode(r, skip_special_tokens=True).strip() for r in responses]


@dataclass
class LocalGeneration:
    """One local reply: text and token counts."""

    text: str
    prompt_tokens: int
    completion_tokens: int


class LocalTeacher:
    """An in-process causal LM teacher.

    Args:
        model: an embedded model name or a local folder (see module docstring).
        device: where to run (``"cpu"`` by default).
        model_seed: initialisation seed of the ``tiny`` preset.
        preloaded: an already loaded ``(model, tokenizer)`` to use instead of loading ``model``
            (the model must be on ``device``; it is used read-only).
    """

    def __init__(
        self,
        model: str = DEFAULT_LOCAL_MODEL,
        *,
        device: str = "cpu",
        model_seed: int = 0,
        preloaded: tuple[Any, Any] | None = None,
    ) -> None:
        self.model_name = model
        self.device = device
        self.model_seed = model_seed
        self._lock = threading.Lock()
        self._model: Any = preloaded[0] if preloaded is not None else None
        self._tokenizer: Any = preloaded[1] if preloaded is not None else None

    def __repr__(self) -> str:
        state = "loaded" if self._model is not None else "not loaded"
        return f"LocalTeacher({self.model_name!r}, device={self.device!r}, {state})"

    def _ensure_loaded(self) -> None:
        if self._model is None:
            from composer_replication.models import load_model_and_tokenizer

            log.info("loading local teacher %s", self.model_name)
            self._model, self._tokenizer = load_model_and_tokenizer(
                self.model_name, seed=self.model_seed, device=self.device
            )

    def generate(
        self,
        messages: list[dict[str, str]],
        *,
        state_id: str,
        max_new_tokens: int,
        temperature: float = 0.7,
        seed: int = 0,
    ) -> LocalGeneration:
        """Generate a reply to ``messages`` (blocking; thread-safe). Deterministic in (seed, state_id)."""
        with self._lock:
            self._ensure_loaded()
            return self._generate(messages, state_id, max_new_tokens, temperature, seed)

    def sample_actions(self, prompts: Sequence[Sequence[dict[str, Any]]], **kwargs: Any) -> list[str]:
        """:func:`sample_actions` with this model (blocking; thread-safe; loads the model on first use)."""
        with self._lock:
            self._ensure_loaded()
            return sample_actions(self._model, self._tokenizer, prompts, **kwargs)

    def _generate(
        self,
        messages: list[dict[str, str]],
        state_id: str,
        max_new_tokens: int,
        temperature: float,
        seed: int,
    ) -> LocalGeneration:
        import torch

        tok, model = self._tokenizer, self._model
        ids = list(
            tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        )
        limit = int(getattr(model.config, "max_position_embeddings", 2048)) - max_new_tokens
        if limit < 1:
            raise ValueError(
                f"max_tokens={max_new_tokens} does not fit the local model's context "
                f"({model.config.max_position_embeddings} positions); lower max_tokens."
            )
        if len(ids) > limit:
            log.warning("state %s: prompt of %d tokens truncated to its last %d", state_id, len(ids), limit)
            ids = ids[-limit:]
        eos = model.generation_config.eos_token_id
        stop = set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}
        gen = torch.Generator(device="cpu").manual_seed(_call_seed(seed, state_id))
        x = torch.tensor([ids], device=self.device)  # [1, T]
        past = None
        out: list[int] = []
        with torch.inference_mode():
            for _ in range(max_new_tokens):
                res = model(input_ids=x, past_key_values=past, use_cache=True)
                past = res.past_key_values
                logits = res.logits[0, -1].float()  # [V]
                if temperature <= 0:
                    nxt = int(torch.argmax(logits))
                else:
                    probs = torch.softmax(logits / temperature, dim=-1).cpu()
                    nxt = int(torch.multinomial(probs, 1, generator=gen))
                if nxt in stop:
                    break
                out.append(nxt)
                x = torch.tensor([[nxt]], device=self.device)  # [1, 1]
        text = tok.decode(out, skip_special_tokens=True).strip()
        return LocalGeneration(text=text, prompt_tokens=len(ids), completion_tokens=len(out))

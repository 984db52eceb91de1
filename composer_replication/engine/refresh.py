"""On-policy refresh of recorded pairs: the rejected side re-sampled from the current student.

With the ``recorded`` teacher (``composer_replication.teacher_replay.recorded``) a pair's rejected side
is the student's own sampled action (``metadata["rejected_source"] == "student_sample"``). The
replay samples it once, from the initial weights; as the student trains, that sample stops being
what the student would do. Every ``rollout.pair_refresh_every = R`` steps the trainer therefore
re-samples the rejected side of those pairs from its current weights (:func:`refresh_pairs`), with
the student's rollout settings, and drops the pairs where the student now agrees with the chosen
action (``canonical_action``): there is nothing left to prefer.

**Staleness bound.** The refresh runs at the start of step ``t`` when ``t % R == 0`` (``t > 0``),
from the weights after ``t`` optimizer steps. So the rejected sides used at step ``t`` were sampled
from the weights of step ``R * floor(t / R)``: at most ``R - 1`` optimizer steps old (steps below ``R``
use the replay's samples, from the initial weights; ``R = 0`` never refreshes, and the staleness is
unbounded). Each refreshed pair records its sampling step in ``metadata["student_sample"]["step"]``.

Each refresh re-samples the pairs that the next ``R`` steps draw (the draws are a function of the seed
and the step, so they are known in advance): exactly the pairs trained on, so the bound holds for every one
of them at about half the cost of the whole pool at the default preset's sizes. Dropped pairs are not lost:
a refresh re-samples a pair from the original pool whenever a window draws it, so a pair the student agreed
with comes back if it drifts away again. The refresh is deterministic in
``(weights, pairs, seed, step, rank)`` and does not touch the caller's RNG, so a resumed run refreshes
exactly as an uninterrupted one (:meth:`PairRefresher.state_dict` holds the live rejected sides).
Other pairs (frontier teachers against the recorded action) are never changed.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable, Collection, Sequence
from typing import Any

from composer_replication.actions import canonical_action
from composer_replication.batching import BatchingStats, TokenizedPair, tokenize_pairs
from composer_replication.teacher_replay.local import sample_actions
from composer_replication.teacher_replay.recorded import is_student_sample
from composer_replication.types import PreferencePair

__all__ = ["refresh_pairs", "tokenize_live", "PairRefresher", "is_student_sample"]


def refresh_pairs(
    model: Any,
    tokenizer: Any,
    pairs: Sequence[PreferencePair],
    *,
    seed: int,
    step: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    batch_size: int = 64,
    indices: Collection[int] | None = None,
) -> list[PreferencePair | None]:
    """Re-sample the rejected side of the student-sample pairs in ``pairs`` from ``model``.

    Args:
        model / tokenizer: the current student (its mode and the caller's RNG are left as they were).
        pairs: the pool; pairs whose rejected side is not a student sample pass through unchanged.
        seed: the sampling seed (the caller derives it from its seed, the step and its rank).
        step: the training step whose weights sample (recorded in ``metadata["student_sample"]``).
        max_new_tokens / temperature / top_p / batch_size: as ``teacher_replay.local.sample_actions``.
        indices: re-sample only these pairs (default: all); the others pass through unchanged.

    Returns:
        Index-aligned with ``pairs``: the refreshed pair, or ``None`` where the student's new sample agrees
        with ``chosen`` (the pair is dropped for now).

    Raises:
        ValueError: an index outside ``pairs``.
    """
    if indices is not None and any(not 0 <= i < len(pairs) for i in indices):
        raise ValueError(f"refresh_pairs: indices must be in [0, {len(pairs)}), got {sorted(indices)}")
    out: list[PreferencePair | None] = list(pairs)
    wanted = range(len(pairs)) if indices is None else sorted(set(indices))
    todo = [i for i in wanted if is_student_sample(pairs[i])]
    texts = sample_actions(
        model,
        tokenizer,
        [pairs[i].state_messages for i in todo],
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        seed=seed,
        batch_size=batch_size,
    )
    for i, text in zip(todo, texts):
        pair = pairs[i]
        if canonical_action(text) == canonical_action(pair.chosen):
            out[i] = None
            continue
        sample = {
            **pair.metadata.get("student_sample", {}),
            "step": int(step),
            "seed": int(seed),
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
        }
        out[i] = dataclasses.replace(
            pair,
            rejected_messages=[{"role": "assistant", "content": text}],
            metadata={**pair.metadata, "student_sample": sample},
        )
    return out


def tokenize_live(
    tokenizer: Any,
    live: Sequence[PreferencePair | None],
    *,
    max_seq_len: int | None,
    over_length: str,
    stats: BatchingStats,
) -> list[TokenizedPair | None]:
    """``batching.tokenize_pairs`` over the live pairs, index-aligned (``None`` for a dropped or skipped pair)."""
    kept = [i for i, p in enumerate(live) if p is not None]
    toks = tokenize_pairs(
        tokenizer, [live[i] for i in kept], max_seq_len=max_seq_len, over_length=over_length, stats=stats
    )
    out: list[TokenizedPair | None] = [None] * len(live)
    for i, tok in zip(kept, toks):
        out[i] = tok
    return out


class PairRefresher:
    """When to refresh, and the live rejected sides (see the module docstring).

    Args:
        pairs: the run's pairs (the pool; index-aligned with ``TrainingData.pairs``).
        every: ``rollout.pair_refresh_every`` (0: never).
        seed / rank: combined with the step into each refresh's sampling seed.
        max_new_tokens / temperature / top_p: the student's rollout settings.
        draw: the pool indices a step trains on (``engine.data.pair_indices_for_step``); each refresh then
            re-samples only the pairs that the next ``every`` steps draw: every pair trained on is still at
            most ``every - 1`` steps old, at the cost of the pairs actually used (about half the pool at the
            default preset's 4 pairs a step from 48 over 8 steps), and the others keep their last sample
            until a window draws them. ``None``: every refresh re-samples the whole pool.
    """

    def __init__(
        self,
        pairs: Sequence[PreferencePair],
        *,
        every: int,
        seed: int,
        rank: int,
        max_new_tokens: int,
        temperature: float,
        top_p: float = 1.0,
        draw: Callable[[int], Collection[int]] | None = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 0:
            raise ValueError(f"'rollout.pair_refresh_every' must be an integer >= 0, got {every!r}")
        self.pool = list(pairs)
        self.every = every if any(is_student_sample(p) for p in self.pool) else 0
        self.seed, self.rank = seed, rank
        self.sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        self.draw = draw
        self.live: list[PreferencePair | None] = list(self.pool)
        self.at = 0

    def maybe_refresh(self, step: int, model: Any, tokenizer: Any) -> list[PreferencePair | None] | None:
        """Refresh when ``step`` is a refresh step not yet refreshed: the new live pairs, else ``None``."""
        if self.every == 0 or step == 0 or step % self.every or step == self.at:
            return None
        digest = hashlib.sha256(f"refresh:{self.seed}:{step}:{self.rank}".encode()).digest()
        seed = int.from_bytes(digest[:8], "little") & (2**63 - 1)
        window = None if self.draw is None else {i for t in range(step, step + self.every) for i in self.draw(t)}
        fresh = refresh_pairs(model, tokenizer, self.pool, seed=seed, step=step, indices=window, **self.sampling)
        self.live = fresh if window is None else [fresh[i] if i in window else p for i, p in enumerate(self.live)]
        self.at = step
        return self.live

    def metrics(self, step: int) -> dict[str, float]:
        """``replay/pairs_live`` (pairs not dropped) and ``replay/rejected_age`` (steps since the student-sample
        rejected sides were drawn; at most ``every - 1``), when refreshing is on; else ``{}``."""
        if self.every == 0:
            return {}
        return {
            "replay/pairs_live": float(sum(p is not None for p in self.live)),
            "replay/rejected_age": float(step - self.at),
        }

    def state_dict(self) -> dict[str, Any]:
        """The refresh step and each pair's live rejected side and sampling record (``None``: dropped)."""
        live = [
            None
            if p is None
            else {"rejected": p.rejected, "student_sample": p.metadata.get("student_sample")}
            for p in self.live
        ]
        return {"at": self.at, "live": live}

    def load_state_dict(self, state: dict[str, Any] | None) -> list[PreferencePair | None] | None:
        """Restore :meth:`state_dict` (``None``: nothing saved, nothing changes); returns the live pairs.

        Raises:
            ValueError: the saved state is for a different number of pairs.
        """
        if state is None:
            return None
        if len(state["live"]) != len(self.pool):
            raise ValueError(
                f"the checkpoint's pair refresh holds {len(state['live'])} pairs but the run has "
                f"{len(self.pool)}; resume with the run's own pairs.jsonl"
            )
        self.at = int(state["at"])
        self.live = []
        for pair, saved in zip(self.pool, state["live"]):
            if saved is None or not is_student_sample(pair):
                self.live.append(None if saved is None else pair)
                continue
            meta = {**pair.metadata, "student_sample": saved["student_sample"]}
            self.live.append(
                dataclasses.replace(
                    pair,
                    rejected_messages=[{"role": "assistant", "content": saved["rejected"]}],
                    metadata=meta,
                )
            )
        return self.live

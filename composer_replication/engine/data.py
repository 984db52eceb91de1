"""Per-step training data: which prompts and which DPO pairs a rank trains on at a given step.

The choice is a pure function of ``(seed, step, rank)`` drawn with a local ``random.Random``
(seeded from a string, so it is stable across processes and Python hash seeds). A resumed run
therefore needs no data cursor: step ``k`` after a restart sees exactly the data it would have seen.
Within one epoch-sized window the draw is without replacement, so small datasets are still covered.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from composer_replication.types import PreferencePair

__all__ = [
    "TrainingData",
    "MixedEnvironment",
    "build_training_data",
    "select_states",
    "prompts_for_step",
    "pairs_for_step",
    "pair_indices_for_step",
    "step_rng",
    "derive_seed",
]


@dataclass(kw_only=True)
class TrainingData:
    """What the student trains on.

    ``environment`` scores sampled actions (``composer_replication.rollout.Environment``:
    ``score(prompt, action_text) -> Score``); ``prompts`` are ``rollout.Prompt`` records sampled
    for channels 1 and 2; ``pairs`` are channel-3 :class:`~composer_replication.types.PreferencePair`
    records (spec ``DPOPair`` dicts are read into that record).
    """

    environment: Any
    """The reward environment (``score(prompt, action_text) -> Score``)."""
    prompts: list[Any] = field(default_factory=list)
    """Training prompts (``rollout.Prompt``); may be empty only when ``pairs`` is not."""
    pairs: list[PreferencePair] = field(default_factory=list)
    """Channel-3 pairs; may be empty."""
    eval_prompts: list[Any] | None = None
    """Held-out prompts for ``evaluate``; ``None`` means the first few training prompts."""
    eval_environment: Any = None
    """Scores ``eval_prompts`` (held-out sessions: a next-action environment whose references are the
    recorded actions); ``None`` means ``environment``."""
    eval_max_new_tokens: int | None = None
    """Tokens a greedy evaluation answer may have; ``None`` means ``rollout.max_new_tokens``."""

    def __post_init__(self) -> None:
        if self.environment is None or not hasattr(self.environment, "score"):
            raise ValueError(
                f"'environment' must have a score(prompt, action_text) method, got {self.environment!r}"
            )
        self.pairs = [PreferencePair.from_mapping(p, where=f"pairs[{i}]") for i, p in enumerate(self.pairs)]
        if not self.prompts and not self.pairs:
            raise ValueError("TrainingData needs at least one prompt or one pair; got neither")
        if self.eval_max_new_tokens is not None and self.eval_max_new_tokens < 1:
            raise ValueError(f"'eval_max_new_tokens' must be >= 1 or None, got {self.eval_max_new_tokens!r}")

    def eval_scorer(self, prompts: Sequence[Any]) -> Any:
        """The environment that scores ``prompts``: ``eval_environment`` for held-out prompts, else ``environment``."""
        held = {p.prompt_id for p in self.eval_prompts or []}
        if self.eval_environment is not None and prompts and all(p.prompt_id in held for p in prompts):
            return self.eval_environment
        return self.environment


class MixedEnvironment:
    """Several environments behind one: each prompt is scored by the environment that offered it.

    Routing is by ``prompt.prompt_id`` (so it survives pickling to another process).

    Raises:
        ValueError: no environments, or two environments offer the same ``prompt_id``.
    """

    name = "mixed"

    def __init__(self, environments: Sequence[Any]) -> None:
        if not environments:
            raise ValueError("MixedEnvironment needs at least one environment")
        self.environments = list(environments)
        self._prompts: list[Any] = []
        self._route: dict[str, Any] = {}
        for env in self.environments:
            for prompt in env.prompts():
                if prompt.prompt_id in self._route:
                    raise ValueError(
                        f"prompt_id {prompt.prompt_id!r} is offered by both {self._route[prompt.prompt_id].name!r} "
                        f"and {env.name!r}; prompt ids must be unique across mixed environments"
                    )
                self._route[prompt.prompt_id] = env
                self._prompts.append(prompt)

    def prompts(self) -> list[Any]:
        """The prompts of every environment, in order."""
        return list(self._prompts)

    def score(self, prompt: Any, action_text: str) -> Any:
        """Score with the environment that offered ``prompt`` (``KeyError`` for an unknown prompt id)."""
        try:
            env = self._route[prompt.prompt_id]
        except KeyError:
            raise KeyError(f"MixedEnvironment: no environment offers prompt_id {prompt.prompt_id!r}") from None
        return env.score(prompt, action_text)


def build_training_data(
    environment: str,
    *,
    states: Sequence[dict[str, Any]] | None = None,
    pairs: Sequence[Any] | None = None,
    tasks: Sequence[Any] | None = None,
    num_eval_prompts: int = 0,
    seed: int = 0,
    eval_states: Sequence[dict[str, Any]] | None = None,
    eval_max_new_tokens: int | None = None,
) -> TrainingData:
    """Build :class:`TrainingData` for a ``RolloutConfig.environment`` name.

    Args:
        environment: ``"next_action"`` (needs ``states``), ``"python_tasks"`` (``tasks``, default the
            bundled ones) or ``"mixed"`` (both).
        states: ``TraceState`` dicts for next-action prediction.
        pairs: channel-3 pairs (``PreferencePair`` or spec ``DPOPair`` dicts); their ``chosen`` actions also
            become the reference actions of their states.
        tasks: ``rollout.PythonTask`` records.
        num_eval_prompts: training prompts held out for ``evaluate`` (drawn with ``seed``); they and their
            pairs are never trained on. Prefer ``eval_states``: whole held-out sessions.
        seed: seed of the held-out draw.
        eval_states: ``TraceState`` dicts of held-out sessions: the evaluation prompts, scored against their
            recorded actions (no pair is their reference); they enter no training channel.
        eval_max_new_tokens: see :attr:`TrainingData.eval_max_new_tokens`.

    Raises:
        ValueError: an unknown environment, ``next_action`` without states, more held-out prompts than
            exist, both ``eval_states`` and ``num_eval_prompts``, or an evaluation state that is also a
            training state (same ``state_id``).
    """
    from composer_replication import rollout as R

    pairs = [PreferencePair.from_mapping(p, where=f"pairs[{i}]") for i, p in enumerate(pairs or [])]
    envs: list[Any] = []
    if environment not in ("next_action", "python_tasks", "mixed"):
        raise ValueError(
            f"'rollout.environment' must be 'next_action', 'python_tasks' or 'mixed', got {environment!r}"
        )
    if environment in ("next_action", "mixed"):
        if not states:
            raise ValueError(f"environment {environment!r} needs trace states; pass states=[TraceState, ...]")
        envs.append(R.NextActionEnvironment(states, pairs))
    if environment in ("python_tasks", "mixed"):
        envs.append(R.PythonTaskEnvironment(list(tasks) if tasks is not None else None))
    env = envs[0] if len(envs) == 1 else MixedEnvironment(envs)
    prompts = env.prompts()
    if eval_states:
        return _with_heldout_sessions(env, prompts, pairs, states or [], eval_states, num_eval_prompts,
                                      eval_max_new_tokens)
    if not 0 <= num_eval_prompts < max(1, len(prompts)):
        raise ValueError(
            f"'num_eval_prompts' must be in [0, {len(prompts)}) for {len(prompts)} prompts, got {num_eval_prompts}"
        )
    held = set(random.Random(f"eval:{seed}").sample(range(len(prompts)), num_eval_prompts))
    held_ids = {p.prompt_id for i, p in enumerate(prompts) if i in held}
    return TrainingData(
        environment=env,
        prompts=[p for i, p in enumerate(prompts) if i not in held],
        pairs=[p for p in pairs if p.state_id not in held_ids],  # a held-out prompt's pair would teach its answer
        eval_prompts=[p for i, p in enumerate(prompts) if i in held] or None,
        eval_max_new_tokens=eval_max_new_tokens,
    )


def _with_heldout_sessions(env: Any, prompts: list[Any], pairs: list[PreferencePair],
                           states: Sequence[dict[str, Any]], eval_states: Sequence[dict[str, Any]],
                           num_eval_prompts: int, eval_max_new_tokens: int | None) -> TrainingData:
    """:class:`TrainingData` whose evaluation prompts are the held-out sessions' states."""
    from composer_replication.rollout import NextActionEnvironment

    if num_eval_prompts:
        raise ValueError(
            f"give held-out sessions (eval_states) or num_eval_prompts ({num_eval_prompts}), not both; "
            "set num_eval_prompts to 0 (data.num_eval_prompts=0 in the recipe)"
        )
    train_ids = {s.get("state_id") for s in states}
    shared = sorted(str(s.get("state_id")) for s in eval_states if s.get("state_id") in train_ids)
    if shared:
        raise ValueError(
            f"{len(shared)} evaluation state(s) are also training states (e.g. {shared[0]!r}); held-out sessions "
            "must not be trained on: keep data.eval_sessions and data.sessions apart"
        )
    eval_env = NextActionEnvironment(eval_states)  # no pairs: the reference is the recorded action
    return TrainingData(environment=env, prompts=prompts, pairs=pairs, eval_prompts=eval_env.prompts(),
                        eval_environment=eval_env, eval_max_new_tokens=eval_max_new_tokens)


def select_states(states: Sequence[dict[str, Any]], max_states: int, *, stream: str = "eval-states"
                  ) -> list[dict[str, Any]]:
    """At most ``max_states`` of ``states``, spread over them (a fixed draw, kept in the given order).

    The same states are chosen in every run (for a given ``stream``: ``"eval-states"`` for the held-out draw,
    ``"train-states"`` for the training draw), so runs compare and every session can contribute.
    ``max_states <= 0`` keeps them all.
    """
    if max_states <= 0 or len(states) <= max_states:
        return list(states)
    keep = set(random.Random(stream).sample(range(len(states)), max_states))
    return [s for i, s in enumerate(states) if i in keep]


def derive_seed(seed: int, step: int, rank: int, stream: str = "sample") -> int:
    """A 63-bit seed from ``(seed, step, rank, stream)``, stable across processes and platforms."""
    digest = hashlib.sha256(f"{stream}:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def step_rng(seed: int, step: int, rank: int, stream: str) -> random.Random:
    """A private ``random.Random`` for ``(seed, step, rank, stream)``; no global state is touched."""
    return random.Random(f"{stream}:{seed}:{step}:{rank}")


def _indices_for_step(n: int, k: int, *, seed: int, step: int, rank: int, stream: str) -> list[int]:
    """``k`` indices into ``range(n)``: without replacement when ``k <= n``, else whole shuffled passes."""
    if n == 0 or k == 0:
        return []
    rng = step_rng(seed, step, rank, stream)
    out: list[int] = []
    while len(out) < k:
        take = min(n, k - len(out))
        out.extend(rng.sample(range(n), take))
    return out


def prompts_for_step(
    data: TrainingData, step: int, *, rank: int = 0, prompts_per_step: int, seed: int
) -> list[Any]:
    """The prompts rank ``rank`` samples at ``step``: a deterministic function of ``(seed, step, rank)``.

    Raises:
        ValueError: ``step`` or ``rank`` is negative, or ``prompts_per_step < 0``.
    """
    _check_args(step, rank, prompts_per_step, "prompts_per_step")
    idx = _indices_for_step(
        len(data.prompts), prompts_per_step, seed=seed, step=step, rank=rank, stream="prompts"
    )
    return [data.prompts[i] for i in idx]


def pair_indices_for_step(
    data: TrainingData, step: int, *, rank: int = 0, pairs_per_step: int, seed: int
) -> list[int]:
    """Indices into ``data.pairs`` of the pairs rank ``rank`` trains on at ``step`` (from ``(seed, step, rank)``).

    Raises:
        ValueError: ``step`` or ``rank`` is negative, or ``pairs_per_step < 0``.
    """
    _check_args(step, rank, pairs_per_step, "pairs_per_step")
    return _indices_for_step(len(data.pairs), pairs_per_step, seed=seed, step=step, rank=rank, stream="pairs")


def pairs_for_step(
    data: TrainingData, step: int, *, rank: int = 0, pairs_per_step: int, seed: int
) -> list[PreferencePair]:
    """The channel-3 pairs rank ``rank`` trains on at ``step`` (see :func:`pair_indices_for_step`)."""
    idx = pair_indices_for_step(data, step, rank=rank, pairs_per_step=pairs_per_step, seed=seed)
    return [data.pairs[i] for i in idx]


def _check_args(step: int, rank: int, count: int, name: str) -> None:
    if step < 0:
        raise ValueError(f"'step' must be >= 0, got {step}")
    if rank < 0:
        raise ValueError(f"'rank' must be >= 0, got {rank}")
    if count < 0:
        raise ValueError(f"'{name}' must be >= 0, got {count}")

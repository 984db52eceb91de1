"""What the student trains on: the data, the held-out split, and each step's draw of prompts and pairs.

Every draw is a pure function of ``(seed, step, rank)`` (a local ``random.Random`` seeded from a string, stable
across processes), so a resumed run needs no data cursor; within an epoch-sized window it is without replacement.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from composer_replication.types import PreferencePair, trace_state

__all__ = ["TrainingData", "build_training_data", "heldout_split", "select_states", "draw_step", "step_rng",
           "derive_seed"]


@dataclass(kw_only=True)
class TrainingData:
    """Environment, prompts (channels 1 and 2), pairs (channel 3) and the held-out evaluation set.

    A pair whose rejected side comes from the rollouts (``PreferencePair.rejected_from_rollout``) is trained at
    its state: a prompt with ``prompt_id == state_id`` must be offered (by ``prompts`` or ``environment.prompts()``).
    """

    environment: Any
    """The reward environment (``score(prompt, action_text) -> Score``; ``rollout.Environment``)."""
    prompts: list[Any] = field(default_factory=list)
    """Training prompts (``rollout.Prompt``); may be empty only when ``pairs`` is not."""
    pairs: list[PreferencePair] = field(default_factory=list)
    """Channel-3 pairs (spec ``DPOPair`` dicts are read into the record); may be empty."""
    eval_prompts: list[Any] | None = None
    """Held-out prompts for ``evaluate``; ``None``: the first few training prompts."""
    eval_environment: Any = None
    """Scores ``eval_prompts`` (held-out sessions: references are the recorded actions); ``None``: ``environment``."""
    eval_max_new_tokens: int | None = None
    """Tokens a greedy evaluation answer may have; ``None``: ``rollout.max_new_tokens``."""

    def __post_init__(self) -> None:
        if not hasattr(self.environment, "score"):
            raise ValueError(f"'environment' must have a score(prompt, action_text) method, got {self.environment!r}")
        self.pairs = [PreferencePair.from_mapping(p, where=f"pairs[{i}]") for i, p in enumerate(self.pairs)]
        if not self.prompts and not self.pairs:
            raise ValueError("TrainingData needs at least one prompt or one pair; got neither")
        if self.eval_max_new_tokens is not None and self.eval_max_new_tokens < 1:
            raise ValueError(f"'eval_max_new_tokens' must be >= 1 or None, got {self.eval_max_new_tokens!r}")
        self._prompt_of: dict[str, Any] = {}
        if any(p.rejected_from_rollout for p in self.pairs):
            offered = [*getattr(self.environment, "prompts", list)(), *self.prompts]
            self._prompt_of = {p.prompt_id: p for p in offered}
            lost = [p.state_id for p in self.pairs if p.rejected_from_rollout and p.state_id not in self._prompt_of]
            if lost:
                raise ValueError(f"{len(lost)} pair(s) take their rejected side from the step's rollouts but no prompt "
                                 f"is offered at their state (e.g. {lost[0]!r}); train on the states the pairs were "
                                 "made from, or give pairs with a stored rejected side")

    def prompt_of(self, state_id: str) -> Any:
        """The prompt offered at ``state_id`` (for pairs whose rejected side comes from the rollouts)."""
        return self._prompt_of[state_id]

    def eval_scorer(self, prompts: Sequence[Any]) -> Any:
        """The environment that scores ``prompts``: ``eval_environment`` for held-out prompts, else ``environment``."""
        held = {p.prompt_id for p in self.eval_prompts or []}
        if self.eval_environment is not None and prompts and all(p.prompt_id in held for p in prompts):
            return self.eval_environment
        return self.environment


class MixedEnvironment:
    """Several environments behind one: each prompt is scored by the environment that offered it (by ``prompt_id``;
    ``ValueError`` for no environments, or two that offer the same ``prompt_id``)."""

    name = "mixed"

    def __init__(self, environments: Sequence[Any]) -> None:
        if not environments:
            raise ValueError("MixedEnvironment needs at least one environment")
        self.environments = list(environments)
        self._route: dict[str, Any] = {}
        for env in self.environments:
            for prompt in env.prompts():
                if prompt.prompt_id in self._route:
                    raise ValueError(
                        f"prompt_id {prompt.prompt_id!r} is offered by both {self._route[prompt.prompt_id].name!r} "
                        f"and {env.name!r}; prompt ids must be unique across mixed environments")
                self._route[prompt.prompt_id] = env

    def prompts(self) -> list[Any]:
        """The prompts of every environment, in order."""
        return [p for env in self.environments for p in env.prompts()]

    def score(self, prompt: Any, action_text: str) -> Any:
        """Score with the environment that offered ``prompt`` (``KeyError`` for an unknown prompt id)."""
        if prompt.prompt_id not in self._route:
            raise KeyError(f"MixedEnvironment: no environment offers prompt_id {prompt.prompt_id!r}")
        return self._route[prompt.prompt_id].score(prompt, action_text)


def heldout_split(train_ids: Sequence[str], *, eval_ids: Collection[str] = (), num_eval_prompts: int = 0,
                  seed: int = 0) -> set[str]:
    """The one held-out split (called by :func:`build_training_data`, and by the recipe before any spawn): the
    training ids held out. Held-out sessions (``eval_ids``) share no id with ``train_ids`` and hold none out; without
    them, ``num_eval_prompts`` of ``train_ids`` are drawn with ``seed``.

    Raises:
        ValueError: both ``eval_ids`` and ``num_eval_prompts``, an evaluation id that is also a training id, or
            ``num_eval_prompts`` outside ``[0, len(train_ids))``.
    """
    if eval_ids and num_eval_prompts:
        raise ValueError(f"give held-out sessions (eval_states) or num_eval_prompts ({num_eval_prompts}), not both; "
                         "set num_eval_prompts to 0 (data.num_eval_prompts=0, or data.eval_sessions=[] in the recipe)")
    shared = sorted(set(eval_ids) & set(train_ids))
    if shared:
        raise ValueError(f"{len(shared)} evaluation state(s) or task(s) are also training ones (e.g. {shared[0]!r}); "
                         "held-out data must not be trained on: keep data.eval_sessions and data.sessions (agentic: "
                         "data.eval_tasks and data.tasks) apart")
    if not 0 <= num_eval_prompts < max(1, len(train_ids)):
        raise ValueError(f"'num_eval_prompts' ({num_eval_prompts}) must be in [0, {len(train_ids)}) for "
                         f"{len(train_ids)} training prompts; lower it (data.num_eval_prompts) or add states")
    return set(random.Random(f"eval:{seed}").sample(list(train_ids), num_eval_prompts))


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
    eval_tasks: Sequence[Any] | None = None,
) -> TrainingData:
    """:class:`TrainingData` for a ``RolloutConfig.environment`` name.

    Args:
        environment: ``"next_action"`` (``states``: ``TraceState`` dicts), ``"python_tasks"`` (``tasks``:
            ``rollout.PythonTask`` records, default the bundled ones), ``"mixed"`` (both) or ``"agentic"`` (``tasks``:
            ``rollout.agent.Task`` records, default the bundled train tasks; ``eval_tasks``: the held-out ones).
        pairs: channel-3 pairs (``PreferencePair`` or spec ``DPOPair`` dicts); a pair's ``chosen`` becomes the
            reference action of its state. A pair whose rejected side comes from the rollouts and whose state is not
            among ``states`` adds its state (its ``state_messages``, ``chosen`` as the recorded action).
        num_eval_prompts / seed / eval_states: the held-out split (:func:`heldout_split`). ``eval_states`` (held-out
            sessions) become the evaluation prompts, scored against their recorded actions; held-out prompts and
            their pairs enter no training channel.
        eval_max_new_tokens: see :attr:`TrainingData.eval_max_new_tokens`.

    Raises:
        ValueError: an unknown environment, ``next_action`` without states, or a bad split.
    """
    from composer_replication import rollout as R

    if environment == "agentic":
        return _agentic_data(tasks, eval_tasks, num_eval_prompts=num_eval_prompts, seed=seed,
                             eval_max_new_tokens=eval_max_new_tokens)
    if environment not in ("next_action", "python_tasks", "mixed"):
        raise ValueError("'rollout.environment' must be 'next_action', 'python_tasks', 'mixed' or 'agentic', got "
                         f"{environment!r}")
    pairs = [PreferencePair.from_mapping(p, where=f"pairs[{i}]") for i, p in enumerate(pairs or [])]
    envs: list[Any] = []
    if environment in ("next_action", "mixed"):
        if not states:
            raise ValueError(f"environment {environment!r} needs trace states; pass states=[TraceState, ...]")
        known = {s["state_id"] for s in [*states, *(eval_states or [])]}  # a rollout pair made elsewhere: its state
        extra = {p.state_id: trace_state(p.state_id, p.state_messages, p.chosen) for p in pairs
                 if p.rejected_from_rollout and p.state_id not in known}
        envs.append(R.NextActionEnvironment([*states, *extra.values()], pairs))
    if environment in ("python_tasks", "mixed"):
        envs.append(R.PythonTaskEnvironment(list(tasks) if tasks is not None else None))
    env = envs[0] if len(envs) == 1 else MixedEnvironment(envs)
    prompts = env.prompts()
    held = heldout_split([p.prompt_id for p in prompts], eval_ids=[s["state_id"] for s in eval_states or []],
                         num_eval_prompts=num_eval_prompts, seed=seed)
    if eval_states:
        eval_env = R.NextActionEnvironment(eval_states)  # no pairs: the reference is the recorded action
        eval_ids = {s["state_id"] for s in eval_states}
        return TrainingData(environment=env, prompts=prompts, pairs=[p for p in pairs if p.state_id not in eval_ids],
                            eval_prompts=eval_env.prompts(), eval_environment=eval_env,
                            eval_max_new_tokens=eval_max_new_tokens)
    return TrainingData(
        environment=env,
        prompts=[p for p in prompts if p.prompt_id not in held],
        pairs=[p for p in pairs if p.state_id not in held],  # a held-out prompt's pair would teach its answer
        eval_prompts=[p for p in prompts if p.prompt_id in held] or None,
        eval_max_new_tokens=eval_max_new_tokens,
    )


def _agentic_data(tasks: Sequence[Any] | None, eval_tasks: Sequence[Any] | None, *, num_eval_prompts: int,
                  seed: int, eval_max_new_tokens: int | None) -> TrainingData:
    """The agentic tasks: one prompt per task; held out: ``eval_tasks`` (their own ids), else ``num_eval_prompts``."""
    from composer_replication.data import bundled_path
    from composer_replication.rollout.agent import load_tasks
    from composer_replication.rollout.agent.rollouts import AgenticEnvironment
    from composer_replication.rollout.agent.tasks import BUNDLED_TASKS

    tasks = list(tasks) if tasks is not None else load_tasks(bundled_path(BUNDLED_TASKS["train"]))
    held = heldout_split([t.task_id for t in tasks], eval_ids=[t.task_id for t in eval_tasks or []],
                         num_eval_prompts=num_eval_prompts, seed=seed)
    train = [t for t in tasks if t.task_id not in held]
    evals = list(eval_tasks or []) or [t for t in tasks if t.task_id in held]
    env = AgenticEnvironment(train)
    eval_env = AgenticEnvironment(evals) if evals else None
    return TrainingData(environment=env, prompts=env.prompts(), pairs=[],
                        eval_prompts=eval_env.prompts() if eval_env else None, eval_environment=eval_env,
                        eval_max_new_tokens=eval_max_new_tokens)


def select_states(states: Sequence[dict[str, Any]], max_states: int, *, stream: str = "eval-states"
                  ) -> list[dict[str, Any]]:
    """At most ``max_states`` of ``states`` (``<= 0``: all), a fixed draw spread over them, in their order: the same
    states in every run for a given ``stream`` (``"eval-states"``, ``"train-states"``)."""
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


def _indices(n: int, k: int, *, seed: int, step: int, rank: int, stream: str, name: str) -> list[int]:
    """``k`` indices into ``range(n)``: without replacement when ``k <= n``, else whole shuffled passes."""
    for key, value in (("step", step), ("rank", rank), (name, k)):
        if value < 0:
            raise ValueError(f"'{key}' must be >= 0, got {value}")
    rng, out = step_rng(seed, step, rank, stream), []
    while n and len(out) < k:
        out.extend(rng.sample(range(n), min(n, k - len(out))))
    return out


def prompts_for_step(data: TrainingData, step: int, *, rank: int = 0, prompts_per_step: int, seed: int) -> list[Any]:
    """``prompts_per_step`` of ``data.prompts`` drawn for ``(seed, step, rank)`` (``ValueError`` on a negative)."""
    idx = _indices(len(data.prompts), prompts_per_step, seed=seed, step=step, rank=rank, stream="prompts",
                   name="prompts_per_step")
    return [data.prompts[i] for i in idx]


def pair_indices_for_step(data: TrainingData, step: int, *, rank: int = 0, pairs_per_step: int, seed: int
                          ) -> list[int]:
    """Indices into ``data.pairs`` of the ``pairs_per_step`` pairs drawn for ``(seed, step, rank)``."""
    return _indices(len(data.pairs), pairs_per_step, seed=seed, step=step, rank=rank, stream="pairs",
                    name="pairs_per_step")


def draw_step(data: TrainingData, step: int, *, rank: int = 0, prompts_per_step: int, pairs_per_step: int,
              seed: int) -> tuple[list[Any], list[int]]:
    """The prompts and the pair indices rank ``rank`` trains on at ``step``: the pairs are drawn first
    (:func:`pair_indices_for_step`); the state of each drawn pair whose rejected side comes from the rollouts is one of
    the step's prompts (once, in draw order), then prompts of :func:`prompts_for_step` fill up to ``prompts_per_step``.
    """
    drawn = pair_indices_for_step(data, step, rank=rank, pairs_per_step=pairs_per_step, seed=seed)
    prompts = list({data.pairs[i].state_id: data.prompt_of(data.pairs[i].state_id) for i in drawn
                    if data.pairs[i].rejected_from_rollout}.values())
    seen = {p.prompt_id for p in prompts}
    regular = prompts_for_step(data, step, rank=rank, prompts_per_step=prompts_per_step, seed=seed)
    prompts += [p for p in regular if not seen or p.prompt_id not in seen][: max(0, prompts_per_step - len(prompts))]
    return prompts, drawn

"""The environment protocol: prompts in, scored actions out.

An environment hands out :class:`Prompt` objects (a chat history plus what is needed to judge an answer) and
scores one sampled action text for one prompt with a :class:`Score`: a scalar reward and, when the action
failed, the error kind and its context for the hint generator (``hint_generator.dispatch``), which make the
rollout a channel-2 error site. Any object with ``name``, ``prompts()`` and ``score(prompt, text)`` is one::

    class ExactAnswer:
        name = "exact_answer"

        def prompts(self):
            return [Prompt(prompt_id="0", messages=[{"role": "user", "content": "2 + 2?"}], reference="4")]

        def score(self, prompt, action_text):
            ok = action_text.strip() == prompt.reference
            return Score(float(ok), error_kind=None if ok else "other",
                         error_meta=None if ok else {"error_message": f"expected {prompt.reference!r}"})
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from composer_replication.types import ERROR_KINDS

__all__ = ["Prompt", "Score", "Environment", "score_texts"]


@dataclass(kw_only=True)
class Prompt:
    """One state to act from.

    Attributes:
        prompt_id: unique id (a trace ``state_id``, a task id, ...).
        messages: OpenAI-style chat history the policy continues (``build_prompt_ids`` renders it).
        tools: names of the tools the session offers (empty when unknown or not a tool task).
        reference: the reference action text, when the environment has one.
        metadata: anything else the environment needs to score (tests, schemas, ...).
    """

    prompt_id: str
    messages: list[dict[str, Any]]
    tools: list[str] = field(default_factory=list)
    reference: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.messages, list) or not self.messages:
            raise ValueError(f"Prompt {self.prompt_id!r}: messages must be a non-empty list of chat messages, got "
                             f"{self.messages!r}; pass at least one {{'role': 'user', 'content': ...}}.")


@dataclass
class Score:
    """The score of one action.

    Attributes:
        reward: the scalar reward (finite; the built-in environments give values in [0, 1]).
        error_kind: one of :data:`ERROR_KINDS` when the action failed in a way a hint can address.
        error_meta: the error site context for the hint generator (a ``types.HintContext`` dict:
            ``error_message``, ``tool_name``, ``available_tools``, ``tool_schema``, ``intent``).
        details: reward components and diagnostics, for logging.
    """

    reward: float
    error_kind: str | None = None
    error_meta: dict[str, Any] | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.reward, (int, float)) or not math.isfinite(self.reward):
            raise ValueError(f"Score.reward must be a finite number, got {self.reward!r}; clip or replace it.")
        self.reward = float(self.reward)
        if self.error_kind is not None and self.error_kind not in ERROR_KINDS:
            raise ValueError(f"Score.error_kind must be one of {ERROR_KINDS} or None, got {self.error_kind!r}; "
                             "map your failure onto one of them (use 'other' when none fits).")


@runtime_checkable
class Environment(Protocol):
    """What the rollout loop needs from an environment."""

    name: str
    """Short name, used in metrics (``reward/<name>``)."""

    def prompts(self) -> list[Prompt]:
        """The prompts this environment offers (the rollout loop samples from them)."""

    def score(self, prompt: Prompt, action_text: str) -> Score:
        """Score one sampled action (the decoded response, without the end-of-turn token)."""


def score_texts(env: Environment, prompts: Sequence[Prompt], prompt_index: Sequence[int],
                texts: Sequence[str]) -> list[Score]:
    """Score sampled texts: ``texts[i]`` answers ``prompts[prompt_index[i]]``.

    Raises:
        ValueError: ``prompt_index`` and ``texts`` differ in length, or an index is out of range.
    """
    if len(prompt_index) != len(texts):
        raise ValueError(f"score_texts: got {len(texts)} texts but {len(prompt_index)} prompt indices; pass one "
                         "index per text (RolloutBatch.prompt_index).")
    bad = [i for i in prompt_index if not 0 <= i < len(prompts)]
    if bad:
        raise ValueError(f"score_texts: prompt index {bad[0]} is out of range for {len(prompts)} prompts.")
    return [env.score(prompts[i], text) for i, text in zip(prompt_index, texts)]

"""G episodes per task, sampled turn by turn by the policy, kept as the exact tokens it wrote.

:func:`sample_episodes` runs ``len(tasks) * G`` :class:`~.episode.Episode` objects side by side. Each turn, every
running episode's token row (its chat so far, ending in the assistant's generation prompt) is continued in one
batched ``rollout.generate.generate_responses`` call; the sampled tokens stay in the row as sampled (never
re-tokenized), the decoded text runs through ``Episode.step`` (tool calls in the sandbox, a few episodes at a
time on threads), and the tool results are appended as the chat template renders them (:func:`turn_suffix`), so a
live episode is laid out as an ingested session is. An episode ends when the student calls no tool, at its
``max_turns``, when its row would pass ``max_seq_len``, or at a sandbox limit; then its tests run
(``Episode.final_reward``). ``rollout.agent.batch`` turns the :class:`EpisodeRollout` objects into training rows.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from composer_replication.chat_format import (
    build_prompt_ids,
    encode_text,
    end_of_turn_id,
    render_chat_text,
    to_chat_messages,
)
from composer_replication.rollout.agent.episode import Episode, EpisodeConfig, StepResult, opening_messages
from composer_replication.rollout.agent.tasks import Task
from composer_replication.rollout.agent.tools import TOOL_SCHEMAS
from composer_replication.rollout.environment import Prompt, Score
from composer_replication.rollout.generate import generate_responses

__all__ = ["AgenticEnvironment", "EpisodeRollout", "sample_episodes"]

RESULT_LINES = 6
"""Lines of each tool result kept in an episode's record (``episodes.jsonl``)."""


@dataclass
class EpisodeRollout:
    """One sampled episode.

    Attributes:
        task: the task it ran. group: its GRPO group (one per task of the call, plus ``group_offset``).
        ids: the episode's token row: prompt, then each turn's sampled tokens and the tool results after them.
        spans: ``[start, end)`` of each turn's sampled tokens in ``ids`` (the only tokens the loss trains).
        texts: each turn's decoded action text. messages: the chat (``Episode.messages``), for hints and pairs.
        steps: each turn's ``StepResult`` (calls, failures, error site). end: why it ended (``stopped``, ``max_turns``,
            ``context`` or ``limit``). reward / components: ``Episode.final_reward``.
    """

    task: Task
    group: int
    ids: list[int]
    spans: list[tuple[int, int]] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    steps: list[StepResult] = field(default_factory=list)
    end: str = ""
    reward: float = 0.0
    components: dict[str, Any] = field(default_factory=dict)

    @property
    def solved(self) -> bool:
        """The task's tests passed at the end."""
        return bool(self.components.get("solved"))

    def record(self) -> dict[str, Any]:
        """The episode as one ``episodes.jsonl`` line: task, reward and its components, and each turn's action, calls
        (tool, input, failure) and each result's first :data:`RESULT_LINES` lines."""
        turns = [{"turn": s.turn, "action": text, "error_kind": s.error_kind,
                  "calls": [{"name": r.name, "input": r.input, "failure": r.failure,
                             "result": "\n".join(r.output.splitlines()[:RESULT_LINES])} for r in s.results]}
                 for s, text in zip(self.steps, self.texts)]
        return {"task_id": self.task.task_id, "group": self.group, "reward": self.reward, "solved": self.solved,
                "end": self.end, "turns": turns, "components": self.components}


class AgenticEnvironment:
    """The agentic tasks as an environment: one :class:`Prompt` per task (the episode's opening ``[system, user]``
    messages, the task in ``metadata["task"]``). Multi-turn (``multi_turn = True``): the engine samples whole episodes
    with :func:`sample_episodes`; :meth:`score` plays a one-turn episode, for callers that only score texts.

    Args:
        tasks: the tasks (``rollout.agent.load_tasks``). config: the episodes' limits and reward shaping.

    Raises:
        ValueError: no tasks, or task ids repeat.
    """

    name = "agentic"
    multi_turn = True

    def __init__(self, tasks: Sequence[Task], config: EpisodeConfig | None = None) -> None:
        self.tasks, self.config = list(tasks), config or EpisodeConfig()
        ids = [t.task_id for t in self.tasks]
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"AgenticEnvironment needs tasks with unique ids, got {ids}; load them with "
                             "rollout.agent.load_tasks")
        self.baselines: dict = {}

    def prompts(self) -> list[Prompt]:
        """One prompt per task: the opening messages every episode of it starts from."""
        return [Prompt(prompt_id=t.task_id, tools=list(TOOL_SCHEMAS), messages=opening_messages(self.config, t),
                       metadata={"task": t}) for t in self.tasks]

    def score(self, prompt: Prompt, action_text: str) -> Score:
        """The reward of a one-turn episode whose only action is ``action_text``."""
        with Episode(self.config, baselines=self.baselines) as ep:
            ep.reset(prompt.metadata["task"])
            step = ep.step(action_text)
            reward, parts = ep.final_reward()
        return Score(reward, error_kind=step.error_kind, error_meta=dict(step.error_site or {}) or None, details=parts)


def turn_suffix(tokenizer: Any, messages: Sequence[dict[str, Any]], message_index: int) -> list[int]:
    """The tokens that follow the student's turn ``messages[message_index]`` (its end-of-turn token excluded): the
    template's text after that turn, through the tool messages, to the next assistant generation prompt.

    Raises:
        ValueError: the template re-renders earlier turns when a message is added (the episode's row could not keep
            the sampled tokens); agentic episodes need an appending template (ChatML, Llama 3, ...).
    """
    chat = to_chat_messages(messages)
    base = render_chat_text(tokenizer, chat[: message_index + 1], False)
    full = render_chat_text(tokenizer, chat, True)
    eot = tokenizer.decode([end_of_turn_id(tokenizer)])
    cut = base.rfind(eot) + len(eot) if eot else -1
    if cut < len(eot) or not full.startswith(base[:cut]):
        raise ValueError("the chat template does not extend a conversation by appending to it (the text before the "
                         "new tool results changed); agentic episodes need an appending template such as ChatML")
    return encode_text(tokenizer, full[cut:])


def sample_episodes(
    model: torch.nn.Module, tokenizer: Any, tasks: Sequence[Task], *, num_generations: int, max_new_tokens: int,
    max_seq_len: int, temperature: float = 1.0, top_p: float = 1.0, seed: int = 0, greedy: bool = False,
    max_turns: int = 0, config: EpisodeConfig | None = None, baselines: dict | None = None, group_offset: int = 0,
    workers: int = 4,
) -> list[EpisodeRollout]:
    """``num_generations`` episodes of every task, in task order (see the module notes).

    Args:
        model / tokenizer: the policy (put in eval mode to sample, its mode restored).
        tasks: the tasks. num_generations: episodes per task (``G``). max_new_tokens: the longest turn.
        max_seq_len: the longest episode row (an episode whose next turn could pass it ends, ``end="context"``).
        temperature / top_p / seed: sampling (turn ``k`` samples under a seed derived from ``seed`` and ``k``);
            ``greedy``: greedy decoding instead. max_turns: turns per episode, at most each task's own (0: the task's).
        config / baselines: ``Episode`` limits and the shared cache of tasks' pristine test counts.
        group_offset: added to each task's index to form ``group``. workers: episodes whose tool calls run at once.

    Returns:
        ``len(tasks) * num_generations`` :class:`EpisodeRollout` objects, each finished and scored.

    Raises:
        ValueError: no tasks, or a count or limit below 1.
    """
    if not tasks or num_generations < 1 or max_new_tokens < 1 or max_seq_len <= max_new_tokens or workers < 1:
        raise ValueError(f"sample_episodes needs tasks, num_generations >= 1, max_new_tokens >= 1, max_seq_len > "
                         f"max_new_tokens and workers >= 1; got {len(tasks)} task(s), {num_generations}, "
                         f"{max_new_tokens}, {max_seq_len}, {workers}")
    cfg, baselines = config or EpisodeConfig(), {} if baselines is None else baselines
    eot = end_of_turn_id(tokenizer)
    episodes = [Episode(cfg, baselines=baselines) for _ in range(len(tasks) * num_generations)]
    out = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        try:
            for k, ep in enumerate(episodes):
                task = tasks[k // num_generations]
                out.append(EpisodeRollout(task=task, group=group_offset + k // num_generations,
                                          ids=build_prompt_ids(tokenizer, ep.reset(task))))
            for turn in range(max(t.max_turns for t in tasks)):
                live = [k for k, r in enumerate(out) if not r.end]
                for k in live:
                    if len(out[k].ids) + max_new_tokens > max_seq_len:
                        out[k].end = "context"
                live = [k for k in live if not out[k].end]
                if not live:
                    break
                gen = generate_responses(model, tokenizer, [out[k].ids for k in live], max_new_tokens=max_new_tokens,
                                         do_sample=not greedy, temperature=temperature, top_p=top_p,
                                         seed=(seed * 1_000_003 + turn) % 2**63)
                texts = [tokenizer.decode(r, skip_special_tokens=True) for r in gen.responses]
                steps = list(pool.map(lambda k, text: episodes[k].step(text), live, texts))
                for k, response, text, step in zip(live, gen.responses, texts, steps):
                    r, ep = out[k], episodes[k]
                    r.spans.append((len(r.ids), len(r.ids) + len(response)))
                    r.ids.extend(response)
                    r.texts.append(text)
                    limit = min(r.task.max_turns, max_turns or math.inf)
                    if ep.done or turn + 1 >= limit:
                        r.end = "stopped" if not step.results else "max_turns" if turn + 1 >= limit else "limit"
                    else:
                        r.ids.extend(([] if response[-1:] == [eot] else [eot]) + turn_suffix(
                            tokenizer, ep.messages, step.message_index))
            finals = list(pool.map(lambda ep: ep.final_reward(), episodes))
            for r, ep, (reward, parts) in zip(out, episodes, finals):
                r.messages, r.steps, r.reward, r.components = list(ep.messages), list(ep.steps), reward, parts
                r.end = r.end or "max_turns"
        finally:
            for ep in episodes:
                ep.close()
    return out

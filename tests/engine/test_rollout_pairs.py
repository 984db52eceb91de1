"""Recorded pairs whose rejected side is drawn from the step's own rollouts (engine.data.draw_step, engine.pairs)."""

from __future__ import annotations

import copy
import random
from types import SimpleNamespace

import pytest
import torch

from composer_replication.engine import (
    LossConfig,
    OptimConfig,
    RolloutConfig,
    StudentConfig,
    StudentTrainerCore,
    TrainingData,
    build_training_data,
)
from composer_replication.engine.data import draw_step, pair_indices_for_step, prompts_for_step
from composer_replication.engine.pairs import PairRows
from composer_replication.types import ROLLOUT_REJECTED, PreferencePair

SYSTEM = {"role": "system", "content": "You are a coding agent."}
READ = '[TOOL_USE] name=Read input={"file_path": "a.py"}'
STATES = [{"state_id": f"s{i}", "messages": [SYSTEM, {"role": "user", "content": f"Fix bug {i} in a.py"}],
           "student_action": READ, "tools": ["Read", "Bash"]} for i in range(4)]


def _pair(i: int, *, rollout: bool = True, chosen: str = READ) -> PreferencePair:
    meta = {"teachers": ["recorded"], "rejected_source": ROLLOUT_REJECTED if rollout else "recorded"}
    return PreferencePair(state_id=f"s{i}", state_messages=STATES[i]["messages"],
                          chosen_messages=[{"role": "assistant", "content": chosen}],
                          rejected_messages=[] if rollout else [{"role": "assistant", "content": "no"}],
                          metadata=meta)


POOL = [_pair(0), _pair(1, rollout=False), _pair(2), _pair(3)]


def test_drawn_rollout_pairs_states_are_the_steps_prompts():
    data = build_training_data("next_action", states=STATES, pairs=POOL)
    for step in range(6):
        prompts, drawn = draw_step(data, step, prompts_per_step=1, pairs_per_step=2, seed=3)
        assert drawn == pair_indices_for_step(data, step, pairs_per_step=2, seed=3)
        ids = [p.prompt_id for p in prompts]
        wanted = [data.pairs[i].state_id for i in drawn if data.pairs[i].rejected_from_rollout]
        assert set(wanted) <= set(ids) and len(ids) == len(set(ids)) == max(1, len(set(wanted)))
        assert (prompts, drawn) == draw_step(data, step, prompts_per_step=1, pairs_per_step=2, seed=3)
    frontier = build_training_data("next_action", states=STATES, pairs=[POOL[1]])
    assert draw_step(frontier, 2, prompts_per_step=3, pairs_per_step=1, seed=0)[0] == prompts_for_step(
        frontier, 2, prompts_per_step=3, seed=0)  # stored rejected sides: the plain prompt draw


def test_a_rollout_pair_needs_a_prompt_at_its_state():
    with pytest.raises(ValueError, match="no prompt is offered at their state.*'s0'"):
        TrainingData(environment=SimpleNamespace(score=None), prompts=[], pairs=[POOL[0]])


def test_the_rejected_side_is_a_differing_sample_of_the_step(tiny_model_and_tokenizer):
    tok = tiny_model_and_tokenizer[1]
    rows = PairRows(tok, POOL, max_seq_len=1024, over_length="truncate_left", max_new_tokens=8)
    assert rows.tokens[0].rejected == () and rows.tokens[1].rejected  # stored rejected sides are tokenized once
    prompts = [SimpleNamespace(prompt_id="s0"), SimpleNamespace(prompt_id="s2")]
    rollouts = SimpleNamespace(prompt_index=[0, 0, 0, 1, 1, 1], texts=[READ, "ls", "cat", READ, READ, READ],
                               response_ids=[[1], [2], [3], [4], [5], [6]])
    got, agreed = rows.for_step([0, 1, 2], prompts, rollouts, random.Random(0))
    assert agreed == 1  # every sample at s2 is the chosen action: skipped and counted
    assert [r.state_id for r in got] == ["s0", "s1"] and got[0].rejected in ((2,), (3,))
    assert got[0].chosen == rows.tokens[0].chosen and got[1] == rows.tokens[1]
    again, _ = rows.for_step([0, 1, 2], prompts, rollouts, random.Random(0))
    assert again == got  # deterministic in the step's RNG
    picks = {rows.for_step([0], prompts, rollouts, random.Random(seed))[0][0].rejected for seed in range(20)}
    assert picks == {(2,), (3,)}  # only samples that differ from chosen


def _config(**rollout) -> StudentConfig:
    return StudentConfig(model="tiny", device="cpu", seed=3, num_steps=4, optim=OptimConfig(lr=1e-3),
                         loss=LossConfig(alpha_sdpo=0.0, beta_replay=1.0),
                         rollout=RolloutConfig(prompts_per_step=1, num_generations=2, max_new_tokens=6,
                                               pairs_per_step=2, **rollout))


@pytest.mark.slow
def test_trainer_trains_on_rollout_rejected_pairs_and_resumes_exactly():
    def core() -> StudentTrainerCore:
        return StudentTrainerCore(_config(), data=build_training_data("next_action", states=STATES, pairs=POOL))

    straight = core()
    metrics = [straight.train_step(step) for step in range(4)]
    assert all(m["replay/num_pairs"] + m["replay/pairs_agreed"] == 2.0 for m in metrics)
    assert any(m["loss/dpo"] != 0.0 for m in metrics)
    first = core()
    first.train_step(0)
    first.train_step(1)
    state = copy.deepcopy(first.state_dict())
    state["pair_refresh"] = {"at": 0, "live": []}  # a checkpoint from before: its refresh state is ignored
    resumed = core()
    resumed.load_state_dict(state)
    assert [resumed.train_step(2)["loss/total"], resumed.train_step(3)["loss/total"]] == [
        metrics[2]["loss/total"], metrics[3]["loss/total"]]
    for (n, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), n


def test_a_rollout_pair_made_at_another_state_brings_its_state():
    data = build_training_data("next_action", states=STATES[:1], pairs=[_pair(2), _pair(1, rollout=False)])
    assert [p.prompt_id for p in data.prompts] == ["s0", "s2"]  # s1's pair has its rejected side: no prompt needed
    prompts, drawn = draw_step(data, 0, prompts_per_step=1, pairs_per_step=2, seed=0)
    assert "s2" in [p.prompt_id for p in prompts if any(data.pairs[i].state_id == "s2" for i in drawn)] or \
        all(data.pairs[i].state_id != "s2" for i in drawn)
    held = build_training_data("next_action", states=STATES[:1], pairs=[_pair(2)], eval_states=STATES[2:3])
    assert [p.prompt_id for p in held.prompts] == ["s0"] and held.pairs == []  # a held-out state's pair never trains

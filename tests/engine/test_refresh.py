"""On-policy refresh of recorded pairs (engine.refresh): new rejected sides, agreeing pairs dropped, deterministic."""

from __future__ import annotations

import copy

import pytest
import torch

from composer_replication.engine import (
    LossConfig,
    OptimConfig,
    RolloutConfig,
    StudentConfig,
    StudentTrainerCore,
)
from composer_replication.engine.data import build_training_data, pair_indices_for_step
from composer_replication.engine.refresh import PairRefresher, refresh_pairs
from composer_replication.types import PreferencePair

SYSTEM = {"role": "system", "content": "You are a coding agent."}
READ = '[TOOL_USE] name=Read input={"file_path": "a.py"}'
STATES = [
    {
        "state_id": f"s{i}",
        "messages": [SYSTEM, {"role": "user", "content": f"Fix bug {i} in a.py"}],
        "student_action": READ,
        "tools": ["Read", "Bash"],
    }
    for i in range(3)
]
SAMPLE = {"step": 0, "seed": 0, "max_new_tokens": 6, "temperature": 1.0, "top_p": 1.0}


def _pair(
    i: int, *, chosen: str = READ, rejected: str = "I will do nothing.", sampled: bool = True
) -> PreferencePair:
    meta = {
        "teachers": ["recorded"],
        "rejected_source": "student_sample" if sampled else "recorded",
        "recorded_action": READ,
    }
    if sampled:
        meta["student_sample"] = dict(SAMPLE)
    return PreferencePair.from_actions(
        state_id=f"s{i}",
        state_messages=STATES[i]["messages"],
        chosen=chosen,
        rejected=rejected,
        metadata=meta,
    )


POOL = [_pair(0), _pair(1, rejected="[TOOL_USE] name=Bash input={}", sampled=False), _pair(2)]


def _refresh(model_tok, pairs, *, seed=5, temperature=1.0, step=4):
    model, tok = model_tok
    return refresh_pairs(model, tok, pairs, seed=seed, step=step, max_new_tokens=6, temperature=temperature)


def test_refresh_replaces_student_samples_deterministically(tiny_model_and_tokenizer):
    model = tiny_model_and_tokenizer[0]
    rng_before, mode_before = torch.get_rng_state(), model.training
    out = _refresh(tiny_model_and_tokenizer, POOL)
    assert torch.equal(torch.get_rng_state(), rng_before) and model.training == mode_before
    assert out[1] is POOL[1]  # a frontier pair against the recorded action is never touched
    for i in (0, 2):
        assert (
            out[i] is not None and out[i].chosen == READ and out[i].state_messages == POOL[i].state_messages
        )
        assert out[i].rejected != POOL[i].rejected
        assert out[i].metadata["student_sample"] == {**SAMPLE, "step": 4, "seed": 5}
        assert out[i].metadata["teachers"] == ["recorded"]
    again = _refresh(tiny_model_and_tokenizer, POOL)
    assert [p.rejected for p in again] == [p.rejected for p in out]  # same seed, same samples
    other = _refresh(tiny_model_and_tokenizer, POOL, seed=6)
    assert [other[0].rejected, other[2].rejected] != [out[0].rejected, out[2].rejected]


def test_refresh_drops_pairs_the_student_now_agrees_with(tiny_model_and_tokenizer):
    first = _refresh(tiny_model_and_tokenizer, POOL)
    assert first[2].rejected.strip()
    agreeing = [POOL[0], POOL[1], _pair(2, chosen=first[2].rejected)]  # chosen = what the student says now
    out = _refresh(tiny_model_and_tokenizer, agreeing)
    assert out[2] is None
    assert out[0].rejected == first[0].rejected and out[1] is POOL[1]


def test_refresh_only_the_given_indices(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    out = refresh_pairs(model, tok, POOL, seed=5, step=4, max_new_tokens=6, temperature=1.0, indices=[2, 1])
    assert out[0] is POOL[0] and out[1] is POOL[1]  # not asked for / not a student sample
    assert out[2] is None or out[2].metadata["student_sample"]["step"] == 4
    assert refresh_pairs(model, tok, POOL, seed=5, step=4, max_new_tokens=6, temperature=1.0, indices=[]) == POOL
    with pytest.raises(ValueError, match=r"indices must be in \[0, 3\)"):
        refresh_pairs(model, tok, POOL, seed=5, step=4, max_new_tokens=6, temperature=1.0, indices=[3])


def test_refresher_resamples_the_upcoming_pairs_and_keeps_the_others(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    draws = {2: [0], 3: [0], 4: [2], 5: []}  # the pool indices each step trains on
    r = PairRefresher(POOL, every=2, seed=1, rank=0, max_new_tokens=6, temperature=1.0, draw=draws.__getitem__)
    live = r.maybe_refresh(2, model, tok)  # window: steps 2-3 draw pair 0
    assert live[0].metadata["student_sample"]["step"] == 2 and live[2] is POOL[2]
    live = r.maybe_refresh(4, model, tok)  # window: steps 4-5 draw pair 2
    assert live[0].metadata["student_sample"]["step"] == 2  # kept from the last window that drew it
    assert live[2].metadata["student_sample"]["step"] == 4 and live[1] is POOL[1]


def test_refresher_schedule_metrics_and_state(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    r = PairRefresher(POOL, every=2, seed=1, rank=0, max_new_tokens=6, temperature=1.0)
    due = [step for step in range(6) if r.maybe_refresh(step, model, tok) is not None]
    assert due == [2, 4]
    assert r.maybe_refresh(4, model, tok) is None  # already refreshed at this step
    assert r.metrics(5) == {"replay/pairs_live": 3.0, "replay/rejected_age": 1.0}
    restored = PairRefresher(POOL, every=2, seed=1, rank=0, max_new_tokens=6, temperature=1.0)
    live = restored.load_state_dict(copy.deepcopy(r.state_dict()))
    assert [p.to_json() for p in live] == [p.to_json() for p in r.live] and restored.at == 4
    assert restored.load_state_dict(None) is None
    with pytest.raises(ValueError, match="resume with the run's own pairs.jsonl"):
        restored.load_state_dict({"at": 2, "live": [None]})
    # no student-sample pairs, or every=0: never refreshes, no metrics
    off = PairRefresher([POOL[1]], every=1, seed=1, rank=0, max_new_tokens=6, temperature=1.0)
    assert off.maybe_refresh(1, model, tok) is None and off.metrics(1) == {}
    with pytest.raises(ValueError, match="pair_refresh_every"):
        PairRefresher(POOL, every=-1, seed=1, rank=0, max_new_tokens=6, temperature=1.0)
    with pytest.raises(ValueError, match="rollout.pair_refresh_every"):
        RolloutConfig(pair_refresh_every=-2)


def _config(every: int) -> StudentConfig:
    return StudentConfig(
        model="tiny",
        device="cpu",
        seed=3,
        num_steps=4,
        optim=OptimConfig(lr=1e-3),
        loss=LossConfig(alpha_sdpo=0.0, beta_replay=1.0),
        rollout=RolloutConfig(
            prompts_per_step=1,
            num_generations=2,
            max_new_tokens=6,
            pairs_per_step=2,
            pair_refresh_every=every,
        ),
    )


@pytest.mark.slow
def test_trainer_refreshes_through_its_hook_and_resumes_exactly():
    data = build_training_data("next_action", states=STATES, pairs=POOL)
    core = StudentTrainerCore(_config(2), data=data)
    initial = list(core.tokenized_pairs)
    m0, m1 = core.train_step(0), core.train_step(1)
    assert core.tokenized_pairs == initial and m1["replay/rejected_age"] == 1.0
    state = copy.deepcopy(core.state_dict())
    m2 = core.train_step(2)  # refresh step: new rejected sides from the weights after 2 steps
    assert m0["replay/rejected_age"] == 0.0 and m2["replay/rejected_age"] == 0.0
    refreshed = list(core.tokenized_pairs)
    assert refreshed[1] == initial[1]  # the frontier pair keeps its tokens
    window = {i for t in (2, 3) for i in pair_indices_for_step(data, t, pairs_per_step=2, seed=3)}
    for i in (0, 2):  # re-sampled when steps 2-3 draw it, else untouched
        assert (refreshed[i] is None or refreshed[i].rejected != initial[i].rejected) == (i in window)
    resumed = StudentTrainerCore(
        _config(2), data=build_training_data("next_action", states=STATES, pairs=POOL)
    )
    resumed.load_state_dict(state)
    r2 = resumed.train_step(2)
    assert resumed.tokenized_pairs == refreshed and r2["loss/total"] == m2["loss/total"]

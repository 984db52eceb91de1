"""Evaluation on held-out sessions: the split (nothing held out trains), the metrics, the trainer's evaluate."""

from __future__ import annotations

import json
import math

import pytest

from composer_replication.engine import (
    OptimConfig,
    RolloutConfig,
    StudentConfig,
    StudentTrainerCore,
    run_plain,
)
from composer_replication.engine import student as student_module
from composer_replication.engine.data import build_training_data, select_states
from composer_replication.engine.metrics import next_action_stats
from composer_replication.rollout import NextActionEnvironment

SYSTEM = {"role": "system", "content": "You are a coding agent."}
READ = '[TOOL_USE] name=Read input={"file_path": "/r/a.py"}'
BASH = '[TOOL_USE] name=Bash input={"command": "pytest -q"}'


def state(sid: str, action: str, tools=("Read", "Bash", "Edit")) -> dict:
    return {"state_id": sid, "messages": [SYSTEM, {"role": "user", "content": f"task {sid}"}],
            "student_action": action, "tools": list(tools)}


TRAIN = [state("t::0000", READ), state("t::0001", BASH)]
HELD = [state("h::0000", READ), state("h::0001", BASH), state("h::0002", "All tests pass now.")]
PAIR = {"state_id": "t::0000", "state_messages": TRAIN[0]["messages"], "chosen": BASH, "rejected": READ,
        "n_teachers_agreeing": 1}


# ---------------------------------------------------------------------------- the split


def test_heldout_sessions_are_eval_prompts_scored_against_the_recorded_action():
    held_pair = {**PAIR, "state_id": "h::0000"}  # a pair for a held-out state must not change its reference
    data = build_training_data("next_action", states=TRAIN, pairs=[PAIR, held_pair], eval_states=HELD,
                               eval_max_new_tokens=48)
    assert [p.prompt_id for p in data.prompts] == ["t::0000", "t::0001"]
    assert [p.prompt_id for p in data.eval_prompts] == ["h::0000", "h::0001", "h::0002"]
    assert [p.reference for p in data.eval_prompts] == [READ, BASH, "All tests pass now."]
    assert data.eval_scorer(data.eval_prompts) is data.eval_environment
    assert data.eval_scorer(data.prompts) is data.environment
    assert data.eval_max_new_tokens == 48
    assert data.prompts[0].reference == BASH  # training keeps the consensus reference


def test_split_errors_name_the_fix():
    with pytest.raises(ValueError, match="also training ones.*keep data.eval_sessions and data.sessions"):
        build_training_data("next_action", states=TRAIN, eval_states=[TRAIN[0]])
    with pytest.raises(ValueError, match="not both; set num_eval_prompts to 0"):
        build_training_data("next_action", states=TRAIN, eval_states=HELD, num_eval_prompts=1)
    with pytest.raises(ValueError, match="'eval_max_new_tokens' must be >= 1"):
        build_training_data("next_action", states=TRAIN, eval_states=HELD, eval_max_new_tokens=0)


def test_prompts_held_out_by_count_lose_their_pairs():
    states = TRAIN + [state("t::0002", READ)]
    pairs = [{**PAIR, "state_id": s["state_id"]} for s in states]
    data = build_training_data("next_action", states=states, pairs=pairs, num_eval_prompts=1, seed=0)
    held = {p.prompt_id for p in data.eval_prompts}
    assert len(held) == 1 and len(data.pairs) == 2
    assert not held & {p.state_id for p in data.pairs}


def test_select_states_is_a_fixed_spread_draw_in_order():
    states = [state(f"s::{i:04d}", READ) for i in range(50)]
    picked = select_states(states, 12)
    assert len(picked) == 12 and picked == select_states(states, 12)
    ids = [s["state_id"] for s in picked]
    assert ids == sorted(ids) and int(ids[-1][3:]) - int(ids[0][3:]) > 25  # spread, not the first twelve
    assert select_states(states, 0) == states and select_states(states[:5], 12) == states[:5]


# ---------------------------------------------------------------------------- the metrics


def test_next_action_stats_read_the_environment_scores():
    env = NextActionEnvironment(HELD)
    prompts = env.prompts()
    answers = [
        READ,  # exact: agreement 1, same tools, well formed
        '[TOOL_USE] name=Bash input={"command": "pytest -x"}',  # same tool, other argument: partial 0.5
        "All tests pass now.",  # text reference answered with the same text
    ]
    stats = next_action_stats(prompts, answers, [env.score(p, a) for p, a in zip(prompts, answers)])
    assert stats["eval/agreement"] == pytest.approx(2 / 3)
    assert stats["eval/agreement_partial"] == pytest.approx((1 + 0.5 + 1) / 3)
    assert stats["eval/tool_choice_rate"] == 1.0 and stats["eval/well_formed_call_rate"] == 1.0
    bad = ["I would read the file.", '[TOOL_USE] name=Search input={"q": "x"}', READ]
    stats = next_action_stats(prompts, bad, [env.score(p, a) for p, a in zip(prompts, bad)])
    assert stats["eval/agreement"] == 0.0 and stats["eval/tool_choice_rate"] == 0.0
    assert stats["eval/well_formed_call_rate"] == 0.0  # no call, then a tool the session does not offer
    empty = next_action_stats([], [], [])
    assert sorted(empty) == sorted(stats) and all(math.isnan(v) for v in empty.values())


# ---------------------------------------------------------------------------- the trainer


def config() -> StudentConfig:
    return StudentConfig(model="tiny", device="cpu", seed=0, num_steps=1,
                         optim=OptimConfig(lr=1e-3, warmup_steps=0, scheduler="constant"),
                         rollout=RolloutConfig(prompts_per_step=1, num_generations=2, max_new_tokens=4,
                                               pairs_per_step=1))


def test_evaluate_answers_every_heldout_state_with_the_eval_length(monkeypatch):
    data = build_training_data("next_action", states=TRAIN, pairs=[PAIR], eval_states=HELD, eval_max_new_tokens=9)
    core = StudentTrainerCore(config(), data=data)
    seen = {}

    def recorded(model, tokenizer, prompts, *, max_new_tokens):
        seen.update(n=len(prompts), max_new_tokens=max_new_tokens)
        return [p.reference for p in prompts]  # a student that answers exactly what the sessions recorded

    monkeypatch.setattr(student_module, "greedy_texts", recorded)
    ev = core.evaluate()
    assert seen == {"n": 3, "max_new_tokens": 9}
    assert ev["eval/agreement"] == 1.0 and ev["eval/well_formed_call_rate"] == 1.0
    assert ev["eval/mean"] == pytest.approx(1.0) and ev["eval/num_scored"] == 3.0


@pytest.mark.slow
def test_run_writes_eval_start_and_end_with_the_same_keys(tmp_path):
    data = build_training_data("next_action", states=TRAIN, pairs=[PAIR], eval_states=HELD)
    summary = run_plain(config(), data, tmp_path / "run")
    start, end = summary["eval_start"], summary["eval_end"]
    assert sorted(start) == sorted(end)
    for key in ("eval/agreement", "eval/agreement_partial", "eval/tool_choice_rate", "eval/well_formed_call_rate",
                "eval/mean", "eval/num_scored"):
        assert key in start, key
    assert start["eval/num_scored"] == 3.0
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "eval/agreement" in r] == [0, 1]
    on_disk = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert sorted(on_disk["eval_start"]) == sorted(on_disk["eval_end"]) == sorted(start)

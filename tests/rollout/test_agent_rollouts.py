"""Multi-turn episodes sampled by a policy and trained on (rollout.agent.rollouts / .batch, the engine's agentic step).

A scripted policy stands in for the model's sampling (``generate_responses`` is replaced): each episode of a task
plays a fixed list of actions, so the rows, masks, advantages, hints and pairs can be checked token by token.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch

from composer_replication.actions import format_tool_use
from composer_replication.chat_format import build_prompt_ids, build_response_ids, end_of_turn_id
from composer_replication.engine import StudentConfig, StudentTrainerCore, build_training_data
from composer_replication.rollout.agent import Task, parse_task
from composer_replication.rollout.agent import rollouts as R
from composer_replication.rollout.agent.batch import assemble_episode_batch, episode_stats, solution_pair_rows
from composer_replication.rollout.agent.episode import opening_messages
from composer_replication.rollout.generate import Generated
from composer_replication.rollout.sandbox import os_sandbox_status

needs_bwrap = pytest.mark.skipif(not os_sandbox_status()[0], reason=f"no OS sandbox here: {os_sandbox_status()[1]}")
PYTEST = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"]
READ = {"name": "Read", "input": {"file_path": "stats.py"}}
EDIT = {"name": "Edit", "input": {"file_path": "stats.py", "old_string": "    return sum(xs) / len(xs)",
                                  "new_string": "    return sum(xs) / len(xs) if xs else 0.0"}}
BAD_EDIT = {"name": "Edit", "input": {"file_path": "stats.py", "old_string": "return total / n", "new_string": "x"}}
TASK = parse_task({
    "task_id": "mean-empty", "instruction": "mean([]) crashes with ZeroDivisionError; it should return 0.0.",
    "files": {"stats.py": "def mean(xs):\n    return sum(xs) / len(xs)\n",
              "tests/test_stats.py": "from stats import mean\n\n\ndef test_empty():\n    assert mean([]) == 0.0\n"},
    "test_command": PYTEST, "max_turns": 4, "solution_actions": [READ, EDIT],
})


def act(action: dict) -> str:
    return format_tool_use(action["name"], action["input"])


SOLVES = [act(READ), act(EDIT), "The tests pass now."]  # reads, fixes, stops: solved
FAILS = [act(READ), act(BAD_EDIT), "Done."]  # its Edit fails (old_string not in the file); unsolved


@pytest.fixture()
def scripted(monkeypatch, tiny_model_and_tokenizer):
    """``scripted({task_id: [episode 0's texts, episode 1's texts, ...]})``: the policy plays those turns."""
    _, tok = tiny_model_and_tokenizer

    def install(scripts: dict[str, list[list[str]]]):
        turn = {"n": 0}

        def fake(model, tokenizer, rows, *, max_new_tokens, **kw):
            t, out = turn["n"], []
            live = [(tid, g) for tid, eps in scripts.items() for g, texts in enumerate(eps) if len(texts) > t]
            assert len(live) == len(rows), "the script and the live episodes disagree"
            for tid, g in live:
                out.append(build_response_ids(tok, scripts[tid][g][t])[-max_new_tokens:])
            turn["n"] += 1
            return Generated(torch.zeros(0), torch.zeros(0), [list(r) for r in rows], out, [False] * len(out))

        monkeypatch.setattr(R, "generate_responses", fake)

    return install


@needs_bwrap
def test_episodes_keep_the_sampled_tokens_and_train_only_on_them(tiny_model_and_tokenizer, scripted):
    model, tok = tiny_model_and_tokenizer
    scripted({"mean-empty": [SOLVES, FAILS]})
    eps = R.sample_episodes(model, tok, [TASK], num_generations=2, max_new_tokens=128, max_seq_len=4096)
    solved, failed = eps
    assert (solved.solved, solved.reward, solved.end) == (True, 1.0, "stopped")
    assert (failed.solved, failed.end, len(failed.steps)) == (False, "stopped", 3)
    assert failed.steps[1].results[0].failure == "old_string_not_found" and failed.steps[1].error_site
    for e in eps:  # each turn continues exactly the template's rendering of the chat before it
        for step, (s, _end) in zip(e.steps, e.spans):
            assert e.ids[:s] == build_prompt_ids(tok, e.messages[:step.message_index])
        assert [tok.decode(e.ids[s:t]) for s, t in e.spans] == [
            tok.decode(build_response_ids(tok, x)) for x in (SOLVES if e is solved else FAILS)]

    batch, hints = assemble_episode_batch(tok, eps)
    for b, e in enumerate(eps):  # the loss sees the student's tokens of every turn, nothing of the tools
        mask = batch["response_mask"][b].tolist()
        assert [i for i, m in enumerate(mask) if m] == [i for s, t in e.spans for i in range(s, t)]
        assert batch["input_ids"][b, : len(e.ids)].tolist() == e.ids
    assert batch["advantages"][0] > 0 > batch["advantages"][1] and batch["group_ids"].tolist() == [0, 0]
    # channel 2: one hinted row, at the failed Edit; the teacher scores exactly the tokens of that turn
    assert hints == {"old_string_not_found": 1} and batch["ctx_teacher_input_ids"].shape[0] == 1
    s_idx, t_idx = batch["sdpo_student_index"], batch["sdpo_teacher_index"]
    s, t = failed.spans[1]
    assert s_idx.tolist() == [[1, c] for c in range(s, t)]
    assert batch["ctx_teacher_input_ids"][t_idx[:, 0], t_idx[:, 1]].tolist() == failed.ids[s:t]
    teacher_text = tok.decode(batch["ctx_teacher_input_ids"][0])
    assert "old_string" in teacher_text and teacher_text.count("[TOOL_USE] name=Edit") == 1  # the hint precedes it

    # channel 3: the unsolved episode left the solution at turn 1 (the solved one makes no pair)
    rows = solution_pair_rows(tok, eps, max_pairs=4, max_seq_len=4096)
    assert [r.state_id for r in rows] == ["mean-empty::turn1"]
    assert list(rows[0].rejected) == failed.ids[s:t] and list(rows[0].chosen) == build_response_ids(tok, act(EDIT))
    assert list(rows[0].prompt) == failed.ids[:s]

    stats = episode_stats(eps, hints)
    assert stats["rollout/solve_rate"] == 0.5 and stats["rollout/turns"] == 3 and stats["hints/old_string_not_found"] == 1
    record = failed.record()
    assert record["turns"][1]["calls"][0]["failure"] == "old_string_not_found" and not record["solved"]
    assert all(len(c["result"].splitlines()) <= R.RESULT_LINES for turn in record["turns"] for c in turn["calls"])


@needs_bwrap
def test_an_episode_ends_before_its_row_passes_max_seq_len(tiny_model_and_tokenizer, scripted):
    model, tok = tiny_model_and_tokenizer
    opening = len(build_prompt_ids(tok, opening_messages(R.EpisodeConfig(), TASK)))
    scripted({"mean-empty": [SOLVES[:1]]})
    (e,) = R.sample_episodes(model, tok, [TASK], num_generations=1, max_new_tokens=40, max_seq_len=opening + 60)
    assert e.end == "context" and len(e.steps) == 1 and len(e.ids) + 40 > opening + 60


@needs_bwrap
def test_max_turns_caps_the_tasks_own(tiny_model_and_tokenizer, scripted):
    model, tok = tiny_model_and_tokenizer
    scripted({"mean-empty": [SOLVES[:2]]})
    (e,) = R.sample_episodes(model, tok, [TASK], num_generations=1, max_new_tokens=128, max_seq_len=4096, max_turns=2)
    assert e.end == "max_turns" and len(e.steps) == 2 and e.solved  # the edit is in: the tests pass at the end


def test_bad_arguments_and_a_template_that_rewrites_history(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    with pytest.raises(ValueError, match="needs tasks"):
        R.sample_episodes(model, tok, [], num_generations=1, max_new_tokens=8, max_seq_len=64)
    with pytest.raises(ValueError, match="max_seq_len > max_new_tokens"):
        R.sample_episodes(model, tok, [TASK], num_generations=1, max_new_tokens=64, max_seq_len=64)
    with pytest.raises(ValueError, match="unique ids"):
        R.AgenticEnvironment([TASK, TASK])

    class Rewrites:  # a template that drops earlier turns when a message is added
        def __getattr__(self, name):
            return getattr(tok, name)

        def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=False):
            return tok.apply_chat_template(messages[-2:], add_generation_prompt=add_generation_prompt, tokenize=False)

    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": act(READ)}, {"role": "tool", "content": "1\tdef mean(xs):"}]
    gen_prompt = tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert R.turn_suffix(tok, messages, 2)[-len(gen_prompt):] == gen_prompt
    with pytest.raises(ValueError, match="appending template"):
        R.turn_suffix(Rewrites(), messages, 2)


@needs_bwrap
def test_the_engine_trains_an_agentic_step_on_all_three_channels(tiny_model_and_tokenizer, scripted):
    held = Task(**{**TASK.__dict__, "task_id": "mean-held", "source": "<held>"})
    data = build_training_data("agentic", tasks=[TASK], eval_tasks=[held])
    assert [p.prompt_id for p in data.prompts] == ["mean-empty"] and [p.prompt_id for p in data.eval_prompts] == [
        "mean-held"]
    cfg = StudentConfig(model="tiny", device="cpu", num_steps=2, max_seq_len=4096)
    cfg.rollout.environment, cfg.rollout.prompts_per_step, cfg.rollout.num_generations = "agentic", 1, 2
    cfg.rollout.max_new_tokens, cfg.loss.alpha_sdpo, cfg.loss.beta_replay = 128, 0.5, 0.5
    core = StudentTrainerCore(cfg, data=data)
    before = copy.deepcopy(core.model.state_dict())
    scripted({"mean-empty": [SOLVES, FAILS]})
    metrics = core.train_step(0)
    assert metrics["rollout/solve_rate"] == 0.5 and metrics["hints/old_string_not_found"] == 1
    assert metrics["replay/num_pairs"] == 1 and metrics["loss/jsd"] != 0 and metrics["loss/dpo"] != 0
    assert metrics["loss/grpo"] != 0
    assert [e["task_id"] for e in metrics["episodes"]] == ["mean-empty"] * 2 and metrics["episodes"][0]["rank"] == 0
    assert any(not torch.equal(before[k], v) for k, v in core.model.state_dict().items())
    scripted({"mean-held": [SOLVES]})
    ev = core.evaluate()
    assert (ev["eval/solve_rate"], ev["eval/mean_reward"], ev["eval/mean_turns"], ev["eval/num_episodes"]) == (
        1.0, 1.0, 3.0, 1.0)
    assert ev["eval/tool_error_rate"] == 0.0


def test_agentic_data_holds_out_and_refuses_overlaps():
    with pytest.raises(ValueError, match="also training ones"):
        build_training_data("agentic", tasks=[TASK], eval_tasks=[TASK])
    two = [TASK, Task(**{**TASK.__dict__, "task_id": "other", "source": "<t>"})]
    data = build_training_data("agentic", tasks=two, num_eval_prompts=1, seed=0)
    assert len(data.prompts) == 1 and len(data.eval_prompts) == 1
    assert data.prompts[0].prompt_id != data.eval_prompts[0].prompt_id
    bundled = build_training_data("agentic")
    assert len(bundled.prompts) >= 40 and all("task" in p.metadata for p in bundled.prompts)


def test_solution_pairs_are_capped_and_none_where_the_student_agreed(tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    broken = Task(**{**TASK.__dict__, "solution_actions": [{"name": "Read", "input": {"file_path": "stats.py"}}]})

    def episode(task, text):
        e = R.EpisodeRollout(task=task, group=0, ids=[1, 2, 3] + build_response_ids(tok, text))
        e.spans, e.texts = [(3, len(e.ids))], [text]
        e.messages = [{"role": "user", "content": "u"}, {"role": "assistant", "content": text}]
        e.steps = [R.StepResult(turn=0, message_index=1, results=[], done=True)]
        return e

    eps = [episode(broken, f"I will look at file {i}.") for i in range(5)]
    rows = solution_pair_rows(tok, eps, max_pairs=2, max_seq_len=512, rng=random.Random(0))
    assert len(rows) == 2 and all(r.state_id == "mean-empty::turn0" for r in rows)
    assert solution_pair_rows(tok, [episode(broken, act(READ))], max_pairs=2, max_seq_len=512) == []  # it agreed
    assert end_of_turn_id(tok) == rows[0].chosen[-1]

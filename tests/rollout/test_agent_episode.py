"""Agentic episodes on small fixture tasks: chat shape, error sites, reward components, limits, the checker CLI.

Four fixture tasks (a pytest repo, a unittest repo, a repo at a custom ``cwd``, three tests for partial
credit), each with a recorded fix. Tests that run ``test_command`` or Bash need bubblewrap and skip
where it cannot run; one test runs the reward path with ``os_sandbox="off"`` everywhere.
"""

from __future__ import annotations

import json
import time

import pytest

from composer_replication.actions import format_tool_use
from composer_replication.chat_format import to_chat_messages
from composer_replication.hint_generator import dispatch
from composer_replication.rollout.agent import (
    Episode,
    EpisodeConfig,
    Task,
    ToolConfig,
    load_tasks,
    parse_task,
    run_task,
)
from composer_replication.rollout.agent.__main__ import main
from composer_replication.rollout.agent.episode import parse_test_summary
from composer_replication.rollout.sandbox import os_sandbox_status
from composer_replication.types import ERROR_KINDS

needs_bwrap = pytest.mark.skipif(not os_sandbox_status()[0], reason=f"no OS sandbox here: {os_sandbox_status()[1]}")
PYTEST = ["python", "-m", "pytest", "-q", "-p", "no:cacheprovider"]


def call(name: str, **args: object) -> dict:
    return {"name": name, "input": args}


MEAN = {
    "task_id": "mean-empty",
    "instruction": "mean([]) crashes with ZeroDivisionError; it should return 0.0.",
    "files": {"stats.py": "def mean(xs):\n    return sum(xs) / len(xs)\n",
              "tests/test_stats.py": "from stats import mean\n\n\ndef test_empty():\n    assert mean([]) == 0.0\n\n\n"
                                     "def test_two():\n    assert mean([1, 3]) == 2\n"},
    "test_command": PYTEST,
    "solution_actions": [
        call("Read", file_path="stats.py"),
        call("Edit", file_path="/workspace/stats.py", old_string="    return sum(xs) / len(xs)",
             new_string="    return sum(xs) / len(xs) if xs else 0.0"),
        call("Bash", command="python -m pytest -q -p no:cacheprovider"),
    ],
}
WORDS = {
    "task_id": "words",
    "instruction": "count_words('a  b') says 3; it should say 2.",
    "files": {"words.py": "def count_words(s):\n    return len(s.split(' '))\n",
              "test_words.py": "import unittest\n\nfrom words import count_words\n\n\nclass T(unittest.TestCase):\n"
                               "    def test_spaces(self):\n        self.assertEqual(count_words('a  b'), 2)\n\n"
                               "    def test_one(self):\n        self.assertEqual(count_words('a'), 1)\n"},
    "test_command": ["python", "-m", "unittest"],
    "max_turns": 4,
    "solution_actions": [call("Read", file_path="words.py"),
                         call("Edit", file_path="words.py", old_string="s.split(' ')", new_string="s.split()")],
}
CONFIG = {
    "task_id": "config-default",
    "instruction": "Loading a config without `retries` raises KeyError; default it to 3.",
    "cwd": "/home/dev/svc",
    "files": {"app/__init__.py": "", "app/config.py": "def load(data):\n    return {'retries': data['retries']}\n",
              "tests/test_config.py": "from app.config import load\n\n\ndef test_default():\n"
                                      "    assert load({})['retries'] == 3\n"},
    "test_command": PYTEST,
    "solution_actions": [
        call("Grep", pattern="def load", path="/home/dev/svc", output_mode="content", **{"-n": True}),
        call("Read", file_path="/home/dev/svc/app/config.py"),
        call("Edit", file_path="/home/dev/svc/app/config.py", old_string="data['retries']",
             new_string="data.get('retries', 3)"),
    ],
}
PARITY = {
    "task_id": "parity",
    "instruction": "is_even and is_odd are wrong for negative numbers and zero.",
    "files": {"num.py": "def is_even(n):\n    return n % 2 == 1\n\n\ndef is_odd(n):\n    return n % 2 == 0\n\n\n"
                        "def sign(n):\n    return (n > 0) - (n < 0)\n",
              "test_num.py": "from num import is_even, is_odd, sign\n\n\ndef test_even():\n    assert is_even(4)\n\n\n"
                             "def test_odd():\n    assert is_odd(3)\n\n\ndef test_sign():\n    assert sign(-2) == -1\n"},
    "test_command": PYTEST,
    "solution_actions": [call("Read", file_path="num.py"),
                         call("Edit", file_path="num.py", old_string="n % 2 == 1\n", new_string="n % 2 == 0\n"),
                         call("Edit", file_path="num.py", old_string="n % 2 == 0\n\n\ndef sign",
                              new_string="n % 2 == 1\n\n\ndef sign")],
}
FIXTURES = [MEAN, WORDS, CONFIG, PARITY]


@pytest.fixture
def tasks_file(tmp_path):
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in FIXTURES))
    return path


@pytest.fixture
def episode(tmp_path):
    with Episode(EpisodeConfig(workdir=str(tmp_path), test_timeout_s=30)) as ep:
        yield ep


def act(name: str, **args: object) -> str:
    return format_tool_use(name, args)


# ---------------------------------------------------------------------------- tasks


def test_load_tasks_reads_every_field(tasks_file):
    tasks = load_tasks(tasks_file)
    assert [t.task_id for t in tasks] == ["mean-empty", "words", "config-default", "parity"]
    assert tasks[0].max_turns == 8 and tasks[1].max_turns == 4 and tasks[2].cwd == "/home/dev/svc"
    assert tasks[1].source.endswith("tasks.jsonl:2")


@pytest.mark.parametrize("change, field", [
    ({"task_id": None}, "missing required key `task_id`"),
    ({"test_command": "pytest -q"}, "`test_command` must be a non-empty list"),
    ({"files": {"/etc/passwd": "x"}}, "`files` has the path '/etc/passwd'"),
    ({"files": {"../up.py": "x"}}, "`files` has the path '../up.py'"),
    ({"files": {"a.py": 3}}, r"`files` \['a.py'\] must be the file's text"),
    ({"max_turns": 0}, "`max_turns` must be a positive integer"),
    ({"max_turns": 1}, "`solution_actions` has 3 calls but max_turns is 1"),
    ({"solution_actions": [{"name": "Serch", "input": {}}]}, r"`solution_actions` \[0\] must be"),
    ({"cwd": "/usr/lib/x"}, "`cwd` must be an absolute folder outside the system folders"),
    ({"test_cmd": ["x"]}, r"unknown key\(s\) \['test_cmd'\]"),
])
def test_bad_task_lines_name_the_line_and_the_field(tmp_path, change, field):
    bad = {k: v for k, v in {**MEAN, **change}.items() if v is not None}
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(WORDS) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(ValueError, match=f"tasks.jsonl:3: .*{field}"):
        load_tasks(path)


def test_bad_json_and_duplicate_ids(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"task_id": \n')
    with pytest.raises(ValueError, match="t.jsonl:1: not valid JSON"):
        load_tasks(path)
    path.write_text(json.dumps(WORDS) + "\n" + json.dumps(WORDS) + "\n")
    with pytest.raises(ValueError, match="t.jsonl:2: `task_id` 'words' is used by an earlier line"):
        load_tasks(path)


def test_test_counts_reads_pytest_and_unittest_summaries():
    assert parse_test_summary("..F\nFAILED t.py::x - boom\n1 failed, 2 passed in 0.12s") == (2, 3)
    assert parse_test_summary("==== 1 failed, 1 passed, 2 warnings, 1 error in 0.5s ====") == (1, 3)
    assert parse_test_summary("3 passed in 0.01s") == (3, 3)
    assert parse_test_summary("Ran 4 tests in 0.001s\n\nFAILED (failures=1, errors=1)") == (2, 4)
    assert parse_test_summary("Ran 2 tests in 0.000s\n\nOK") == (2, 2)
    assert parse_test_summary("Exit code 127\nbash: pytest: command not found") is None


# ---------------------------------------------------------------------------- episodes


@needs_bwrap
@pytest.mark.parametrize("task", FIXTURES, ids=[t["task_id"] for t in FIXTURES])
def test_each_fixture_fails_before_its_solution_and_passes_after(episode, task):
    task = parse_task(task)
    before = run_task(episode, task, policy="none")
    assert not before["solved"] and before["reward"] == 0.0 and before["turns"] == 0
    after = run_task(episode, task, policy="solution")
    assert after == {**after, "solved": True, "reward": 1.0, "tool_errors": 0,
                     "turns": len(task.solution_actions)}


@needs_bwrap
def test_the_chat_has_the_shape_of_ingested_sessions(episode):
    messages = episode.reset(parse_task(MEAN))
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"].endswith("Working directory: /workspace")
    text = "Let me look.\n" + act("Read", file_path="stats.py") + "\n" + act("Reed", file_path="x")
    step = episode.step(text)
    assistant, ok, bad = episode.messages[2:]
    assert step.message_index == 2 and assistant["content"] == text
    assert [c["function"]["name"] for c in assistant["tool_calls"]] == ["Read", "Reed"]
    assert ok == {"role": "tool", "tool_call_id": assistant["tool_calls"][0]["id"],
                  "content": "     1→def mean(xs):\n     2→    return sum(xs) / len(xs)"}
    assert bad["content"] == "[ERROR] <tool_use_error>Error: No such tool available: Reed</tool_use_error>"
    assert to_chat_messages(episode.messages)[2]["content"] == text  # rendered as the student wrote it


@needs_bwrap
def test_every_failed_call_is_an_error_site_with_a_kind_and_a_hint(episode):
    episode.reset(parse_task(MEAN))
    turns = [
        (act("Reed", file_path="stats.py"), "unknown_tool", "tool_not_found"),
        ('[TOOL_USE] name=Read input={"file_path": "stats.py"', "bad_json", "json_decode"),
        (act("Edit", file_path="stats.py", old_string="x"), "bad_arguments", "type_error"),
        (act("Read", file_path="nope.py"), "file_not_found", "runtime_error"),
        (act("Read", file_path="nope.py"), "file_not_found", "repeated_failure"),
        (act("Read", file_path="stats.py"), None, None),
        (act("Edit", file_path="stats.py", old_string="  return sum(xs)/len(xs)", new_string="y"),
         "old_string_not_found", "runtime_error"),
        (act("Bash", command="python -m pytest -q -p no:cacheprovider"), "test_failure", "runtime_error"),
    ]
    for text, failure, kind in turns:
        step = episode.step(text)
        assert [r.failure for r in step.results] == [failure] and step.error_kind == kind
        if kind is None:
            assert step.error_site is None
            continue
        assert kind in ERROR_KINDS and step.error_site["error_kind"] == kind
        assert "Read" in step.error_site["available_tools"] and dispatch(kind, step.error_site)
    assert "ZeroDivisionError" in step.error_site["error_message"]  # the test failure's assertion line
    assert "FAILED tests/test_stats.py::test_empty" in step.error_site["error_message"]
    assert step.done  # max_turns = 8
    with pytest.raises(RuntimeError, match="reset"):
        episode.step(act("Read", file_path="stats.py"))
    reward, parts = episode.final_reward()
    assert parts["malformed_calls"] == 3 and parts["penalty"] == pytest.approx(0.3)
    assert reward == pytest.approx(-0.3) and parts["tool_errors"] == 7 and parts["turns"] == 8


@needs_bwrap
def test_partial_progress_is_measured_against_the_start(episode):
    task = parse_task(PARITY)  # 1 of 3 tests passes at the start
    episode.reset(task)
    episode.step(act("Read", file_path="num.py"))
    fix_even = task.solution_actions[1]
    episode.step(format_tool_use(fix_even["name"], fix_even["input"]))  # fixes is_even only
    episode.step("I fixed is_even.")
    reward, parts = episode.final_reward()
    assert (parts["tests_passed"], parts["tests_total"]) == (2, 3)
    assert (parts["baseline_passed"], parts["baseline_total"]) == (1, 3)
    assert parts["progress"] == pytest.approx(0.5) and reward == pytest.approx(0.25) and not parts["solved"]
    assert episode.final_reward() == (reward, parts)  # the tests run once


@needs_bwrap
def test_editing_the_tests_does_not_pass_them(episode):
    episode.reset(parse_task(MEAN))
    episode.step(act("Read", file_path="tests/test_stats.py"))
    episode.step(act("Write", file_path="tests/test_stats.py", content="def test_ok():\n    assert True\n"))
    episode.step(act("Bash", command="python -m pytest -q -p no:cacheprovider"))
    assert episode.steps[-1].results[0].failure is None  # passes in the episode...
    reward, parts = episode.final_reward()
    assert not parts["solved"] and reward == 0.0  # ...but the final run uses the task's tests


@needs_bwrap
def test_a_hung_test_command_is_killed_at_its_limit(tmp_path):
    hung = {**WORDS, "test_command": ["python", "-c", "while True: pass"], "solution_actions": []}
    with Episode(EpisodeConfig(workdir=str(tmp_path), test_timeout_s=1.5)) as ep:
        ep.reset(parse_task(hung))
        start = time.monotonic()
        reward, parts = ep.final_reward()
    assert time.monotonic() - start < 10 and parts["test_timed_out"] and not parts["solved"] and reward == 0.0


@needs_bwrap
def test_a_hung_bash_call_fails_and_the_episode_budget_ends_it(tmp_path):
    config = EpisodeConfig(workdir=str(tmp_path), episode_timeout_s=2.0, tools=ToolConfig(timeout_s=1.0))
    with Episode(config) as ep:
        ep.reset(parse_task(MEAN))
        first = ep.step(act("Bash", command="sleep 60"))
        assert first.results[0].failure == "timeout" and first.results[0].output.startswith("Command timed out")
        assert first.results[0].duration_s < 5 and not first.done
        second = ep.step(act("Bash", command="sleep 60"))
        assert second.done and ep.final_reward()[1]["timeouts"] == 2


@needs_bwrap
def test_too_many_calls_in_one_turn_are_refused(tmp_path):
    with Episode(EpisodeConfig(workdir=str(tmp_path), max_calls_per_turn=2)) as ep:
        ep.reset(parse_task(MEAN))
        step = ep.step("\n".join(act("Glob", pattern="*.py") for _ in range(3)))
    assert [r.failure for r in step.results] == [None, None, "too_many_calls"] and step.error_kind == "other"


def test_reward_path_without_the_os_sandbox(tmp_path):
    config = EpisodeConfig(workdir=str(tmp_path), tools=ToolConfig(os_sandbox="off"), test_timeout_s=30)
    with Episode(config) as ep:
        task = parse_task({**WORDS, "test_command": ["python", "-m", "unittest", "-q"]})
        assert run_task(ep, task)["solved"]
        assert ep.final_reward()[1]["isolation"] == "none"
    assert list(tmp_path.iterdir()) == []  # nothing of the episode stays on disk


def test_step_before_reset_and_bad_config_are_refused():
    with pytest.raises(RuntimeError, match="reset"):
        Episode().step("x")
    with pytest.raises(ValueError, match="test_timeout_s"):
        EpisodeConfig(test_timeout_s=0)
    with pytest.raises(ValueError, match="cwd"):
        Task(task_id="t", instruction="i", files={"a": ""}, test_command=["true"], cwd="relative")


# ---------------------------------------------------------------------------- the checker CLI


@needs_bwrap
def test_checker_solution_solves_every_fixture_and_none_solves_none(tasks_file, capsys):
    assert main([str(tasks_file), "--policy", "solution"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["task_id"] for r in rows] == ["mean-empty", "words", "config-default", "parity"]
    assert all(r["solved"] and r["reward"] == 1.0 and r["tool_errors"] == 0 for r in rows)
    assert set(rows[0]) == {"task_id", "solved", "reward", "turns", "tool_errors", "failures"}
    assert main([str(tasks_file), "--policy", "none"]) == 1
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 4 and not any(r["solved"] for r in rows)


@needs_bwrap
def test_checker_names_a_solution_that_does_not_solve_its_task(tmp_path, capsys):
    wrong = {**WORDS, "solution_actions": [call("Read", file_path="words.py"),
                                           call("Edit", file_path="words.py", old_string="len(s.split(' '))",
                                                new_string="len(s)")]}
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps(MEAN) + "\n" + json.dumps(wrong) + "\n")
    assert main([str(path)]) == 1
    err = capsys.readouterr().err
    assert "tasks.jsonl:2: task 'words': `solution_actions` do not solve it" in err and "FAILED" in err


def test_checker_reports_bad_input_with_exit_2(tmp_path, capsys):
    path = tmp_path / "tasks.jsonl"
    path.write_text(json.dumps({**MEAN, "test_command": "pytest"}) + "\n")
    assert main([str(path)]) == 2
    assert "tasks.jsonl:1: task 'mean-empty': `test_command` must be a non-empty list" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.jsonl")]) == 2

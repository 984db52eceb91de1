"""Bundled Python tasks: every reference solution passes; rewards and error kinds of bad answers."""

from __future__ import annotations

import json

import pytest

from composer_replication.rollout.environment import Environment
from composer_replication.rollout.python_tasks import (
    DEFAULT_TASKS_PATH,
    PythonTask,
    PythonTaskEnvironment,
    extract_code,
    load_bundled_tasks,
)

ADD = PythonTask(
    task_id="add", prompt="Write add(a, b). Return the sum.", entry_point="add",
    reference_solution="def add(a, b):\n    return a + b\n",
    tests="def test_a():\n    assert add(1, 2) == 3\n\ndef test_b():\n    assert add(0, 0) == 0\n",
)


@pytest.fixture(scope="module")
def env():
    return PythonTaskEnvironment([ADD], timeout_s=2.0)


def answer(code: str) -> str:
    return f"Here you go:\n```python\n{code}```\n"


def test_bundled_tasks_load_and_reference_solutions_pass():
    tasks = load_bundled_tasks()
    assert len(tasks) >= 8 and DEFAULT_TASKS_PATH.name == "python_tasks.jsonl"
    env = PythonTaskEnvironment(tasks)
    assert isinstance(env, Environment)
    for prompt in env.prompts():
        s = env.score(prompt, prompt.reference)
        assert s.reward == 1.0 and s.error_kind is None, (prompt.prompt_id, s)
        assert s.details["n_total"] >= 4


def test_bundled_tests_reject_a_trivial_answer():
    env = PythonTaskEnvironment(load_bundled_tasks()[:3])
    for prompt in env.prompts():
        entry = prompt.metadata["entry_point"]
        s = env.score(prompt, answer(f"def {entry}(*args):\n    return None\n"))
        assert s.reward < 1.0 and s.error_kind == "runtime_error"


def test_prompt_shape(env):
    (p,) = env.prompts()
    assert p.messages[0]["role"] == "system" and p.messages[1] == {"role": "user", "content": ADD.prompt}
    assert p.metadata["tests"] == ADD.tests


def test_partial_credit_and_runtime_error(env):
    s = env.score(env.prompts()[0], answer("def add(a, b):\n    return a * b\n"))
    assert s.reward == pytest.approx(0.5) and s.error_kind == "runtime_error"
    assert "AssertionError" in s.error_meta["error_message"]
    assert s.error_meta["tool_name"] == "python" and s.error_meta["intent"] == "Write add(a, b)"


def test_syntax_error_is_other(env):
    s = env.score(env.prompts()[0], answer("def add(a, b) return a + b\n"))
    assert s.reward == 0.0 and s.error_kind == "other" and "SyntaxError" in s.error_meta["error_message"]


def test_type_error_is_type_error(env):
    s = env.score(env.prompts()[0], answer("def add(a):\n    return a\n"))
    assert s.reward == 0.0 and s.error_kind == "type_error"


def test_no_code_is_other(env):
    s = env.score(env.prompts()[0], "```python\n```")
    assert s.reward == 0.0 and s.error_kind == "other" and "no code" in s.error_meta["error_message"]


def test_timeout_is_runtime_error():
    env = PythonTaskEnvironment([ADD], timeout_s=0.5)
    s = env.score(env.prompts()[0], answer("while True:\n    pass\n"))
    assert s.reward == 0.0 and s.error_kind == "runtime_error" and s.details["timed_out"]
    assert "timed out" in s.error_meta["error_message"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("```python\nx = 1\n```", "x = 1\n"),
        ("```py\nx = 1\n```\ntext\n```python\ny = 2\n```", "y = 2\n"),
        ("```\nz = 3\n```", "z = 3\n"),
        ("```python\nw = 4\n", "w = 4\n"),  # unclosed (truncated) fence
        ("[THINKING] hmm\nv = 5", "v = 5\n"),
        ("```text\nnope\n```\n```python\nyes = 1\n```", "yes = 1\n"),
    ],
)
def test_extract_code(text, expected):
    assert extract_code(text) == expected


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="unique"):
        PythonTaskEnvironment([ADD, ADD])
    with pytest.raises(ValueError, match="no tasks"):
        PythonTaskEnvironment([])
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_bundled_tasks(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"task_id": "x"}) + "\n")
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_bundled_tasks(bad)
    env = PythonTaskEnvironment([ADD])
    p = env.prompts()[0]
    p.metadata.pop("tests")
    with pytest.raises(ValueError, match="no tests"):
        env.score(p, "x = 1")

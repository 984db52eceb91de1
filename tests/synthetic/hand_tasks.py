"""The executable tasks of the five hand-written bundled sessions (``sessions/train/fix-*.jsonl``).

Each session was written by hand, so its task is too: the repository as the session found it (the files its
Reads showed, the tests its runs exercised), the session's test command, and its successful tool calls as
``solution_actions`` (paths relative to the workspace). ``generate.task_records`` adds them to the generated
sessions' tasks; ``tests/core/test_bundled_data.py`` checks that every task fails before its solution and
passes after it, in the sandbox.
"""

from __future__ import annotations

from typing import Any

_PYPROJECT = '[tool.pytest.ini_options]\npythonpath = [".", "src"]\n'


def _pytest(test: str) -> list[str]:
    return ["env", "PYTHONHASHSEED=0", "python", "-m", "pytest", "-q", test]


def _edit(path: str, old: str, new: str) -> dict[str, Any]:
    return {"name": "Edit", "input": {"file_path": path, "old_string": old, "new_string": new}}


def _bash(command: str, description: str) -> dict[str, Any]:
    return {"name": "Bash", "input": {"command": command, "description": description}}


CONFIG = """import json


def load_config(path):
    with open(path) as f:
        data = json.load(f)
    retries = data["retries"]
    timeout = data.get("timeout", 30)
    return {"retries": retries, "timeout": timeout}
"""
CONFIG_TESTS = """from app.config import load_config


def test_retries_default(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("{}")
    assert load_config(p)["retries"] == 3


def test_timeout_default(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"retries": 1}')
    assert load_config(p)["timeout"] == 30


def test_retries_type(tmp_path):
    p = tmp_path / "c.json"
    p.write_text('{"retries": "5"}')
    assert load_config(p)["retries"] == 5
"""
DATES = '''from datetime import datetime


def parse_iso(value: str) -> datetime:
    """Parse an ISO-8601 timestamp."""
    return datetime.fromisoformat(value)
'''
DATES_TESTS = """from datetime import timezone

from utils.dates import parse_iso


def test_zulu_suffix():
    dt = parse_iso("2024-05-01T12:00:00Z")
    assert dt.tzinfo == timezone.utc and dt.hour == 12


def test_lowercase_zulu_suffix():
    assert parse_iso("2024-05-01T12:00:00z").tzinfo == timezone.utc


def test_offset_kept():
    assert parse_iso("2024-05-01T12:00:00+02:00").utcoffset().seconds == 7200
"""
MEMO = """import functools


def memoize(fn):
    cache = {}

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if args not in cache:
            cache[args] = fn(*args, **kwargs)
        return cache[args]

    return wrapper
"""
MEMO_TESTS = """from memo.core import memoize


def test_kwargs_are_part_of_the_key():
    @memoize
    def f(x, scale=1):
        return x * scale

    assert f(2) == 2
    assert f(2, scale=3) == 6


def test_unhashable_kwarg():
    @memoize
    def g(x, items=()):
        return x + len(items)

    assert g(1, items=[1, 2]) == 3
"""
PAGER = '''"""Split a list into pages."""


def paginate(items, page_size):
    n_pages = len(items) // page_size
    return [items[i * page_size:(i + 1) * page_size] for i in range(n_pages)]
'''
PAGER_TESTS = """import pytest

from pager import paginate


def test_partial_last_page():
    assert paginate(list(range(10)), 3)[-1] == [9]


def test_exact_pages():
    assert paginate(list(range(6)), 3) == [[0, 1, 2], [3, 4, 5]]


def test_page_size_zero():
    with pytest.raises(ValueError):
        paginate([1, 2], 0)


def test_empty():
    assert paginate([], 4) == []
"""
SLUG = """def slugify(text):
    return "-".join(text.lower().split())
"""
SLUG_TESTS = """from textkit.slug import slugify


def test_punctuation():
    assert slugify("Hello, World!") == "hello-world"


def test_spaces():
    assert slugify("a  b") == "a-b"


def test_lowercase():
    assert slugify("ABC") == "abc"


def test_hyphen_kept():
    assert slugify("well-known") == "well-known"


def test_digits_kept():
    assert slugify("Top 10") == "top-10"


def test_empty():
    assert slugify("") == ""
"""
_SLUG_OLD = 'def slugify(text):\n    return "-".join(text.lower().split())'
_SLUG_NEW = 'import re\n\n\ndef slugify(text):\n    text = re.sub(r"[^\\w\\s-]", "", text.lower())\n    return "-".join(text.split())'

HAND_TASKS: list[dict[str, Any]] = [
    {"task_id": "fix-config-defaults", "cwd": "/home/dev/svc",
     "instruction": "Loading a config file without a `retries` key crashes with KeyError. It should default to 3.",
     "files": {"app/config.py": CONFIG, "tests/test_config.py": CONFIG_TESTS, "pyproject.toml": _PYPROJECT},
     "test_command": _pytest("tests/test_config.py"),
     "solution_actions": [
         {"name": "Read", "input": {"file_path": "app/config.py"}},
         _edit("app/config.py", '    retries = data["retries"]', '    retries = data.get("retries", 3)'),
         _edit("app/config.py", '    retries = data.get("retries", 3)', '    retries = int(data.get("retries", 3))'),
         {"name": "Bash", "input": {"command": "python -m pytest tests/test_config.py -q", "timeout": 60000,
                                    "description": "Run the config tests"}}]},
    {"task_id": "fix-iso-date-parsing", "cwd": "/home/dev/tsutil",
     "instruction": "parse_iso('2024-05-01T12:00:00z') raises ValueError (utils/dates.py). Please fix it.",
     "files": {"utils/dates.py": DATES, "tests/test_dates.py": DATES_TESTS, "pyproject.toml": _PYPROJECT},
     "test_command": _pytest("tests/test_dates.py"),
     "solution_actions": [
         {"name": "Grep", "input": {"pattern": "def parse_iso", "output_mode": "content", "-n": True}},
         {"name": "Read", "input": {"file_path": "utils/dates.py"}},
         _bash("python --version", "Show the Python version"),
         _edit("utils/dates.py", "    return datetime.fromisoformat(value)",
               '    if value.endswith(("Z", "z")):\n        value = value[:-1] + "+00:00"\n'
               "    return datetime.fromisoformat(value)"),
         _bash("python -m pytest tests/test_dates.py -q", "Run the date tests")]},
    {"task_id": "fix-memoize-kwargs", "cwd": "/home/dev/memo",
     "instruction": "memoize() returns stale results when the same positional args are passed with different "
                    "keyword args. Can you fix it?",
     "files": {"memo/__init__.py": "", "memo/core.py": MEMO, "tests/test_core.py": MEMO_TESTS,
               "pyproject.toml": _PYPROJECT},
     "test_command": _pytest("tests"),
     "solution_actions": [
         {"name": "Read", "input": {"file_path": "memo/core.py"}},
         {"name": "Read", "input": {"file_path": "tests/test_core.py"}},
         _edit("memo/core.py", "        if args not in cache:\n            cache[args] = fn(*args, **kwargs)\n"
               "        return cache[args]", "        key = (args, tuple(sorted(kwargs.items())))\n"
               "        if key not in cache:\n            cache[key] = fn(*args, **kwargs)\n        return cache[key]"),
         _edit("memo/core.py", "        key = (args, tuple(sorted(kwargs.items())))\n        if key not in cache:",
               "        key = (args, tuple(sorted(kwargs.items())))\n        try:\n            hash(key)\n"
               "        except TypeError:  # unhashable arguments: no caching\n            return fn(*args, **kwargs)\n"
               "        if key not in cache:"),
         _bash("python -m pytest -q", "Run the test suite")]},
    {"task_id": "fix-pagination-off-by-one", "cwd": "/home/dev/pager",
     "instruction": "The last item is missing when I paginate results: `paginate(list(range(10)), page_size=3)` "
                    "gives 3 pages instead of 4. Can you fix it?",
     "files": {"src/pager.py": PAGER, "tests/test_pager.py": PAGER_TESTS, "pyproject.toml": _PYPROJECT},
     "test_command": _pytest("tests/test_pager.py"),
     "solution_actions": [
         {"name": "Grep", "input": {"pattern": "def paginate", "path": ".", "output_mode": "content", "-n": True}},
         {"name": "Read", "input": {"file_path": "src/pager.py"}},
         _edit("src/pager.py", "    n_pages = len(items) // page_size",
               "    n_pages = -(-len(items) // page_size)  # ceiling: keep a partial last page"),
         _edit("src/pager.py", "def paginate(items, page_size):\n", "def paginate(items, page_size):\n"
               '    if page_size < 1:\n        raise ValueError(f"page_size must be >= 1, got {page_size}")\n'),
         _bash("python -m pytest tests/test_pager.py -q", "Run the pager tests")]},
    {"task_id": "fix-slugify-punctuation", "cwd": "/home/dev/textkit",
     "instruction": "`slugify('Hello, World!')` returns 'hello,-world!'; punctuation should be stripped. Please fix it.",
     "files": {"textkit/__init__.py": "", "textkit/slug.py": SLUG, "build/lib/textkit/slug.py": SLUG,
               "tests/test_slug.py": SLUG_TESTS, "pyproject.toml": _PYPROJECT},
     "test_command": _pytest("tests/test_slug.py"),
     "solution_actions": [
         {"name": "Grep", "input": {"pattern": "def slugify", "output_mode": "content", "-n": True}},
         {"name": "Read", "input": {"file_path": "textkit/slug.py"}},
         _edit("textkit/slug.py", _SLUG_OLD, _SLUG_NEW),
         _bash("python -m pytest tests/test_slug.py -q", "Run the slug tests")]},
]
"""The five hand-written sessions' tasks (all in the train split, as their sessions are)."""

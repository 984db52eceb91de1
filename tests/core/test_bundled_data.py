"""The bundled synthetic sessions: the generator (tests/synthetic/generate.py) is deterministic, its sessions are
valid Claude Code traces with tool calls and real-looking failures, the split holds out whole sessions, the bundle
is its output, and every session's task (its bug as data) fails before its fix and passes after it."""

from __future__ import annotations

import importlib
import json
import runpy
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from composer_replication.actions import parse_action
from composer_replication.data import bundled_path, resolve_bundled
from composer_replication.ingestion import ClaudeCodeIngester
from composer_replication.ingestion.registry import detect_format

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "synthetic"))
import generate  # noqa: E402  (tests/synthetic/generate.py)

SESSIONS = Path(__file__).resolve().parents[2] / "composer_replication" / "data" / "sessions"


@pytest.fixture(scope="module")
def generated():
    return generate.generate_sessions()


def _records(sessions: dict) -> dict:
    return {split: {stem: s.records for stem, s in d.items()} for split, d in sessions.items()}


def test_generator_is_deterministic_and_the_seed_matters(generated):
    assert _records(generate.generate_sessions()) == _records(generated)
    assert _records(generate.generate_sessions(seed=1)) != _records(generated)


def test_bundled_files_are_the_generators_output(generated):
    for split in ("train", "heldout"):
        bundled = {p.stem: p.read_bytes() for p in (SESSIONS / split).glob("syn-*.jsonl")}
        assert sorted(bundled) == sorted(generated[split]), (
            f"sessions/{split} differs from the generator; rerun "
            "python tests/synthetic/generate.py --out composer_replication/data/sessions"
        )
        for stem, session in generated[split].items():
            assert bundled[stem] == generate.session_bytes(session.records), stem
    assert not list(SESSIONS.glob("*.jsonl"))  # every session is in a split


def test_split_sizes_and_no_shared_bug(generated):
    train, held = sorted((SESSIONS / "train").glob("*.jsonl")), sorted((SESSIONS / "heldout").glob("*.jsonl"))
    assert len(train) + len(held) >= 40 and len(held) >= 8
    assert sum(p.stat().st_size for p in train + held) < 3_000_000
    fn = lambda p: p.stem.split("-", 2)[-1]  # noqa: E731 - syn-NNN-<function>
    assert not {fn(p) for p in held} & {fn(p) for p in train}  # a held-out bug is never a training bug
    assert set(generated["heldout"]).isdisjoint(generated["train"])


def test_bundled_globs_resolve_through_package_data():
    assert Path(resolve_bundled("bundled:sessions/heldout/*.jsonl")).parent == bundled_path("sessions/heldout")
    assert resolve_bundled("runs/x.jsonl") == "runs/x.jsonl"
    with pytest.raises(FileNotFoundError, match="no bundled data matches"):
        bundled_path("sessions/nowhere/*.jsonl")


def test_sessions_ingest_cleanly_with_tool_calls_and_failures():
    states, kinds, tools, failed_runs = [], Counter(), Counter(), 0
    for split in ("train", "heldout"):
        for path in sorted((SESSIONS / split).glob("syn-*.jsonl")):
            assert detect_format(path) == "claude_code"
            ing = ClaudeCodeIngester()
            got = list(ing.ingest(path))
            st = ing.last_stats
            assert st.skipped_truncated_lines == 0 and st.skipped_unknown == 0 and not st.version_warnings
            assert st.n_missing_results == 0 and st.n_orphan_results == 0
            assert 5 <= len(got) <= 14, path.name
            assert "[TOOL_USE]" not in got[-1]["student_action"]  # a session ends by reporting
            states += got
    for s in states:
        kinds[s.get("error_kind")] += 1
        calls = [b for b in parse_action(s["student_action"]) if b.kind == "tool_use"]
        assert all(b.arguments_valid for b in calls)
        tools.update(b.name for b in calls)
        failed_runs += any(m["role"] == "tool" and "FAILED tests/" in m["content"] for m in s["messages"][-1:])
    assert set(tools) == {"Read", "Edit", "Write", "Bash", "Grep", "Search"}
    assert sum("[TOOL_USE]" in s["student_action"] for s in states) > 250
    assert kinds["runtime_error"] >= 10 and kinds["type_error"] >= 5 and kinds["tool_not_found"] >= 3
    assert failed_runs >= 5  # pytest failures with tracebacks precede some actions
    assert len({s["student_action"] for s in states}) > 0.8 * len(states)  # varied, not one template


def _run_tests(root: Path, files: dict[str, str], test_rel: str, names: list[str], tmp: Path) -> list[bool]:
    """Write ``files`` under ``root`` and run the named tests of ``test_rel`` in-process: passed or not, each."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    sys.path[:0] = [str(root), str(root / "src")]
    importlib.invalidate_caches()
    try:
        ns = runpy.run_path(str(root / test_rel))
        passed = []
        for name in names:
            try:
                ns[name](**({"tmp_path": tmp} if "tmp_path" in ns[name].__code__.co_varnames else {}))
                passed.append(True)
            except Exception:  # noqa: BLE001 - a failing test
                passed.append(False)
        return passed
    finally:
        del sys.path[:2]
        for name in [n for n, m in sys.modules.items() if str(root) in str(getattr(m, "__file__", None) or getattr(m, "__path__", ""))]:
            del sys.modules[name]


def _exit_code(argv: list[str], cwd: Path) -> int:
    argv = [sys.executable if a == "python" else a for a in argv]
    return subprocess.run(argv, cwd=cwd, capture_output=True, timeout=120).returncode


def test_every_task_fails_before_its_fix_and_passes_after(tmp_path):
    every_bug = sum(len(variants) for variants, _ in generate.FAMILIES.values())
    tasks = [s.task for split in generate.generate_sessions(num_sessions=every_bug).values() for s in split.values()]
    assert len(tasks) == every_bug
    for i, task in enumerate(tasks):
        test_rel = task["test_command"][-1]
        assert task["test_command"][:5] == ["env", "PYTHONHASHSEED=0", "python", "-m", "pytest"] and test_rel in task["files"]
        before = _run_tests(tmp_path / f"b{i}", task["files"], test_rel, task["tests"], tmp_path)
        after = _run_tests(tmp_path / f"a{i}", {**task["files"], **task["fixed_files"]}, test_rel, task["tests"], tmp_path)
        if task["family"] == "dedupe_order":  # list(set(...)): in-process the order depends on this process's hash
            before = [_exit_code(task["test_command"], tmp_path / f"b{i}") == 0]  # passed? the command fixes the seed
            assert _exit_code(task["test_command"], tmp_path / f"a{i}") == 0
        assert before[0] is False and all(after), task["task_id"]
        edits = [a for a in task["solution_actions"] if a["name"] == "Edit" and "new_string" in a["input"]]
        module = next(iter(task["fixed_files"]))
        assert edits[-1]["input"]["file_path"] == module  # relative to the workspace
        assert task["files"][module].replace(edits[-1]["input"]["old_string"], edits[-1]["input"]["new_string"]) \
            == task["fixed_files"][module]  # the recorded fix is the fix


def test_cli_writes_the_splits_and_refuses_bad_counts(tmp_path, capsys):
    assert generate.main(["--out", str(tmp_path), "--num-sessions", "14", "--num-heldout", "2", "--seed", "3"]) == 0
    assert len(list((tmp_path / "train").glob("syn-*.jsonl"))) == 12
    assert len(list((tmp_path / "heldout").glob("syn-*.jsonl"))) == 2
    assert generate.main(["--out", str(tmp_path), "--num-heldout", "40"]) == 2
    assert "'num_heldout' must be in [0, 12]" in capsys.readouterr().err


# ---------------------------------------------------------------------------- the bundled agentic tasks
TASKS = Path(__file__).resolve().parents[2] / "composer_replication" / "data" / "tasks" / "agentic"


def test_bundled_tasks_are_the_generators_output_split_as_the_sessions():
    from composer_replication.rollout.agent import load_tasks

    records = generate.task_records()
    for split in ("train", "heldout"):
        lines = (TASKS / f"{split}.jsonl").read_text(encoding="utf-8").splitlines()
        assert [json.loads(line) for line in lines] == records[split], (
            f"tasks/agentic/{split}.jsonl differs from the generator; rerun python tests/synthetic/generate.py "
            "--out composer_replication/data/sessions --tasks-out composer_replication/data/tasks/agentic")
        tasks = load_tasks(TASKS / f"{split}.jsonl")
        assert sorted(t.task_id for t in tasks) == sorted(p.stem for p in (SESSIONS / split).glob("*.jsonl"))
    assert len(records["train"]) >= 40 and len(records["heldout"]) >= 8


@pytest.mark.slow
@pytest.mark.parametrize("split", ["train", "heldout"])
def test_every_bundled_task_fails_before_its_solution_and_passes_after_in_the_sandbox(split, tmp_path):
    from composer_replication.rollout.agent import Episode, EpisodeConfig, load_tasks, run_task
    from composer_replication.rollout.sandbox import os_sandbox_status

    if not os_sandbox_status()[0]:
        pytest.skip(f"no OS sandbox here: {os_sandbox_status()[1]}")
    with Episode(EpisodeConfig(workdir=str(tmp_path))) as episode:
        for task in load_tasks(TASKS / f"{split}.jsonl"):
            unsolved = run_task(episode, task, policy="none")
            assert not unsolved["solved"] and unsolved["reward"] < 1.0, task.task_id
            solved = run_task(episode, task, policy="solution")
            assert solved["solved"] and solved["reward"] == 1.0 and solved["tool_errors"] == 0, (task.task_id, solved)

"""The bundled synthetic sessions: the generator is deterministic, its sessions are valid Claude Code traces
with tool calls and real-looking failures, the split holds out whole sessions, and the bundle is its output."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from composer_replication.actions import parse_action
from composer_replication.data import bundled_path, resolve_bundled
from composer_replication.data.generate_sessions import generate_sessions, main, session_bytes
from composer_replication.ingestion import ClaudeCodeIngester, detect_format

SESSIONS = Path(__file__).resolve().parents[2] / "composer_replication" / "data" / "sessions"


@pytest.fixture(scope="module")
def generated():
    return generate_sessions()


def test_generator_is_deterministic_and_the_seed_matters(generated):
    again = generate_sessions()
    assert generated == again
    other = generate_sessions(seed=1)
    assert other != generated


def test_bundled_files_are_the_generators_output(generated):
    for split in ("train", "heldout"):
        bundled = {p.stem: p.read_bytes() for p in (SESSIONS / split).glob("syn-*.jsonl")}
        assert sorted(bundled) == sorted(generated[split]), (
            f"sessions/{split} differs from the generator; rerun "
            "python -m composer_replication.data.generate_sessions --out composer_replication/data/sessions"
        )
        for stem, records in generated[split].items():
            assert bundled[stem] == session_bytes(records), stem
    assert not list(SESSIONS.glob("*.jsonl"))  # every session is in a split


def test_split_sizes_and_no_shared_bug():
    train, held = sorted((SESSIONS / "train").glob("*.jsonl")), sorted((SESSIONS / "heldout").glob("*.jsonl"))
    assert len(train) + len(held) >= 40 and len(held) >= 8
    assert sum(p.stat().st_size for p in train + held) < 3_000_000
    fn = lambda p: p.stem.split("-", 2)[-1]  # noqa: E731 - syn-NNN-<function>
    assert not {fn(p) for p in held} & {fn(p) for p in train}  # a held-out bug is never a training bug
    gen = generate_sessions()
    assert set(gen["heldout"]).isdisjoint(gen["train"])


def test_bundled_globs_resolve_through_package_data():
    assert Path(resolve_bundled("bundled:sessions/heldout/*.jsonl")).parent == bundled_path("sessions/heldout")
    with pytest.raises(FileNotFoundError, match="no bundled data matches"):
        bundled_path("sessions/nowhere/*.jsonl")


def test_sessions_ingest_cleanly_with_tool_calls_and_failures(generated):
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
        blocks = parse_action(s["student_action"])
        calls = [b for b in blocks if b.kind == "tool_use"]
        assert all(b.arguments_valid for b in calls)
        tools.update(b.name for b in calls)
        failed_runs += any(m["role"] == "tool" and "FAILED tests/" in m["content"] for m in s["messages"][-1:])
    assert set(tools) == {"Read", "Edit", "Write", "Bash", "Grep", "Search"}
    assert sum(bool(parse_action(s["student_action"])) and "[TOOL_USE]" in s["student_action"] for s in states) > 250
    assert kinds["runtime_error"] >= 10 and kinds["type_error"] >= 5 and kinds["tool_not_found"] >= 3
    assert failed_runs >= 5  # pytest failures with tracebacks precede some actions
    assert len({s["student_action"] for s in states}) > 0.8 * len(states)  # varied, not one template


def test_cli_writes_the_splits_and_refuses_bad_counts(tmp_path, capsys):
    assert main(["--out", str(tmp_path), "--num-sessions", "14", "--num-heldout", "2", "--seed", "3"]) == 0
    assert len(list((tmp_path / "train").glob("syn-*.jsonl"))) == 12
    assert len(list((tmp_path / "heldout").glob("syn-*.jsonl"))) == 2
    assert main(["--out", str(tmp_path), "--num-heldout", "40"]) == 2
    assert "'num_heldout' must be in [0, 12]" in capsys.readouterr().err

"""End to end: the agentic_tiny preset through real Monarch processes (episodes in sandboxed workspaces).

One uninterrupted run is shared by the module; the resume test restarts a copy of its folder.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from recipe_helpers import run_recipe

from composer_replication.atomic import atomic_write_text
from composer_replication.engine.checkpoint import load_checkpoint
from composer_replication.rollout.sandbox import os_sandbox_status

pytestmark = [pytest.mark.slow, pytest.mark.monarch,
              pytest.mark.skipif(not os_sandbox_status()[0], reason=f"no OS sandbox: {os_sandbox_status()[1]}")]
EVAL_KEYS = ("eval/solve_rate", "eval/mean_reward", "eval/mean_turns", "eval/tool_error_rate")


@pytest.fixture(scope="module")
def agentic_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("agentic") / "run"
    rc, out, wall = run_recipe("--config", "agentic_tiny", f"run.dir={run_dir}")
    return rc, out, run_dir, wall


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def test_agentic_tiny_trains_on_episodes_and_evaluates_on_held_out_tasks(agentic_run):
    rc, out, run_dir, wall = agentic_run
    assert rc == 0, out[-3000:]
    assert "2 agentic tasks, 2 held out" in out and not (run_dir / "teacher_ledger.jsonl").exists()
    episodes = _lines(run_dir / "episodes.jsonl")
    assert [e["step"] for e in episodes] == [0] * 4 + [1] * 4 + [2] * 4  # 2 tasks x 2 episodes per step
    for e in episodes:
        assert {"rank", "task_id", "group", "reward", "solved", "end", "turns", "components"} <= set(e)
        assert e["turns"] and all({"turn", "action", "calls", "error_kind"} <= set(t) for t in e["turns"])
        assert {"solved", "progress", "penalty", "tool_calls", "tool_errors"} <= set(e["components"])
    rows = [r for r in _lines(run_dir / "metrics.jsonl") if "loss/total" in r]
    assert len(rows) == 3
    for r in rows:
        assert {"rollout/turns", "rollout/solve_rate", "rollout/tool_errors", "rollout/num_episodes"} <= set(r)
        assert r["rollout/num_episodes"] == 4 and "episodes" not in r
    assert any(r["loss/dpo"] for r in rows)  # the tasks' solutions against the student's turns
    summary = json.loads((run_dir / "summary.json").read_text())
    for key in ("eval_start", "eval_end"):
        assert all(isinstance(summary[key][k], float) for k in EVAL_KEYS), summary[key]
        assert summary[key]["eval/num_episodes"] == 2  # the held-out tasks, one greedy episode each
    assert wall < 120, f"agentic_tiny took {wall:.0f} s; the preset promises under 2 minutes"


def test_an_agentic_resume_matches_the_uninterrupted_run(agentic_run, tmp_path):
    rc, out, run_dir, _ = agentic_run
    assert rc == 0, out[-3000:]
    copy = tmp_path / "resumed"
    shutil.copytree(run_dir, copy)
    shutil.rmtree(copy / "checkpoints" / "step_000003")
    atomic_write_text(copy / "checkpoints" / "latest", "step_000002\n")
    rc2, out2, _ = run_recipe("--resume", str(copy), "run.display=plain")
    assert rc2 == 0, out2[-3000:]
    assert "resumed at step 2" in out2
    assert [e["step"] for e in _lines(copy / "episodes.jsonl")] == [0] * 4 + [1] * 4 + [2] * 4  # none twice
    full = load_checkpoint(run_dir / "checkpoints" / "step_000003")["model"]
    resumed = load_checkpoint(copy / "checkpoints" / "step_000003")["model"]
    assert all(torch.equal(full[k], resumed[k]) for k in full)


def test_bad_task_files_stop_before_anything_spawns(tmp_path):
    rc, out, _ = run_recipe("--config", "agentic_tiny", f"run.dir={tmp_path / 'a'}", "data.tasks=no/such.jsonl")
    assert rc == 2 and "'data.tasks' file 'no/such.jsonl' does not exist" in out, out[-2000:]
    bad = tmp_path / "tasks.jsonl"
    bad.write_text(json.dumps({"task_id": "t", "instruction": "fix", "files": {"../x.py": ""},
                               "test_command": ["true"]}) + "\n")
    rc, out, _ = run_recipe("--config", "agentic_tiny", f"run.dir={tmp_path / 'b'}", f"data.tasks={bad}")
    assert rc == 2 and f"{bad}:1" in out and "`files`" in out, out[-2000:]
    assert not (tmp_path / "b" / "metrics.jsonl").exists()


def test_agentic_episodes_train_under_diloco_replicas(tmp_path):
    run_dir = tmp_path / "run"
    rc, out, _ = run_recipe("--config", "agentic_tiny", f"run.dir={run_dir}", "diloco.replicas=2", "diloco.sync_every=2",
                            "student.num_steps=2", "data.max_tasks=4", timeout=600)
    assert rc == 0, out[-3000:]
    episodes = _lines(run_dir / "episodes.jsonl")
    assert sorted({e["rank"] for e in episodes}) == [0, 1] and len(episodes) == 2 * 2 * 4  # steps x replicas x eps
    by_rank = {r: {e["task_id"] for e in episodes if e["rank"] == r} for r in (0, 1)}
    assert not by_rank[0] & by_rank[1]  # each replica trains its own shard of the tasks
    summary = json.loads((run_dir / "summary.json").read_text())
    digests = summary["replica_param_sha256"]
    assert len(digests) == 2 and len(set(digests.values())) == 1  # one model after the sync

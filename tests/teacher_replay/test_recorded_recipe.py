"""The recorded teacher in the Monarch recipe: the presets, and one end-to-end tiny run's pairs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from replay_helpers import REPO

from composer_replication.replaysim.normalize import RULES, degeneracy
from recipes.monarch.config import load_config


def test_presets_distil_the_recorded_actions():
    for preset in ("single_node", "tiny", "gpu_single_node"):
        cfg = load_config(preset)
        assert cfg.teachers.slugs == ["recorded"] and cfg.teachers.agreement_threshold == 1
        spec = cfg.teacher_specs()[0]
        assert spec["slug"] == "recorded" and spec["input_per_mtok"] == spec["output_per_mtok"] == 0.0
        assert cfg.rejected_from_rollout()  # the rejected side: the training step's own rollouts


def test_student_samples_setting():
    frontier = ["teachers.slugs=[a/one, b/two]", "teachers.agreement_threshold=2"]
    assert not load_config("tiny", frontier).rejected_from_rollout()  # frontier teachers: rejected = recorded action
    assert load_config("tiny", [*frontier, "teachers.student_samples=always"]).rejected_from_rollout()
    both = load_config(
        "tiny",
        [
            "teachers.slugs=[recorded, openai/gpt-5]",
            "teachers.agreement_threshold=2",
            "teachers.input_per_mtok=1.25",
        ],
    )
    assert [s["input_per_mtok"] for s in both.teacher_specs()] == [0.0, 1.25] and both.rejected_from_rollout()
    with pytest.raises(ValueError, match="lists 'recorded' but 'teachers.student_samples' is 'never'"):
        load_config("tiny", ["teachers.student_samples=never"])
    with pytest.raises(ValueError, match="unknown key 'student.rollout.pair_refresh_every'"):
        load_config("tiny", ["student.rollout.pair_refresh_every=2"])  # retired: no refresh, zero staleness


@pytest.mark.slow
@pytest.mark.monarch
def test_tiny_run_trains_on_well_formed_recorded_pairs(tmp_path):
    """The tiny preset end to end: every chosen is a well-formed recorded action, its rejected side left to the
    training step's rollouts."""
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "recipes.monarch.run", "--config", "tiny", f"run.dir={run_dir}", "run.display=none",
         "run.evaluate=false", "student.num_steps=3", "run.checkpoint_every=0"],
        cwd=REPO, capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    pairs = [json.loads(line) for line in (run_dir / "pairs.jsonl").read_text().splitlines()]
    assert pairs
    for p in pairs:
        meta = p["metadata"]
        assert p["chosen"] == meta["recorded_action"] and meta["teachers"] == ["recorded"]
        assert meta["rejected_source"] == "rollout" and p["rejected_messages"] == []  # drawn by each step
        assert degeneracy(p["chosen"], recorded_action=meta["recorded_action"]) is None
    summary = json.loads((run_dir / "summary.json").read_text())
    assert {f"replay/dropped/{rule}" for rule in RULES} <= summary.keys()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [m for m in rows if "replay/num_pairs" in m]
    assert len(steps) == 3 and all(m["replay/num_pairs"] + m["replay/pairs_agreed"] == 2.0 for m in steps)

"""End to end: the tiny preset through real Monarch processes (teacher, trainer, reducer meshes).

One uninterrupted run is shared by the module; the resume and fault tests restart from a copy of its
folder (so they skip the replay: ``--resume`` reads ``pairs.jsonl`` back).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
from recipe_helpers import REPO, alive, run_recipe, session_overrides

from composer_replication.atomic import atomic_write_text
from composer_replication.engine import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.monarch]

CHANNELS = ("grpo", "sdpo_jsd", "trace_replay_dpo")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tiny") / "run"
    rc, out, wall = run_recipe("--config", "tiny", f"run.dir={run_dir}", "run.display=plain", *session_overrides())
    return rc, out, run_dir, wall


def _rewind(src, dst, step: int) -> None:
    """Copy a run folder and drop every checkpoint after ``step`` (as if the run had been killed there)."""
    shutil.copytree(src, dst)
    for ckpt in (dst / "checkpoints").glob("step_*"):
        if int(ckpt.name.split("_")[1]) > step:
            shutil.rmtree(ckpt)
    atomic_write_text(dst / "checkpoints" / "latest", f"step_{step:06d}\n")


def test_tiny_run_completes_with_every_channel(tiny_run):
    rc, out, run_dir, _ = tiny_run
    assert rc == 0, out[-3000:]
    for name in ("config.yaml", "metrics.jsonl", "pairs.jsonl", "summary.json", "processes.json",
                 "teacher_ledger.jsonl"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [int(m["step"]) for m in lines] == [0, 1, 2, 3]
    for ch in CHANNELS:
        assert any(m[ch] not in (0.0, None) for m in lines), f"channel {ch} was zero at every step"
    assert all("reward_mean" in m and "tokens_per_s" in m and "teacher_spent_usd" in m for m in lines)
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000002", "step_000004"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["n_pairs"] >= 1 and summary["eval"] is not None
    assert "config.yaml" not in out and "step 4/4" in out  # plain display printed the progress
    cfg = (run_dir / "config.yaml").read_text()
    assert str(run_dir) in cfg and "{time}" not in cfg


def test_resume_matches_uninterrupted_run_bit_exact(tiny_run, tmp_path):
    rc, out, run_dir, _ = tiny_run
    assert rc == 0, out[-2000:]
    copy = tmp_path / "resumed"
    _rewind(run_dir, copy, 2)
    rc2, out2, _ = run_recipe("--resume", str(copy), "run.display=plain")
    assert rc2 == 0, out2[-3000:]
    assert "resumed at step 2" in out2
    full = load_checkpoint(run_dir / "checkpoints" / "step_000004")["model"]
    resumed = load_checkpoint(copy / "checkpoints" / "step_000004")["model"]
    assert full.keys() == resumed.keys()
    for k in full:
        assert torch.equal(full[k], resumed[k]), k
    a = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (copy / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in b] == [0, 1, 2, 3]
    for x, y in zip(a, b):
        assert x["total"] == y["total"] and x["reward_mean"] == y["reward_mean"]


@pytest.mark.parametrize("mode,verb", [("raise", "raised an error"), ("exit", "died")])
def test_trainer_failure_is_reported_and_nothing_is_left(tiny_run, tmp_path, mode, verb):
    rc, out, run_dir, _ = tiny_run
    assert rc == 0, out[-2000:]
    copy = tmp_path / f"fault-{mode}"
    _rewind(run_dir, copy, 2)
    t0 = time.monotonic()
    rc2, out2, wall = run_recipe("--resume", str(copy), "run.display=plain", f"mesh.inject_fault=trainer:0:2:{mode}",
                                 "mesh.call_timeout_s=60")
    assert rc2 == 1, out2[-3000:]
    assert f"actor 'trainer' rank 0 {verb}" in out2
    if mode == "raise":
        assert "injected fault" in out2
    else:
        assert "exited with non-zero code 3" in out2
    assert wall < 60 + 120  # the call timeout plus start-up, never a hang
    pids = json.loads((copy / "processes.json").read_text())
    deadline = time.monotonic() + 10
    while any(alive(p) for p in [pids["teacher"], *pids["trainer"]]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in [pids["teacher"], *pids["trainer"]]), pids
    assert time.monotonic() - t0 < 240


@pytest.mark.parametrize("mode,text", [("raise", "raised an error during replay: RuntimeError: injected fault"),
                                       ("exit", "died (its process exited) during replay")])
def test_teacher_failure_names_the_teacher(tmp_path, mode, text):
    rc, out, wall = run_recipe("--config", "tiny", f"run.dir={tmp_path / 'run'}", "run.display=plain",
                               f"mesh.inject_fault=teacher:0:0:{mode}", *session_overrides())
    assert rc == 1, out[-3000:]
    assert f"actor 'teacher' rank 0 {text}" in out
    assert wall < 120


def test_ctrl_c_stops_every_mesh_and_keeps_the_run_resumable(tmp_path):
    """SIGINT mid-training: the controller exits 130, names --resume, and no actor process survives."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "recipes.monarch.run", "--config", "tiny", f"run.dir={run_dir}",
           "run.display=plain", "student.num_steps=500", "run.checkpoint_every=1", *session_overrides()]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, out[-3000:]
    assert f"interrupted; stopping every mesh (resume with --resume {run_dir})" in out
    pids = json.loads((run_dir / "processes.json").read_text())
    deadline = time.monotonic() + 10
    while any(alive(p) for p in [pids["teacher"], *pids["trainer"]]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(alive(p) for p in [pids["teacher"], *pids["trainer"]]), pids
    assert (run_dir / "checkpoints" / "latest").exists()

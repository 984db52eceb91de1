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
from composer_replication.engine.checkpoint import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.monarch]

CHANNELS = ("loss/grpo", "loss/jsd", "loss/dpo")


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
                 "teacher_ledger.jsonl", "report.png"):
        assert (run_dir / name).is_file(), name
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = [m for m in rows if "loss/total" in m]
    assert [int(m["step"]) for m in lines] == [0, 1, 2, 3]
    assert [int(m["step"]) for m in rows if "eval/mean" in m] == [0, 4]  # eval_start and eval_end rows
    for ch in CHANNELS:
        assert any(m[ch] not in (0.0, None) for m in lines), f"channel {ch} was zero at every step"
    assert all("reward/mean" in m and "perf/tokens_per_s" in m and "replay/spent_usd" in m for m in lines)
    pairs = [json.loads(x) for x in (run_dir / "pairs.jsonl").read_text().splitlines()]
    assert pairs and all(p["metadata"]["rejected_source"] == "rollout" for p in pairs)  # drawn from each step's rollouts
    assert all(m["replay/num_pairs"] + m["replay/pairs_agreed"] == 2.0 for m in lines)  # tiny: 2 pairs per step
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000002", "step_000004"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 4 and summary["n_pairs"] >= 1 and summary["eval_end"] is not None
    assert summary["eval_start"].keys() == summary["eval_end"].keys()
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
    assert [m["step"] for m in b if "loss/total" in m] == [0, 1, 2, 3]
    assert [m["step"] for m in b if "eval/mean" in m] == [0, 4]
    for x, y in zip(a, b):
        assert x.get("loss/total") == y.get("loss/total") and x.get("reward/mean") == y.get("reward/mean")


def test_pairs_written_by_the_replay_cli_train_in_the_recipe(tmp_path):
    """`python -m composer_replication.teacher_replay --normalize --out pairs.jsonl` -> `data.pairs=` of the recipe."""
    from composer_replication.ingestion import ingest_any

    states = [dict(s) for s in ingest_any(sorted((REPO / "composer_replication" / "data" / "sessions" / "train").glob("*.jsonl"))[0])][:3]
    (tmp_path / "states.jsonl").write_text("".join(json.dumps(s) + "\n" for s in states))
    cli = subprocess.run([sys.executable, "-m", "composer_replication.teacher_replay", str(tmp_path / "states.jsonl"),
                          "--teachers", "recorded", "--agreement", "1", "--budget", "0",
                          "--ledger", str(tmp_path / "ledger.jsonl"), "--out", str(tmp_path / "pairs.jsonl"),
                          "--normalize"], cwd=REPO, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-2000:]
    written = [json.loads(x) for x in (tmp_path / "pairs.jsonl").read_text().splitlines()]
    assert written and all({"chosen", "rejected", "chosen_messages", "metadata"} <= set(p) for p in written)
    run_dir = tmp_path / "run"
    rc, out, _ = run_recipe("--config", "tiny", f"run.dir={run_dir}", "run.display=plain", "run.evaluate=false",
                            "student.num_steps=1", f"data.pairs={tmp_path / 'pairs.jsonl'}", *session_overrides())
    assert rc == 0, out[-3000:]
    row = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert row["replay/num_pairs"] >= 1 and row["loss/dpo"] != 0.0
    assert [json.loads(x)["state_id"] for x in (run_dir / "pairs.jsonl").read_text().splitlines()] == [
        p["state_id"] for p in written]


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
            # interrupt once a step's checkpoint exists (a Ctrl-C before the first one resumes from step 0)
            if (run_dir / "checkpoints" / "latest").exists() and len(metrics.read_text().splitlines()) >= 2:
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

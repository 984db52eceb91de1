"""The recipe on a real two-node SLURM on loopback (``cluster.py``): submitted through ``monarch.job.SlurmJob``.

The ``slurm`` preset trains one model with a replica per node; with node n2's Monarch host process killed
mid-run, the replica restarts on a fresh worker on n2 and heals; the docs' ``sbatch`` script runs as written;
bad requests exit with one line. After every test no job is left in ``squeue`` and no Python process of the
cluster is left running.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tests" / "recipes"))
from cluster import LocalCluster, free_ports, missing  # noqa: E402
from recipe_helpers import session_overrides  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.monarch]

FAST = ["teachers.slugs=[local:tiny]", "run.display=plain"]


@pytest.fixture(scope="module")
def cluster():
    reason = missing()
    if reason:
        pytest.skip(reason)
    with LocalCluster(2) as c:
        yield c


@pytest.fixture
def clean(cluster):
    """After the test: no job in the queue, no Python process of this cluster left."""
    yield cluster
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (cluster.run("squeue", "-h").strip() or cluster.python_pids()):
        time.sleep(0.5)
    assert cluster.run("squeue", "-h").strip() == ""
    assert cluster.python_pids() == []


def _recipe(cluster: LocalCluster, run_dir: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    env = {**cluster.env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), **(env or {})}
    cmd = [sys.executable, "-m", "recipes.monarch.run", "--config", "slurm", f"run.dir={run_dir}", *FAST,
           f"mesh.slurm.port={free_ports()}", *args, *session_overrides()]
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _check_one_model(run_dir: Path) -> dict:
    summary = json.loads((run_dir / "summary.json").read_text())
    digests = summary["replica_param_sha256"]
    assert digests["0"] == digests["1"]
    last = [r for r in _rows(run_dir) if "diloco/outer_step" in r][-1]
    assert last["diloco/participants"] == 2.0 and last["diloco/param_sha256/0"] == last["diloco/param_sha256/1"]
    assert summary["replica_nodes"] == {"0": "n1", "1": "n2"}
    assert summary["slurm_job_id"].isdigit()
    return summary


@pytest.fixture(scope="module")
def preset_run(cluster, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("slurm") / "run"
    run = _recipe(cluster, run_dir)
    out, _ = run.communicate(timeout=600)
    return run.returncode, out, run_dir


def test_the_slurm_preset_trains_one_model_with_a_replica_per_node(preset_run, clean):
    rc, out, run_dir = preset_run
    assert rc == 0, out[-4000:]
    summary = _check_one_model(run_dir)
    assert f"SLURM job {summary['slurm_job_id']} running on n1, n2" in out
    assert summary["restarts"] == {"0": 0, "1": 0}
    assert list((run_dir / "slurm").glob(f"slurm_{summary['slurm_job_id']}_*.out"))


def test_resume_in_a_new_job_continues_exactly(preset_run, clean, tmp_path):
    rc, out, run_dir = preset_run
    assert rc == 0, out[-2000:]
    copy = tmp_path / "resumed"
    shutil.copytree(run_dir, copy)
    for folder in [copy / "checkpoints", *copy.glob("replicas/rank_*/checkpoints")]:
        shutil.rmtree(folder / "step_000008")
        (folder / "latest").write_text("step_000004\n")
    env = {**clean.env, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "recipes.monarch.run", "--resume", str(copy), "run.display=plain",
                          f"mesh.slurm.port={free_ports()}"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    before, after = (json.loads((d / "summary.json").read_text()) for d in (run_dir, copy))
    assert after["replica_param_sha256"] == before["replica_param_sha256"]  # as if never interrupted
    assert after["slurm_job_id"] != before["slurm_job_id"]


def test_a_killed_node_worker_is_restarted_on_its_node_and_heals(clean, tmp_path):
    run_dir = tmp_path / "run"
    run = _recipe(clean, run_dir, "student.num_steps=24", "mesh.call_timeout_s=20")
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and run.poll() is None:
            if (run_dir / "metrics.jsonl").exists() and any(
                    r.get("step") == 2 and "loss/total" in r for r in _rows(run_dir)):
                break
            time.sleep(0.3)
        assert run.poll() is None, "the run ended before the node could be killed"
        assert clean.kill_node("n2")  # n2's Monarch worker and its actor processes: the host
        out, _ = run.communicate(timeout=500)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, out[-4000:]
    assert re.search(r"replica 1: worker tcp://127\.0\.0\.1:\d+ \(node n2\) lost; moving it to a new worker "
                     r"tcp://127\.0\.0\.1:\d+ \(node n2\)", out), out[-4000:]
    summary = _check_one_model(run_dir)
    assert summary["restarts"] == {"0": 0, "1": 1}
    event = summary["diloco_events"][0]
    assert event["replica"] == 1 and event["kind"] == "timeout" and event["rejoined_step"] > event["step"] >= 3
    rows = _rows(run_dir)
    assert any(r.get("diloco/participants") == 1.0 for r in rows)  # the survivor went on alone
    healed = [r for r in rows if "diloco/outer_step" in r and r["step"] > event["rejoined_step"]]
    assert healed and all(r["diloco/param_sha256/0"] == r["diloco/param_sha256/1"] for r in healed)


def test_more_failures_than_max_restarts_exit_1_and_cancel_the_job(clean, tmp_path):
    run = _recipe(clean, tmp_path / "run", "mesh.inject_fault=trainer:1:3:raise", "diloco.max_restarts=0")
    out, _ = run.communicate(timeout=600)
    assert run.returncode == 1, out[-4000:]
    assert "more than 'diloco.max_restarts' = 0" in out


def test_ctrl_c_cancels_the_job(clean, tmp_path):
    run_dir = tmp_path / "run"
    run = _recipe(clean, run_dir, "student.num_steps=24")
    try:
        deadline = time.monotonic() + 400
        while time.monotonic() < deadline and run.poll() is None and not (
                (run_dir / "metrics.jsonl").exists() and any("loss/total" in r for r in _rows(run_dir))):
            time.sleep(0.3)
        assert run.poll() is None and clean.run("squeue", "-h").strip()  # training, the job running
        run.send_signal(signal.SIGINT)
        out, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 130, out[-3000:]
    assert "interrupted; stopping every mesh" in out


@pytest.mark.parametrize("args,rc,text", [
    (["mesh.slurm.partition=nope"], 2, "error: SLURM partition 'nope' does not exist (partitions: debug); "
                                       "set mesh.slurm.partition"),
    (["mesh.slurm.nodes=3"], 2, "error: the job needs 3 nodes but partition 'debug' has 2"),
    (["mesh.slurm.extra_args=[--no-such-option]"], 2, "error: sbatch refused the job: "),
    (["mesh.slurm.extra_args=[--begin=now+3600]", "mesh.slurm.pending_timeout_s=3"], 1,
     "still PENDING (BeginTime) after 3 s; cancelled it"),
])
def test_a_bad_request_exits_with_one_line_and_leaves_nothing(clean, tmp_path, args, rc, text):
    run = _recipe(clean, tmp_path / "run", *args)
    out, _ = run.communicate(timeout=300)
    assert run.returncode == rc, out[-3000:]
    assert text in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_sbatch_missing_exits_2(tmp_path):
    env = {**os.environ, "PATH": str(Path(sys.executable).parent), "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-m", "recipes.monarch.run", "--config", "slurm",
                          f"run.dir={tmp_path / 'run'}", *FAST, *session_overrides()],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: mesh.launcher is slurm but `sbatch` is not on PATH" in out.stderr


def test_the_docs_sbatch_script_runs_as_written(clean, tmp_path):
    doc = (REPO / "docs" / "diloco.md").read_text()
    script = next(b for b in re.findall(r"```bash\n(.*?)```", doc, re.S) if "#SBATCH" in b)
    (tmp_path / "diloco.sbatch").write_text(script)
    env = {**clean.env, "PYTHON": sys.executable, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    sub = subprocess.run(["sbatch", f"--output={tmp_path}/job.out", str(tmp_path / "diloco.sbatch"),
                          f"run.dir={tmp_path / 'run'}", *FAST, f"mesh.slurm.port={free_ports()}",
                          *session_overrides()], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job_id = sub.stdout.split()[-1]
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and clean.run("squeue", "-h", "-j", job_id, check=False).strip():
        time.sleep(1)
    info = clean.run("scontrol", "-o", "show", "job", job_id)
    assert "JobState=COMPLETED" in info and "ExitCode=0:0" in info, (tmp_path / "job.out").read_text()[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["slurm_job_id"] == job_id and summary["replica_nodes"] == {"0": "n1", "1": "n2"}
    assert summary["replica_param_sha256"]["0"] == summary["replica_param_sha256"]["1"]

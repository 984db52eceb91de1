"""Multi-host on loopback: three `python -m recipes.monarch.worker` processes (two hosts and a spare).

The DiLoCo preset runs one replica per worker; mid-run the second worker's whole process group is killed
(Monarch reports nothing: only the call timeout notices). The controller moves that replica to the spare
worker (a new address), it heals from the survivor, and the run ends with identical replicas.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "recipes"))
from recipe_helpers import alive, session_overrides  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.monarch]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def workers():
    """Three workers on free loopback ports, each its own process group (killed by group at the end)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    procs = []
    for _ in range(3):
        address = f"tcp://127.0.0.1:{_free_port()}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "recipes.monarch.worker", "--address", address],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        procs.append((address, proc))
    try:
        for address, proc in procs:
            line = ""
            deadline = time.monotonic() + 60
            while "worker ready" not in line and time.monotonic() < deadline and proc.poll() is None:
                line = proc.stdout.readline()
            # Monarch may print its own log notice on the same line (no newline between the two writers)
            assert f"worker ready at {address}" in line, line
        yield procs
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_worker_rejects_a_bad_address():
    out = subprocess.run(
        [sys.executable, "-m", "recipes.monarch.worker", "--address", "127.0.0.1:1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--address must look like tcp://HOST:PORT" in out.stderr


def _worker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "recipes.monarch.worker", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60)


def test_worker_refuses_a_non_loopback_bind_without_allow_remote():
    """Anything reaching a worker's port runs code as its user: a non-loopback bind needs --allow-remote."""
    out = _worker("--address", f"tcp://node1.cluster:{_free_port()}@tcp://0.0.0.0:{_free_port()}")
    assert out.returncode == 2 and "not loopback" in out.stderr and "--allow-remote" in out.stderr


def test_worker_refuses_a_ca_monarch_cannot_honour():
    out = _worker("--address", f"tcp://127.0.0.1:{_free_port()}", "--ca", "/etc/ssl/ca.pem")
    assert out.returncode == 2 and "cannot be honoured" in out.stderr and "trust_all_connections" in out.stderr


def test_worker_binds_loopback_by_default_and_says_what_remote_means():
    from recipes.monarch.worker import (
        DEFAULT_ADDRESS,
        check_security,
        is_loopback,
        listen_address,
        parse_args,
        split_address,
    )

    assert listen_address(parse_args([])) == DEFAULT_ADDRESS and is_loopback(split_address(DEFAULT_ADDRESS)[0])
    assert is_loopback("localhost") and not is_loopback("0.0.0.0") and not is_loopback("::")
    assert check_security("127.0.0.1", 26601, allow_remote=False, ca="trust_all_connections") is None
    warning = check_security("0.0.0.0", 26601, allow_remote=True, ca="trust_all_connections")  # nothing is bound
    assert "Any process that can reach port 26601 can run code on this machine as user" in warning


def test_a_lost_host_moves_its_replica_to_a_spare_worker(workers, tmp_path):
    (a0, _), (a1, p1), (spare, _) = workers
    run_dir = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "recipes.monarch.run",
        "--config",
        "multi_host",
        f"run.dir={run_dir}",
        "run.display=plain",
        "teachers.slugs=[local:tiny]",
        f"mesh.workers=[{a0},{a1}]",
        f"mesh.spare_workers=[{spare}]",
        "student.num_steps=24",
        "mesh.call_timeout_s=20",
        *session_overrides(),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    run = subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        metrics, deadline = run_dir / "metrics.jsonl", time.monotonic() + 300
        while time.monotonic() < deadline and run.poll() is None:
            if metrics.exists() and any(
                json.loads(x).get("step") == 4 and "loss/total" in x for x in metrics.read_text().splitlines()
            ):
                break
            time.sleep(0.3)
        assert run.poll() is None, "the run ended before the host could be killed"
        killed_at = time.monotonic()
        os.killpg(p1.pid, signal.SIGKILL)  # the whole "host": worker and its actor processes
        out, _ = run.communicate(timeout=400)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    assert run.returncode == 0, out[-4000:]
    assert f"replica 1: worker {a1} lost; moving it to spare worker {spare}" in out
    assert time.monotonic() - killed_at < 400
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == {"0": 0, "1": 1}
    assert summary["replica_param_sha256"]["0"] == summary["replica_param_sha256"]["1"]
    event = summary["diloco_events"][0]
    assert event["kind"] == "timeout" and event["rejoined_step"] > event["step"]
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    assert any(r.get("diloco/participants") == 1.0 for r in rows)  # the survivor went on alone
    last = [r for r in rows if "diloco/outer_step" in r][-1]
    assert (
        last["diloco/participants"] == 2.0 and last["diloco/param_sha256/0"] == last["diloco/param_sha256/1"]
    )
    assert not alive(p1.pid)

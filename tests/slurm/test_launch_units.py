"""Units of the SLURM launcher without a cluster: the SLURM client commands are faked."""

from __future__ import annotations

import subprocess

import pytest

import meshes.launch as launch
from meshes.hosts import ReplicaHosts
from meshes.launch import LaunchError, SlurmHosts, check_partition, job_state


def _fake(monkeypatch, answers: dict[str, str]) -> list[tuple]:
    calls: list[tuple] = []

    def run(*cmd, timeout=30.0):
        calls.append(cmd)
        for key, out in answers.items():
            if " ".join(cmd).startswith(key):
                if out is None:
                    raise LaunchError(f"`{' '.join(cmd)}` failed")
                return out
        raise AssertionError(f"unexpected command {cmd}")

    monkeypatch.setattr(launch, "_slurm", run)
    return calls


def test_check_partition_names_the_problem_and_the_fix(monkeypatch):
    _fake(monkeypatch, {"sinfo": "debug* 1\ndebug* 1\ngpu 4\n"})
    check_partition(None, 2)  # the default partition, its nodes summed over states
    check_partition("gpu", 4)
    with pytest.raises(LaunchError, match=r"partition 'nope' does not exist \(partitions: debug, gpu\)") as e:
        check_partition("nope", 1)
    assert e.value.exit_code == 2
    with pytest.raises(LaunchError, match="needs 3 nodes but partition 'debug' has 2"):
        check_partition(None, 3)


def test_job_state_falls_back_to_scontrol_once_the_job_left_squeue(monkeypatch):
    _fake(monkeypatch, {"squeue -h -j 7": "RUNNING|None|n[1-2]\n", "scontrol show hostnames n[1-2]": "n1\nn2\n"})
    assert job_state("7") == ("RUNNING", "None", ["n1", "n2"])
    _fake(monkeypatch, {"squeue": "", "scontrol -o show job 8": "JobId=8 JobState=NODE_FAIL Reason=NodeDown x=y"})
    assert job_state("8") == ("NODE_FAIL", "NodeDown", [])
    _fake(monkeypatch, {"squeue": "", "scontrol": None})
    assert job_state("9")[0] == "GONE"


def test_relaunch_starts_a_worker_step_on_the_lost_node_at_a_new_port(monkeypatch, tmp_path):
    _fake(monkeypatch, {"squeue": "RUNNING|None|n[1-2]", "scontrol show hostnames": "n1\nn2\n"})
    steps, popen = [], subprocess.Popen
    monkeypatch.setattr(launch.subprocess, "Popen", lambda cmd, **kw: steps.append(cmd) or popen(["true"]))
    hosts = SlurmHosts("7", ["n1", "n2"], ["tcp://127.0.0.1:100", "tcp://127.0.0.1:101"], 100, "py", str(tmp_path))
    assert hosts.relaunch("tcp://127.0.0.1:101") == "tcp://127.0.0.1:102"
    assert steps[0][:6] == ["srun", "--jobid=7", "--overlap", "--kill-on-bad-exit=0", "-w", "n2"]
    assert steps[0][-2:] == ["--address", "tcp://127.0.0.1:102"] and hosts.node_of()["tcp://127.0.0.1:102"] == "n2"
    _fake(monkeypatch, {"squeue": "RUNNING|None|n1", "scontrol show hostnames": "n1\n"})
    assert hosts.relaunch("tcp://127.0.0.1:102") is None  # the job no longer holds n2
    hosts.cancel()  # no SlurmJob (attach mode): only its own steps end
    assert all(s.poll() is not None for s in hosts.steps)


def test_replica_hosts_use_spares_first_then_relaunch_and_name_the_node():
    hosts = ReplicaHosts(workers=["tcp://a:1", "tcp://b:1"], spares=["tcp://c:1"],
                         relaunch=lambda lost: lost.replace(":1", ":2"),
                         nodes={"tcp://a:1": "n1", "tcp://b:1": "n2", "tcp://c:1": "n3"})
    assert hosts.replace_worker(1) == "tcp://c:1" and hosts.describe(hosts.where(1)) == "tcp://c:1 (node n3)"
    assert hosts.replace_worker(1) == "tcp://c:2" and hosts.describe("tcp://c:2") == "tcp://c:2 (node n3)"
    assert ReplicaHosts(workers=["tcp://a:1"]).replace_worker(0) is None


def test_the_worker_listens_at_its_node_addr_plus_its_node_id(monkeypatch):
    from recipes.monarch import worker

    monkeypatch.setenv("SLURMD_NODENAME", "n2")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setattr(worker.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(
        a, 0, stdout="NodeName=n2 Arch=x86_64 NodeAddr=10.0.0.2 NodeHostName=node2\n"))
    assert worker.slurm_address(26600) == "tcp://10.0.0.2:26601"
    args = worker.parse_args(["--slurm-port", "26600", "-c", "import monarch"])  # SlurmJob's srun line
    assert args.slurm_port == 26600 and args.address is None

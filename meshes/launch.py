"""Job launchers: a run's hosts from SLURM, through Monarch's ``monarch.job.SlurmJob``.

:func:`slurm_hosts` submits one batch job (``SlurmJob.apply``: ``sbatch``) in which every node runs a Monarch
worker (``python -m recipes.monarch.worker --slurm-port P``: node ``k`` of the job listens at
``tcp://<its NodeAddr>:<P + k>``), or, with ``attach``, starts those workers as a step of the allocation the
controller runs in (inside ``salloc`` / ``sbatch``). It waits, with a timeout naming the job and its state, for
the job to run and every worker to listen, and returns :class:`SlurmHosts`: the worker addresses (for
:func:`~meshes.hosts.attach_meshes`), :meth:`SlurmHosts.relaunch` (a fresh worker, at a new port, on the node of
a lost one) and :meth:`SlurmHosts.cancel` (``scancel``, or the steps stopped in attach mode) for ``finally:``.
Kubernetes (``monarch.job.kubernetes.KubernetesJob``) is documented in docs/diloco.md, untested here.
"""

from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LaunchError", "SlurmHosts", "slurm_hosts", "node_addrs", "job_state"]

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """The hosts could not be had: one line naming the problem and the fix; ``exit_code`` 2 for bad input, else 1."""

    def __init__(self, message: str, exit_code: int = 1) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def _slurm(*cmd: str, timeout: float = 30.0) -> str:
    """Run a SLURM client command; its stdout. ``LaunchError`` naming the command and its stderr on failure."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"`{' '.join(cmd)}` failed: {exc}") from None
    if out.returncode:
        raise LaunchError(f"`{' '.join(cmd)}` failed: {(out.stderr.strip().splitlines() or [''])[-1]}")
    return out.stdout


def expand(nodelist: str) -> list[str]:
    """Node names of a SLURM host list (``n[1-2]`` -> ``["n1", "n2"]``), in SLURM's order."""
    return _slurm("scontrol", "show", "hostnames", nodelist).split() if nodelist.strip() else []


def node_addrs(names: list[str]) -> list[str]:
    """Each node's ``NodeAddr`` (the address SLURM reaches it at; its host name on most clusters)."""
    fields = {}
    for line in _slurm("scontrol", "-o", "show", "node", ",".join(names)).splitlines():
        kv = dict(f.split("=", 1) for f in line.split() if "=" in f)
        fields[kv.get("NodeName")] = kv.get("NodeAddr") or kv.get("NodeName")
    return [fields.get(n, n) for n in names]


def job_state(job_id: str) -> tuple[str, str, list[str]]:
    """``(state, reason, nodes)`` of a job, from ``squeue`` or, once it left the queue, ``scontrol``."""
    out = _slurm("squeue", "-h", "-j", job_id, "-o", "%T|%r|%N").strip()
    if out:
        state, reason, nodes = out.splitlines()[0].split("|")
        return state, reason, expand(nodes)
    try:
        kv = dict(f.split("=", 1) for f in _slurm("scontrol", "-o", "show", "job", job_id).split() if "=" in f)
    except LaunchError:
        return "GONE", "not in squeue or scontrol", []
    return kv.get("JobState", "GONE"), kv.get("Reason", ""), []


def check_partition(partition: str | None, nodes: int) -> None:
    """``LaunchError`` (exit 2) when the partition does not exist or has fewer than ``nodes`` nodes."""
    sizes = {}
    for line in _slurm("sinfo", "-h", "-o", "%P %D").splitlines():
        name, count = line.split()
        sizes[name] = sizes.get(name, 0) + int(count)
    default = next((n.rstrip("*") for n in sizes if n.endswith("*")), None)
    sizes = {n.rstrip("*"): c for n, c in sizes.items()}
    name = partition or default
    if name not in sizes:
        raise LaunchError(f"SLURM partition {name!r} does not exist (partitions: {', '.join(sizes) or 'none'}); "
                          "set mesh.slurm.partition", 2)
    if sizes[name] < nodes:
        raise LaunchError(f"the job needs {nodes} nodes but partition {name!r} has {sizes[name]}; lower "
                          "diloco.replicas / mesh.slurm.nodes or pick a bigger partition", 2)


@dataclass
class SlurmHosts:
    """The nodes of one SLURM job, a Monarch worker on each (see the module docstring)."""

    job_id: str
    nodes: list[str]
    """Node names, in the job's order (node ``k`` is ``SLURM_NODEID`` ``k``)."""
    workers: list[str]
    """Worker address of each node."""
    port: int
    python: str
    log_dir: str
    """Where the job's and the workers' output goes."""
    submitted_at: float = field(default_factory=time.time)
    job: Any = None
    """The ``SlurmJob`` (``None`` when attached to the current allocation)."""
    steps: list[subprocess.Popen] = field(default_factory=list)
    """``srun`` steps this process started (attach mode's workers, relaunched workers)."""

    def summary(self) -> dict[str, Any]:
        """``slurm_job_id`` and ``slurm_submitted_at`` (epoch seconds) for ``summary.json``."""
        return {"slurm_job_id": self.job_id, "slurm_submitted_at": self.submitted_at}

    def node_of(self) -> dict[str, str]:
        """``{worker address: node name}``."""
        return dict(zip(self.workers, self.nodes))

    def srun(self, *args: str, log_name: str) -> subprocess.Popen:
        """Start ``srun --jobid=<job> --overlap ARGS`` (output into the log folder), remembered in ``steps``."""
        with open(os.path.join(self.log_dir, f"slurm_{self.job_id}_{log_name}.out"), "ab") as out:
            step = subprocess.Popen(["srun", f"--jobid={self.job_id}", "--overlap", "--kill-on-bad-exit=0", *args],
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.steps.append(step)
        return step

    def relaunch(self, address: str) -> str | None:
        """A fresh worker on ``address``'s node at a new port (a new job step); ``None`` when the job lost the node."""
        node = self.node_of().get(address)
        state, _, nodes = job_state(self.job_id)
        if node is None or state != "RUNNING" or node not in nodes:
            log.warning("SLURM job %s is %s on %s: no worker can be restarted on node %s", self.job_id, state,
                        ",".join(nodes) or "no node", node)
            return None
        host = address.split("://", 1)[1].rsplit(":", 1)[0]
        new = f"tcp://{host}:{self.port + len(self.workers)}"
        self.workers.append(new)
        self.nodes.append(node)
        self.srun("-w", node, "-N1", "-n1", self.python, "-m", "recipes.monarch.worker", "--allow-remote", "--address", new,
                  log_name=f"relaunch_{node}_{len(self.steps)}")
        log.warning("SLURM job %s: worker on node %s restarted at %s", self.job_id, node, new)
        return new

    def cancel(self, timeout_s: float = 30.0) -> None:
        """End every step this process started and (when it submitted the job) cancel the job; wait until it is gone."""
        for step in self.steps:
            step.terminate()  # a no-op once the step has ended
        for step in self.steps:
            try:
                step.wait(timeout=10)
            except subprocess.TimeoutExpired:
                step.kill()
                step.wait()
        if self.job is None:
            return
        self.job.kill()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                if job_state(self.job_id)[0] not in ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED"):
                    break
            except LaunchError:
                break
            time.sleep(0.5)


def slurm_hosts(cfg: Any, nodes: int, *, log_dir: str, python: str) -> SlurmHosts:
    """Submit (or attach to) a job of ``nodes`` nodes, start a worker on each, and wait until they all listen.

    Args:
        cfg: the ``mesh.slurm`` section (``SlurmConfig``).
        nodes: nodes of the job (one DiLoCo replica per node; more are spares).
        log_dir: where SLURM writes the job's and the workers' output (the run folder's ``slurm/``).
        python: the Python that runs the workers (this environment, on every node).

    Raises:
        LaunchError: no SLURM here, no allocation to attach to, a bad partition or node count (exit 2); the job
            failed, pended or its workers did not listen within ``cfg.pending_timeout_s`` (exit 1). The job is
            cancelled first.
    """
    tool = "srun" if cfg.attach else "sbatch"
    if not shutil.which(tool):
        raise LaunchError(f"mesh.launcher is slurm but `{tool}` is not on PATH; run on a SLURM login node "
                          "(or install SLURM: apt-get install slurm-wlm munge)", 2)
    os.makedirs(log_dir, exist_ok=True)
    # the job's nodes are the private network the user chose with mesh.launcher=slurm (docs/security.md, Workers)
    worker = [python, "-m", "recipes.monarch.worker", "--slurm-port", str(cfg.port), "--allow-remote"]
    if cfg.attach:
        job_id = os.environ.get("SLURM_JOB_ID")
        if not job_id:
            raise LaunchError("mesh.slurm.attach=true needs an allocation: run inside salloc or an sbatch script "
                              "(SLURM_JOB_ID is not set), or drop attach to submit a job", 2)
        names = expand(os.environ.get("SLURM_JOB_NODELIST", ""))
        if len(names) < nodes:
            raise LaunchError(f"the allocation {job_id} has {len(names)} node(s), the run needs {nodes}; allocate "
                              f"more (salloc -N {nodes}) or lower diloco.replicas", 2)
        hosts = SlurmHosts(job_id, names[:nodes], [], cfg.port, python, log_dir)
        hosts.srun("-N", str(nodes), "-n", str(nodes), "--ntasks-per-node=1", "-w", ",".join(hosts.nodes), *worker,
                   log_name="workers")
    else:
        from monarch.job import SlurmJob

        check_partition(cfg.partition, nodes)
        # SlurmJob's script runs `srun <python_exe> -c <its bootstrap>`: our worker, which ignores -c
        job = SlurmJob(meshes={"hosts": nodes}, python_exe=" ".join(worker), monarch_port=cfg.port,
                       slurm_args=["--no-requeue", *cfg.extra_args], job_name=cfg.job_name, time_limit=cfg.time,
                       partition=cfg.partition, log_dir=log_dir, gpus_per_node=cfg.gpus_per_node,
                       cpus_per_task=cfg.cpus_per_task)
        try:
            job.apply()
        except RuntimeError as exc:
            lines = [x for x in str(exc).splitlines() if x.strip()]
            raise LaunchError(f"sbatch refused the job: {lines[-1] if lines else exc}; fix mesh.slurm", 2) from None
        hosts = SlurmHosts(job._slurm_job_id, [], [], cfg.port, python, log_dir, job=job)  # no public accessor
    try:
        _wait_running(hosts, nodes, cfg.pending_timeout_s)
        return hosts
    except BaseException:
        hosts.cancel()
        raise


def _wait_running(hosts: SlurmHosts, nodes: int, timeout_s: float) -> None:
    """Wait for the job to run and every worker to accept connections (fills ``hosts.nodes`` / ``.workers``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        state, reason, names = job_state(hosts.job_id)
        if state == "RUNNING" and len(names) >= nodes:
            break
        if state not in ("PENDING", "CONFIGURING", "RUNNING"):
            raise LaunchError(f"SLURM job {hosts.job_id} is {state} ({reason}) before it started; see "
                              f"{hosts.log_dir}")
        if time.monotonic() > deadline:
            raise LaunchError(f"SLURM job {hosts.job_id} still {state} ({reason}) after {timeout_s:g} s; cancelled it. "
                              "Free nodes, ask for fewer, or raise mesh.slurm.pending_timeout_s")
        time.sleep(1.0)
    if not hosts.nodes:
        hosts.nodes = names[:nodes]
    hosts.workers = [f"tcp://{a}:{hosts.port + k}" for k, a in enumerate(node_addrs(hosts.nodes))]
    for address, node in zip(hosts.workers, hosts.nodes):
        host, port = address[len("tcp://"):].rsplit(":", 1)
        while True:
            try:
                socket.create_connection((host, int(port)), timeout=1.0).close()
                break
            except OSError:
                if time.monotonic() > deadline or job_state(hosts.job_id)[0] != "RUNNING" or any(
                        s.poll() is not None for s in hosts.steps):
                    raise LaunchError(f"the worker on node {node} ({address}) of SLURM job {hosts.job_id} is not "
                                      f"listening; see its output in {hosts.log_dir}") from None
                time.sleep(0.5)

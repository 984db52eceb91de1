"""A real SLURM on loopback for tests and demos: munge, one slurmctld and N slurmd (nodes n1..nN) in a folder.

    python tests/slurm/cluster.py [--nodes 2]     # prints `export SLURM_CONF=...`; Ctrl-C stops everything

Everything (slurm.conf, munge key and socket, state, spool, logs, pid files) lives under one temp folder,
with ports picked per run, so two clusters never collide. :meth:`LocalCluster.stop` cancels every job,
shuts the daemons down and kills, by pid, every process left that carries this cluster's ``SLURM_CONF``
(job steps included). Needs root and Debian's ``slurm-wlm`` + ``munge`` (:func:`missing` says why not).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "srun")


def missing() -> str | None:
    """Why a local cluster cannot run here (``None`` when it can); installs the packages when root on Debian."""
    if not all(shutil.which(d) for d in DAEMONS) and os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run("apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge",
                       shell=True, capture_output=True, timeout=900)
    absent = [d for d in DAEMONS if not shutil.which(d)]
    if absent:
        return f"SLURM is not installed ({', '.join(absent)} missing) and cannot be installed here (needs root and apt)"
    if os.geteuid() != 0:
        return "a local SLURM cluster needs root (slurmd runs jobs as any user)"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int = 8) -> int:
    """A port ``p`` with ``p .. p+n-1`` all free on loopback (``mesh.slurm.port``: node ``k`` and restarts above)."""
    while True:
        base, socks = _free_port(), []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


class LocalCluster:
    """``nodes`` SLURM nodes ``n1..nN`` on this machine (each ``CPUs=1``), partition ``debug``; a context manager.

    ``env`` is the environment for SLURM clients (``SLURM_CONF``); ``run(*cmd)`` runs one with it.
    """

    def __init__(self, nodes: int = 2, root: str | None = None) -> None:
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.own_root = root is None  # a temp folder of its own is removed by stop()
        self.root = Path(root or tempfile.mkdtemp(prefix="slurm-"))
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    def _write(self) -> None:
        r, host = self.root, socket.gethostname()
        for sub in ("state", "log", *(f"spool/{n}" for n in self.nodes)):
            (r / sub).mkdir(parents=True, exist_ok=True)
        key = r / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        lines = [
            "ClusterName=local", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={_free_port()}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", "CredType=cred/munge",
            f"AuthInfo=socket={r}/munge.sock", f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/ctld.log", f"SlurmdLogFile={r}/log/d-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "MpiDefault=none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "ReturnToService=2", "KillWait=2", "SlurmdTimeout=30",
            "InactiveLimit=0", "MinJobAge=600",
            *(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} CPUs=1 RealMemory=10000 "
              "State=UNKNOWN" for n in self.nodes),
            f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE:4",
        ]
        self.conf.write_text("\n".join(lines) + "\n")

    def _spawn(self, *cmd: str) -> None:
        log = open(self.root / "log" / f"{Path(cmd[0]).name}-{len(self.procs)}.out", "wb")
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))
        log.close()

    def run(self, *cmd: str, check: bool = True, timeout: float = 30) -> str:
        """A SLURM client command against this cluster; its stdout."""
        out = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and out.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed: {out.stderr.strip()}")
        return out.stdout

    def start(self, timeout_s: float = 60) -> LocalCluster:
        """Start munge, slurmctld and the slurmd; wait until ``sinfo`` shows every node idle."""
        self._write()
        r = self.root
        self._spawn("munged", "-F", "--force", f"--key-file={r}/munge.key", f"--socket={r}/munge.sock",
                    f"--pid-file={r}/munged.pid", f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge.seed")
        deadline = time.monotonic() + timeout_s
        while not (r / "munge.sock").exists():
            if time.monotonic() > deadline or self.procs[0].poll() is not None:
                self.stop()
                raise RuntimeError(f"munged did not start; see {r}/log")
            time.sleep(0.1)
        self._spawn("slurmctld", "-D", "-f", str(self.conf))
        for node in self.nodes:
            self._spawn("slurmd", "-D", "-N", node, "-f", str(self.conf))
        while True:
            out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=self.env, capture_output=True, text=True)
            states = dict(line.split() for line in out.stdout.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in self.nodes):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"SLURM nodes not idle within {timeout_s} s ({states}); see {r}/log")
            time.sleep(0.5)

    def pids(self) -> list[int]:
        """Every live process carrying this cluster's ``SLURM_CONF`` (daemons, job steps, their children)."""
        tag, out = f"SLURM_CONF={self.conf}".encode(), []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    if tag in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                        out.append(int(entry))
                except OSError:
                    continue
        return out

    def python_pids(self, node: str | None = None) -> list[int]:
        """The Python processes of this cluster (on ``node`` only: a node's Monarch worker and its actors)."""
        out, tag = [], f"SLURMD_NODENAME={node}".encode()
        for pid in self.pids():
            try:
                cmd, env = Path(f"/proc/{pid}/cmdline").read_bytes(), Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if b"python" in cmd and (node is None or tag in env.split(b"\0")):
                out.append(pid)
        return out

    def kill_node(self, node: str) -> list[int]:
        """SIGKILL every Python process on ``node`` (its Monarch host process and actors, as if the host died)."""
        pids = self.python_pids(node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        return pids

    def stop(self) -> None:
        """Cancel every job, shut the daemons down, kill what is left by pid, remove a temp folder of its own."""
        if any(p.poll() is None for p in self.procs[1:]):
            subprocess.run(["scancel", "--user", str(os.getuid())], env=self.env, capture_output=True, timeout=30)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and self.run("squeue", "-h", check=False).strip():
                time.sleep(0.5)
            subprocess.run(["scontrol", "shutdown"], env=self.env, capture_output=True, timeout=30)
        for p in self.procs[1:]:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                if p.poll() is None:
                    p.send_signal(sig)
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except OSError:
                    pass
            time.sleep(0.5)
        for p in self.procs:
            p.wait(timeout=10)
        self.procs.clear()
        if self.own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


if __name__ == "__main__":
    reason = missing()
    if reason:
        sys.exit(f"error: {reason}")
    n = int(sys.argv[sys.argv.index("--nodes") + 1]) if "--nodes" in sys.argv else 2
    with LocalCluster(n) as cluster:
        print(f"export SLURM_CONF={cluster.conf}   # {n} nodes idle; Ctrl-C stops the cluster", flush=True)
        try:
            signal.pause()
        except KeyboardInterrupt:
            pass

"""A Monarch worker: one per host of a multi-host run; the controller attaches to it (``mesh.workers``).

    python -m recipes.monarch.worker                                    # tcp://127.0.0.1:26601, loopback only
    python -m recipes.monarch.worker --address tcp://127.0.0.1:26602    # prints "worker ready at ..." once listening
    python -m recipes.monarch.worker --address tcp://FQDN:26601@tcp://0.0.0.0:26601 --allow-remote
    srun python -m recipes.monarch.worker --slurm-port 26600 --allow-remote   # one per SLURM node: NodeAddr:26600+NODEID

Anything that reaches the worker's port can spawn actors on it, and so run any code as this user: Monarch 0.7
has no authentication (``ca`` must be ``trust_all_connections``). So the worker binds loopback unless
``--allow-remote`` is given, and then says so; keep such a port on a private network (docs/security.md, Workers).
Actor processes it spawns import this repository (its root is put on ``PYTHONPATH``). It runs until its
controller shuts it down or it is killed. Exit codes: 0 stopped, 2 bad arguments or the port is taken.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_ADDRESS = "tcp://127.0.0.1:26601"
SUPPORTED_CA = "trust_all_connections"  # the only value Monarch 0.7.0 accepts (anything else: NotImplementedError)
REMOTE_WARNING = (
    "WARNING: this worker listens on {host}, which is not loopback. Any process that can reach port {port} can run "
    "code on this machine as user {user}: Monarch 0.7 does not authenticate or encrypt connections. Keep the port "
    "on a private network (a firewall or a Kubernetes NetworkPolicy admitting only the controller), or bind "
    "127.0.0.1 and reach it through an SSH tunnel (docs/security.md, Workers).")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipes.monarch.worker", description=__doc__.split("\n\n")[0])
    where = p.add_mutually_exclusive_group()
    where.add_argument("--address",
                       help=f"where to listen and be reached: tcp://HOST:PORT, or tcp://DIAL@tcp://BIND (default {DEFAULT_ADDRESS})")
    where.add_argument("--slurm-port", type=int, help="in a SLURM task: listen at tcp://<NodeAddr>:PORT+$SLURM_NODEID")
    p.add_argument("-c", help=argparse.SUPPRESS)  # monarch.job.SlurmJob appends its own bootstrap; unused
    p.add_argument("--allow-remote", action="store_true",
                   help="allow a non-loopback bind address (anyone reaching the port runs code as this user)")
    p.add_argument("--ca", default=SUPPORTED_CA,
                   help=f"certificate authority; Monarch 0.7 supports only {SUPPORTED_CA!r} (no TLS)")
    p.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for the port to listen")
    return p.parse_args(argv)


def listen_address(args: argparse.Namespace) -> str:
    """The address this worker listens at: ``--slurm-port``'s node address, else ``--address``, else loopback."""
    if args.slurm_port is not None:
        return slurm_address(args.slurm_port)
    return args.address or DEFAULT_ADDRESS


def slurm_address(port: int) -> str:
    """``tcp://<this node's NodeAddr>:<port + SLURM_NODEID>`` (what ``meshes.launch`` dials for this node)."""
    node = os.environ["SLURMD_NODENAME"]
    out = subprocess.run(["scontrol", "-o", "show", "node", node], capture_output=True, text=True, check=True).stdout
    addr = dict(f.split("=", 1) for f in out.split() if "=" in f).get("NodeAddr", node)
    return f"tcp://{addr}:{port + int(os.environ['SLURM_NODEID'])}"


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` that the worker listens on, from ``tcp://HOST:PORT`` (or ``tcp://DIAL@tcp://BIND``).

    Raises:
        ValueError: not a ``tcp://HOST:PORT`` address.
    """
    bind = address.split("@", 1)[-1]
    host, _, port = bind.removeprefix("tcp://").rpartition(":")
    if not bind.startswith("tcp://") or not host or not port.isdigit():
        raise ValueError(f"--address must look like tcp://HOST:PORT, got {address[:200]!r}")
    return host.strip("[]"), int(port)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback one (``0.0.0.0`` and ``::`` are not)."""
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def check_security(host: str, port: int, *, allow_remote: bool, ca: str) -> str | None:
    """The warning to print for a remote bind, or ``None`` on loopback.

    Raises:
        ValueError: a ``ca`` Monarch 0.7 cannot honour, or a non-loopback ``host`` without ``allow_remote``.
    """
    if ca != SUPPORTED_CA:
        raise ValueError(f"--ca {ca[:200]!r} cannot be honoured: Monarch 0.7 accepts only ca={SUPPORTED_CA!r} and has "
                         "no TLS with a certificate authority; drop --ca and keep the port on a private network, or "
                         "behind an SSH tunnel (docs/security.md, Workers)")
    if is_loopback(host):
        return None
    if not allow_remote:
        raise ValueError(f"--address binds {host}, which is not loopback: anyone who reaches the port could run code as "
                         "this user (Monarch 0.7 has no authentication). Bind 127.0.0.1 and use an SSH tunnel, or pass "
                         "--allow-remote on a private network (docs/security.md, Workers)")
    import getpass

    return REMOTE_WARNING.format(host=host, port=port, user=getpass.getuser())


def _announce_when_listening(address: str, host: str, port: int, timeout_s: float) -> None:
    """Print ``worker ready at ADDRESS`` once the port accepts connections (the line scripts wait for)."""
    probe = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((probe, port), timeout=1.0):
                print(f"worker ready at {address}", flush=True)
                return
        except OSError:
            time.sleep(0.1)
    print(f"worker at {address} did not listen within {timeout_s} s", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        args.address = listen_address(args)
        host, port = split_address(args.address)
        warning = check_security(host, port, allow_remote=args.allow_remote, ca=args.ca)
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:  # fail early: port taken
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except (ValueError, OSError, KeyError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if warning is not None:
        print(warning, file=sys.stderr, flush=True)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    from monarch.actor import run_worker_loop_forever

    threading.Thread(target=_announce_when_listening, args=(args.address, host, port, args.ready_timeout),
                     daemon=True).start()
    with contextlib.suppress(KeyboardInterrupt):
        run_worker_loop_forever(address=args.address, ca=args.ca)
    return 0


if __name__ == "__main__":
    sys.exit(main())

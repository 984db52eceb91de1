"""A Monarch worker: one per host of a multi-host run; the controller attaches to it (``mesh.workers``).

    python -m recipes.monarch.worker --address tcp://HOST:26601     # prints "worker ready at ..." once listening

The worker runs until its controller shuts it down or it is killed (Ctrl-C). Actor processes it spawns
import this repository (its root is put on ``PYTHONPATH``). On a cluster use the host's FQDN (or
``tcp://FQDN:PORT@tcp://0.0.0.0:PORT`` to bind every interface); see docs/diloco.md for SLURM and Kubernetes.
Exit codes: 0 stopped, 2 bad address or the port is taken.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipes.monarch.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="where to listen and be reached: tcp://HOST:PORT")
    p.add_argument("--ready-timeout", type=float, default=60.0, help="seconds to wait for the port to listen")
    return p.parse_args(argv)


def split_address(address: str) -> tuple[str, int]:
    """``(host, port)`` that the worker listens on, from ``tcp://HOST:PORT`` (or ``tcp://DIAL@tcp://BIND``).

    Raises:
        ValueError: not a ``tcp://HOST:PORT`` address.
    """
    bind = address.split("@", 1)[-1]
    if not bind.startswith("tcp://"):
        raise ValueError(f"--address must look like tcp://HOST:PORT, got {address!r}")
    host, _, port = bind[len("tcp://") :].rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--address must look like tcp://HOST:PORT, got {address!r}")
    return host.strip("[]"), int(port)


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
        host, port = split_address(args.address)
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:  # fail early: port taken
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep
    )
    from monarch.actor import run_worker_loop_forever

    threading.Thread(
        target=_announce_when_listening, args=(args.address, host, port, args.ready_timeout), daemon=True
    ).start()
    try:
        run_worker_loop_forever(address=args.address, ca="trust_all_connections")
    except KeyboardInterrupt:
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

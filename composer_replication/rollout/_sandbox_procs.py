"""Process plumbing of the sandbox: waiting, killing what a run left behind, reading its output.

- :func:`count_namespace`: processes still in the sandbox's PID namespace (bubblewrap runs). The
  kernel kills them all when the namespace's first process exits; this waits for that and counts
  survivors.
- :func:`kill_group`: kills the child's process group (runs without the OS sandbox) and counts
  survivors. A process that called ``setsid`` has left the group; without the OS sandbox only the
  audit hook (which refuses ``fork``) stops that.
- :func:`wait_or_kill`, :func:`read_pidns`, :class:`PipeReader`, :func:`tail_of`:
  the wall-clock limit, bubblewrap's namespace id, the records pipe and the output files.
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import signal
import subprocess
import threading
import time
from pathlib import Path

__all__ = [
    "KILL_GRACE_S", "PipeReader", "count_namespace", "group_members", "kill_group",
    "read_pidns", "signal_group", "tail_of", "wait_or_kill",
]  # fmt: skip

log = logging.getLogger(__name__)

KILL_GRACE_S = 2.0
MAX_RECORDS_BYTES = 64 << 20


def signal_group(pgid: int, sig: int) -> None:
    """``killpg`` that ignores a group that is already gone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _live_pids() -> list[str]:
    return [e for e in os.listdir("/proc") if e.isdigit()]


def _is_zombie(pid: str) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        stat = f.read()
    return stat[stat.rfind(")") + 2 :].split()[0] == "Z"


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    if not Path("/proc").is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    try:
        os.killpg(pgid, 0)  # cheap: most groups are gone when this is asked
    except (ProcessLookupError, PermissionError):
        return []
    members = []
    for pid in _live_pids():
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # state ppid pgrp ...
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(pid))
    return members


def kill_group(pgid: int, grace_s: float = 2.0) -> int:
    """Kill whatever is left of process group ``pgid``; return how many processes survive."""
    if group_members(pgid):
        signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + grace_s
        while group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.01)
    left = len(group_members(pgid))
    if left:
        log.warning("sandbox: %d process(es) of group %d survived SIGKILL", left, pgid)
    return left


def namespace_members(pidns: str) -> list[int]:
    """Live processes whose ``/proc/<pid>/ns/pid`` is ``pidns`` (e.g. ``"pid:[4026532181]"``)."""
    members = []
    for pid in _live_pids():
        try:
            if os.readlink(f"/proc/{pid}/ns/pid") == pidns and not _is_zombie(pid):
                members.append(int(pid))
        except (OSError, IndexError):
            continue
    return members


def count_namespace(pidns: str, grace_s: float = 2.0) -> int:
    """Wait up to ``grace_s`` for the sandbox's PID namespace to empty, SIGKILL-ing stragglers; count survivors."""
    deadline, pause = time.monotonic() + grace_s, 0.001
    members = namespace_members(pidns)
    while members and time.monotonic() < deadline:
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(pause)  # usually processes still exiting after the namespace's first one ended
        pause = min(2 * pause, 0.02)
        members = namespace_members(pidns)
    if members:
        log.warning("sandbox: %d process(es) of PID namespace %s survived", len(members), pidns)
    return len(members)


def read_pidns(fd: int) -> str | None:
    """The ``pid:[inode]`` of the sandbox's PID namespace, from bubblewrap's ``--info-fd`` JSON."""
    os.set_blocking(fd, False)
    try:
        text = os.read(fd, 1 << 16).decode(errors="replace")
        return f"pid:[{int(json.loads(text)['pid-namespace'])}]"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _wait(proc: subprocess.Popen, timeout_s: float) -> None:
    """``proc.wait(timeout_s)``, on a pidfd where the OS has one (``Popen.wait`` polls with sleeps of up
    to 50 ms, which would add as much to every short command)."""
    try:
        fd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        proc.wait(timeout=timeout_s)
        return
    try:
        poll = select.poll()
        poll.register(fd, select.POLLIN)
        ready = poll.poll(math.ceil(timeout_s * 1000))
    finally:
        os.close(fd)
    if not ready:
        raise subprocess.TimeoutExpired(proc.args, timeout_s)
    proc.wait()


def wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the child; on expiry SIGKILL its whole process group. True when it timed out."""
    try:
        _wait(proc, timeout_s)
        return False
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:  # stuck in the kernel (e.g. uninterruptible I/O)
            log.warning("sandbox: child %d did not exit %.0fs after SIGKILL", proc.pid, KILL_GRACE_S)
        return True


class PipeReader(threading.Thread):
    """Drains the records pipe (so the child never blocks on it), keeping at most 64 MiB."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True)
        self.fd, self.buf, self.closed = fd, bytearray(), False

    def run(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except OSError:
                return
            if not chunk:
                return
            if len(self.buf) < MAX_RECORDS_BYTES:
                self.buf += chunk

    def data(self) -> bytes:
        return bytes(self.buf)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if not self.is_alive():
                os.close(self.fd)
            # else: a leftover writer keeps the pipe open; the daemon thread closes nothing and ends with it


def tail_of(f, limit: int) -> str:  # noqa: ANN001 - a binary file object
    f.flush()
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - limit))
    return f.read().decode("utf-8", errors="replace")

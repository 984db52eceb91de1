"""Finding and killing what a sandboxed run left behind (Linux ``/proc``; a ``killpg`` probe elsewhere).

- :func:`count_namespace`: processes still in the sandbox's PID namespace (bubblewrap runs). The
  kernel kills them all when the namespace's first process exits; this waits for that and counts
  survivors.
- :func:`kill_group`: kills the child's process group (runs without the OS sandbox) and counts
  survivors. A process that called ``setsid`` has left the group; without the OS sandbox only the
  audit hook (which refuses ``fork``) stops that.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path

__all__ = ["count_namespace", "group_members", "kill_group", "signal_group"]

log = logging.getLogger(__name__)


def signal_group(pgid: int, sig: int) -> None:
    """``killpg`` that ignores a group that is already gone."""
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _live_pids() -> list[Path]:
    return [e for e in Path("/proc").iterdir() if e.name.isdigit()]


def _is_zombie(entry: Path) -> bool:
    stat = (entry / "stat").read_text()
    return stat[stat.rfind(")") + 2 :].split()[0] == "Z"


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    if not Path("/proc").is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    members = []
    for entry in _live_pids():
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # state ppid pgrp ...
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
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
    for entry in _live_pids():
        try:
            if os.readlink(entry / "ns" / "pid") == pidns and not _is_zombie(entry):
                members.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return members


def count_namespace(pidns: str, grace_s: float = 2.0) -> int:
    """Wait up to ``grace_s`` for the sandbox's PID namespace to empty, SIGKILL-ing stragglers; count survivors."""
    deadline = time.monotonic() + grace_s
    members = namespace_members(pidns)
    while members and time.monotonic() < deadline:
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)
        members = namespace_members(pidns)
    if members:
        log.warning("sandbox: %d process(es) of PID namespace %s survived", len(members), pidns)
    return len(members)

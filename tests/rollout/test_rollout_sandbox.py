"""The sandbox contains infinite loops, fork bombs, memory hogs, stray writes and network access."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from composer_replication.rollout.sandbox import _group_members, _kill_group, run_python_sandboxed

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="the sandbox needs POSIX process groups")

TESTS = """
def test_small():
    assert add(1, 2) == 3

def test_zero():
    assert add(0, 0) == 0

def test_negative():
    assert add(-1, -2) == -3
"""


def run(code: str, tests: str = TESTS, **kw):
    kw.setdefault("timeout_s", 3.0)
    return run_python_sandboxed(code, tests, **kw)


def test_passing_solution():
    res = run("def add(a, b):\n    return a + b\n")
    assert res.passed and (res.n_passed, res.n_total) == (3, 3)
    assert res.error is None and res.error_type is None and not res.timed_out and res.returncode == 0
    assert res.test_results == {"test_small": True, "test_zero": True, "test_negative": True}
    if sys.platform.startswith("linux"):
        assert {"RLIMIT_AS", "RLIMIT_CPU", "RLIMIT_FSIZE", "RLIMIT_NOFILE"} <= set(res.limits_applied)


def test_failing_solution_counts_each_test():
    res = run("def add(a, b):\n    return a * b\n")  # 1*2 != 3, 0*0 == 0, (-1)*(-2) != -3
    assert not res.passed and (res.n_passed, res.n_total) == (1, 3)
    assert res.test_results == {"test_small": False, "test_zero": True, "test_negative": False}
    assert res.error_type == "AssertionError" and 'File "tests.py"' in res.error
    assert "_sandbox_child" not in res.error  # the bootstrap's own frames are hidden


def test_syntax_error():
    res = run("def add(a, b) return a + b\n")
    assert not res.passed and res.n_passed == 0 and res.n_total == 3
    assert res.error_type == "SyntaxError" and "solution.py" in res.error


def test_solution_cannot_define_extra_tests():
    res = run("def add(a, b):\n    return a - b\n\ndef test_free():\n    pass\n")
    assert res.n_total == 3 and res.n_passed == 1  # only the tests' own functions count


def test_stdout_and_stderr_are_captured():
    res = run("import sys\nprint('hello out')\nprint('hello err', file=sys.stderr)\ndef add(a, b):\n    return a + b\n")
    assert res.passed and "hello out" in res.stdout and "hello err" in res.stderr


def test_infinite_loop_is_killed_within_the_timeout():
    start = time.monotonic()
    res = run("while True:\n    pass\n", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert sandbox_children() == []
    assert res.timed_out and res.killed and not res.passed and res.n_passed == 0
    assert res.error_type == "Timeout" and res.returncode is not None and res.returncode < 0
    assert elapsed < 1.0 + 3.0, f"took {elapsed:.1f}s"
    assert res.leftover_processes == 0


def test_infinite_loop_inside_a_test_keeps_earlier_results():
    tests = TESTS + "\ndef test_zz_hang():\n    while True:\n        pass\n"
    res = run("def add(a, b):\n    return a + b\n", tests, timeout_s=1.0)
    assert res.timed_out and not res.passed and res.n_total == 4 and res.n_passed == 3


def test_fork_bomb_is_contained_and_leaves_no_process():
    bomb = "import os\nwhile True:\n    os.fork()\n"
    res = run(bomb)
    assert not res.passed and not res.timed_out
    assert res.error_type == "PermissionError" and "os.fork" in res.error
    assert res.leftover_processes == 0
    # a bomb that swallows the refusal still creates nothing and is scored on its tests
    stubborn = "import os\nfor _ in range(200):\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    res = run(stubborn)
    assert not res.passed and res.leftover_processes == 0
    assert sandbox_children() == [], "a sandbox process outlived its run"


def sandbox_children() -> list[int]:
    """Live processes running the sandbox bootstrap (checked independently of the sandbox's own count)."""
    if not Path("/proc").is_dir():
        pytest.skip("no /proc to list processes")
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"_sandbox_child.py" in (entry / "cmdline").read_bytes():
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.mark.parametrize(
    "code",
    [
        "import subprocess\nsubprocess.run(['sleep', '30'])\n",
        "import os\nos.system('sleep 30')\n",
        "import multiprocessing\n",
        "import ctypes\n",
        "import os\nos.posix_spawn('/bin/sleep', ['sleep', '30'], {})\n",
    ],
    ids=["subprocess", "os.system", "multiprocessing", "ctypes", "posix_spawn"],
)
def test_process_creation_is_refused(code):
    start = time.monotonic()
    res = run(code + "def add(a, b):\n    return a + b\n")
    assert not res.passed and not res.timed_out and res.leftover_processes == 0
    assert res.error_type in ("PermissionError", "ImportError"), res.error
    assert time.monotonic() - start < 3.0


def test_memory_hog_is_contained():
    res = run("data = bytearray(4 * 1024 ** 3)\n", memory_mb=256)
    assert not res.passed and res.error_type == "MemoryError"
    res = run("chunks = []\nwhile True:\n    chunks.append(bytearray(16 * 1024 ** 2))\n", memory_mb=256)
    assert not res.passed and not res.timed_out and res.error_type == "MemoryError"


def test_write_outside_the_temporary_directory_is_blocked(tmp_path: Path):
    target = tmp_path / f"escape-{uuid.uuid4().hex}.txt"
    for code in (
        f"open({str(target)!r}, 'w').write('x')\n",
        f"import os\nfd = os.open({str(target)!r}, os.O_WRONLY | os.O_CREAT)\n",
        f"import os\nos.symlink({str(target)!r}, 'link')\nopen('link', 'w').write('x')\n",
        f"import pathlib\npathlib.Path({str(target)!r}).write_text('x')\n",
    ):
        res = run(code + "def add(a, b):\n    return a + b\n")
        assert not res.passed and res.error_type == "PermissionError", res.error
        assert not target.exists()


def test_existing_files_outside_cannot_be_changed(tmp_path: Path):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    for code in (f"import os\nos.remove({str(victim)!r})\n", f"import os\nos.rename({str(victim)!r}, 'x')\n",
                 f"import os\nos.chmod({str(victim)!r}, 0o777)\n", f"open({str(victim)!r}, 'a').write('x')\n"):
        res = run(code)
        assert res.error_type == "PermissionError", res.error
    assert victim.read_text() == "keep"


def test_writes_inside_the_temporary_directory_work_and_vanish():
    code = (
        "import os, shutil, tempfile\n"
        "os.makedirs('a/b')\nopen('a/b/c.txt', 'w').write('x')\nshutil.rmtree('a')\n"
        "with tempfile.NamedTemporaryFile() as f:\n    f.write(b'x')\n"
        "CWD = os.getcwd()\n"
        "def add(a, b):\n    return a + b\n"
    )
    res = run(code + "print(CWD)\n")
    assert res.passed, res.error
    assert not Path(res.stdout.strip()).exists()  # the temporary directory is removed afterwards


@pytest.mark.parametrize("namespace", [True, False], ids=["namespace-if-allowed", "audit-hook-only"])
def test_network_is_blocked(namespace):
    code = (
        "import socket\n"
        "def add(a, b):\n    return a + b\n"
        "def test_connect():\n"
        "    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
    )
    res = run(code, TESTS + "\ndef test_net():\n    test_connect()\n", network_namespace=namespace)
    assert res.test_results["test_small"] and not res.test_results["test_net"]
    assert res.network_isolation in ("netns", "userns+netns", "audit-hook")
    if not namespace:
        assert res.network_isolation == "audit-hook" and "socket" in res.error
    elif res.network_isolation == "audit-hook":
        pytest.skip("no network namespace on this OS/kernel: only the audit hook blocked the socket")
    else:  # inside the new namespace only the (down) loopback interface exists
        probe = "IFACES = [l.split(':')[0].strip() for l in open('/proc/self/net/dev').read().splitlines()[2:]]\n"
        res = run(probe + "print(IFACES)\ndef add(a, b):\n    return a + b\n")
        assert res.passed and res.stdout.strip() == "['lo']", res.stdout


def test_oversized_output_fails_without_filling_the_disk():
    res = run("while True:\n    print('x' * 1000)\n", max_output_bytes=64 * 1024)
    assert not res.passed and not res.timed_out and res.error_type == "OSError"
    assert len(res.stdout) <= 64 * 1024


def test_solution_exiting_early_is_a_failure():
    res = run("import os\nos._exit(0)\n")
    assert not res.passed and res.error_type == "NoResult"


def test_kill_group_cleans_up_stray_processes():
    proc = subprocess.Popen(["sleep", "30"], start_new_session=True)
    try:
        assert _group_members(proc.pid) == [proc.pid]
        assert _kill_group(proc.pid) == 0
        proc.wait(timeout=5)
        assert proc.returncode < 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize(
    "kwargs, match",
    [({"timeout_s": 0}, "timeout_s"), ({"memory_mb": -1}, "memory_mb"), ({"max_output_bytes": 0}, "max_output_bytes")],
)
def test_bad_limits(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_python_sandboxed("x = 1", TESTS, **kwargs)


def test_bad_code_type():
    with pytest.raises(ValueError, match="Python source strings"):
        run_python_sandboxed(b"x = 1", TESTS)  # type: ignore[arg-type]


def test_parent_environment_is_not_leaked(monkeypatch):
    monkeypatch.setenv("CR_SECRET_TOKEN", "do-not-leak")
    res = run("import os\nSEEN = os.environ.get('CR_SECRET_TOKEN')\ndef add(a, b):\n    return a + b\n",
              TESTS + "\ndef test_env():\n    assert SEEN is None\n")
    assert res.passed, res.error
    assert os.environ["CR_SECRET_TOKEN"] == "do-not-leak"

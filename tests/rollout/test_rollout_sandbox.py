"""The sandbox on its normal path: scoring, limits, errors (hostile code: test_attacks_sandbox.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from composer_replication.rollout import sandbox as sandbox_mod
from composer_replication.rollout._sandbox_facts import (
    decode,
    judge_check,
    make_checker,
    make_flusher,
    rewrite_tests,
)
from composer_replication.rollout._sandbox_os import group_members, kill_group
from composer_replication.rollout.sandbox import (
    SandboxUnavailableError,
    os_sandbox_status,
    run_command_sandboxed,
    run_python_sandboxed,
)

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
    res = run(
        "import sys\nprint('hello out')\nprint('hello err', file=sys.stderr)\ndef add(a, b):\n    return a + b\n"
    )
    assert res.passed and "hello out" in res.stdout and "hello err" in res.stderr


def test_infinite_loop_is_killed_within_the_timeout():
    before = set(sandbox_children())
    start = time.monotonic()
    res = run("while True:\n    pass\n", timeout_s=1.0)
    elapsed = time.monotonic() - start
    assert not outlived(before)
    assert res.timed_out and res.killed and not res.passed and res.n_passed == 0
    assert res.error_type == "Timeout" and res.returncode is not None and res.returncode < 0
    assert elapsed < 1.0 + 3.0, f"took {elapsed:.1f}s"
    assert res.leftover_processes == 0


def test_infinite_loop_inside_a_test_keeps_earlier_results():
    tests = TESTS + "\ndef test_zz_hang():\n    while True:\n        pass\n"
    res = run("def add(a, b):\n    return a + b\n", tests, timeout_s=1.0)
    assert res.timed_out and not res.passed and res.n_total == 4 and res.n_passed == 3


def test_fork_bomb_is_contained_and_leaves_no_process():
    before = set(sandbox_children())
    bomb = "import os\nwhile True:\n    os.fork()\n"
    res = run(bomb)
    assert not res.passed and not res.timed_out
    assert res.error_type == "PermissionError" and "os.fork" in res.error
    assert res.leftover_processes == 0
    # a bomb that swallows the refusal still creates nothing and is scored on its tests
    stubborn = (
        "import os\nfor _ in range(200):\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    )
    res = run(stubborn)
    assert not res.passed and res.leftover_processes == 0
    assert not outlived(before), "a sandbox process outlived its run"


def sandbox_children() -> list[int]:
    """Live processes running the sandbox bootstrap (checked independently of the sandbox's own count)."""
    if not Path("/proc").is_dir():
        pytest.skip("no /proc to list processes")
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            cmdline = (entry / "cmdline").read_bytes() if entry.name.isdigit() else b""
            if b"_sandbox_child.py" in cmdline or b"/.cr/child.py" in cmdline:
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def outlived(before: set[int], settle_s: float = 3.0) -> set[int]:
    """Sandbox processes started since ``before`` was listed that are still alive ``settle_s`` later (a run that
    another pytest on this machine has going at the same moment ends within its limit; a leaked one does not)."""
    new = set(sandbox_children()) - before
    deadline = time.monotonic() + settle_s
    while new and time.monotonic() < deadline:
        time.sleep(0.2)
        new &= set(sandbox_children())
    return new


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
    for code in (
        f"import os\nos.remove({str(victim)!r})\n",
        f"import os\nos.rename({str(victim)!r}, 'x')\n",
        f"import os\nos.chmod({str(victim)!r}, 0o777)\n",
        f"open({str(victim)!r}, 'a').write('x')\n",
    ):
        res = run(code)
        assert res.error_type == "PermissionError", res.error
    assert victim.read_text() == "keep"


def test_writes_inside_the_temporary_directory_work_and_vanish():
    marker = f"marker-{uuid.uuid4().hex}"
    code = (
        "import os, shutil, tempfile\n"
        "os.makedirs('a/b')\nopen('a/b/c.txt', 'w').write('x')\nshutil.rmtree('a')\n"
        "with tempfile.NamedTemporaryFile() as f:\n    f.write(b'x')\n"
        f"open('{marker}', 'w').write('x')\n"
        "CWD = os.getcwd()\n"
        "def add(a, b):\n    return a + b\n"
    )
    res = run(code + "print(CWD)\n")
    assert res.passed, res.error
    assert not (Path(res.stdout.strip()) / marker).exists()  # the working directory is gone afterwards


@pytest.mark.parametrize("os_sandbox", ["auto", "off"])
def test_network_is_blocked(os_sandbox):
    code = (
        "import socket\n"
        "def add(a, b):\n    return a + b\n"
        "def test_connect():\n"
        "    socket.create_connection(('127.0.0.1', 9), timeout=1)\n"
    )
    res = run(code, TESTS + "\ndef test_net():\n    test_connect()\n", os_sandbox=os_sandbox)
    assert res.test_results["test_small"] and not res.test_results["test_net"]
    if os_sandbox == "off" or res.isolation == "none":
        assert res.network_isolation == "audit-hook" and "socket" in res.error
    else:  # inside the network namespace only the loopback interface exists
        assert res.network_isolation == "netns"
        probe = (
            "IFACES = [l.split(':')[0].strip() for l in open('/proc/self/net/dev').read().splitlines()[2:]]\n"
        )
        res = run(probe + "print(IFACES)\ndef add(a, b):\n    return a + b\n", audit_hook=False)
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
        assert group_members(proc.pid) == [proc.pid]
        assert kill_group(proc.pid) == 0
        proc.wait(timeout=5)
        assert proc.returncode < 0
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"timeout_s": 0}, "timeout_s"),
        ({"memory_mb": -1}, "memory_mb"),
        ({"max_output_bytes": 0}, "max_output_bytes"),
    ],
)
def test_bad_limits(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_python_sandboxed("x = 1", TESTS, **kwargs)


def test_bad_code_type():
    with pytest.raises(ValueError, match="Python source strings"):
        run_python_sandboxed(b"x = 1", TESTS)  # type: ignore[arg-type]


def test_parent_environment_is_not_leaked(monkeypatch):
    monkeypatch.setenv("CR_SECRET_TOKEN", "do-not-leak")
    res = run(
        "import os\nSEEN = os.environ.get('CR_SECRET_TOKEN')\ndef add(a, b):\n    return a + b\n",
        TESTS + "\ndef test_env():\n    assert SEEN is None\n",
    )
    assert res.passed, res.error
    assert os.environ["CR_SECRET_TOKEN"] == "do-not-leak"


# ---------------------------------------------------------------------------- isolation modes


def test_os_sandbox_is_used_when_available():
    available, reason = os_sandbox_status()
    if not available:
        pytest.skip(f"no OS sandbox here: {reason}")
    res = run("def add(a, b):\n    return a + b\n")
    assert res.passed and res.isolation == "bwrap" and res.network_isolation == "netns"


def test_without_namespaces_the_result_says_so_and_warns_once(monkeypatch, caplog):
    monkeypatch.setattr(sandbox_mod, "_probe_bwrap", lambda: (None, "namespaces refused (test)"))
    sandbox_mod._warn_once.cache_clear()
    with caplog.at_level("WARNING", logger=sandbox_mod.__name__):
        first = run("def add(a, b):\n    return a + b\n")
        second = run("def add(a, b):\n    return a - b\n")
    assert first.passed and first.isolation == "none" and first.network_isolation == "audit-hook"
    assert not second.passed and second.isolation == "none"
    warnings = [r for r in caplog.records if "WITHOUT OS isolation" in r.getMessage()]
    assert len(warnings) == 1 and "namespaces refused (test)" in warnings[0].getMessage()
    with pytest.raises(SandboxUnavailableError, match="namespaces refused"):
        run("def add(a, b):\n    return a + b\n", os_sandbox="require")
    sandbox_mod._warn_once.cache_clear()


def test_bad_os_sandbox_mode_and_readable_path(tmp_path):
    with pytest.raises(ValueError, match="os_sandbox"):
        run("x = 1", os_sandbox="maybe")
    with pytest.raises(ValueError, match="does not exist"):
        run("x = 1", readable_paths=[tmp_path / "missing"])


# ---------------------------------------------------------------------------- facts judged by the parent


def test_asserts_are_judged_on_plain_values():
    tests = (
        "def test_shapes():\n"
        "    assert f() == [1, (2.5, 'x'), {'k': {3}}]\n"
        "    assert f() != [] and not (f() is None)\n"
        "    assert 0 < len(f()) <= 3\n"
        "    assert 'x' in f()[1]\n"
        "    assert f()[2]['k'] == frozenset({3}) or False\n"
    )
    res = run("def f():\n    return [1, (2.5, 'x'), {'k': {3}}]\n", tests)
    assert res.passed, res.error
    res = run("def f():\n    return [1, (2.5, 'y'), {'k': {3}}]\n", tests)
    assert not res.passed and res.error_type == "AssertionError" and "(values: [1, (2.5, 'y')" in res.error


def test_parent_rejudges_each_reported_assert():
    _, sites = rewrite_tests("def test_a():\n    assert f(1) == 2 and not g()\n")
    enc = {1: ("i", 1), 2: ("i", 2), 0: ("b", False)}
    assert judge_check(sites[0], ((0, enc[2]), (1, enc[2]), (2, enc[0])))
    assert not judge_check(
        sites[0], ((0, enc[1]), (1, enc[2]))
    )  # short-circuited: `not g()` was never needed
    assert not judge_check(sites[0], ((0, enc[2]), (1, enc[2])))  # `g()` missing although needed
    assert not judge_check(sites[0], ((0, ("?", 1)), (1, enc[2]), (2, enc[0])))  # malformed value
    assert decode(("d", ((("s", "a"), ("F", (("f", "nan"),))),))).keys() == {"a"}


def test_checker_functions_look_up_no_global_name():
    """Patching builtins or the facts module from candidate code cannot change the checker."""
    import dis

    helpers, take = make_checker()
    flush = make_flusher(lambda text: None, take)
    todo = [f.__code__ for f in [*helpers.values(), take, flush]]
    seen = 0
    while todo:
        code = todo.pop()
        seen += 1
        loads = [i.argval for i in dis.get_instructions(code) if i.opname in ("LOAD_GLOBAL", "LOAD_NAME")]
        assert loads == [], f"{code.co_name} looks up globals {loads}"
        todo += [c for c in code.co_consts if hasattr(c, "co_code")]
    assert seen > len(helpers)


# ---------------------------------------------------------------------------- commands (an agent's workspace)


@pytest.mark.parametrize("mode", ["require", "off"])
def test_command_runs_in_its_workspace_under_limits_and_leaves_nothing_behind(tmp_path, mode):
    if mode == "require" and not os_sandbox_status()[0]:
        pytest.skip(f"no OS sandbox here: {os_sandbox_status()[1]}")
    (tmp_path / "in.txt").write_text("data\n")
    mount = "/workspace" if mode == "require" else str(tmp_path)
    script = ("cat in.txt; echo made > out.txt; pwd; echo $CR_X; ulimit -v; ulimit -Hv; "
              "(sleep 60 &) ; echo err >&2; exit 3")
    start = time.monotonic()
    res = run_command_sandboxed(["bash", "-c", script], workdir=tmp_path, mount=mount, memory_mb=512,
                                env={"CR_X": "a b"}, os_sandbox=mode)
    assert time.monotonic() - start < 10 and res.returncode == 3 and not res.timed_out
    assert res.output.split("\n")[:6] == ["data", mount, "a b", str(512 << 10), str(512 << 10), "err"]
    assert (tmp_path / "out.txt").read_text() == "made\n"
    assert res.leftover_processes == 0 and res.isolation == ("bwrap" if mode == "require" else "none")


def test_a_readable_path_under_the_hosts_tmp_is_visible_inside(tmp_path):
    """The sandbox's /tmp is private; a readable path under the host's /tmp (pytest's tmp_path, a virtualenv in a CI
    checkout under /tmp) is bound after it, so it stays readable."""
    if not os_sandbox_status()[0]:
        pytest.skip(f"no OS sandbox here: {os_sandbox_status()[1]}")
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "lib.txt").write_text("visible\n")
    (tmp_path / "w").mkdir()
    res = run_command_sandboxed(["cat", str(shared / "lib.txt")], workdir=tmp_path / "w", mount="/w",
                                readable_paths=[shared], os_sandbox="require")
    assert res.returncode == 0 and res.output == "visible\n", res.output


def test_command_timeout_kills_it_and_output_is_bounded(tmp_path):
    res = run_command_sandboxed(["bash", "-c", "echo started; sleep 60"], workdir=tmp_path, mount="/w",
                                timeout_s=1.0, os_sandbox="auto")
    assert res.timed_out and res.duration_s < 5 and res.leftover_processes == 0 and res.output == "started\n"
    res = run_command_sandboxed(["yes"], workdir=tmp_path, mount="/w", max_file_bytes=1 << 20, os_sandbox="auto")
    assert not res.timed_out and res.returncode != 0 and len(res.output) <= 1 << 20  # RLIMIT_FSIZE stops it


def test_command_arguments_are_checked(tmp_path):
    with pytest.raises(ValueError, match="argv must be a non-empty list"):
        run_command_sandboxed("ls", workdir=tmp_path, mount="/w")
    with pytest.raises(ValueError, match="mount an absolute path"):
        run_command_sandboxed(["ls"], workdir=tmp_path, mount="w")
    if os_sandbox_status()[0]:
        with pytest.raises(ValueError, match="overlaps /usr"):
            run_command_sandboxed(["ls"], workdir=tmp_path, mount="/usr/local/w")
    with pytest.raises(ValueError, match="env must map"):
        run_command_sandboxed(["ls"], workdir=tmp_path, mount="/w", env={"A;rm": "x"})
    with pytest.raises(ValueError, match="timeout_s must be positive"):
        run_command_sandboxed(["ls"], workdir=tmp_path, mount="/w", timeout_s=0)

"""Hostile code in the sandbox: every attack must leave no effect outside it, and no reward hack may pay.

Each attack runs under the layers that claim to stop it: ``os+hook`` (the default: bubblewrap and
the audit hook), ``os-only`` (bubblewrap alone, ``audit_hook=False``: proves the OS layer holds by
itself) and ``hook-only`` (``os_sandbox="off"``: the fallback where namespaces are refused). Each
test asserts the *outside* effect did not happen: the file is unchanged, the parent got no signal,
no process is left, no byte reached a loopback listener, the parent's environment was not seen.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

from composer_replication.rollout.sandbox import os_sandbox_status, run_python_sandboxed

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the attacks target Linux")

LAYERS = {"os+hook": {}, "os-only": {"audit_hook": False}, "hook-only": {"os_sandbox": "off"}}
ADD_TESTS = (
    "def test_small():\n    assert add(1, 2) == 3\n\n"
    "def test_zero():\n    assert add(0, 0) == 0\n\n"
    "def test_negative():\n    assert add(-1, -2) == -3\n"
)
ADD = "def add(a, b):\n    return a + b\n"
WRONG_ADD = "def add(a, b):\n    return 0\n"


def run(layer: str, code: str, tests: str = ADD_TESTS, **kw):
    """Run under ``layer``; OS layers are skipped where bubblewrap cannot run."""
    if layer != "hook-only":
        available, reason = os_sandbox_status()
        if not available:
            pytest.skip(f"no OS sandbox here: {reason}")
    kw.setdefault("timeout_s", 4.0)
    return run_python_sandboxed(code, tests, **LAYERS[layer], **kw)


def attempts(*lines: str) -> str:
    """Candidate code trying each line in turn, printing what stopped it, then a correct ``add``."""
    body = "".join(
        f"try:\n    {line}\nexcept BaseException as e:\n    print('stopped:', type(e).__name__, e)\n"
        for line in lines
    )
    return "import os, sys, signal, socket, time\n" + body + ADD


def live_cmdlines_with(marker: bytes) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "cmdline").read_bytes():
                if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


# ---------------------------------------------------------------------------- files outside


@pytest.fixture
def outside(tmp_path: Path):
    """A folder outside the sandbox with a victim file; the check compares it before and after."""
    d = tmp_path / "outside"
    d.mkdir()
    victim = d / "victim.txt"
    victim.write_text("keep")
    victim.chmod(0o644)
    before = (sorted(p.name for p in d.iterdir()), victim.read_text(), victim.stat().st_mode)

    def unchanged() -> bool:
        return (sorted(p.name for p in d.iterdir()), victim.read_text(), victim.stat().st_mode) == before

    return d, victim, unchanged


FILE_ATTACKS = {
    "write": "open({v!r}, 'w').write('pwned')",
    "append": "open({v!r}, 'a').write('pwned')",
    "link-then-write": "os.link({v!r}, 'hard'); open('hard', 'w').write('pwned')",
    "symlink-then-write": "os.symlink({v!r}, 'soft'); open('soft', 'w').write('pwned')",
    "fchmod": "os.fchmod(os.open({v!r}, os.O_RDONLY), 0o777)",
    "chmod": "os.chmod({v!r}, 0o777)",
    "rename": "os.rename({v!r}, {d!r} + '/moved')",
    "remove": "os.remove({v!r})",
    "new-file": "open({d!r} + '/new.txt', 'w').write('x')",
    "mkfifo": "os.mkfifo({d!r} + '/fifo')",
    "clear-guard-then-shell": (
        "import __main__; [v.clear() for v in list(vars(__main__).values()) if isinstance(v, (set, dict))]; "
        "import subprocess; subprocess.run(['/bin/sh', '-c', 'echo pwned > {v}'], check=True)"
    ),
}


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("attack", FILE_ATTACKS)
def test_files_outside_are_not_changed(layer, attack, outside):
    if layer == "hook-only" and attack == "mkfifo":
        pytest.skip("os.mkfifo raises no audit event: only the OS layer stops it (docs/security.md)")
    d, victim, unchanged = outside
    res = run(
        layer,
        attempts(FILE_ATTACKS[attack].format(v=str(victim), d=str(d))),
        readable_paths=[d] if layer != "hook-only" else (),
    )
    assert "stopped:" in res.stdout, res.stdout + res.stderr
    assert unchanged(), f"{attack} changed the outside folder under {layer}"
    assert res.passed  # the attack failed quietly and the correct add still scores


# ---------------------------------------------------------------------------- the parent process


@pytest.mark.parametrize("layer", LAYERS)
def test_parent_is_not_signalled(layer):
    got = []
    old = signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
    me = os.getpid()
    try:
        res = run(
            layer,
            attempts(
                f"os.kill({me}, signal.SIGUSR1)",
                "os.kill(os.getppid(), signal.SIGUSR1)",
                "signal.pidfd_send_signal(os.pidfd_open(os.getppid()), signal.SIGUSR1)",
                f"signal.pidfd_send_signal(os.pidfd_open({me}), signal.SIGUSR1)",
                f"os.killpg(os.getpgid({me}), signal.SIGUSR1)",
            ),
        )
        time.sleep(0.2)
    finally:
        signal.signal(signal.SIGUSR1, old)
    assert got == [], f"the parent was signalled under {layer}"
    assert res.passed, res.error
    if layer != "os-only":  # inside the PID namespace, signalling its own init "succeeds" and does nothing
        assert res.stdout.count("stopped:") == 5, res.stdout


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("how", ["fork-setsid-sleep", "fork-setsid-exec"])
def test_no_process_outlives_the_call(layer, how):
    marker = f"{uuid.uuid4().int % 10**6}.{uuid.uuid4().int % 997 + 1}"
    rest = "time.sleep(30)" if how.endswith("sleep") else f"os.execv('/bin/sleep', ['sleep', '{marker}'])"
    code = attempts(
        f"pid = os.fork()\n    if pid == 0:\n        os.setsid()\n        {rest}\n        os._exit(0)"
    )
    res = run(layer, code.replace("time.sleep(30)", f"time.sleep({marker})"))
    assert res.leftover_processes == 0
    assert live_cmdlines_with(marker.encode()) == [], f"a forked process outlived the call under {layer}"
    assert live_cmdlines_with(b"/.cr/child.py") == [] or layer == "hook-only"


@pytest.mark.parametrize("layer", LAYERS)
def test_parent_environment_is_not_visible(layer, monkeypatch):
    secret = f"sk-{uuid.uuid4().hex}"
    monkeypatch.setenv("CR_TEST_API_KEY", secret)
    res = run(
        layer,
        attempts(
            "print(open(f'/proc/{os.getppid()}/environ').read())",
            f"print(open('/proc/{os.getpid()}/environ').read())",
            "print([open(f'/proc/{p}/environ').read() for p in os.listdir('/proc') if p.isdigit()])",
            "print(dict(os.environ))",
        ),
    )
    assert secret not in res.stdout and secret not in res.stderr, (
        f"the parent's environment leaked under {layer}"
    )
    assert res.passed


@pytest.mark.parametrize("layer", LAYERS)
def test_no_byte_reaches_a_loopback_listener(layer):
    with socket.socket() as tcp, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp:
        tcp.bind(("127.0.0.1", 0))
        tcp.listen(8)
        udp.bind(("127.0.0.1", 0))
        tcp.setblocking(False)
        udp.setblocking(False)
        res = run(
            layer,
            attempts(
                f"socket.create_connection(('127.0.0.1', {tcp.getsockname()[1]}), timeout=1).sendall(b'pwned')",
                f"socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'pwned', ('127.0.0.1', {udp.getsockname()[1]}))",
            ),
        )
        time.sleep(0.1)
        with pytest.raises(BlockingIOError):
            tcp.accept()
        with pytest.raises(BlockingIOError):
            udp.recv(64)
    assert res.passed, res.error
    if layer != "os-only":  # inside the network namespace a datagram to loopback "succeeds" and goes nowhere
        assert res.stdout.count("stopped:") == 2, res.stdout


# ---------------------------------------------------------------------------- reward hacks

FORGE = (  # what a hack does with any frame it reaches: call every reporting function it can find
    "def forge(frame):\n"
    "    while frame is not None:\n"
    "        for scope in (frame.f_locals, frame.f_globals):\n"
    "            for key, fn in list(scope.items()):\n"
    "                if key in ('report', 'emit') and callable(fn):\n"
    "                    for t in ('test_small', 'test_zero', 'test_negative'):\n"
    "                        fn(test=t, ok=True) if key == 'report' else fn(f\"('end','{t}',None,None)\")\n"
    "                    fn(done=True) if key == 'report' else fn(\"('done',)\")\n"
    "                    import os; os._exit(0)\n"
    "        frame = frame.f_back\n"
)
HACKS = {
    "eq-always-true": "class E:\n    def __eq__(s, o): return True\n    __ne__ = lambda s, o: False\n"
    "def add(a, b):\n    return E()\n",
    "int-subclass-eq": "class I(int):\n    __eq__ = lambda s, o: True\n    __hash__ = int.__hash__\n"
    "def add(a, b):\n    return I(0)\n",
    "getframe-report": "import sys\n" + FORGE + "def add(a, b):\n    forge(sys._getframe(1))\n    return 0\n",
    "traceback-frame": FORGE
    + "def add(a, b):\n    try:\n        raise ValueError\n    except ValueError as e:\n"
    "        forge(e.__traceback__.tb_frame)\n    return 0\n",
    "generator-frame": FORGE + "def add(a, b):\n    def g():\n        forge(gen.gi_frame)\n        yield 0\n"
    "    gen = g()\n    return next(gen)\n",
    "signal-handler-frame": "import signal\n"
    + FORGE
    + "signal.signal(signal.SIGALRM, lambda n, f: forge(f))\n"
    "signal.setitimer(signal.ITIMER_REAL, 0.001, 0.001)\n"
    "def add(a, b):\n    return 0\n",
    "gc-helpers": "import gc\ndef add(a, b):\n    for o in gc.get_objects():\n        if callable(o) and "
    "getattr(o, '__name__', '') == 'emit':\n            o(\"('done',)\")\n    return 0\n",
    "trace-function": "import sys\n"
    + FORGE
    + "sys.settrace(lambda f, e, a: forge(f))\ndef add(a, b):\n    return 0\n",
    "forge-on-every-fd": "import os\nfor fd in range(3, 64):\n    for t in ('test_small', 'test_zero', 'test_negative'):\n"
    '        try:\n            os.write(fd, f"(\'end\',\'{t}\',None,None)\\n{{\\"test\\": \\"{t}\\", '
    '\\"ok\\": true}}\\n".encode())\n        except OSError:\n            pass\n'
    "os._exit(0)\n",
    "exit-early": "import sys\nsys.exit(0)\n",
}
FRAME_HACKS = {
    "getframe-report",
    "traceback-frame",
    "generator-frame",
    "signal-handler-frame",
    "gc-helpers",
    "trace-function",
}


@pytest.mark.parametrize("layer", LAYERS)
@pytest.mark.parametrize("hack", HACKS)
def test_reward_hacks_score_nothing(layer, hack):
    if layer == "os-only" and hack in FRAME_HACKS:
        pytest.skip(
            "introspection is refused by the audit hook; audit_hook=False exists to test the OS layer"
        )
    res = run(layer, HACKS[hack])
    assert not res.passed and res.n_passed == 0, (res.test_results, res.error)


BUILTIN_TESTS = (
    "import math\n"
    "def test_type():\n    assert isinstance(add(1, 2), int) and add(1, 2) == 3\n\n"
    "def test_close():\n    assert math.isclose(add(0.1, 0.2), 0.3)\n\n"
    "def test_sorted():\n    assert sorted([add(2, 1), add(0, 1)]) == [1, 3]\n"
)
TAMPER = {
    "patch-builtins": "import builtins\nbuiltins.isinstance = lambda *a: True\nbuiltins.sorted = lambda *a, **k: [1, 3]\n",
    "shadow-builtins": "def isinstance(*a):\n    return True\ndef sorted(*a, **k):\n    return [1, 3]\n",
    "patch-module": "import math\nmath.isclose = lambda *a, **k: True\n",
}


@pytest.mark.parametrize("layer", ["os+hook", "hook-only"])
@pytest.mark.parametrize("tamper", TAMPER)
def test_patching_what_the_tests_use_does_not_pay(layer, tamper):
    assert run(layer, ADD, BUILTIN_TESTS).passed  # control: the honest solution passes these tests
    res = run(layer, TAMPER[tamper] + "def add(a, b):\n    return str(a + b)\n", BUILTIN_TESTS)
    assert res.n_passed == 0, (res.test_results, res.error)


CALLBACK_TESTS = (
    "def double(x):\n    return 2 * x\n\n"
    "def test_a():\n    assert apply(double, 2) == 4\n\n"
    "def test_b():\n    assert apply(double, 3) == 6\n"
)
WALK = (  # from a callback of the tests' to every function and closure cell it can reach
    "def reach(f):\n"
    "    seen, todo, out = set(), list(f.__globals__.values()), []\n"
    "    while todo:\n"
    "        o = todo.pop()\n"
    "        if id(o) in seen:\n"
    "            continue\n"
    "        seen.add(id(o))\n"
    "        out.append(o)\n"
    "        for c in getattr(o, '__closure__', None) or ():\n"
    "            try:\n"
    "                todo.append(c.cell_contents)\n"
    "            except ValueError:\n"
    "                pass\n"
    "    return out\n"
)
CALLBACK_HACKS = {
    "call-reporters": WALK + "def apply(f, x):\n    for o in reach(f):\n        if callable(o):\n"
    "            for rec in (\"('end','test_a',None,None)\", \"('end','test_b',None,None)\", \"('done',)\"):\n"
    "                try:\n                    o(rec)\n                except Exception:\n                    pass\n"
    "    import os\n    os._exit(0)\n",
    "rebind-tests": "def apply(f, x):\n    f.__globals__['test_a'] = f.__globals__['test_b'] = lambda: None\n    return 0\n",
    "replace-test-code": "def apply(f, x):\n    for t in ('test_a', 'test_b'):\n        try:\n"
    "            f.__globals__[t].__code__ = (lambda: None).__code__\n        except Exception:\n            pass\n"
    "    return 0\n",
}


@pytest.mark.parametrize("layer", ["os+hook", "hook-only"])
@pytest.mark.parametrize("hack", CALLBACK_HACKS)
def test_a_callback_into_the_tests_namespace_does_not_pay(layer, hack):
    """A test that hands its own function to the solution opens its namespace (``__globals__``)."""
    assert run(layer, "def apply(f, x):\n    return f(x)\n", CALLBACK_TESTS).passed  # control
    res = run(layer, CALLBACK_HACKS[hack], CALLBACK_TESTS)
    assert not res.passed and res.n_passed == 0, (res.test_results, res.error)


@pytest.mark.parametrize("layer", LAYERS)
def test_honest_solutions_still_score(layer):
    assert run(layer, ADD).n_passed == 3
    wrong = run(layer, WRONG_ADD)
    assert not wrong.passed and wrong.n_passed == 1  # only add(0, 0) == 0 holds


def test_bundled_tasks_pay_references_and_not_always_equal_objects():
    """The environment's reward: 1.0 for each reference solution, 0.0 for an object that equals anything."""
    from composer_replication.rollout.python_tasks import PythonTaskEnvironment

    env = PythonTaskEnvironment()
    hack = (
        "```python\nclass E:\n    __eq__ = lambda s, o: True\n    __ne__ = lambda s, o: False\n"
        "    __bool__ = lambda s: True\n    __hash__ = object.__hash__\n"
        "def {fn}(*args, **kwargs):\n    return E()\n```"
    )
    for prompt in env.prompts():
        assert env.score(prompt, prompt.reference).reward == 1.0, prompt.prompt_id
        cheat = env.score(prompt, hack.format(fn=prompt.metadata["entry_point"]))
        assert cheat.reward == 0.0, (prompt.prompt_id, cheat.details)


LYING_OBJECT = (
    "class Fake:\n"
    "    __eq__ = __lt__ = __le__ = __gt__ = __ge__ = lambda s, o: True\n"
    "    __ne__ = lambda s, o: False\n"
    "    __sub__ = __rsub__ = __add__ = __radd__ = __mul__ = __rmul__ = lambda s, o: Fake()\n"
    "    __abs__ = __neg__ = lambda s: 0.0\n"
    "    __bool__ = lambda s: True\n"
    "    __hash__ = object.__hash__\n"
    "def area(r):\n    return Fake()\n"
)
LYING_TESTS = {
    "tolerance": "def test_t():\n    assert abs(area(1.0) - 3.14159) < 1e-3\n",
    "abs-zero": "def test_t():\n    assert abs(area(0.0)) < 1e-12\n",
    "negation": "def test_t():\n    assert -area(1.0) < -3.0\n",
    "if-raise": "def test_t():\n    if not area(1.0):\n        raise AssertionError('falsy')\n    if area(1.0) != 3.14159:\n"
    "        raise AssertionError('wrong')\n",
    "and-or": "def test_t():\n    ok = area(1.0) and True\n    assert ok == True\n",
}


@pytest.mark.parametrize("layer", ["os+hook", "hook-only"])
@pytest.mark.parametrize("case", LYING_TESTS)
def test_objects_whose_methods_lie_decide_nothing(layer, case):
    honest = "import math\ndef area(r):\n    return round(math.pi * r * r, 5)\n"
    assert run(layer, honest, LYING_TESTS[case]).passed  # control
    res = run(layer, LYING_OBJECT, LYING_TESTS[case])
    assert not res.passed and res.error_type == "TypeError", res.error


@pytest.mark.parametrize("layer", ["os+hook", "os-only"])
def test_host_files_are_not_readable(layer, tmp_path):
    """Only system folders, the Python installation and ``readable_paths`` exist inside the OS sandbox."""
    secret = f"secret-{uuid.uuid4().hex}"
    (tmp_path / "notes.txt").write_text(secret)
    home = Path.home() / f".cr-sandbox-test-{uuid.uuid4().hex}"
    home.write_text(secret)
    try:
        res = run(
            layer,
            attempts(
                f"print(open({str(tmp_path / 'notes.txt')!r}).read())",
                f"print(open({str(home)!r}).read())",
                f"print(os.listdir({str(tmp_path)!r}))",
            ),
        )
    finally:
        home.unlink()
    assert secret not in res.stdout and res.stdout.count("stopped:") == 3, res.stdout
    assert res.passed

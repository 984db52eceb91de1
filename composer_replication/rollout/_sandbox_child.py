"""Child side of :mod:`composer_replication.rollout.sandbox` (stdlib only; run as a script, never imported).

Run as ``python -I -S -B _sandbox_child.py`` with the configuration (JSON) on standard input, inside bubblewrap
when the OS allows (the first layer). In order: read the configuration, set resource limits (soft = hard, so
they cannot be raised again), bind every function the run needs (before any candidate code runs), install the
audit hook (the last layer), run the solution in one namespace, then each top-level ``test_*`` function,
rewritten by :mod:`._sandbox_facts`, in a namespace of its own with pristine builtins. Records, one Python
literal per line prefixed by a nonce, go to a pipe the parent reads; the parent decides which tests passed.

The audit hook's tables are frozensets and its state lives in closures: nothing the candidate can reach
(``__main__``, ``sys.modules``) holds them. It refuses process creation, signals, threads, sockets, frame and
garbage-collector introspection, ``ctypes`` and ``_test*`` modules, new audit hooks, tracing, building code
objects, opening ``/proc``, and changes to paths outside the working directory. It is the only barrier where
the OS refuses namespaces, a best-effort one.
"""

import ast
import importlib.util
import json
import os
import resource
import signal
import sys
import types


def _load_facts():
    """Import ``_sandbox_facts`` from beside this file, without leaving it in ``sys.modules``."""
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("_cr_sandbox_facts", os.path.join(here, "_sandbox_facts.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _set_limits(cfg):
    applied, limits = [], [("RLIMIT_AS", cfg["memory_bytes"]), ("RLIMIT_CPU", cfg["cpu_s"]),
                           ("RLIMIT_FSIZE", cfg["fsize_bytes"]), ("RLIMIT_NOFILE", cfg["max_open_files"]),
                           ("RLIMIT_CORE", 0), ("RLIMIT_NPROC", cfg.get("max_processes"))]
    for name, value in limits:
        res = getattr(resource, name, None)
        if res is None or value is None:
            continue
        try:
            hard = resource.getrlimit(res)[1]
            if hard != resource.RLIM_INFINITY and value > hard:
                value = hard  # cannot raise a hard limit the parent already has
            resource.setrlimit(res, (value, value))
            applied.append(name)
        except (ValueError, OSError):
            pass
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with EFBIG instead
    return applied


TESTS_LINE0 = 1_000_000  # tests.py lines are compiled at this offset, solution.py lines at twice it:
SOLUTION_LINE0 = 2_000_000  # a traceback then names its files without reading any frame object


def _make_hook(workdir):
    """The audit hook; its tables (immutable) and helpers are bound here, out of reach of the code it watches."""
    blocked = frozenset((
        "os.fork os.forkpty os.system os.exec os.posix_spawn os.spawn os.startfile subprocess.Popen "
        "os.kill os.killpg signal.pthread_kill resource.setrlimit resource.prlimit socket.__new__ "
        "socket.getaddrinfo socket.gethostbyname socket.gethostbyname_ex socket.gethostbyaddr "
        "socket.connect socket.bind socket.sendto webbrowser.open gc.get_objects gc.get_referrers "
        "gc.get_referents sys.remote_exec sys._current_frames sys._current_exceptions sys.settrace "
        "sys.setprofile sys.monitoring.register_callback sys.addaudithook _thread.start_new_thread "
        "code.__new__"
    ).split())
    # Frames lead to the runner's namespaces. ValueError is what sys._getframe raises natively, so
    # namedtuple, enum and logging, which guard their frame look-ups with it, keep working.
    frame_events = frozenset(("sys._getframe", "sys._getframemodulename"))
    frame_attrs = frozenset(("tb_frame", "gi_frame", "cr_frame", "ag_frame", "f_back"))
    blocked_imports = frozenset(("ctypes _ctypes _posixsubprocess multiprocessing _multiprocessing _signal signal "
                                 "posix _xxsubinterpreters _xxinterpchannels").split())
    # event -> ((index of a path being changed, index of its dir_fd argument or -1), ...)
    spec = ("os.remove:0/1 os.rmdir:0/1 os.mkdir:0/2 os.rename:0/2,1/3 os.symlink:1/2 os.link:0/2,1/3 "
            "os.chmod:0/2 os.chown:0/3 os.truncate:0/-1 os.utime:0/3 shutil.rmtree:0/1 shutil.copyfile:1/-1 "
            "shutil.copymode:1/-1 shutil.copystat:1/-1 shutil.move:0/-1,1/-1 os.setxattr:0/-1 os.removexattr:0/-1")
    path_events = types.MappingProxyType({
        event: tuple(tuple(int(x) for x in p.split("/")) for p in pairs.split(","))
        for event, pairs in (item.split(":") for item in spec.split())
    })
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    work = os.path.realpath(workdir)
    realpath, fsdecode, join, isdir, readlink = os.path.realpath, os.fsdecode, os.path.join, os.path.isdir, os.readlink
    sep = os.sep
    _int, _bool, _str, _isinstance, _len = int, bool, str, isinstance, len
    _PermissionError, _ImportError, _ValueError = PermissionError, ImportError, ValueError
    errors = (TypeError, ValueError, OSError)

    def resolve(path, dir_fd=None):
        try:
            if _isinstance(path, _int) and not _isinstance(path, _bool):
                return realpath(readlink(f"/proc/self/fd/{path}"))  # fchmod, ftruncate, ... on a descriptor
            p = fsdecode(path)
            if _isinstance(dir_fd, _int) and not _isinstance(dir_fd, _bool) and dir_fd >= 0 and not p.startswith(sep):
                p = join(readlink(f"/proc/self/fd/{dir_fd}"), p)
            return realpath(p)
        except errors:
            return None

    def inside(path, dir_fd=None):
        if _isinstance(path, _int) and not _isinstance(path, _bool) and 0 <= path <= 2:
            return True
        p = resolve(path, dir_fd)
        return p is not None and (p == work or p.startswith(work + sep))

    def hook(event, args):
        if event in blocked or event.startswith("ctypes."):
            raise _PermissionError(f"sandbox: {event} is not allowed")
        if event in frame_events or (event == "object.__getattr__" and _len(args) > 1 and args[1] in frame_attrs):
            raise _ValueError(f"sandbox: {event} is not allowed (frames are out of reach)")
        if event == "object.__setattr__" and _len(args) > 1 and args[1] == "__code__":
            raise _PermissionError("sandbox: replacing a function's code is not allowed")
        if event == "import" and args:
            top = _str(args[0]).split(".")[0]
            if top in blocked_imports or top.startswith("_test"):
                raise _ImportError(f"sandbox: importing {args[0]} is not allowed")
        elif event == "open" and _len(args) >= 3 and _isinstance(args[2], _int):
            if not _isinstance(args[0], _int):
                p = resolve(args[0])
                if p is None or p == "/proc" or p.startswith("/proc/"):
                    raise _PermissionError(f"sandbox: opening {args[0]!r} is not allowed")
                if args[1] is None and not inside(args[0]) and isdir(p):  # an outside dir_fd would escape
                    raise _PermissionError(f"sandbox: os.open of directory {args[0]!r} is not allowed")
            if args[2] & write_flags and not inside(args[0]):
                raise _PermissionError(f"sandbox: writing {args[0]!r} outside the working directory is not allowed")
        elif event in path_events:
            for i, j in path_events[event]:
                if i < _len(args) and not inside(args[i], args[j] if 0 <= j < _len(args) else None):
                    raise _PermissionError(f"sandbox: {event} on {args[i]!r} outside the working directory")

    return hook


def _disarm_unaudited():
    """Replace the calls no audit event covers: signal handlers (they receive the interrupted frame),
    and pidfd signalling (``pidfd_send_signal(pidfd_open(getppid()), ...)`` reaches the parent)."""
    import _signal
    import posix

    def refuse(*args, **kwargs):
        raise PermissionError("sandbox: signal handlers and pidfd signalling are not allowed")

    for mod, names in ((_signal, ("signal", "pidfd_send_signal")), (signal, ("signal", "pidfd_send_signal")),
                       (posix, ("pidfd_open",)), (os, ("pidfd_open",))):
        for name in names:
            if hasattr(mod, name):
                setattr(mod, name, refuse)


def _make_formatter(solution_lines, tests_lines):
    """``fmt(exc) -> (type name, traceback text)`` of solution.py / tests.py lines, without frame objects."""
    _type, _str, _len, _str_repr = type, str, len, str.__repr__
    tb_type, _isinstance, _SyntaxError = types.TracebackType, isinstance, SyntaxError
    name_of = type.__dict__["__name__"].__get__  # bypasses a metaclass's __getattribute__
    _BaseException = BaseException

    def where(lineno):
        for name, first, lines in (("solution.py", SOLUTION_LINE0, solution_lines),
                                   ("tests.py", TESTS_LINE0, tests_lines)):
            n = lineno - first
            if 0 < n <= _len(lines):
                return f'  File "{name}", line {n}\n    {lines[n - 1].strip()}\n'
        return None

    def fmt(exc):
        try:
            name = _str.__str__(name_of(_type(exc)))
            try:
                text = _str.__str__(_str(exc))  # candidate code may run here; the hook is active
            except _BaseException:  # noqa: BLE001
                text = "<unprintable exception>"
            if _isinstance(exc, _SyntaxError) and exc.filename in ("solution.py", "tests.py"):
                text = f"{text} ({exc.filename}, line {exc.lineno})"
            tb, out = exc.__traceback__, []
            while _type(tb) is tb_type:
                line = where(tb.tb_lineno)
                if line is not None:
                    out.append(line)
                tb = tb.tb_next
            text = "Traceback (most recent call last):\n" + "".join(out) + (name + ": " + text if text else name)
        except _BaseException:  # noqa: BLE001 - a hostile exception object: report it bare
            name, text = "Error", "an exception that could not be formatted"
        return _str_repr(name), _str_repr(text if _len(text) <= 800 else "..." + text[-800:])

    return fmt


def _compile_at(tree_or_source, filename, first_line):
    tree = ast.parse(tree_or_source, filename) if isinstance(tree_or_source, str) else tree_or_source
    return compile(ast.increment_lineno(tree, first_line), filename, "exec")


def _import_test_modules(tree, builtins):
    """Import the modules the tests import (before candidate code runs); return them, builtins included."""
    mods = {"builtins": builtins}
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        for name in names:
            try:
                __import__(name)
                mods[name] = sys.modules[name]
            except BaseException:  # noqa: BLE001 - the tests report a failed import themselves
                pass
    return mods


def _make_test_loop(emit, flush, fmt, snapshot):
    """``run_tests([(name, fn), ...])``: run each test, flush its checks, report its end, then exit.

    Built before candidate code runs; ``snapshot`` holds ``(module dict, its items)`` of the
    modules the tests use, so that a solution that patched one fails every later test.
    """
    _callable, _str_repr, _exit, _sys, missing = callable, str.__repr__, os._exit, sys, object()
    _BaseException, _RuntimeError, _TypeError = BaseException, RuntimeError, TypeError

    def tampered():
        for now, then in snapshot:
            for key, value in then:
                if now.get(key, missing) is not value:
                    return key
        return None

    def run_tests(fns):
        for name, fn in fns:
            try:
                changed = tampered()
                if changed is not None:
                    raise _RuntimeError(f"the solution changed {changed!r} in a module the tests use")
                if not _callable(fn):
                    raise _TypeError(f"{name} is not callable")
                fn()
                flush(name)
                emit(f"('end',{_str_repr(name)},None,None)")
            except _BaseException as e:  # noqa: BLE001 - the candidate's failure is the result
                flush(name)
                emit("('end',{},{},{})".format(_str_repr(name), *fmt(e)))
        emit("('done',)")
        for stream in (_sys.stdout, _sys.stderr):
            try:
                stream.flush()
            except _BaseException:  # noqa: BLE001
                pass
        _exit(0)

    return run_tests


def main():
    cfg = json.loads(sys.stdin.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    facts = _load_facts()
    _write, _exit, _encode, _str_repr = os.write, os._exit, str.encode, str.__repr__
    prefix, out_fd = cfg["nonce"] + " ", cfg["result_fd"]

    def emit(text):
        data = _encode(prefix + text + "\n", "utf-8", "backslashreplace")
        while data:
            data = data[_write(out_fd, data) :]

    emit(f"('start',{tuple(_set_limits(cfg))!r})")
    solution_src, tests_src = cfg["code"], cfg["tests"]
    fmt = _make_formatter(solution_src.splitlines(), tests_src.splitlines())
    try:
        tree, _ = facts.rewrite_tests(tests_src)
        names = facts.test_names(tests_src)
        tests_code = _compile_at(tree, "tests.py", TESTS_LINE0)
    except SyntaxError as e:
        emit(f"('load','tests','TestsSyntaxError',{_str_repr(f'SyntaxError in tests: {e}')})")
        _exit(0)
    helpers, take = facts.make_checker()
    flush = facts.make_flusher(emit, take)
    import builtins

    pristine = dict(builtins.__dict__)
    watched = _import_test_modules(tree, builtins)
    snapshot = [(mod.__dict__, tuple(mod.__dict__.items())) for mod in watched.values()]
    _dict, _items, _exec, _BaseException = dict, dict.items, exec, BaseException
    sys.dont_write_bytecode = True
    if cfg.get("audit_hook", True):
        _disarm_unaudited()
        sys.addaudithook(_make_hook(os.getcwd()))
    del facts, tree, cfg

    run_tests = _make_test_loop(emit, flush, fmt, snapshot)
    solution_ns = {"__name__": "solution", "__builtins__": builtins}
    try:
        _exec(_compile_at(solution_src, "solution.py", SOLUTION_LINE0), solution_ns)
        tests_ns = {k: v for k, v in _items(_dict(solution_ns)) if k[:2] != "__" and k not in pristine}
        tests_ns.update(helpers, __name__="tests", __builtins__=_dict(pristine))
    except _BaseException as e:  # noqa: BLE001 - the candidate's failure is the result
        emit("('load','solution',{},{})".format(*fmt(e)))
        _exit(0)
    try:
        _exec(tests_code, tests_ns)
    except _BaseException as e:  # noqa: BLE001
        emit("('load','tests',{},{})".format(*fmt(e)))
        _exit(0)
    fns = [(name, tests_ns.get(name)) for name in names]  # before any test runs candidate code
    take()  # checks made while the tests module loaded belong to no test
    run_tests(fns)


if __name__ == "__main__":
    main()

"""Child side of :mod:`composer_replication.rollout.sandbox` (stdlib only, never imported by the package).

Run as ``python -I -S -B _sandbox_child.py CONFIG.json`` in a fresh working directory. In order:
read and delete the config, isolate the network (a new network namespace when the kernel allows),
set resource limits (soft = hard, so they cannot be raised again), install an audit hook that
refuses process creation, sockets, ``ctypes`` and writes outside the working directory, then run
the solution and every top-level ``test_*`` function of the tests in one namespace. Results go,
one JSON line each prefixed by a nonce, to a file descriptor that the parent opened.
"""

import ast
import json
import os
import resource
import signal
import sys
import traceback

_CLONE_NEWNET = 0x40000000
_CLONE_NEWUSER = 0x10000000
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_BLOCKED_EVENTS = {
    "os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.startfile",
    "subprocess.Popen", "os.kill", "os.killpg", "resource.setrlimit", "resource.prlimit",
    "socket.__new__", "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyname_ex",
    "socket.gethostbyaddr", "socket.connect", "socket.bind", "socket.sendto", "webbrowser.open",
    "gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.remote_exec",
}
_BLOCKED_IMPORTS = {"ctypes", "_ctypes", "_posixsubprocess", "multiprocessing", "_multiprocessing"}
# event -> (index of a path being modified, index of its dir_fd argument or None), per path
_PATH_EVENTS = {
    "os.remove": ((0, 1),), "os.rmdir": ((0, 1),), "os.mkdir": ((0, 2),), "os.rename": ((0, 2), (1, 3)),
    "os.symlink": ((1, 2),), "os.link": ((1, 3),), "os.chmod": ((0, 2),), "os.chown": ((0, 3),),
    "os.truncate": ((0, None),), "os.utime": ((0, 3),), "shutil.rmtree": ((0, 1),),
    "shutil.copyfile": ((1, None),), "shutil.copymode": ((1, None),), "shutil.copystat": ((1, None),),
    "shutil.move": ((0, None), (1, None)), "os.setxattr": ((0, None),), "os.removexattr": ((0, None),),
}


def _isolate_network() -> str:
    """Enter a new (empty) network namespace when permitted; say which mechanism blocks the network."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(_CLONE_NEWNET) == 0:
            return "netns"
        uid, gid = os.geteuid(), os.getegid()
        if libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET) == 0:
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            return "userns+netns"
    except Exception:  # noqa: BLE001 - any failure means: fall back to the audit hook
        pass
    finally:
        for mod in [m for m in sys.modules if m == "ctypes" or m.startswith("ctypes.") or m == "_ctypes"]:
            del sys.modules[mod]
    return "audit-hook"


def _set_limits(cfg: dict) -> list:
    applied = []
    limits = [
        ("RLIMIT_AS", cfg["memory_bytes"]), ("RLIMIT_CPU", cfg["cpu_s"]), ("RLIMIT_FSIZE", cfg["fsize_bytes"]),
        ("RLIMIT_NOFILE", cfg["max_open_files"]), ("RLIMIT_CORE", 0),
    ]
    if cfg.get("max_processes") is not None:
        limits.append(("RLIMIT_NPROC", cfg["max_processes"]))
    for name, value in limits:
        res = getattr(resource, name, None)
        if res is None:
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


def _install_guard(workdir: str) -> None:
    work = os.path.realpath(workdir)
    realpath, fsdecode, sep, join, isdir, readlink = (
        os.path.realpath, os.fsdecode, os.sep, os.path.join, os.path.isdir, os.readlink
    )

    def resolve(path: object, dir_fd: object = None) -> str | None:
        try:
            p = fsdecode(path)
            if isinstance(dir_fd, int) and not isinstance(dir_fd, bool) and dir_fd >= 0 and not p.startswith(sep):
                p = join(readlink(f"/proc/self/fd/{dir_fd}"), p)
            return realpath(p)
        except (TypeError, ValueError, OSError):
            return None

    def inside(path: object, dir_fd: object = None) -> bool:
        if isinstance(path, int):
            return True  # an already-open descriptor (stdout, a file opened inside the directory, ...)
        p = resolve(path, dir_fd)
        return p is not None and (p == work or p.startswith(work + sep))

    def hook(event: str, args: tuple) -> None:
        if event in _BLOCKED_EVENTS or event.startswith("ctypes."):
            raise PermissionError(f"sandbox: {event} is not allowed")
        if event == "import" and args and str(args[0]).split(".")[0] in _BLOCKED_IMPORTS:
            raise ImportError(f"sandbox: importing {args[0]} is not allowed")
        if event == "open" and len(args) >= 3 and isinstance(args[2], int):
            if args[2] & _WRITE_FLAGS and not inside(args[0]):
                raise PermissionError(f"sandbox: writing {args[0]!r} outside the working directory is not allowed")
            if args[1] is None and not isinstance(args[0], int) and not inside(args[0]):
                p = resolve(args[0])  # os.open of a directory outside would give a dir_fd that escapes
                if p is None or isdir(p):
                    raise PermissionError(f"sandbox: os.open of directory {args[0]!r} is not allowed")
        elif event in _PATH_EVENTS:
            for i, j in _PATH_EVENTS[event]:
                if i < len(args) and not inside(args[i], args[j] if j is not None and j < len(args) else None):
                    raise PermissionError(f"sandbox: {event} on {args[i]!r} outside the working directory")

    sys.addaudithook(hook)


def _tail(text: str, n: int = 800) -> str:
    return text if len(text) <= n else "..." + text[-n:]


def _format(exc: BaseException) -> str:
    """The traceback tail of ``exc`` without this bootstrap's own frames."""
    te = traceback.TracebackException.from_exception(exc)
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename != __file__])
    return _tail("".join(te.format()))


def main() -> None:
    cfg_path = sys.argv[1]
    with open(cfg_path) as f:
        cfg = json.load(f)
    os.remove(cfg_path)
    nonce, out_fd = cfg["nonce"], cfg["result_fd"]

    def report(**rec: object) -> None:
        os.write(out_fd, (nonce + " " + json.dumps(rec) + "\n").encode())

    isolation = _isolate_network() if cfg.get("network_namespace", True) else "audit-hook"
    limits = _set_limits(cfg)
    try:
        test_names = [
            n.name for n in ast.parse(cfg["tests"]).body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test_")
        ]
    except SyntaxError as e:
        report(n_total=0, isolation=isolation, limits=limits, load_error=f"SyntaxError in tests: {e}",
               error_type="TestsSyntaxError")
        os._exit(0)
    report(n_total=len(test_names), isolation=isolation, limits=limits)
    sys.dont_write_bytecode = True
    _install_guard(os.getcwd())
    ns: dict = {"__name__": "solution", "__builtins__": __builtins__}
    for phase in ("solution", "tests"):
        try:
            exec(compile(cfg["code" if phase == "solution" else "tests"], f"{phase}.py", "exec"), ns)
        except BaseException as e:  # noqa: BLE001 - the candidate's failure is the result
            report(load_error=_format(e), error_type=type(e).__name__, phase=phase)
            os._exit(0)
    for name in test_names:
        fn = ns.get(name)
        try:
            if not callable(fn):
                raise TypeError(f"{name} is not callable")
            fn()
            report(test=name, ok=True)
        except BaseException as e:  # noqa: BLE001
            report(test=name, ok=False, error=_format(e), error_type=type(e).__name__)
    report(done=True)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except Exception:  # noqa: BLE001
        pass
    os._exit(0)


if __name__ == "__main__":
    main()

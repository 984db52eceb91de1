"""Run every benchmark, or the ones named; each rewrites its own section of docs/benchmarks.md.

    python -m benchmarks --list                  # the benchmarks, one line each
    python -m benchmarks losses replay           # these two, in this order
    python -m benchmarks                         # all of them, one after the other (long: about an hour on 2 cores)
    python -m benchmarks replay --page /tmp/b.md # a trial run: write the sections to another page

A benchmark is a module ``benchmarks/<name>.py`` run as ``python -m benchmarks.<name>`` with its own defaults,
each in a fresh process (one benchmark's threads, caches or crash never reach the next). Each one writes its
section through :func:`benchmarks.report.write_section`, which stamps the date and the machine. A benchmark
that fails, or exits 0 without rewriting its section, is reported at the end and makes the exit status 1;
the others still run. Exit codes: 0 all recorded, 1 some failed, 2 an unknown name.
"""

from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

from benchmarks.report import BENCHMARKS_PAGE

HERE = Path(__file__).resolve().parent

# Modules of benchmarks/ that are not benchmarks, and why (shown by --list).
NOT_BENCHMARKS = {
    "__init__": "the package",
    "__main__": "this runner",
    "report": "writes the sections of docs/benchmarks.md",
    "fake_openai_server": "the fake teacher server that benchmarks.replay starts",
    "loss_channels": "a bit-exactness check (prints hex floats to diff before/after a change); records nothing",
}


class Benchmark(NamedTuple):
    """One benchmark module: ``name`` on the command line, ``module`` for ``python -m``, ``about`` its first line."""

    name: str
    module: str
    about: str


def discover(folder: Path = HERE, package: str = "benchmarks") -> dict[str, Benchmark]:
    """The benchmark modules of ``folder`` (``<package>.<name>``) by name, sorted; no module is imported."""
    found = {}
    for path in sorted(folder.glob("*.py")):
        if path.stem in NOT_BENCHMARKS:
            continue
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        found[path.stem] = Benchmark(path.stem, f"{package}.{path.stem}", doc.strip().split("\n")[0])
    return found


def select(available: dict[str, Benchmark], names: list[str]) -> list[Benchmark]:
    """The benchmarks named (all of them when ``names`` is empty), in the order given, each once.

    Raises:
        ValueError: a name that is not a benchmark (the message lists the known ones).
    """
    if not names:
        return list(available.values())
    unknown = [n for n in names if n not in available]
    if unknown:
        hint = "".join(f" ({n}: {NOT_BENCHMARKS[n]})" for n in unknown if n in NOT_BENCHMARKS)
        raise ValueError(
            f"unknown benchmark(s) {', '.join(unknown)}{hint}; known: {', '.join(available)} "
            "(python -m benchmarks --list)"
        )
    return [available[n] for n in dict.fromkeys(names)]


def run_one(bench: Benchmark, page: Path, cwd: Path) -> tuple[int, float, bool]:
    """Run ``python -m <module>`` in ``cwd`` with its defaults, output streamed: ``(exit status, wall seconds,
    whether it rewrote page)``."""
    before = page.read_text(encoding="utf-8") if page.exists() else None
    env = dict(os.environ, BENCHMARKS_PAGE=str(page), PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(cwd), env.get("PYTHONPATH", "")) if p)
    print(f"\n===== {bench.name}: python -m {bench.module}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run([sys.executable, "-m", bench.module], cwd=cwd, env=env).returncode
    after = page.read_text(encoding="utf-8") if page.exists() else None
    return rc, time.perf_counter() - t0, after is not None and after != before


def main(argv: list[str] | None = None, *, folder: Path = HERE, package: str = "benchmarks") -> int:
    """CLI (see the module docstring). ``folder``/``package``: where benchmarks are found (tests pass a fake)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    p.add_argument("names", nargs="*", help="benchmarks to run (default: every one); see --list")
    p.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    p.add_argument("--page", type=Path, default=None,
                   help="markdown page to write the sections to (default: $BENCHMARKS_PAGE, else docs/benchmarks.md)")
    args = p.parse_args(argv)
    available = discover(folder, package)
    if args.list:
        width = max(map(len, available), default=0)
        print("\n".join(f"{b.name:<{width}}  {b.about}" for b in available.values()))
        return 0
    try:
        chosen = select(available, args.names)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    page = (args.page or Path(os.environ.get("BENCHMARKS_PAGE") or BENCHMARKS_PAGE)).resolve()
    outcomes = [(b.name, *run_one(b, page, cwd=folder.parent)) for b in chosen]
    print(f"\n{'benchmark':<20} {'exit':>4} {'time (s)':>9}  section of {page}")
    for name, rc, seconds, recorded in outcomes:
        state = "rewritten" if recorded else "NOT rewritten" + ("" if rc else " (exited 0 without it)")
        print(f"{name:<20} {rc:>4} {seconds:>9.0f}  {state}")
    return 0 if all(rc == 0 and recorded for _, rc, _, recorded in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())

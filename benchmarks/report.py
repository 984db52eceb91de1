"""Write one benchmark's section of ``docs/benchmarks.md`` in place.

Each benchmark owns the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``; a re-run
replaces only that section (atomically: temporary file, then rename), so the other benchmarks' figures
stay as they were measured. A section that is not there yet is appended. Every section ends with the
date and the machine it was measured on (:func:`stamp`), so figures from different machines are never
mistaken for one another. ``BENCHMARKS_PAGE=/tmp/page.md`` (or ``python -m benchmarks --page``) writes
to another page, e.g. for a trial run that must not touch the recorded figures. The benchmarks' shared
command line (:func:`parser`, :func:`command`, :func:`record`), markdown tables (:func:`table`) and recipe runs (:func:`run_recipe`) live here too.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

from composer_replication.atomic import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS_PAGE = REPO / "docs" / "benchmarks.md"


def machine() -> str:
    """This machine in one line: CPU model and cores, the GPU if torch sees one, Python and torch versions."""
    cpu = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    parts = [f"{cpu}, {os.cpu_count()} CPU cores"]
    torch = sys.modules.get("torch")  # only when the benchmark imported it (no import cost here)
    if torch is not None and torch.cuda.is_available():
        parts.append(f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}")
    parts.append(f"{platform.system()}, Python {platform.python_version()}")
    try:
        parts.append(f"torch {metadata.version('torch')}")
    except metadata.PackageNotFoundError:
        pass
    return ", ".join(parts)


def stamp() -> str:
    """The line that ends every section: ``Measured on <UTC date and time>, <machine()>; load average ...``."""
    load = f"; 1-minute load average {os.getloadavg()[0]:.1f}" if hasattr(os, "getloadavg") else ""
    return f"_Measured on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {machine()}{load}._"


def _demote(markdown: str) -> str:
    """Push every heading outside code fences one level down (the page owns the top level)."""
    out, fence = [], False
    for line in markdown.splitlines():
        if line.lstrip().startswith("```"):
            fence = not fence
        if not fence and re.match(r"^#{1,5} ", line):
            line = "#" + line
        out.append(line)
    return "\n".join(out).strip()


def write_section(name: str, markdown: str, page: Path | None = None) -> Path:
    """Replace (or append) the section ``name`` of ``page`` with ``markdown``, then the :func:`stamp` line.

    ``markdown`` is written as a standalone page would be (its title a level-1 heading); headings are
    demoted one level so that they nest under the page's title. ``page`` defaults to ``$BENCHMARKS_PAGE``,
    else docs/benchmarks.md. Returns the page's path.
    """
    page = Path(page or os.environ.get("BENCHMARKS_PAGE") or BENCHMARKS_PAGE)
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"benchmark section name must be lowercase [a-z0-9_]+, got {name!r}")
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{_demote(markdown)}\n\n{stamp()}\n{end}"
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    atomic_write_text(page, text)
    return page


def parser(doc: str, prog: str | None = None) -> argparse.ArgumentParser:
    """A benchmark's parser: described by ``doc``'s first paragraph, with ``--no-record`` (alias ``--no-write``)."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument("--no-record", "--no-write", action="store_true", help="print only; leave docs/benchmarks.md alone")
    return p


def command(module: str, argv: list[str] | None = None) -> str:
    """The command line this run was started with: ``python -m benchmarks.<module> ARGS``."""
    return " ".join([f"python -m benchmarks.{module}", *(sys.argv[1:] if argv is None else argv)])


def record(args: argparse.Namespace, name: str, markdown: str, *, echo: bool = False) -> None:
    """Write section ``name`` (:func:`write_section`) and say where, unless ``args.no_record``; ``echo``: print
    ``markdown`` first."""
    if echo:
        print(markdown)
    if not args.no_record:
        print(f"wrote {write_section(name, markdown)}")


def table(header: list[str], rows, rule: str | list[str] = "---") -> list[str]:
    """A markdown table's lines: ``header``, the rule row (``rule`` for every column, or one per column), ``rows``."""
    rules = [rule] * len(header) if isinstance(rule, str) else rule
    return [f"| {' | '.join(header)} |", f"|{'|'.join(rules)}|", *(f"| {' | '.join(map(str, r))} |" for r in rows)]


def timed(fn, *args, clock=time.perf_counter, **kwargs) -> tuple[float, object]:
    """``(seconds, fn(*args, **kwargs))``, the seconds by ``clock`` (``time.process_time``: this process's CPU time)."""
    t0 = clock()
    out = fn(*args, **kwargs)
    return clock() - t0, out


def metrics_rows(folder: Path) -> list[dict]:
    """The complete rows of ``folder/metrics.jsonl`` so far (none when it is not there yet)."""
    path = Path(folder) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.endswith("}")] if path.exists() else []


def run_recipe(folder: Path, *args: str, env: dict | None = None, timeout: float | None = None) -> list[dict]:
    """``python -m recipes.monarch.run run.dir=<folder> ARGS`` in the repository root, output captured; its
    metrics rows. Raises SystemExit with the output's tail when the run fails."""
    proc = subprocess.run([sys.executable, "-m", "recipes.monarch.run", f"run.dir={folder}", *args], cwd=REPO,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}, capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    return metrics_rows(folder)

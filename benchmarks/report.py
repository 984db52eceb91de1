"""Write one benchmark's section of ``docs/benchmarks.md`` in place.

Each benchmark owns the text between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->``; a re-run
replaces only that section (atomically: temporary file, then rename), so the other benchmarks' figures
stay as they were measured. A section that is not there yet is appended.
"""

from __future__ import annotations

import re
from pathlib import Path

from composer_replication.atomic import atomic_write_text

BENCHMARKS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"


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


def write_section(name: str, markdown: str, page: Path = BENCHMARKS_PAGE) -> Path:
    """Replace (or append) the section ``name`` of ``page`` with ``markdown``.

    ``markdown`` is written as a standalone page would be (its title a level-1 heading); headings are
    demoted one level so that they nest under the page's title. Returns the page's path.
    """
    if not re.fullmatch(r"[a-z0-9_]+", name):
        raise ValueError(f"benchmark section name must be lowercase [a-z0-9_]+, got {name!r}")
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{start}\n{_demote(markdown)}\n{end}"
    text = page.read_text() if page.exists() else "# Benchmarks\n"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        _, tail = rest.split(end, 1)
        text = head + block + tail
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    atomic_write_text(page, text)
    return page

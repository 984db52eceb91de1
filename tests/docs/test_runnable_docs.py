"""Every code block of docs/ marked runnable runs, and succeeds, as the page shows it.

Mark a block by putting an HTML comment (invisible on the rendered page) on the line before its fence::

    <!-- runnable -->
    ```python
    ...
    ```

``<!-- runs: NAME -->`` (docs/integrations.md's marker, the tests of that integration read the same block)
counts as well. Python blocks run in a fresh interpreter of this virtualenv, bash blocks with ``bash -eo
pipefail`` and this virtualenv's ``python`` first on ``PATH``; both from the repository root, as the docs are
written. Mark only blocks that take seconds and write nothing into the tree.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
MARKER = re.compile(r"^<!--\s*(runnable|runs:[^>]*?)\s*-->\s*$")
LANGUAGES = {"python": "python", "py": "python", "bash": "bash", "sh": "bash", "shell": "bash"}
TIMEOUT_S = 300


@dataclass(frozen=True)
class Block:
    """One marked block: where it is, its language (python or bash) and its code."""

    page: Path
    line: int
    language: str
    code: str

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def marked_blocks(root: Path = DOCS) -> tuple[list[Block], list[str]]:
    """The marked blocks under ``root`` (``*.md``), and the problems: a marker without a block after it,
    or a block in a language that cannot run."""
    blocks, problems = [], []
    for page in sorted(root.rglob("*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        for i, line in enumerate(lines):
            if not MARKER.match(line.strip()):
                continue
            fence = lines[i + 1].strip() if i + 1 < len(lines) else ""
            where = f"{page.relative_to(root.parent)}:{i + 1}"
            if not fence.startswith("```"):
                problems.append(f"{where}: runnable marker not followed by a ``` code fence")
                continue
            language = LANGUAGES.get(fence[3:].strip().split(" ")[0].lower())
            if language is None:
                problems.append(
                    f"{where}: cannot run a {fence[3:].strip() or 'plain'!r} block (python or bash)"
                )
                continue
            end = next((j for j in range(i + 2, len(lines)) if lines[j].strip() == "```"), None)
            if end is None:
                problems.append(f"{where}: the code fence is never closed")
                continue
            blocks.append(Block(page, i + 3, language, "\n".join(lines[i + 2 : end]) + "\n"))
    return blocks, problems


def run_block(block: Block, cwd: Path = REPO) -> subprocess.CompletedProcess:
    """Run one block as the reader would; returns the finished process (output captured)."""
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=os.pathsep.join([venv_bin, os.environ.get("PATH", "")]), MPLBACKEND="Agg")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    cmd = (
        [sys.executable, "-c", block.code]
        if block.language == "python"
        else ["bash", "-eo", "pipefail", "-c", block.code]
    )
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)


BLOCKS, PROBLEMS = marked_blocks()


def test_markers_are_well_formed():
    assert not PROBLEMS, "\n".join(PROBLEMS)
    assert len(BLOCKS) >= 3, "docs/ should keep a few runnable examples"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_runnable_block(block):
    proc = run_block(block)
    assert proc.returncode == 0, (
        f"{block.where}: the {block.language} block exits {proc.returncode}\n"
        f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    )


def test_a_broken_block_fails_and_a_bad_marker_is_reported(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "page.md").write_text(
        "<!-- runnable -->\n```python\nraise SystemExit(7)\n```\n\n<!-- runnable -->\nno fence here\n\n"
        "<!-- runnable -->\n```text\nplain\n```\n\n<!-- runnable -->\n```bash\nfalse | true\necho never\n```\n"
    )
    blocks, problems = marked_blocks(docs)
    assert [b.language for b in blocks] == ["python", "bash"]
    assert [p.split(": ", 1)[1] for p in problems] == [
        "runnable marker not followed by a ``` code fence",
        "cannot run a 'text' block (python or bash)",
    ]
    assert run_block(blocks[0], cwd=tmp_path).returncode == 7
    assert run_block(blocks[1], cwd=tmp_path).returncode != 0  # pipefail: a failing stage fails the block

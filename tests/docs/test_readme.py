"""The README stays true: the two commands first, a rendered architecture diagram, the run picture, every doc linked."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
LINKS = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)


def test_the_two_commands_come_first():
    first_block = re.search(r"```\w*\n(.*?)```", README, re.S).group(1)
    assert [line.split()[:2] for line in first_block.splitlines()] == [["make", "run"], ["make", "test"]]


def test_architecture_is_a_mermaid_diagram():
    assert re.search(r"```mermaid\n(flowchart|graph) ", README), (
        "the README's architecture is a Mermaid block"
    )


def test_every_link_resolves_and_the_report_picture_is_there():
    broken = [link for link in LINKS if "://" not in link and not (REPO / link).exists()]
    assert not broken, f"README links to missing files: {broken}"
    assert "docs/img/report.png" in LINKS
    assert (REPO / "docs/img/report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_every_doc_is_linked():
    docs = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md"))
    missing = [d for d in docs if d not in LINKS]
    assert not missing, f"README's Documentation section does not link: {missing}"

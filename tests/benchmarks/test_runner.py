"""``python -m benchmarks``: discovery, selection, order and outcome, on a fake package of benchmarks.

The real benchmarks take minutes to an hour; these fakes run in a fraction of a second each, through the
same subprocess path and the same ``write_section`` (pointed at a temporary page).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.__main__ import discover, main, select

REPO = Path(__file__).resolve().parents[2]

FAKE = '''"""{about}"""
import sys
from pathlib import Path

from benchmarks.report import write_section

with open(Path(__file__).parent / "ran.log", "a") as f:
    f.write("{name}\\n")
{body}
'''
BODIES = {
    "good": ("Good: writes its section.", 'write_section("good", "# Good\\n\\nfigure 42")'),
    "silent": ("Silent: exits 0 and records nothing.", "pass"),
    "broken": ("Broken: fails with exit status 3.", "sys.exit(3)"),
}


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A package ``fakebench`` of three benchmarks, a page to write to, and the log of what ran."""
    pkg = tmp_path / "fakebench"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "report.py").write_text('"""Not a benchmark (a helper module, by its name)."""\n')
    for name, (about, body) in BODIES.items():
        (pkg / f"{name}.py").write_text(FAKE.format(about=about, name=name, body=body))
    monkeypatch.setenv("PYTHONPATH", str(REPO))  # `benchmarks.report` for the fakes
    page = tmp_path / "page.md"
    page.write_text("# Benchmarks\n")

    def run(*argv: str) -> tuple[int, list[str]]:
        rc = main([*argv, "--page", str(page)], folder=pkg, package="fakebench")
        log = pkg / "ran.log"
        ran = log.read_text().split() if log.exists() else []
        log.unlink(missing_ok=True)
        return rc, ran

    return pkg, page, run


def test_list_shows_every_benchmark_with_its_first_line(fake, capsys):
    pkg, _, _ = fake
    assert main(["--list"], folder=pkg, package="fakebench") == 0
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "broken  Broken: fails with exit status 3.",
        "good    Good: writes its section.",
        "silent  Silent: exits 0 and records nothing.",
    ]
    assert not (pkg / "ran.log").exists()  # listing imports and runs nothing


def test_named_subset_runs_only_those_and_records_date_and_machine(fake):
    _, page, run = fake
    rc, ran = run("good")
    assert (rc, ran) == (0, ["good"])
    text = page.read_text()
    assert "<!-- bench:good -->" in text and "figure 42" in text
    assert (
        "_Measured on 20" in text and "CPU cores" in text
    )  # the date and the machine, stamped by write_section


def test_order_given_each_once_and_silent_benchmark_fails_the_run(fake, capsys):
    _, _, run = fake
    rc, ran = run("silent", "good", "silent")
    assert ran == ["silent", "good"]
    assert rc == 1  # silent exited 0 but did not rewrite its section
    assert "NOT rewritten (exited 0 without it)" in capsys.readouterr().out


def test_all_run_by_default_and_a_failure_does_not_stop_the_others(fake, capsys):
    _, page, run = fake
    rc, ran = run()
    assert ran == ["broken", "good", "silent"] and rc == 1
    out = capsys.readouterr().out
    assert "broken                  3" in out  # its exit status, in the final table
    assert "figure 42" in page.read_text()


def test_unknown_name_is_refused_before_anything_runs(fake, capsys):
    _, _, run = fake
    rc, ran = run("good", "gpu_magic")
    assert (rc, ran) == (2, [])
    err = capsys.readouterr().err
    assert "unknown benchmark(s) gpu_magic" in err and "known: broken, good, silent" in err


def test_the_real_package_lists_its_benchmarks_without_helpers():
    names = set(discover())
    assert {"losses", "replay", "ingestion", "learning", "recipe_overhead", "step_throughput"} <= names
    assert not names & {"report", "fake_openai_server", "__main__", "__init__", "loss_channels"}
    with pytest.raises(ValueError, match="loss_channels: a bit-exactness check"):
        select(discover(), ["loss_channels"])

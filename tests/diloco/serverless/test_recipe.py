"""recipes.serverless.run: two local replicas train the tiny Llama through a file:// store; digests equal."""

from __future__ import annotations

from pathlib import Path

import pytest

from recipes.serverless import run


@pytest.mark.slow
def test_recipe_trains_two_replicas_to_equal_digests(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    code = run.main(
        [
            "--replicas",
            "2",
            "--store",
            f"file://{tmp_path}/run1",
            "--steps",
            "4",
            "--sync-every",
            "2",
            "--seq-len",
            "32",
            "--batch-size",
            "2",
            "--poll-interval-s",
            "0.05",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    digests = [
        line.split("digest ")[1].split()[0] for line in out.splitlines() if line.startswith("replica ")
    ]
    assert len(digests) == 2 and digests[0] == digests[1]
    assert "rounds 2 committed / 0 dropped" in out
    assert "final parameter digests EQUAL across 2 replicas" in out


def test_recipe_refuses_a_run_that_would_not_end_on_a_sync(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as info:
        run.main(["--store", "/tmp/x", "--steps", "5", "--sync-every", "2"])
    assert info.value.code == 2 and "multiple of --sync-every" in capsys.readouterr().err

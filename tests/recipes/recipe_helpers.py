"""Shared helpers of the Monarch recipe tests: run the recipe as a real controller process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def session_overrides() -> list[str]:
    """Use the bundled sample sessions when present, else a small ingestion fixture."""
    if list((REPO / "composer_replication" / "data" / "sessions" / "train").glob("*.jsonl")):
        return []
    return ["data.sessions=[tests/ingestion/fixtures/errors.jsonl]"]


def run_recipe(*args: str, timeout: float = 400) -> tuple[int, str, float]:
    """``python -m recipes.monarch.run ARGS`` in a subprocess; returns (rc, stdout+stderr, wall seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "recipes.monarch.run", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def alive(pid: int) -> bool:
    """Whether ``pid`` is a live (non-zombie) process."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] != "Z"
    except OSError:
        return False

"""Helpers shared by the teacher-replay tests (imported by name; this folder is on sys.path)."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # `benchmarks` is importable from a checkout without an install too
    sys.path.insert(0, str(REPO))

SECRET = "sk-or-v1-TESTSECRET-0123456789abcdef"


def make_states(n: int, *, student: str = "I will do nothing.", prefix: str = "t") -> list[dict]:
    """``n`` small TraceStates with distinct last user messages."""
    return [
        {
            "state_id": f"{prefix}::{i:04d}",
            "messages": [
                {"role": "system", "content": "You are a coding agent."},
                {"role": "user", "content": f"Fix bug number {i} in the repository."},
            ],
            "student_action": student,
        }
        for i in range(n)
    ]


def teacher(slug: str, base_url: str, *, p_in: float = 1.0, p_out: float = 2.0, **extra) -> dict:
    """A TeacherSpec on ``base_url``."""
    return {"slug": slug, "input_per_mtok": p_in, "output_per_mtok": p_out, "base_url": base_url, **extra}

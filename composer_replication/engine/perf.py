"""Wall-clock time per phase of a training step, reported as ``perf/<phase>_s`` metrics."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["PhaseTimer"]


class PhaseTimer:
    """Adds up the seconds spent in named phases (``with timer.phase("generate"): ...``)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block and add it to ``name``."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - t0)

    def add(self, name: str, seconds: float) -> None:
        """Add ``seconds`` to phase ``name``."""
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def metrics(self, prefix: str = "perf/") -> dict[str, float]:
        """``{prefix}<phase>_s`` for every phase timed."""
        return {f"{prefix}{name}_s": value for name, value in self.seconds.items()}

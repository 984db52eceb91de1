"""The run folder: resolved config, per-step metrics, TensorBoard events, pairs, summary, checkpoints.

Layout::

    <run>/config.yaml      resolved configuration (write_config)
    <run>/metrics.jsonl    one JSON line per step: {"step": k, "time": ..., <metric>: value, ...}
    <run>/tb/              TensorBoard scalars (same names as metrics.jsonl)
    <run>/pairs.jsonl      channel-3 pairs used by the run (write_pairs)
    <run>/summary.json     final summary (write_summary)
    <run>/checkpoints/     see composer_replication.engine.checkpoint

On resume from a checkpoint taken after ``k`` completed steps, call :meth:`RunDir.truncate_metrics`
with ``k`` (or pass ``resume_step=k``): metric lines of steps ``>= k`` are dropped (atomic rewrite)
and TensorBoard events from step ``k`` on are purged, so no step appears twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from composer_replication.atomic import atomic_write_text
from composer_replication.engine.checkpoint import CHECKPOINTS_DIR
from composer_replication.engine.data import pair_to_dict

__all__ = ["RunDir"]

log = logging.getLogger(__name__)


def _scalar(value: Any) -> float | None:
    """A finite-or-not Python float for numbers and 0-d tensors; ``None`` for anything else."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return float(value.item())
    return None


def _finite_or_none(value: Any) -> Any:
    """NaN/inf floats become ``None`` (JSON ``null``) so every line is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    return value


def _json_default(value: Any) -> Any:
    s = _scalar(value)
    if s is not None:
        return s
    return str(value)


class RunDir:
    """A run folder (created if missing). Not thread-safe; one writer process per folder.

    Args:
        path: the run folder.
        tensorboard: also write TensorBoard scalars under ``tb/``.
        resume_step: when resuming after ``k`` completed steps, drop metrics of steps ``>= k``.
    """

    def __init__(self, path: str | os.PathLike[str], *, tensorboard: bool = True, resume_step: int | None = None):
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._tensorboard = tensorboard
        self._writer: Any = None
        self._purge_step: int | None = None
        self._metrics_fh: Any = None
        if resume_step is not None:
            self.truncate_metrics(resume_step)

    # ------------------------------------------------------------------ paths
    @property
    def config_path(self) -> Path:
        """``<run>/config.yaml``."""
        return self.path / "config.yaml"

    @property
    def metrics_path(self) -> Path:
        """``<run>/metrics.jsonl``."""
        return self.path / "metrics.jsonl"

    @property
    def tb_dir(self) -> Path:
        """``<run>/tb``."""
        return self.path / "tb"

    @property
    def pairs_path(self) -> Path:
        """``<run>/pairs.jsonl``."""
        return self.path / "pairs.jsonl"

    @property
    def summary_path(self) -> Path:
        """``<run>/summary.json``."""
        return self.path / "summary.json"

    @property
    def checkpoints_dir(self) -> Path:
        """``<run>/checkpoints``."""
        return self.path / CHECKPOINTS_DIR

    # ------------------------------------------------------------------ writers
    def write_config(self, config: dict[str, Any]) -> Path:
        """Write the resolved config as ``config.yaml`` (atomic)."""
        if not isinstance(config, dict):
            raise TypeError(f"write_config expects a plain dict (use training.config.to_dict), got {type(config)}")
        atomic_write_text(self.config_path, yaml.safe_dump(config, sort_keys=False))
        return self.config_path

    def read_config(self) -> dict[str, Any]:
        """The dict stored in ``config.yaml`` (``FileNotFoundError`` when absent)."""
        return yaml.safe_load(self.config_path.read_text()) or {}

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """Append ``{"step": step, "time": ..., **metrics}`` to ``metrics.jsonl`` (flushed) and to TensorBoard.

        Non-numeric values go to the JSON line only; numeric ones (and 0-d tensors) also become
        TensorBoard scalars tagged by their metric name. NaN/inf are written as ``null`` (strict JSON)
        and skipped in TensorBoard.
        """
        if self._metrics_fh is None:
            self._metrics_fh = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115
        line = {"step": int(step), "time": time.time(), **metrics}
        line = _finite_or_none({k: _scalar(v) if _scalar(v) is not None else v for k, v in line.items()})
        self._metrics_fh.write(json.dumps(line, default=_json_default, allow_nan=False) + "\n")
        self._metrics_fh.flush()
        if self._tensorboard:
            writer = self._tb_writer()
            for name, value in metrics.items():
                s = _scalar(value)
                if s is not None and math.isfinite(s):
                    writer.add_scalar(name, s, global_step=int(step))
            writer.flush()

    def read_metrics(self) -> list[dict[str, Any]]:
        """All lines of ``metrics.jsonl`` as dicts (empty when absent); a torn last line is skipped."""
        if not self.metrics_path.is_file():
            return []
        out = []
        for raw in self.metrics_path.read_text(encoding="utf-8").splitlines():
            if not raw.strip():
                continue
            try:
                out.append(json.loads(raw))
            except ValueError:
                log.warning("skipping an unreadable line of %s", self.metrics_path)
        return out

    def truncate_metrics(self, resume_step: int) -> int:
        """Keep only metric lines with ``step < resume_step`` (atomic rewrite); returns lines dropped.

        Also makes the next TensorBoard writer purge events at steps ``>= resume_step``.
        """
        if self._metrics_fh is not None:
            self._metrics_fh.close()
            self._metrics_fh = None
        self._purge_step = resume_step
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        lines = self.read_metrics()
        kept = [m for m in lines if int(m.get("step", -1)) < resume_step]
        if self.metrics_path.is_file():
            atomic_write_text(self.metrics_path, "".join(json.dumps(m) + "\n" for m in kept))
        return len(lines) - len(kept)

    def write_pairs(self, pairs: Iterable[Any]) -> Path:
        """Write channel-3 pairs (``DPOPair`` dicts or ``NormalizedDPOPair``) as ``pairs.jsonl`` (atomic)."""
        text = "".join(json.dumps(pair_to_dict(p), default=_json_default) + "\n" for p in pairs)
        atomic_write_text(self.pairs_path, text)
        return self.pairs_path

    def write_summary(self, summary: dict[str, Any]) -> Path:
        """Write ``summary.json`` (atomic)."""
        text = json.dumps(_finite_or_none(summary), indent=2, default=_json_default, allow_nan=False)
        atomic_write_text(self.summary_path, text + "\n")
        return self.summary_path

    def close(self) -> None:
        """Flush and close the metrics file and the TensorBoard writer (idempotent)."""
        if self._metrics_fh is not None:
            self._metrics_fh.close()
            self._metrics_fh = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _tb_writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.tb_dir), purge_step=self._purge_step)
        return self._writer

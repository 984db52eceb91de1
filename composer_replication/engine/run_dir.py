"""The run folder: resolved config, per-step metrics, TensorBoard events, pairs, summary, checkpoints.

Layout::

    <run>/config.yaml      resolved configuration (write_config)
    <run>/metrics.jsonl    one JSON line per step: {"step": k, "time": ..., <metric>: value, ...}
    <run>/tb/              TensorBoard scalars (same names as metrics.jsonl)
    <run>/pairs.jsonl      channel-3 pairs used by the run (write_pairs)
    <run>/summary.json     final summary (write_summary)
    <run>/checkpoints/     see composer_replication.engine.checkpoint
    <run>/.lock            held (``flock``) while a RunDir is open; holds the owner's PID and host

One run per folder: opening a ``RunDir`` takes an exclusive, non-blocking ``fcntl.flock`` on
``<run>/.lock`` and :meth:`RunDir.close` releases it (so does the end of the process, even after
``kill -9``). A second run or resume on a folder in use stops at once with :class:`RunDirInUseError`,
naming the folder and the PID holding it, instead of interleaving its metrics and ledger lines. A full
disk while writing any of these files raises :class:`~composer_replication.engine.checkpoint.DiskFullError`
naming the folder.

On resume from a checkpoint taken after ``k`` completed steps, call :meth:`RunDir.truncate_metrics`
with ``k`` (or pass ``resume_step=k``): metric lines of steps ``>= k`` are dropped (atomic rewrite)
and TensorBoard events from step ``k`` on are purged, so no step appears twice.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import math
import os
import socket
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from composer_replication.atomic import atomic_write_text
from composer_replication.engine.checkpoint import CHECKPOINTS_DIR, reraise_disk_full

__all__ = ["RunDir", "RunDirInUseError"]

log = logging.getLogger(__name__)

_LOCK = ".lock"


class RunDirInUseError(ValueError):
    """The run folder is held by another open :class:`RunDir` (another run, or a resume of this one)."""


def _lock_folder(path: Path) -> Any:
    """Take ``<path>/.lock`` (exclusive, non-blocking ``flock``) and write our PID into it; returns its handle.

    Raises:
        RunDirInUseError: another open file description holds the lock (names the folder and the holder).
    """
    try:  # never through a symlink: the lock file is truncated once taken
        fd = os.open(path / _LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ValueError(
            f"{path / _LOCK} is a symbolic link; remove it (a run folder's lock is a plain file)"
        ) from None
    fh = os.fdopen(fd, "r+", encoding="utf-8", errors="replace")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            log.warning(
                "cannot lock %s (%s); two runs on this folder would not be stopped", path / _LOCK, exc
            )
            return fh
        pid, _, host = fh.read(200).strip().partition(" ")
        fh.close()
        who = (f"PID {pid}" if pid else "a process whose PID is not written yet") + (
            f" on host {host}" if host else ""
        )
        raise RunDirInUseError(
            f"run folder {path} is in use by another run ({who} holds {path / _LOCK}); wait for it to end "
            f"or stop it, then resume with --resume {path}; or choose another run folder"
        ) from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()} {socket.gethostname()}\n")
    fh.flush()
    return fh


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
    """A run folder (created if missing), locked for this object's lifetime. Not thread-safe.

    Args:
        path: the run folder.
        tensorboard: also write TensorBoard scalars under ``tb/``.
        resume_step: when resuming after ``k`` completed steps, drop metrics of steps ``>= k``.

    Raises:
        RunDirInUseError: another open ``RunDir`` (in any process on this machine) holds the folder.
        ValueError: ``path`` is empty.
        DiskFullError: the folder cannot be created or written for lack of space.
    """

    def __init__(
        self, path: str | os.PathLike[str], *, tensorboard: bool = True, resume_step: int | None = None
    ):
        if not os.fspath(path).strip():
            raise ValueError("the run folder path is empty; give a folder such as runs/my-run")
        self.path = Path(path)
        with reraise_disk_full(self.path, "the run folder"):
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock: Any = _lock_folder(self.path)
        self._tensorboard = tensorboard
        self._writer: Any = None
        self._purge_step: int | None = None
        self._metrics_fh: Any = None
        if resume_step is not None:
            try:
                self.truncate_metrics(resume_step)
            except BaseException:
                self.close()
                raise

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
            raise TypeError(
                f"write_config expects a plain dict (use training.config.to_dict), got {type(config)}"
            )
        with reraise_disk_full(self.path, self.config_path.name):
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
        line = {"step": int(step), "time": time.time(), **metrics}
        line = _finite_or_none({k: _scalar(v) if _scalar(v) is not None else v for k, v in line.items()})
        with reraise_disk_full(self.path, self.metrics_path.name):
            if self._metrics_fh is None:
                self._metrics_fh = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115
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
            with reraise_disk_full(self.path, self.metrics_path.name):
                atomic_write_text(self.metrics_path, "".join(json.dumps(m) + "\n" for m in kept))
        return len(lines) - len(kept)

    def write_pairs(self, pairs: Iterable[Any]) -> Path:
        """Write channel-3 pairs as ``pairs.jsonl`` (``teacher_replay.save_pairs``: atomic, the one pair format)."""
        from composer_replication.teacher_replay.pairs import save_pairs

        with reraise_disk_full(self.path, self.pairs_path.name):
            save_pairs(list(pairs), self.pairs_path)
        return self.pairs_path

    def write_summary(self, summary: dict[str, Any]) -> Path:
        """Write ``summary.json`` (atomic)."""
        text = json.dumps(_finite_or_none(summary), indent=2, default=_json_default, allow_nan=False)
        with reraise_disk_full(self.path, self.summary_path.name):
            atomic_write_text(self.summary_path, text + "\n")
        return self.summary_path

    def close(self) -> None:
        """Flush and close the metrics file and the TensorBoard writer, then release the folder (idempotent)."""
        try:
            if self._metrics_fh is not None:
                self._metrics_fh.close()
                self._metrics_fh = None
            if self._writer is not None:
                self._writer.close()
                self._writer = None
        finally:
            if self._lock is not None:
                fcntl.flock(self._lock.fileno(), fcntl.LOCK_UN)  # also for a forked child's copy of the fd
                self._lock.close()
                self._lock = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _tb_writer(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.tb_dir), purge_step=self._purge_step)
        return self._writer

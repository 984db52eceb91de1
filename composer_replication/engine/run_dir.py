"""The run folder: resolved config, per-step metrics, TensorBoard events, pairs, summary, checkpoints.

Layout::

    <run>/config.yaml      resolved configuration (write_config)
    <run>/metrics.jsonl    one JSON line per step: {"step": k, "time": ..., <metric>: value, ...}
    <run>/tb/              TensorBoard scalars (same names as metrics.jsonl)
    <run>/pairs.jsonl      channel-3 pairs used by the run (write_pairs)
    <run>/episodes.jsonl   agentic runs: one JSON line per sampled episode, {"step": k, "task_id": ..., "turns": ...}
    <run>/summary.json     final summary (write_summary)
    <run>/checkpoints/     see composer_replication.engine.checkpoint
    <run>/.lock            held (``flock``) while a RunDir is open; holds the owner's PID and host

One run per folder: a ``RunDir`` holds an exclusive ``flock`` on ``<run>/.lock`` until :meth:`RunDir.close` or the
process ends (even by ``kill -9``); a second one stops at once with :class:`RunDirInUseError` (folder and PID). A
full disk raises ``engine.checkpoint.DiskFullError`` naming the folder. A resume after ``k`` steps drops metric and
episode lines and TensorBoard events of steps ``>= k`` (:meth:`RunDir.truncate_metrics`, ``resume_step=k``).
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
from composer_replication.engine.config import load_yaml

__all__ = ["RunDir", "RunDirInUseError"]

log = logging.getLogger(__name__)


class RunDirInUseError(ValueError):
    """The run folder is held by another open :class:`RunDir` (another run, or a resume of this one)."""


def _lock_folder(path: Path) -> Any:
    """Take ``<path>/.lock`` (exclusive, non-blocking ``flock``) and write our PID and host into it; its handle
    (``RunDirInUseError`` naming the folder and the holder when another open file description holds it)."""
    lock = path / ".lock"
    try:  # never through a symlink: the lock file is truncated once taken
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise ValueError(f"{lock} is a symbolic link; remove it (a run folder's lock is a plain file)") from None
    fh = os.fdopen(fd, "r+", encoding="utf-8", errors="replace")
    try:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            log.warning("cannot lock %s (%s); two runs on this folder would not be stopped", lock, exc)
            return fh
        pid, _, host = fh.read(200).strip().partition(" ")
        fh.close()
        who = (f"PID {pid}" if pid else "a process whose PID is not written yet") + (f" on host {host}" if host else "")
        raise RunDirInUseError(f"run folder {path} is in use by another run ({who} holds {lock}); wait for it to end "
                               f"or stop it, then resume with --resume {path}; or choose another run folder") from None
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()} {socket.gethostname()}\n")
    fh.flush()
    return fh


def _scalar(value: Any) -> float | None:
    """A Python float for numbers (bools included) and 0-d tensors; ``None`` for anything else."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    return float(value.item()) if hasattr(value, "item") and getattr(value, "ndim", 1) == 0 else None


def _finite_or_none(value: Any) -> Any:
    """NaN/inf floats become ``None`` (JSON ``null``) so every line is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return {k: _finite_or_none(v) for k, v in value.items()} if isinstance(value, dict) else value


def _json_default(value: Any) -> Any:
    return s if (s := _scalar(value)) is not None else str(value)


class RunDir:
    """A run folder (created if missing), locked for this object's lifetime; ``tensorboard``: also write scalars under
    ``tb/``; ``resume_step=k``: drop metrics of steps ``>= k``. Not thread-safe. Attributes ``path``, ``config_path``,
    ``metrics_path``, ``tb_dir``, ``pairs_path``, ``summary_path``, ``checkpoints_dir``: the layout above.

    Raises:
        RunDirInUseError: another open ``RunDir`` (in any process on this machine) holds the folder.
        ValueError: ``path`` is empty.
        DiskFullError: the folder cannot be created or written for lack of space.
    """

    def __init__(self, path: str | os.PathLike[str], *, tensorboard: bool = True, resume_step: int | None = None):
        if not os.fspath(path).strip():
            raise ValueError("the run folder path is empty; give a folder such as runs/my-run")
        self.path = Path(path)
        self.config_path, self.metrics_path = self.path / "config.yaml", self.path / "metrics.jsonl"
        self.tb_dir, self.pairs_path = self.path / "tb", self.path / "pairs.jsonl"
        self.episodes_path = self.path / "episodes.jsonl"
        self.summary_path, self.checkpoints_dir = self.path / "summary.json", self.path / CHECKPOINTS_DIR
        with reraise_disk_full(self.path, "the run folder"):
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock: Any = _lock_folder(self.path)
        self._tensorboard, self._writer, self._purge_step, self._metrics_fh = tensorboard, None, None, None
        if resume_step is not None:
            try:
                self.truncate_metrics(resume_step)
            except BaseException:
                self.close()
                raise

    def write_config(self, config: dict[str, Any]) -> Path:
        """Write the resolved config as ``config.yaml`` (atomic)."""
        if not isinstance(config, dict):
            raise TypeError(f"write_config expects a plain dict (use engine.config.to_dict), got {type(config)}")
        with reraise_disk_full(self.path, self.config_path.name):
            atomic_write_text(self.config_path, yaml.safe_dump(config, sort_keys=False))
        return self.config_path

    def read_config(self) -> dict[str, Any]:
        """The dict stored in ``config.yaml`` (``FileNotFoundError`` when absent)."""
        return load_yaml(self.config_path.read_text()) or {}

    def log_metrics(self, step: int, metrics: dict[str, Any]) -> None:
        """Append ``{"step": step, "time": ..., **metrics}`` to ``metrics.jsonl`` (flushed) and to TensorBoard.

        Numbers and 0-d tensors also become TensorBoard scalars under their metric name; other values go to the JSON
        line only. NaN/inf are written as ``null`` (strict JSON) and skipped in TensorBoard.
        """
        line = {"step": int(step), "time": time.time(), **metrics}
        line = _finite_or_none({k: v if _scalar(v) is None else _scalar(v) for k, v in line.items()})
        with reraise_disk_full(self.path, self.metrics_path.name):
            if self._metrics_fh is None:
                self._metrics_fh = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115
            self._metrics_fh.write(json.dumps(line, default=_json_default, allow_nan=False) + "\n")
            self._metrics_fh.flush()
        if self._tensorboard:
            if self._writer is None:
                from torch.utils.tensorboard import SummaryWriter

                self._writer = SummaryWriter(log_dir=str(self.tb_dir), purge_step=self._purge_step)
            for name, value in metrics.items():
                if (s := _scalar(value)) is not None and math.isfinite(s):
                    self._writer.add_scalar(name, s, global_step=int(step))
            self._writer.flush()

    def log_episodes(self, step: int, records: Iterable[dict[str, Any]]) -> None:
        """Append one ``{"step": step, **record}`` line per episode record to ``episodes.jsonl`` (flushed)."""
        text = "".join(json.dumps(_finite_or_none({"step": int(step), **r}), default=_json_default, allow_nan=False)
                       + "\n" for r in records)
        with reraise_disk_full(self.path, self.episodes_path.name), open(self.episodes_path, "a", encoding="utf-8") as f:
            f.write(text)

    def read_metrics(self, path: Path | None = None) -> list[dict[str, Any]]:
        """The rows of ``metrics.jsonl`` (or of ``path``, e.g. :attr:`episodes_path`; empty when absent): JSON objects
        with a whole-number ``step``; any other line (torn, not JSON, not an object, nested too deeply, a damaged
        step) is skipped with a warning naming it."""
        out, path = [], path or self.metrics_path
        text = path.read_text(encoding="utf-8", errors="replace") if path.is_file() else ""
        for n, raw in enumerate(text.splitlines(), 1):
            try:
                row = json.loads(raw) if raw.strip() else {}
            except (ValueError, RecursionError):
                row = None
            step = row.get("step") if isinstance(row, dict) else None
            if type(step) in (int, float) and math.isfinite(step) and step == int(step):
                out.append(row)
            elif raw.strip():
                log.warning("skipping line %d of %s: not a row (a JSON object with a whole-number step)", n, path)
        return out

    def truncate_metrics(self, resume_step: int) -> int:
        """Keep only metric (and episode) rows with ``step < resume_step`` (atomic rewrite; damaged lines are dropped),
        and make the next TensorBoard writer purge events at steps ``>= resume_step``; returns the metric rows dropped."""
        self._close_writers()
        self._purge_step = resume_step
        dropped = {}
        for path in (self.metrics_path, self.episodes_path):
            lines = self.read_metrics(path)
            kept = [m for m in lines if m["step"] < resume_step]
            if path.is_file():
                with reraise_disk_full(self.path, path.name):
                    atomic_write_text(path, "".join(json.dumps(m) + "\n" for m in kept))
            dropped[path] = len(lines) - len(kept)
        return dropped[self.metrics_path]

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

    def _close_writers(self) -> None:
        for fh in (self._metrics_fh, self._writer):
            if fh is not None:
                fh.close()
        self._metrics_fh = self._writer = None

    def close(self) -> None:
        """Flush and close the metrics file and the TensorBoard writer, then release the folder (idempotent)."""
        try:
            self._close_writers()
        finally:
            if self._lock is not None:
                fcntl.flock(self._lock.fileno(), fcntl.LOCK_UN)  # also for a forked child's copy of the fd
                self._lock.close()
                self._lock = None

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

"""Atomic checkpoints in a run folder: ``checkpoints/step_000010/`` plus a ``latest`` pointer.

A checkpoint folder holds ``state.pt`` (``torch.save`` of the state dict: model, optimizer,
scheduler, TAID, RNG, step, ...) and ``meta.json`` (step and file sizes), written last. It is
built in a hidden temporary folder (``checkpoints/.tmp-step_000010-*``), every file and the folder
are fsynced, and the folder is renamed into place with ``os.replace``; then the ``latest`` file is
rewritten the same way (tmp + fsync + replace). A crash at any point leaves either the previous
checkpoint or the new one, never a half-written one that :func:`latest_checkpoint` would pick.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from composer_replication.atomic import atomic_write_text, fsync_dir

__all__ = [
    "CHECKPOINTS_DIR",
    "save_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "checkpoint_step",
]

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
_STATE = "state.pt"
_META = "meta.json"
_LATEST = "latest"
_NAME = re.compile(r"^step_(\d{6,})$")


def _checkpoints_root(run_dir_or_path: Any) -> Path:
    path = Path(getattr(run_dir_or_path, "path", run_dir_or_path))
    return path if path.name == CHECKPOINTS_DIR else path / CHECKPOINTS_DIR


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The step encoded in a checkpoint folder name (``step_000010`` -> 10)."""
    m = _NAME.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not a checkpoint folder (expected a name like 'step_000010')")
    return int(m.group(1))


def save_checkpoint(
    run_dir_or_path: Any, step: int, state: dict[str, Any], *, keep_last: int | None = None
) -> Path:
    """Save ``state`` as ``<run_dir>/checkpoints/step_{step:06d}/`` atomically and point ``latest`` at it.

    Args:
        run_dir_or_path: a ``RunDir``, a run folder, or its ``checkpoints`` folder.
        step: completed optimizer steps at save time (the step a resumed run starts from).
        state: a ``torch.save``-able dict (tensors, numbers, strings, lists, dicts).
        keep_last: when set, delete all but the newest ``keep_last`` checkpoints afterwards.

    Returns:
        The checkpoint folder.

    Raises:
        ValueError: ``step < 0`` or ``keep_last < 1``.
    """
    if step < 0:
        raise ValueError(f"'step' must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"'keep_last' must be >= 1 or None, got {keep_last}")
    root = _checkpoints_root(run_dir_or_path)
    root.mkdir(parents=True, exist_ok=True)
    name = f"step_{step:06d}"
    final = root / name
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
    try:
        state_path = tmp / _STATE
        with open(state_path, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        meta = {"step": step, "time": time.time(), "files": {_STATE: state_path.stat().st_size}}
        with open(tmp / _META, "w") as fh:
            json.dump(meta, fh)
            fh.flush()
            os.fsync(fh.fileno())
        fsync_dir(tmp)
        if final.exists():  # re-saving the same step (e.g. after a resume): move the old one aside
            old = Path(tempfile.mkdtemp(prefix=f".old-{name}-", dir=root))
            os.replace(final, old / name)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    atomic_write_text(root / _LATEST, name + "\n")
    if keep_last is not None:
        for old_ckpt in list_checkpoints(root)[:-keep_last]:
            shutil.rmtree(old_ckpt, ignore_errors=True)
    log.info("saved checkpoint %s", final)
    return final


def _is_complete(folder: Path) -> bool:
    try:
        meta = json.loads((folder / _META).read_text())
        return all((folder / f).stat().st_size == size for f, size in meta["files"].items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def list_checkpoints(run_dir_or_path: Any) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first (temporary and half-written ones excluded)."""
    root = _checkpoints_root(run_dir_or_path)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name) and _is_complete(p)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(run_dir: Any) -> Path | None:
    """The newest complete checkpoint of a run, or ``None`` when it has none.

    Reads the ``latest`` pointer; when it is missing or names an incomplete folder, falls back to
    the highest complete ``step_*`` folder. Temporary ``.tmp-*`` folders are never returned.
    """
    root = _checkpoints_root(run_dir)
    pointer = root / _LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _NAME.match(name) and _is_complete(root / name):
            candidates = list_checkpoints(root)
            # the pointer is authoritative unless a newer complete checkpoint exists
            if not candidates or checkpoint_step(candidates[-1]) <= checkpoint_step(name):
                return root / name
            return candidates[-1]
        log.warning("checkpoint pointer %s names %r, which is missing or incomplete", pointer, name)
    candidates = list_checkpoints(root)
    return candidates[-1] if candidates else None


def _previous_hint(folder: Path) -> str:
    try:
        step = checkpoint_step(folder)
    except ValueError:
        return ""
    older = [p for p in list_checkpoints(folder.parent) if checkpoint_step(p) < step]
    if older:
        return f" The previous complete checkpoint is {older[-1]}; resume from it instead."
    return " No older complete checkpoint exists; start the run afresh (without --resume)."


def load_checkpoint(path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint folder (or a run folder: its latest checkpoint) and return the state dict.

    Raises:
        FileNotFoundError: the folder or its ``state.pt`` is missing (names the path and the previous
            complete checkpoint to use instead).
        ValueError: the checkpoint is incomplete or corrupt (same message content).
    """
    folder = Path(path)
    if folder.is_dir() and not _NAME.match(folder.name):
        found = latest_checkpoint(folder)
        if found is None:
            raise FileNotFoundError(f"no complete checkpoint under {folder}; start the run afresh.")
        folder = found
    if not (folder / _STATE).is_file():
        raise FileNotFoundError(f"checkpoint {folder} is missing (no {_STATE}).{_previous_hint(folder)}")
    if not _is_complete(folder):
        raise ValueError(
            f"checkpoint {folder} is incomplete or corrupt ({_META} missing or sizes differ)."
            f"{_previous_hint(folder)}"
        )
    try:
        with open(folder / _STATE, "rb") as fh:
            state = torch.load(fh, map_location=map_location, weights_only=True)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"checkpoint {folder} could not be read ({type(exc).__name__}: {reason})."
            f"{_previous_hint(folder)}"
        ) from exc
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {folder} holds a {type(state).__name__}, not a state dict.")
    return state

"""Atomic checkpoints in a run folder: ``checkpoints/step_000010/`` plus a ``latest`` pointer.

A checkpoint folder holds ``state.pt`` (``torch.save`` of the state dict) and ``meta.json`` (step, file sizes and
the SHA-256 of every file, hashed as it is written), written last. It is built in a hidden temporary folder,
fsynced, and renamed into place with ``os.replace``; then ``latest`` is rewritten the same way. A crash leaves the
previous checkpoint or the new one, never a half-written one that :func:`latest_checkpoint` would pick.

On load the manifest is checked: :func:`load_checkpoint` refuses a folder whose bytes differ from it, and
:func:`latest_checkpoint` skips one with a warning and falls back to the previous intact checkpoint (checkpoints
written before manifests are checked by size); :func:`load_latest_checkpoint` (what a resume calls) also skips one
whose ``state.pt`` matches its manifest but cannot be loaded. A full disk raises :class:`DiskFullError`.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from composer_replication.atomic import atomic_write_text, fsync_dir

__all__ = ["save_checkpoint", "latest_checkpoint", "load_latest_checkpoint", "checkpoint_step",
           "DiskFullError"]

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
_STATE, _META, _LATEST = "state.pt", "meta.json", "latest"
_NAME = re.compile(r"^step_(\d{6,})$")


class DiskFullError(OSError):
    """A write into a run folder failed for a full disk or quota: an ``OSError`` with the original ``errno``
    (``ENOSPC`` or ``EDQUOT``) whose message names the folder."""


@contextmanager
def reraise_disk_full(folder: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Inside the block, turn ``ENOSPC``/``EDQUOT`` into :class:`DiskFullError` naming ``folder`` and ``what``."""
    try:
        yield
    except DiskFullError:
        raise
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise DiskFullError(exc.errno, f"no space left on the device of {folder} while writing {what}; free space "
                            "there (or keep fewer checkpoints: run.keep_last) or move the run to another folder") from exc


class _HashingWriter:
    """A file wrapper that hashes every byte ``torch.save`` writes; keeps an ``OSError`` raised inside ``write``
    (``torch.save`` turns it into a ``RuntimeError``) in ``error``."""

    def __init__(self, fh: Any) -> None:
        self._fh, self.sha256, self.size, self.error = fh, hashlib.sha256(), 0, None

    def write(self, data: Any) -> int:
        n = self._kept(self._fh.write, data)
        self.sha256.update(memoryview(data))
        self.size += memoryview(data).nbytes
        return n

    def flush(self) -> None:
        self._kept(self._fh.flush)

    def _kept(self, call: Any, *args: Any) -> Any:
        try:
            return call(*args)
        except OSError as exc:
            self.error = exc
            raise


def _root(run_dir_or_path: Any) -> Path:
    path = Path(getattr(run_dir_or_path, "path", run_dir_or_path))
    return path if path.name == CHECKPOINTS_DIR else path / CHECKPOINTS_DIR


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The step encoded in a checkpoint folder name (``step_000010`` -> 10)."""
    if not (m := _NAME.match(Path(path).name)):
        raise ValueError(f"{path} is not a checkpoint folder (expected a name like 'step_000010')")
    return int(m.group(1))


def _write_files(folder: Path, step: int, state: dict[str, Any]) -> None:
    """``state.pt`` (hashed while written), then ``meta.json`` with sizes and the manifest; all fsynced."""
    with open(folder / _STATE, "wb") as fh:
        writer = _HashingWriter(fh)
        try:
            torch.save(state, writer)
        except RuntimeError as exc:
            if writer.error is None:
                raise
            raise writer.error from exc
        fh.flush()
        os.fsync(fh.fileno())
    if (size := (folder / _STATE).stat().st_size) != writer.size:
        raise RuntimeError(f"torch.save wrote {size} bytes to {folder / _STATE} but hashed {writer.size}; not saved")
    with open(folder / _META, "w") as fh:
        json.dump({"step": step, "time": time.time(), "files": {_STATE: size},
                   "sha256": {_STATE: writer.sha256.hexdigest()}}, fh)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(folder)


def save_checkpoint(run_dir_or_path: Any, step: int, state: dict[str, Any], *, keep_last: int | None = None) -> Path:
    """Save ``state`` (a ``torch.save``-able dict) as ``<run>/checkpoints/step_{step:06d}/`` atomically, point
    ``latest`` at it, and keep only the newest ``keep_last`` checkpoints (all when ``None``); the folder.

    ``run_dir_or_path`` is a ``RunDir``, a run folder or its ``checkpoints`` folder; ``step`` counts completed
    optimizer steps (where a resumed run starts).

    Raises:
        ValueError: ``step < 0`` or ``keep_last < 1``.
        DiskFullError: the disk is full (names the checkpoints folder); the previous checkpoints stay valid.
    """
    if step < 0:
        raise ValueError(f"'step' must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"'keep_last' must be >= 1 or None, got {keep_last}")
    root, name = _root(run_dir_or_path), f"step_{step:06d}"
    final = root / name
    with reraise_disk_full(root, f"checkpoint {name}"):
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            _write_files(tmp, step, state)
            if final.exists():  # re-saving a step (e.g. after a resume): move the old one aside first
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
    for old_ckpt in list_checkpoints(root)[:-keep_last] if keep_last is not None else []:
        shutil.rmtree(old_ckpt, ignore_errors=True)
    log.info("saved checkpoint %s", final)
    return final


def _meta(folder: Path) -> dict[str, Any] | None:
    """``meta.json`` when it is readable and lists ``state.pt``, else ``None``."""
    try:
        meta = json.loads((folder / _META).read_text())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) and isinstance(meta.get("files"), dict) and _STATE in meta["files"] else None


def _is_complete(folder: Path) -> bool:
    """Cheap check: every file ``meta.json`` lists has its recorded size."""
    try:
        return (meta := _meta(folder)) is not None and all((folder / f).stat().st_size == n
                                                          for f, n in meta["files"].items())
    except (OSError, TypeError):
        return False


def checkpoint_damage(path: str | os.PathLike[str]) -> str | None:
    """Why a checkpoint folder is not intact (``meta.json`` unreadable, a file missing, of the wrong size, or not
    matching its SHA-256), or ``None``. Reads every byte of ``state.pt`` (about 1 s per 2 GB)."""
    folder = Path(path)
    if (meta := _meta(folder)) is None:
        return f"{_META} is missing, unreadable or lists no {_STATE}"
    sums = meta.get("sha256") if isinstance(meta.get("sha256"), dict) else {}
    for name, size in meta["files"].items():
        file = folder / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {_META} says {size}"
        if name in sums:
            digest = hashlib.sha256()
            with open(file, "rb") as fh:
                while chunk := fh.read(8 << 20):
                    digest.update(chunk)
            if digest.hexdigest() != sums[name]:
                return f"{name} does not match its SHA-256 in {_META}: its bytes changed after it was written"
    return None


def list_checkpoints(run_dir_or_path: Any) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first (by size only; :func:`checkpoint_damage` reads bytes)."""
    root = _root(run_dir_or_path)
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name)] if root.is_dir() else []
    return sorted((p for p in found if _is_complete(p)), key=checkpoint_step)


def latest_checkpoint(run_dir: Any, *, max_step: int | None = None) -> Path | None:
    """The newest intact checkpoint of ``run_dir`` (a ``RunDir``, run folder or ``checkpoints`` folder; ``None``:
    none), skipping damaged ones with a warning; ``max_step``: only up to this step (replicas that resume together
    all load the ``min`` of their latest steps when one had to fall back)."""
    root = _root(run_dir)
    if (pointer := root / _LATEST).is_file():
        name = pointer.read_text(errors="replace").strip()
        if not (_NAME.match(name) and _is_complete(root / name)):
            log.warning("checkpoint pointer %s names %r, which is missing or incomplete", pointer, name)
    for folder in reversed(list_checkpoints(root)):
        if max_step is not None and checkpoint_step(folder) > max_step:
            continue
        if (problem := checkpoint_damage(folder)) is None:
            return folder
        log.warning("checkpoint %s is damaged (%s); falling back to the previous checkpoint", folder, problem)
    return None


def _load_folder(folder: Path, map_location: str | torch.device, *, hint: bool = True) -> dict[str, Any]:
    """Verify (manifest), then load one checkpoint folder; errors name it and, with ``hint``, the previous one."""
    more = ""
    if hint and _NAME.match(folder.name):
        older = [p for p in list_checkpoints(folder.parent) if checkpoint_step(p) < checkpoint_step(folder)]
        more = (f" The previous complete checkpoint is {older[-1]}; resume from it instead." if older else
                " No older complete checkpoint exists; start the run afresh (without --resume).")
    if not (folder / _STATE).is_file():
        raise FileNotFoundError(f"checkpoint {folder} is missing (no {_STATE}).{more}")
    if (problem := checkpoint_damage(folder)) is not None:
        raise ValueError(f"checkpoint {folder} is incomplete or corrupt ({problem}).{more}")
    try:
        with open(folder / _STATE, "rb") as fh:
            state = torch.load(fh, map_location=map_location, weights_only=True)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"checkpoint {folder} could not be read ({type(exc).__name__}: {reason}).{more}") from exc
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {folder} holds a {type(state).__name__}, not a state dict.")
    return state


def load_latest_checkpoint(run_dir: Any, *, max_step: int | None = None, map_location: str | torch.device = "cpu"
                           ) -> tuple[Path, dict[str, Any]] | None:
    """``(folder, state)`` of the newest checkpoint of ``run_dir`` (of at most ``max_step``) that loads, or ``None``:
    each damaged (manifest) or unreadable one (``state.pt`` matches its manifest but ``torch.load`` fails) is skipped
    with a warning naming it and why."""
    for folder in reversed(list_checkpoints(run_dir)):
        if max_step is None or checkpoint_step(folder) <= max_step:
            try:
                return folder, _load_folder(folder, map_location, hint=False)
            except ValueError as exc:
                log.warning("%s; falling back to the previous checkpoint", exc)
    return None


def load_checkpoint(path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint folder (checked against its manifest first), or a run folder's newest checkpoint that loads
    (:func:`load_latest_checkpoint`). ``FileNotFoundError``: the folder or its ``state.pt`` is missing, or no
    checkpoint; ``ValueError``: incomplete, damaged or unreadable (naming the previous checkpoint), or none loads.
    """
    folder = Path(path)
    if not folder.is_dir() or _NAME.match(folder.name):
        return _load_folder(folder, map_location)
    if not list_checkpoints(folder):
        raise FileNotFoundError(f"no complete checkpoint under {folder}; start the run afresh.")
    if (found := load_latest_checkpoint(folder, map_location=map_location)) is None:
        raise ValueError(f"no intact checkpoint under {folder} (why each failed: the warnings above); start the run "
                         "afresh.")
    return found[1]

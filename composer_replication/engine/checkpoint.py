"""Atomic checkpoints in a run folder: ``checkpoints/step_000010/`` plus a ``latest`` pointer.

A checkpoint folder holds ``state.pt`` (``torch.save`` of the state dict: model, optimizer,
scheduler, TAID, RNG, step, ...) and ``meta.json`` (step, file sizes and a SHA-256 manifest of every
file, hashed as it is written), written last. It is
built in a hidden temporary folder (``checkpoints/.tmp-step_000010-*``), every file and the folder
are fsynced, and the folder is renamed into place with ``os.replace``; then the ``latest`` file is
rewritten the same way (tmp + fsync + replace). A crash at any point leaves either the previous
checkpoint or the new one, never a half-written one that :func:`latest_checkpoint` would pick.

On load the manifest is checked: :func:`load_checkpoint` refuses a folder whose bytes differ from it
(bit rot, a same-size overwrite), and :func:`latest_checkpoint` skips such a folder with a warning and
falls back to the previous intact checkpoint. Checkpoints written before manifests existed are checked
by size only. A full disk (``ENOSPC``/``EDQUOT``) raises :class:`DiskFullError`, naming the folder.
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

__all__ = [
    "CHECKPOINTS_DIR",
    "save_checkpoint",
    "latest_checkpoint",
    "list_checkpoints",
    "load_checkpoint",
    "checkpoint_step",
    "checkpoint_damage",
    "DiskFullError",
    "reraise_disk_full",
]

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
_STATE = "state.pt"
_META = "meta.json"
_LATEST = "latest"
_NAME = re.compile(r"^step_(\d{6,})$")


_CHUNK = 8 << 20
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


class DiskFullError(OSError):
    """A write into a run folder failed because its disk (or the user's quota) is full.

    An ``OSError`` with the original ``errno`` (``ENOSPC`` or ``EDQUOT``) whose message names the folder.
    """


@contextmanager
def reraise_disk_full(folder: str | os.PathLike[str], what: str) -> Iterator[None]:
    """Inside the block, turn ``ENOSPC``/``EDQUOT`` into :class:`DiskFullError` naming ``folder`` and ``what``.

    Every other exception passes through unchanged.
    """
    try:
        yield
    except DiskFullError:
        raise
    except OSError as exc:
        if exc.errno not in _DISK_FULL:
            raise
        raise DiskFullError(
            exc.errno,
            f"no space left on the device of {folder} while writing {what}; free space there "
            "(or keep fewer checkpoints: run.keep_last) or move the run to another folder",
        ) from exc


class _HashingWriter:
    """A binary file wrapper that SHA-256 hashes every byte ``torch.save`` writes through it.

    ``torch.save`` needs only ``write`` and ``flush``; it turns an exception raised inside ``write``
    into a ``RuntimeError``, so the original ``OSError`` (e.g. a full disk) is kept in ``error``.
    """

    def __init__(self, fh: Any) -> None:
        self._fh = fh
        self.sha256 = hashlib.sha256()
        self.size = 0
        self.error: OSError | None = None

    def write(self, data: Any) -> int:
        try:
            n = self._fh.write(data)
        except OSError as exc:
            self.error = exc
            raise
        view = memoryview(data)
        self.sha256.update(view)
        self.size += view.nbytes
        return n

    def flush(self) -> None:
        try:
            self._fh.flush()
        except OSError as exc:
            self.error = exc
            raise


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _checkpoints_root(run_dir_or_path: Any) -> Path:
    path = Path(getattr(run_dir_or_path, "path", run_dir_or_path))
    return path if path.name == CHECKPOINTS_DIR else path / CHECKPOINTS_DIR


def checkpoint_step(path: str | os.PathLike[str]) -> int:
    """The step encoded in a checkpoint folder name (``step_000010`` -> 10)."""
    m = _NAME.match(Path(path).name)
    if not m:
        raise ValueError(f"{path} is not a checkpoint folder (expected a name like 'step_000010')")
    return int(m.group(1))


def _write_files(folder: Path, step: int, state: dict[str, Any]) -> None:
    """``state.pt`` (hashed while written) then ``meta.json`` with sizes and the SHA-256 manifest; all fsynced."""
    state_path = folder / _STATE
    with open(state_path, "wb") as fh:
        writer = _HashingWriter(fh)
        try:
            torch.save(state, writer)
        except RuntimeError as exc:
            if writer.error is not None:
                raise writer.error from exc
            raise
        fh.flush()
        os.fsync(fh.fileno())
    size = state_path.stat().st_size
    if size != writer.size:
        raise RuntimeError(
            f"torch.save wrote {size} bytes to {state_path} but hashed {writer.size}; not saved"
        )
    meta = {
        "step": step,
        "time": time.time(),
        "files": {_STATE: size},
        "sha256": {_STATE: writer.sha256.hexdigest()},
    }
    with open(folder / _META, "w") as fh:
        json.dump(meta, fh)
        fh.flush()
        os.fsync(fh.fileno())
    fsync_dir(folder)


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
        DiskFullError: the disk is full (names the checkpoints folder); the previous checkpoints stay valid.
    """
    if step < 0:
        raise ValueError(f"'step' must be >= 0, got {step}")
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"'keep_last' must be >= 1 or None, got {keep_last}")
    root = _checkpoints_root(run_dir_or_path)
    name = f"step_{step:06d}"
    final = root / name
    with reraise_disk_full(root, f"checkpoint {name}"):
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{name}-", dir=root))
        try:
            _write_files(tmp, step, state)
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


def _read_meta(folder: Path) -> dict[str, Any] | None:
    try:
        meta = json.loads((folder / _META).read_text())
    except (OSError, ValueError):
        return None
    files = meta.get("files") if isinstance(meta, dict) else None
    if not isinstance(files, dict) or _STATE not in files:
        return None
    return meta


def _is_complete(folder: Path) -> bool:
    """Cheap check: ``meta.json`` is readable and every file it lists has its recorded size."""
    meta = _read_meta(folder)
    try:
        return meta is not None and all(
            (folder / f).stat().st_size == size for f, size in meta["files"].items()
        )
    except (OSError, TypeError):
        return False


def checkpoint_damage(path: str | os.PathLike[str]) -> str | None:
    """Why a checkpoint folder is not intact, or ``None`` when it is.

    Checks that ``meta.json`` is readable and that every file it lists exists with its recorded size and,
    when the manifest has one (every checkpoint written by :func:`save_checkpoint`), its SHA-256. Reads
    every byte of ``state.pt`` (about 1 s per 2 GB).
    """
    folder = Path(path)
    meta = _read_meta(folder)
    if meta is None:
        return f"{_META} is missing, unreadable or lists no {_STATE}"
    sums = meta.get("sha256") if isinstance(meta.get("sha256"), dict) else {}
    for name, size in meta["files"].items():
        file = folder / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != size:
            return f"{name} has {file.stat().st_size} bytes, {_META} says {size}"
        if name in sums and _file_sha256(file) != sums[name]:
            return f"{name} does not match its SHA-256 in {_META}: its bytes changed after it was written"
    return None


def list_checkpoints(run_dir_or_path: Any) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first (temporary and half-written ones excluded).

    Completeness is checked by size only (cheap); :func:`checkpoint_damage` checks the bytes.
    """
    root = _checkpoints_root(run_dir_or_path)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _NAME.match(p.name) and _is_complete(p)]
    return sorted(found, key=checkpoint_step)


def latest_checkpoint(run_dir: Any, *, max_step: int | None = None) -> Path | None:
    """The newest intact checkpoint of a run, or ``None`` when it has none.

    Walks the complete ``step_*`` folders from the newest and returns the first whose bytes match its
    SHA-256 manifest; a damaged one is skipped with a warning that names it (fallback to the previous
    checkpoint). A ``latest`` pointer that names a missing or incomplete folder is reported too.
    Temporary ``.tmp-*`` folders are never returned.

    Args:
        run_dir: a ``RunDir``, a run folder, or its ``checkpoints`` folder.
        max_step: only checkpoints of at most this step. Replicas that resume together use it to load
            the same step when one of them had to fall back (each reports its latest step, then all load
            ``min`` of them).
    """
    root = _checkpoints_root(run_dir)
    pointer = root / _LATEST
    if pointer.is_file():
        name = pointer.read_text(errors="replace").strip()
        if not (_NAME.match(name) and _is_complete(root / name)):
            log.warning("checkpoint pointer %s names %r, which is missing or incomplete", pointer, name)
    for folder in reversed(list_checkpoints(root)):
        if max_step is not None and checkpoint_step(folder) > max_step:
            continue
        problem = checkpoint_damage(folder)
        if problem is None:
            return folder
        log.warning("checkpoint %s is damaged (%s); falling back to the previous checkpoint", folder, problem)
    return None


def _previous_hint(folder: Path) -> str:
    try:
        step = checkpoint_step(folder)
    except ValueError:
        return ""
    older = [p for p in list_checkpoints(folder.parent) if checkpoint_step(p) < step]
    if older:
        return f" The previous complete checkpoint is {older[-1]}; resume from it instead."
    return " No older complete checkpoint exists; start the run afresh (without --resume)."


def _load_folder(folder: Path, map_location: str | torch.device, *, hint: bool = True) -> dict[str, Any]:
    """Verify (manifest) then load one checkpoint folder; errors name it and, with ``hint``, the previous one."""
    more = _previous_hint(folder) if hint else ""
    if not (folder / _STATE).is_file():
        raise FileNotFoundError(f"checkpoint {folder} is missing (no {_STATE}).{more}")
    problem = checkpoint_damage(folder)
    if problem is not None:
        raise ValueError(f"checkpoint {folder} is incomplete or corrupt ({problem}).{more}")
    try:
        with open(folder / _STATE, "rb") as fh:
            state = torch.load(fh, map_location=map_location, weights_only=True)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"checkpoint {folder} could not be read ({type(exc).__name__}: {reason}).{more}"
        ) from exc
    if not isinstance(state, dict):
        raise ValueError(f"checkpoint {folder} holds a {type(state).__name__}, not a state dict.")
    return state


def load_checkpoint(
    path: str | os.PathLike[str], *, map_location: str | torch.device = "cpu"
) -> dict[str, Any]:
    """Load a checkpoint folder (or a run folder: its newest intact checkpoint) and return the state dict.

    A checkpoint folder is checked against its SHA-256 manifest before it is unpickled. Given a run
    folder, a damaged or unreadable newest checkpoint is skipped with a warning and the previous one is
    loaded (the state's own step says where to continue).

    Raises:
        FileNotFoundError: the folder or its ``state.pt`` is missing (names the path and the previous
            complete checkpoint to use instead).
        ValueError: the checkpoint is incomplete, damaged or unreadable (same message content); for a
            run folder, when no checkpoint of it is intact.
    """
    folder = Path(path)
    if not (folder.is_dir() and not _NAME.match(folder.name)):
        return _load_folder(folder, map_location)
    candidates = list_checkpoints(folder)
    if not candidates:
        raise FileNotFoundError(f"no complete checkpoint under {folder}; start the run afresh.")
    problems = []
    for ckpt in reversed(candidates):
        try:
            return _load_folder(ckpt, map_location, hint=False)
        except ValueError as exc:
            log.warning("%s; falling back to the previous checkpoint", exc)
            problems.append(str(exc))
    raise ValueError(f"no intact checkpoint under {folder} ({'; '.join(problems)}); start the run afresh.")

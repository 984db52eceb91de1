"""Faults of the run folder: two runs on one folder, damaged checkpoints, a full disk (issue #9, section 4)."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from composer_replication.engine import checkpoint as ckpt_mod
from composer_replication.engine import run_dir as run_dir_mod
from composer_replication.engine.checkpoint import (
    DiskFullError,
    checkpoint_damage,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from composer_replication.engine.run_dir import RunDir, RunDirInUseError

# ---------------------------------------------------------------------------- one run per folder


def test_a_second_run_dir_on_a_folder_in_use_stops_naming_folder_and_pid(tmp_path):
    with RunDir(tmp_path / "run", tensorboard=False) as first:
        first.log_metrics(0, {"total": 1.0})
        with pytest.raises(
            RunDirInUseError, match=rf"run folder {tmp_path / 'run'} is in use .*PID {os.getpid()}"
        ):
            RunDir(tmp_path / "run", tensorboard=False)
        with pytest.raises(ValueError, match="in use"):  # a config error for the recipe
            RunDir(tmp_path / "run", resume_step=0)
        first.log_metrics(1, {"total": 0.5})
    # the refused openers wrote nothing: one line per step, and the resume did not truncate anything
    assert [m["step"] for m in first.read_metrics()] == [0, 1]
    with RunDir(tmp_path / "run", tensorboard=False):  # released by close()
        pass


def test_lock_is_held_across_processes_and_released_when_the_holder_exits(tmp_path):
    folder = tmp_path / "run"
    code = (
        "import sys\nfrom composer_replication.engine.run_dir import RunDir\n"
        f"r = RunDir({str(folder)!r}, tensorboard=False)\nprint('ready', flush=True)\nsys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert child.stdout.readline().strip() == "ready"
        with pytest.raises(RunDirInUseError, match=rf"PID {child.pid}\b"):
            RunDir(folder, tensorboard=False)
    finally:
        child.stdin.close()  # the child exits without calling close(): the OS releases the lock
        child.wait(timeout=60)
    RunDir(folder, tensorboard=False).close()


def test_empty_run_folder_path_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="run folder path is empty"):
        RunDir("")
    assert not list(tmp_path.iterdir())  # nothing written into the current folder


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_kept(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep me")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / ".lock").symlink_to(target)
    with pytest.raises(ValueError, match=r"\.lock is a symbolic link"):
        RunDir(tmp_path / "run", tensorboard=False)
    assert target.read_text() == "keep me"


# ---------------------------------------------------------------------------- checkpoint manifests


def _state(x: float) -> dict:
    return {"w": torch.full((256,), x), "step": int(x)}


def _overwrite_tensor_bytes(state_file, value: float, new: float) -> None:
    """Same-size damage: replace the stored float32 bytes of ``value`` by those of ``new``."""
    raw = state_file.read_bytes()
    old_b, new_b = torch.tensor([value]).numpy().tobytes() * 8, torch.tensor([new]).numpy().tobytes() * 8
    assert old_b in raw
    state_file.write_bytes(raw.replace(old_b, new_b, 1))


def test_checkpoint_meta_holds_a_sha256_manifest(tmp_path):
    folder = save_checkpoint(tmp_path, 1, _state(1.0))
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["sha256"] == {"state.pt": hashlib.sha256((folder / "state.pt").read_bytes()).hexdigest()}
    assert checkpoint_damage(folder) is None


def test_same_size_corruption_falls_back_to_the_previous_checkpoint(tmp_path, caplog):
    good = save_checkpoint(tmp_path, 2, _state(2.0))
    bad = save_checkpoint(tmp_path, 3, _state(3.0))
    _overwrite_tensor_bytes(bad / "state.pt", 3.0, float("nan"))
    assert list_checkpoints(tmp_path) == [good, bad]  # same size: the cheap check cannot tell
    assert "SHA-256" in checkpoint_damage(bad)
    with caplog.at_level(logging.WARNING):
        assert latest_checkpoint(tmp_path) == good
    assert any(str(bad) in r.getMessage() and "falling back" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        state = load_checkpoint(tmp_path)  # a run folder: its newest intact checkpoint
    assert state["step"] == 2 and torch.isfinite(state["w"]).all()
    assert any(str(bad) in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=rf"{bad} is incomplete or corrupt.*SHA-256.*previous.*{good}"):
        load_checkpoint(bad)  # asked for by name: refused, never loaded with NaNs


def test_replicas_that_fell_back_can_all_load_the_same_step(tmp_path):
    rank0, rank1 = tmp_path / "r0", tmp_path / "r1"
    for folder in (rank0, rank1):
        for step in (2, 3):
            save_checkpoint(folder, step, _state(float(step)))
    _overwrite_tensor_bytes(rank0 / "checkpoints" / "step_000003" / "state.pt", 3.0, 9.0)
    steps = [int(latest_checkpoint(r).name[-6:]) for r in (rank0, rank1)]
    assert steps == [2, 3]  # rank 0 fell back, rank 1 did not
    common = min(steps)
    assert [latest_checkpoint(r, max_step=common).name for r in (rank0, rank1)] == ["step_000002"] * 2
    assert latest_checkpoint(rank1, max_step=1) is None


def test_no_intact_checkpoint_left_is_an_error_naming_the_folder(tmp_path, caplog):
    only = save_checkpoint(tmp_path, 1, _state(1.0))
    _overwrite_tensor_bytes(only / "state.pt", 1.0, 7.0)
    assert latest_checkpoint(tmp_path) is None
    with caplog.at_level(logging.WARNING), pytest.raises(
        ValueError, match=rf"no intact checkpoint under {tmp_path}.*start the run afresh"
    ):
        load_checkpoint(tmp_path)
    assert any("SHA-256" in r.getMessage() for r in caplog.records)


def test_checkpoints_without_a_manifest_still_load(tmp_path):
    folder = save_checkpoint(tmp_path, 4, _state(4.0))
    meta = json.loads((folder / "meta.json").read_text())
    del meta["sha256"]  # written before manifests existed
    (folder / "meta.json").write_text(json.dumps(meta))
    assert latest_checkpoint(tmp_path) == folder and load_checkpoint(folder)["step"] == 4


# ---------------------------------------------------------------------------- full disk


class _FullDiskFile:
    """A real file that raises ENOSPC once more than ``room`` bytes were written to it."""

    def __init__(self, fh, room: int):
        self._fh, self._room = fh, room

    def write(self, data):
        self._room -= len(data)
        if self._room < 0:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self._fh.write(data)

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


def _full_disk_open(room: int):
    def fake_open(path, mode="r", *args, **kwargs):
        fh = open(path, mode, *args, **kwargs)  # noqa: SIM115
        return _FullDiskFile(fh, room) if "w" in mode or "a" in mode else fh

    return fake_open


def test_full_disk_while_saving_a_checkpoint_names_the_folder(tmp_path, monkeypatch):
    good = save_checkpoint(tmp_path, 1, _state(1.0))
    monkeypatch.setattr(ckpt_mod, "open", _full_disk_open(room=100), raising=False)
    with pytest.raises(
        DiskFullError, match=rf"no space left on the device of {tmp_path / 'checkpoints'}.*step_000002"
    ) as info:
        save_checkpoint(tmp_path, 2, _state(2.0))
    assert info.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert latest_checkpoint(tmp_path) == good  # the previous checkpoint is intact and still the latest
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".tmp")]


def test_full_disk_while_writing_the_run_folder_names_the_folder(tmp_path, monkeypatch):
    run = RunDir(tmp_path / "run", tensorboard=False)
    monkeypatch.setattr(run_dir_mod, "open", _full_disk_open(room=10), raising=False)
    with pytest.raises(DiskFullError, match=rf"device of {tmp_path / 'run'} while writing metrics.jsonl"):
        run.log_metrics(0, {"total": 1.0, "reward_mean": 0.5})

    monkeypatch.undo()
    run.write_config({"a": 1})

    def no_space(fd):  # delayed allocation: the disk reports ENOSPC when the atomic writers fsync
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", no_space)
    for write, name in (
        (lambda: run.write_config({"a": 2}), "config.yaml"),
        (lambda: run.write_summary({"steps": 1}), "summary.json"),
        (lambda: run.write_pairs([]), "pairs.jsonl"),
    ):
        with pytest.raises(DiskFullError, match=rf"{tmp_path / 'run'} while writing {name}"):
            write()
    monkeypatch.undo()
    assert run.read_config() == {"a": 1}  # the previous config.yaml is intact
    assert sorted(p.name for p in run.path.iterdir()) == [
        ".lock",
        "config.yaml",
        "metrics.jsonl",
    ]  # no temp files
    run.close()

"""Atomic writes: the target is either the old file or the new one; a failed write leaves no trace."""

from __future__ import annotations

import os

import pytest

from composer_replication.atomic import atomic_write_text


def test_writes_creates_parents_and_replaces(tmp_path):
    target = tmp_path / "a" / "b" / "out.txt"
    assert atomic_write_text(target, "one\n") == target
    assert target.read_text() == "one\n"
    atomic_write_text(target, "two ünïcode\n")
    assert target.read_text(encoding="utf-8") == "two ünïcode\n"
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.txt"]  # no temporary left


def test_a_failed_write_keeps_the_old_file_and_removes_the_temporary(tmp_path, monkeypatch):
    target = tmp_path / "out.txt"
    target.write_text("old")

    def boom(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_text(target, "new")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_atomic_writer_replaces_only_when_the_block_succeeds(tmp_path):
    from composer_replication.atomic import atomic_writer

    target = tmp_path / "out.jsonl"
    target.write_text("old\n")
    with atomic_writer(target) as fh:
        fh.write("a\n")
        assert target.read_text() == "old\n"  # nothing visible until the block ends
        fh.write("b\n")
    assert target.read_text() == "a\nb\n"
    with pytest.raises(RuntimeError, match="discard"):
        with atomic_writer(target) as fh:
            fh.write("partial\n")
            raise RuntimeError("discard")
    assert target.read_text() == "a\nb\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.jsonl"]


def _mode(p) -> int:
    return os.stat(p).st_mode & 0o7777


def test_a_new_file_gets_the_usual_mode_not_0600(tmp_path):
    old = os.umask(0o022)
    try:
        atomic_write_text(tmp_path / "new.txt", "x")
        assert _mode(tmp_path / "new.txt") == 0o644
        os.umask(0o027)
        atomic_write_text(tmp_path / "other.txt", "x")
        assert _mode(tmp_path / "other.txt") == 0o640
    finally:
        os.umask(old)


def test_a_replaced_file_keeps_its_mode(tmp_path):
    target = tmp_path / "script.sh"
    target.write_text("old")
    os.chmod(target, 0o751)
    atomic_write_text(target, "new")
    assert target.read_text() == "new" and _mode(target) == 0o751


def test_a_symlink_is_written_through_not_replaced(tmp_path):
    real = tmp_path / "data" / "real.jsonl"
    real.parent.mkdir()
    real.write_text("old")
    os.chmod(real, 0o640)
    link = tmp_path / "link.jsonl"
    link.symlink_to(real)
    atomic_write_text(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert real.read_text() == "new" and _mode(real) == 0o640
    assert [p.name for p in real.parent.iterdir()] == ["real.jsonl"]  # temp was beside the target
    dangling = tmp_path / "dangling.jsonl"
    dangling.symlink_to(tmp_path / "data" / "later.jsonl")
    atomic_write_text(dangling, "made")
    assert dangling.is_symlink() and (tmp_path / "data" / "later.jsonl").read_text() == "made"


def test_a_folder_target_is_refused_before_writing(tmp_path):
    with pytest.raises(IsADirectoryError, match="is a folder"):
        atomic_write_text(tmp_path, "x")
    assert list(tmp_path.iterdir()) == []

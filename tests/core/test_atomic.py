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

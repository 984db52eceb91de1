"""Faults of the recipe's config and run folder: each stops with `config error:` and exit 2 before any spawn.

Issue #9, section 4: an empty `run.dir`, non-finite floats, broken YAML and unsafe tags, a folder in use
by another run; and a `--resume` that fails before its checkpoint loads leaves `config.yaml` as it was.
"""

from __future__ import annotations

import os
import re

import pytest
from recipe_helpers import session_overrides

from composer_replication.engine import RunDir
from meshes import ActorFailure
from meshes.hosts import child_pids
from recipes.monarch import run as recipe
from recipes.monarch.config import config_to_yaml, load_config, resume_config


def _resumable_run(folder) -> str:
    """A run folder holding only the config.yaml of a tiny run (enough for --resume's checks)."""
    cfg = load_config("tiny", [*session_overrides(), f"run.dir={folder}", "run.display=none"])
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(config_to_yaml(cfg))
    return (folder / "config.yaml").read_text()


def _main_exits_2(argv: list[str], capsys) -> str:
    before = set(child_pids())
    rc = recipe.main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    assert err.startswith("config error: "), err
    assert set(child_pids()) <= before  # nothing spawned
    return err


# ---------------------------------------------------------------------------- values


@pytest.mark.parametrize(
    "override,match",
    [
        ("run.dir=", r"'run.dir' must name a folder"),
        ("run.dir=' '", r"'run.dir' must name a folder"),
        ("student.optim.lr=inf", r"'student.optim.lr' must be a finite number, got 'inf'"),
        ("student.optim.lr=.inf", r"'student.optim.lr' must be a finite number, got inf"),
        ("student.optim.lr=nan", r"'student.optim.lr' must be a finite number, got 'nan'"),
        ("student.optim.lr=1e999", r"'student.optim.lr' must be a finite number"),
        ("student.optim.betas=[0.9, .nan]", r"'student.optim.betas\[1\]' must be a finite number"),
        ("teachers.max_total_usd=.inf", r"'teachers.max_total_usd' must be a finite number"),
        ("mesh.call_timeout_s=nan", r"'mesh.call_timeout_s' must be a finite number"),
        ("student.optim.lr=[1", r"override 'student.optim.lr=\[1': the value is not plain YAML"),
    ],
)
def test_bad_values_are_config_errors_naming_the_key(override, match, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # an empty run.dir must not turn into the current folder
    with pytest.raises(ValueError, match=match):
        load_config("tiny", [*session_overrides(), override])
    err = _main_exits_2(["--config", "tiny", *session_overrides(), override], capsys)
    assert re.search(match, err)
    assert not list(tmp_path.iterdir())  # no config.yaml, no .lock, no folder written


def test_unsafe_yaml_tag_in_an_override_is_never_constructed(tmp_path, capsys):
    marker = tmp_path / "pwned"
    override = f"student.model=!!python/object/apply:os.system ['touch {marker}']"
    with pytest.raises(ValueError, match=r"not plain YAML .*python/object/apply:os.system.*never read"):
        load_config("tiny", [*session_overrides(), override])
    _main_exits_2(["--config", "tiny", *session_overrides(), override], capsys)
    assert not marker.exists()


# ---------------------------------------------------------------------------- YAML files


@pytest.mark.parametrize(
    "text,match",
    [
        ("student:\n  num_steps: [1, 2\n", r"is not valid YAML: .* at line \d+, column \d+; fix the file"),
        ("student: {model: tiny\n", r"is not valid YAML"),
        ("student:\n\tnum_steps: 2\n", r"is not valid YAML"),
        (
            "!!python/object/apply:os.system ['touch {marker}']\n",
            r"is not valid YAML: .*python/object.*never read",
        ),
        ("student: !!python/name:os.system\n", r"is not valid YAML: .*python/name.*never read"),
        ("- a\n- b\n", r"must hold a mapping of config sections, got list"),
    ],
)
def test_broken_or_unsafe_preset_file_is_a_config_error(text, match, tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = tmp_path / "preset.yaml"
    path.write_text(text.replace("{marker}", str(marker)))
    with pytest.raises(ValueError, match=match) as info:
        load_config(str(path), session_overrides())
    assert str(info.value).startswith(f"--config {path} ")
    assert str(path) in _main_exits_2(["--config", str(path), *session_overrides()], capsys)
    assert not marker.exists()


def test_undecodable_preset_file_is_a_config_error(tmp_path, capsys):
    path = tmp_path / "preset.yaml"
    path.write_bytes(b"student:\n  model: \xff\xfe\n")
    with pytest.raises(ValueError, match=rf"--config {path} cannot be read as UTF-8 text"):
        load_config(str(path))
    _main_exits_2(["--config", str(path), *session_overrides()], capsys)


def test_damaged_config_yaml_of_a_run_is_a_config_error_on_resume(tmp_path, capsys):
    marker = tmp_path / "pwned"
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"student: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ValueError, match=rf"--resume '{run}': {run / 'config.yaml'} is not valid YAML"):
        resume_config(str(run))
    _main_exits_2(["--resume", str(run)], capsys)
    (run / "config.yaml").write_text("run: [dir\n")
    assert "is not valid YAML" in _main_exits_2(["--resume", str(run)], capsys)
    assert "an empty string" in _main_exits_2(["--resume", ""], capsys)
    assert not marker.exists()


# ---------------------------------------------------------------------------- one run per folder


def test_resume_or_fresh_run_on_a_folder_in_use_stops_naming_the_pid(tmp_path, capsys):
    folder = tmp_path / "run"
    original = _resumable_run(folder)
    with RunDir(folder, tensorboard=False) as holder:
        holder.log_metrics(0, {"total": 1.0})
        err = _main_exits_2(["--resume", str(folder)], capsys)
        assert f"run folder {folder} is in use" in err and f"PID {os.getpid()}" in err
        other = tmp_path / "fresh"
        with RunDir(other, tensorboard=False):
            err = _main_exits_2(["--config", "tiny", *session_overrides(), f"run.dir={other}"], capsys)
            assert f"run folder {other} is in use" in err
    # the refused runs wrote nothing into the folder in use
    assert [m["step"] for m in holder.read_metrics()] == [0]
    assert (folder / "config.yaml").read_text() == original
    assert not (other / "config.yaml").exists()


def test_fresh_run_into_a_file_is_a_config_error_naming_it(tmp_path, capsys):
    target = tmp_path / "a_file"
    target.write_text("x")
    err = _main_exits_2(["--config", "tiny", *session_overrides(), f"run.dir={target}"], capsys)
    assert f"'run.dir' '{target}' cannot be used as the run folder" in err


# ---------------------------------------------------------------------------- config.yaml on resume


def test_resume_keeps_config_yaml_until_its_checkpoint_has_loaded(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "run"
    original = _resumable_run(folder)

    def fail_to_spawn(**kwargs):  # a resume that fails before load_latest (bad override, crash, Ctrl-C...)
        raise ActorFailure(actor="trainer", rank=0, kind="died", detail="simulated", what="setup")

    monkeypatch.setattr(recipe, "local_meshes", fail_to_spawn)
    rc = recipe.main(["--resume", str(folder), "student.optim.lr=0.5", "student.num_steps=9"])
    assert rc == 1 and "simulated" in capsys.readouterr().err
    assert (folder / "config.yaml").read_text() == original  # a later --resume still reads the run's config
    assert (
        resume_config(str(folder)).student.optim.lr
        == load_config("tiny", session_overrides()).student.optim.lr
    )
    RunDir(folder, tensorboard=False).close()  # the failed resume released the folder

"""A fresh run never overwrites a folder's files (issue #24, item 4): only a new or empty ``run.dir`` is accepted.

Anything else (``run.dir=.`` inside a project, a folder holding another ``config.yaml``, ``summary.json`` or
``pairs.jsonl``) is refused before anything spawns, naming the folder and what it holds; its files are untouched.
"""

from __future__ import annotations

import pytest
from recipe_helpers import session_overrides

from meshes.hosts import child_pids
from recipes.monarch import run as recipe


def _refused(run_dir: str, capsys) -> str:
    before = set(child_pids())
    rc = recipe.main(["--config", "tiny", *session_overrides(), f"run.dir={run_dir}"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("config error: "), err
    assert set(child_pids()) <= before  # nothing spawned
    return err


@pytest.mark.parametrize("names", [["config.yaml"], ["summary.json"], ["pairs.jsonl"],
                                   ["a", "b", "c", "config.yaml", "d", "e", "f"]])
def test_a_fresh_run_never_writes_into_a_folder_that_holds_files(names, tmp_path, capsys):
    folder = tmp_path / "project"
    folder.mkdir()
    for name in names:
        (folder / name).write_text(f"the project's own {name}\n")
    err = _refused(str(folder), capsys)
    assert f"'run.dir' '{folder}' is not empty (holds {', '.join(sorted(names)[:5])}" in err
    assert "choose another run.dir" in err and (len(names) <= 5 or "(7 entries)" in err)
    assert sorted(p.name for p in folder.iterdir()) == sorted(names)  # no .lock, nothing added
    assert all((folder / n).read_text() == f"the project's own {n}\n" for n in names)


def test_run_dir_dot_inside_a_project_is_refused(tmp_path, monkeypatch, capsys):
    (tmp_path / "config.yaml").write_text("mine\n")
    monkeypatch.chdir(tmp_path)
    assert "'run.dir' '.' is not empty (holds config.yaml)" in _refused(".", capsys)
    assert (tmp_path / "config.yaml").read_text() == "mine\n" and not (tmp_path / ".lock").exists()


def test_a_new_or_empty_folder_is_accepted(tmp_path):
    from recipes.monarch.run_folder import open_run_dir

    (tmp_path / "empty").mkdir()
    for folder in (tmp_path / "empty", tmp_path / "new" / "run"):
        open_run_dir(folder, resuming=False).close()
        open_run_dir(folder, resuming=False).close()  # a .lock left behind alone does not count

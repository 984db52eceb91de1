"""Every value of the recipe's config tree is checked before anything spawns (issue #24, item 5).

The walk gives every leaf of ``RecipeConfig`` (student, loss, optim, rollout, data, teachers, mesh, slurm, diloco,
run) hostile values; ``load_config`` (the first thing ``python -m recipes.monarch.run`` does) refuses each, naming
the key and showing at most 200 characters of the value. The CLI tests show that path exits 2 with nothing spawned.
"""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest
from recipe_helpers import run_recipe, session_overrides

from meshes.hosts import child_pids
from recipes.monarch import run as recipe
from recipes.monarch.config import RecipeConfig, config_to_yaml, load_config


def _leaves(cls: type, prefix: str = "") -> list[tuple[str, typing.Any]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        out += _leaves(tp, f"{prefix}{f.name}.") if dataclasses.is_dataclass(tp) else [(prefix + f.name, tp)]
    return out


LEAVES = _leaves(RecipeConfig)
WRONG_TYPES = [".nan", "-1", "true", "[1, 2]", "{a: 1}", "x" * 5000]  # hostile for every leaf
NUMBERS = [".inf", "-.inf", "1e300", "1" * 40, "abc"]  # hostile for a number too


def _refused(override: str) -> str:
    with pytest.raises(ValueError) as info:
        load_config("tiny", [*session_overrides(), override])
    return str(info.value)


def test_the_walk_covers_the_whole_tree():
    names = {name for name, _ in LEAVES}
    assert len(LEAVES) > 100 and {"student.seed", "student.loss.kl_beta", "student.optim.betas",
                                  "student.rollout.top_p", "mesh.slurm.port", "diloco.pg_timeout_s"} <= names


@pytest.mark.parametrize("leaf,tp", LEAVES, ids=[name for name, _ in LEAVES])
def test_every_leaf_refuses_hostile_values_naming_it(leaf, tp):
    kinds = typing.get_args(tp) or (tp,)
    numeric = bool({int, float} & set(kinds)) or typing.get_origin(tp) is tuple
    for value in WRONG_TYPES + (NUMBERS if numeric else []):
        if value == "true" and bool in kinds:
            continue
        message = _refused(f"{leaf}={value}")
        assert leaf.rsplit(".", 1)[-1] in message, (value, message)
        assert "x" * 201 not in message and len(message) < 800, (value, message[:300])
    if str in kinds or typing.get_origin(tp) is list:  # a long but allowed string: refused or not, shown to 200
        try:
            load_config("tiny", [*session_overrides(), f"{leaf}=[{'y' * 4000}]" if typing.get_origin(tp) is list
                                 else f"{leaf}={'y' * 4000}"])
        except ValueError as exc:
            assert "y" * 201 not in str(exc) and len(str(exc)) < 800, str(exc)[:300]


@pytest.mark.parametrize(
    "override,match",
    [
        ("student.seed=9223372036854775808", r"'seed' must be an integer in \[0, 9223372036854775808\)"),
        ("run.eval_every=-1", r"'run.eval_every' must be an integer in \[0, 1e9\], got -1"),
        ("teachers.timeout_s=-1", r"'teachers.timeout_s' must be a number in \(0, 604800\], got -1"),
        ("data.num_eval_prompts=-2", r"'data.num_eval_prompts' must be an integer in \[0, 1e9\], got -2"),
        ("mesh.call_timeout_s=1e300", r"'mesh.call_timeout_s' must be a number in \(0, 604800\], got 1e\+300"),
        ("mesh.slurm.port=70000", r"'mesh.slurm.port' must be an integer in \[1, 65535\]"),
        ("teachers.base_url=ftp://x", r"'teachers.base_url' must be an http:// or https:// URL"),
        ("run.dir=" + "y" * 4000, r"'run.dir' 'y{199}\.\.\. cannot be .*File name too long"),
    ],
)
def test_the_reviews_examples_exit_2_before_spawning(override, match, tmp_path, capsys):
    before = set(child_pids())
    rc = recipe.main(["--config", "tiny", *session_overrides(), f"run.dir={tmp_path / 'r'}", override])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("config error: ")
    assert re.search(match, err), err
    assert set(child_pids()) <= before and not (tmp_path / "r").exists()


def test_the_largest_seed_the_seeding_apis_take_is_accepted():
    import torch

    seed = load_config("tiny", [*session_overrides(), f"student.seed={2**63 - 1}"]).student.seed
    torch.Generator().manual_seed(seed)  # the bound is what torch accepts


# ---------------------------------------------------------------------------- YAML anchors and aliases

BOMB = "[" + ",".join(f"&{c} [" + ",".join([f"*{chr(ord(c) - 1)}" if c > "a" else "x"] * 10) + "]" for c in "abcdefghi") + "]"


def test_an_alias_bomb_in_an_override_is_refused_in_one_short_line():
    assert len(BOMB) < 400
    message = _refused(f"data.sessions={BOMB}")
    assert "anchors and aliases (&name, *name) are refused" in message and len(message) < 600


def test_anchors_and_aliases_are_refused_in_presets_config_files_and_resumed_configs(tmp_path, capsys):
    text = config_to_yaml(load_config("tiny", session_overrides()))
    path = tmp_path / "mine.yaml"
    path.write_text(text.replace("student:", "student: &s", 1) + "copy: *s\n")
    with pytest.raises(ValueError, match=rf"--config {path} is not valid YAML: YAML anchors and aliases"):
        load_config(str(path))
    _refused("student.model=&a tiny")  # an anchor alone is refused too
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(path.read_text())
    assert recipe.main(["--resume", str(run)]) == 2
    assert "anchors and aliases" in capsys.readouterr().err


@pytest.mark.slow
def test_the_cli_exits_2_on_a_hostile_value_before_spawning(tmp_path):
    rc, out, _ = run_recipe("--config", "tiny", *session_overrides(), f"run.dir={tmp_path / 'r'}",
                            "student.seed=99999999999999999999", timeout=120)
    assert rc == 2 and "config error: 'seed' must be an integer in [0, 9223372036854775808)" in out
    assert "Traceback" not in out and not (tmp_path / "r").exists()

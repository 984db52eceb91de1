"""The recipe's config tree: presets load, overrides apply, and bad configs stop before any spawn."""

from __future__ import annotations

import pytest
from recipe_helpers import REPO, session_overrides

from meshes.hosts import child_pids
from recipes.monarch import run as recipe
from recipes.monarch.config import RecipeConfig, list_presets, load_config
from recipes.monarch.data import load_states


def test_presets_exist_and_load():
    assert {"single_node", "tiny", "gpu_single_node"} <= set(list_presets())
    for name in list_presets():
        cfg = load_config(name, session_overrides())
        assert isinstance(cfg, RecipeConfig) and "{time}" not in cfg.run.dir
    assert load_config("single_node", session_overrides()).student.model == "smollm2-135m"
    assert recipe.parse_args([]).config == "single_node"  # `python -m recipes.monarch.run` = single_node


def test_overrides_are_typed():
    cfg = load_config("tiny", [*session_overrides(), "student.num_steps=7", "student.optim.lr=3e-4",
                               "teachers.slugs=[local:tiny]", "run.keep_last=null"])
    assert cfg.student.num_steps == 7 and cfg.student.optim.lr == pytest.approx(3e-4)
    assert cfg.teachers.slugs == ["local:tiny"] and cfg.run.keep_last is None


@pytest.mark.parametrize(
    "override,match",
    [
        ("student.loss.alhpa_sdpo=0.1", r"unknown key 'student.loss.alhpa_sdpo'; allowed: .*alpha_sdpo"),
        ("student.optim.lr=abc", r"'student.optim.lr' must be a float, got 'abc'"),
        ("mesh.num_replicas=0", r"'mesh.num_replicas' must be an integer in \[1, 1024\], got 0"),
        ("student.rollout.max_new_tokens=4096", r"'student.rollout.max_new_tokens' \(4096\) must be < 'student.max_seq_len'"),
        ("teachers.agreement_threshold=2", r"'teachers.agreement_threshold' \(2\) cannot exceed"),
        ("data.sessions=[/no/such/*.jsonl]", r"'data.sessions' entry '/no/such/\*.jsonl' matches no file"),
        ("data.tasks=/no/tasks.jsonl", r"'data.tasks' file '/no/tasks.jsonl' does not exist"),
        ("student.model=/no/model", r"'student.model' must be 'tiny', 'smollm2-135m' or a model folder"),
        ("mesh.inject_fault=trainer:x", r"'mesh.inject_fault' must look like 'ACTOR:RANK:STEP:MODE'"),
        ("mesh.call_timeout_s=0", r"'mesh.call_timeout_s' must be a number in \(0, 604800\]"),
        ("run.display=fancy", r"'run.display' must be one of 'rich', 'plain', 'none'"),
    ],
)
def test_bad_config_names_the_key(override, match):
    overrides = [o for o in session_overrides() if not override.startswith("data.sessions")] + [override]
    with pytest.raises(ValueError, match=match):
        load_config("tiny", overrides)


def test_bad_preset_and_impossible_sizes():
    with pytest.raises(ValueError, match=r"neither a preset nor a YAML file; presets: .*single_node"):
        load_config("nope")
    cfg = load_config("tiny", [*session_overrides(), "data.max_states=2", "data.eval_sessions=[]",
                                 "data.num_eval_prompts=2"])
    with pytest.raises(ValueError, match=r"'num_eval_prompts' \(2\) must be in \[0, 2\).*data.num_eval_prompts"):
        load_states(cfg)


def test_main_exits_2_before_spawning(tmp_path, capsys):
    before = set(child_pids())
    rc = recipe.main(["--config", "tiny", f"run.dir={tmp_path / 'r'}", "student.optim.lr=abc", *session_overrides()])
    assert rc == 2
    assert "config error: 'student.optim.lr' must be a float" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # nothing written, nothing spawned
    assert set(child_pids()) <= before
    rc = recipe.main(["--resume", str(tmp_path / "missing")])
    assert rc == 2 and "no config.yaml there" in capsys.readouterr().err


def test_fresh_run_refuses_an_existing_run_folder(tmp_path, capsys):
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "metrics.jsonl").write_text("{}\n")
    rc = recipe.main(["--config", "tiny", f"run.dir={tmp_path / 'old'}", *session_overrides()])
    err = capsys.readouterr().err
    assert rc == 2 and "'run.dir'" in err and "is not empty (holds metrics.jsonl)" in err and "--resume" in err


def test_ledger_spend(tmp_path):
    from composer_replication.teacher_replay.ledger import ledger_spend

    path = tmp_path / "ledger.jsonl"
    assert ledger_spend(path) == 0.0
    path.write_text('{"result": {"cost_usd": 0.25}}\n{"result": {"cost_usd": 0.5}}\nnot json\n')
    assert ledger_spend(path) == 0.75


def test_yaml_path_works(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text((REPO / "recipes/monarch/configs/tiny.yaml").read_text())
    assert load_config(str(path), [*session_overrides(), "student.seed=3"]).student.seed == 3


def test_independent_replicas_are_refused_with_the_diloco_setting_to_use():
    with pytest.raises(ValueError, match=r"'mesh.num_replicas' is 2: .* set 'diloco.replicas: 2'"):
        load_config("tiny", ["mesh.num_replicas=2"])


def test_a_run_from_before_the_rollout_rejected_pairs_still_resumes(tmp_path):
    import yaml

    from recipes.monarch.config import config_to_yaml, resume_config

    old = yaml.safe_load(config_to_yaml(load_config("tiny", session_overrides())))
    old["student"]["rollout"]["pair_refresh_every"] = 2  # the retired key, in an earlier run's config.yaml
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    assert resume_config(str(tmp_path)).student.rollout.pairs_per_step == old["student"]["rollout"]["pairs_per_step"]
    with pytest.raises(ValueError, match="unknown key 'student.rollout.pair_refresh_every'"):
        load_config("tiny", ["student.rollout.pair_refresh_every=2"])  # but a new run refuses it

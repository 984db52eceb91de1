"""Per-step data draws, atomic checkpoints and the run folder (no model involved)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from composer_replication.engine.checkpoint import (
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)
from composer_replication.engine.data import TrainingData, pair_indices_for_step, prompts_for_step
from composer_replication.engine.run_dir import RunDir


class _Env:
    name = "dummy"

    def score(self, prompt, action_text):  # pragma: no cover - never called here
        raise AssertionError


def _data(n_prompts=5, n_pairs=3):
    return TrainingData(environment=_Env(), prompts=[f"p{i}" for i in range(n_prompts)],
                        pairs=[_pair(f"s{i}") for i in range(n_pairs)])


def _pair(state_id: str, chosen: str = "a", rejected: str = "b") -> dict:
    return {"state_id": state_id, "state_messages": [{"role": "user", "content": "q"}],
            "chosen": chosen, "rejected": rejected}


# ---------------------------------------------------------------------------- data


def test_prompts_for_step_is_deterministic_and_varies_with_step_rank_seed():
    data = _data()
    a = prompts_for_step(data, 3, rank=0, prompts_per_step=3, seed=1)
    assert a == prompts_for_step(data, 3, rank=0, prompts_per_step=3, seed=1)
    assert len(set(a)) == 3  # without replacement when it fits
    others = [
        prompts_for_step(data, 4, rank=0, prompts_per_step=3, seed=1),
        prompts_for_step(data, 3, rank=1, prompts_per_step=3, seed=1),
        prompts_for_step(data, 3, rank=0, prompts_per_step=3, seed=2),
    ]
    assert any(o != a for o in others)


def test_draws_do_not_touch_global_random_state():
    import random

    random.seed(123)
    expected = random.random()
    random.seed(123)
    prompts_for_step(_data(), 0, prompts_per_step=2, seed=0)
    assert random.random() == expected


def test_more_prompts_than_data_cycles_whole_passes():
    data = _data(n_prompts=3)
    got = prompts_for_step(data, 0, prompts_per_step=7, seed=0)
    assert len(got) == 7
    assert sorted(got[:3]) == ["p0", "p1", "p2"] and sorted(got[3:6]) == ["p0", "p1", "p2"]


def test_pairs_for_step_and_empty_cases():
    data = _data(n_pairs=3)
    assert len(set(pair_indices_for_step(data, 0, pairs_per_step=2, seed=0))) == 2
    assert pair_indices_for_step(data, 0, pairs_per_step=0, seed=0) == []
    assert pair_indices_for_step(_data(n_pairs=0), 0, pairs_per_step=2, seed=0) == []
    with pytest.raises(ValueError, match="'step' must be >= 0"):
        pair_indices_for_step(data, -1, pairs_per_step=2, seed=0)
    with pytest.raises(ValueError, match="'prompts_per_step' must be >= 0"):
        prompts_for_step(data, 0, prompts_per_step=-1, seed=0)


def test_training_data_validation():
    with pytest.raises(ValueError, match="at least one prompt or one pair"):
        TrainingData(environment=_Env())
    with pytest.raises(ValueError, match="'environment' must have a score"):
        TrainingData(environment=object(), prompts=["p"])


# ---------------------------------------------------------------------------- checkpoints


def _state(x: float) -> dict:
    return {"w": torch.full((3,), x), "step": int(x), "nested": {"lst": [1, 2], "s": "a"}}


def test_save_latest_load_round_trip(tmp_path):
    assert latest_checkpoint(tmp_path) is None
    p1 = save_checkpoint(tmp_path, 1, _state(1.0))
    p2 = save_checkpoint(tmp_path, 2, _state(2.0))
    assert p1.name == "step_000001" and p2 == tmp_path / "checkpoints" / "step_000002"
    assert (tmp_path / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert latest_checkpoint(tmp_path) == p2
    state = load_checkpoint(p2)
    assert torch.equal(state["w"], torch.full((3,), 2.0)) and state["nested"] == {"lst": [1, 2], "s": "a"}
    assert load_checkpoint(tmp_path)["step"] == 2  # a run folder loads its latest
    assert list_checkpoints(tmp_path) == [p1, p2]


def test_resaving_a_step_replaces_it_and_keep_last_prunes(tmp_path):
    save_checkpoint(tmp_path, 1, _state(1.0))
    save_checkpoint(tmp_path, 1, _state(5.0))
    assert load_checkpoint(tmp_path)["w"][0] == 5.0
    for s in (2, 3, 4):
        save_checkpoint(tmp_path, s, _state(float(s)), keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_000003", "step_000004"]
    assert not [p for p in (tmp_path / "checkpoints").iterdir() if p.name.startswith(".")]


def test_half_written_tmp_folder_and_incomplete_checkpoint_are_ignored(tmp_path):
    good = save_checkpoint(tmp_path, 2, _state(2.0))
    root = tmp_path / "checkpoints"
    tmp = root / ".tmp-step_000003-abc"  # a crash while writing step 3
    tmp.mkdir()
    (tmp / "state.pt").write_bytes(b"partial")
    broken = root / "step_000004"  # renamed but its meta is missing (never happens with save_checkpoint)
    broken.mkdir()
    (broken / "state.pt").write_bytes(b"junk")
    assert latest_checkpoint(tmp_path) == good
    (root / "latest").write_text("step_000004\n")  # pointer to an incomplete folder
    assert latest_checkpoint(tmp_path) == good
    (root / "latest").unlink()  # pointer lost
    assert latest_checkpoint(tmp_path) == good


def test_load_errors_name_the_path_and_suggest_the_previous(tmp_path):
    good = save_checkpoint(tmp_path, 2, _state(2.0))
    bad = save_checkpoint(tmp_path, 3, _state(3.0))
    with open(bad / "state.pt", "r+b") as fh:  # same size, garbage content
        fh.write(b"\0" * 16)
    with pytest.raises(ValueError, match=rf"{bad} is incomplete or corrupt.*SHA-256.*{good}"):
        load_checkpoint(bad)
    meta = json.loads((bad / "meta.json").read_text())
    del meta["sha256"]  # a checkpoint written before manifests: only torch.load notices
    (bad / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"{bad}.*could not be read.*{good}"):
        load_checkpoint(bad)
    with open(bad / "state.pt", "ab") as fh:
        fh.write(b"x")
    with pytest.raises(ValueError, match=rf"{bad} is incomplete or corrupt.*{good}"):
        load_checkpoint(bad)
    with pytest.raises(FileNotFoundError, match=rf"step_000009 is missing.*{bad.parent}"):
        load_checkpoint(tmp_path / "checkpoints" / "step_000009")
    with pytest.raises(FileNotFoundError, match="nowhere is missing"):
        load_checkpoint(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="'step' must be >= 0"):
        save_checkpoint(tmp_path, -1, {})


def test_empty_run_dir_missing_checkpoint_error(tmp_path):
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(FileNotFoundError, match="start the run afresh"):
        load_checkpoint(tmp_path / "empty_run")


# ---------------------------------------------------------------------------- run folder


def test_run_dir_outputs(tmp_path):
    with RunDir(tmp_path / "run") as run:
        run.write_config({"model": "tiny", "optim": {"lr": 1e-4}})
        run.log_metrics(0, {"total": 1.5, "reward_mean": 0.25, "note": "x", "t": torch.tensor(2.0)})
        run.log_metrics(1, {"total": 1.0, "reward_mean": float("nan")})
        run.write_pairs([_pair("s0")])
        run.write_summary({"steps": 2})
        # lines are flushed as they are logged
        assert len(run.metrics_path.read_text().splitlines()) == 2
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1] and lines[0]["total"] == 1.5 and lines[0]["t"] == 2.0
    assert lines[1]["reward_mean"] is None  # NaN is written as null: strict JSON
    assert run.read_config() == {"model": "tiny", "optim": {"lr": 1e-4}}
    assert json.loads(run.summary_path.read_text()) == {"steps": 2}
    pair = json.loads(run.pairs_path.read_text())
    assert (pair["state_id"], pair["chosen"], pair["rejected"]) == ("s0", "a", "b")
    events = list(run.tb_dir.glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_truncate_metrics_on_resume_drops_later_steps(tmp_path):
    run = RunDir(tmp_path)
    for s in range(5):
        run.log_metrics(s, {"total": float(s)})
    run.close()
    with open(run.metrics_path, "a") as fh:
        fh.write('{"step": 5, "tot')  # a torn last line from a crash
    run2 = RunDir(tmp_path, resume_step=3)
    assert [m["step"] for m in run2.read_metrics()] == [0, 1, 2]
    run2.log_metrics(3, {"total": 30.0})
    run2.close()
    steps = [m["step"] for m in run2.read_metrics()]
    assert steps == [0, 1, 2, 3] and len(set(steps)) == len(steps)
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".metrics")]


def test_write_config_rejects_dataclass(tmp_path):
    from composer_replication.engine.config import StudentConfig

    with pytest.raises(TypeError, match="to_dict"):
        RunDir(tmp_path, tensorboard=False).write_config(StudentConfig())

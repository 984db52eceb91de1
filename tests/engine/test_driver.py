"""The one training driver with a fake StepTrainer: order of work, rows, checkpoints, resume, evaluation."""

from __future__ import annotations

import json

import pytest

from composer_replication.engine import DriveConfig, RunDir, drive


class FakeTrainer:
    """Records every call; ``latest`` is the step a resume finds."""

    def __init__(self, latest: int = 0) -> None:
        self.calls: list[tuple] = []
        self.latest = latest

    def train_step(self, step: int) -> dict[str, float]:
        self.calls.append(("train", step))
        return {"loss/total": 1.0 / (step + 1), "loss/grpo": 0.5, "loss/dpo": 0.0}

    def save(self, step: int, keep_last: int | None) -> None:
        self.calls.append(("save", step, keep_last))

    def load_latest(self) -> int:
        self.calls.append(("load",))
        return self.latest

    def evaluate(self) -> dict[str, float]:
        self.calls.append(("eval",))
        return {"eval/agreement": 0.25}


def rows(path) -> list[dict]:
    return [json.loads(x) for x in (path / "metrics.jsonl").read_text().splitlines()]


def test_fresh_run_order_rows_checkpoints_and_summary(tmp_path):
    trainer = FakeTrainer()
    with RunDir(tmp_path) as run:
        summary = drive(trainer, run, DriveConfig(num_steps=4, checkpoint_every=2, keep_last=1, eval_every=2),
                        run_config={"a": 1}, extra_metrics={"replay/spent_usd": 0.5}, summary_extra={"n": 3})
    assert trainer.calls == [("eval",), ("train", 0), ("train", 1), ("save", 2, 1), ("eval",), ("train", 2),
                             ("train", 3), ("save", 4, 1), ("eval",)]
    got = rows(tmp_path)
    assert [(r["step"], "eval/agreement" in r) for r in got] == [(0, True), (0, False), (1, False), (2, True),
                                                                  (2, False), (3, False), (4, True)]
    assert all(r["replay/spent_usd"] == 0.5 for r in got if "loss/total" in r)
    assert summary["eval_start"] == summary["eval_end"] == {"eval/agreement": 0.25}
    assert summary["channel_nonzero_steps"] == {"loss/grpo": 4, "loss/dpo": 0} and summary["n"] == 3
    assert json.loads((tmp_path / "summary.json").read_text())["start_step"] == 0


def test_resume_loads_first_then_rewrites_config_and_never_reevaluates_the_start(tmp_path):
    with RunDir(tmp_path) as run:
        drive(FakeTrainer(), run, DriveConfig(num_steps=2, evaluate=False), run_config={"v": 1})
    trainer, seen = FakeTrainer(latest=1), []

    class Watching(RunDir):
        def write_config(self, config):
            seen.append(("config", [c[0] for c in trainer.calls]))
            return super().write_config(config)

    with Watching(tmp_path) as run:
        summary = drive(trainer, run, DriveConfig(num_steps=3, resume=True), run_config={"v": 2},
                        on_resume=lambda step: seen.append(("resumed", step)))
    assert seen == [("resumed", 1), ("config", ["load"])]  # config.yaml only after the checkpoint loaded
    assert summary["start_step"] == 1 and summary["eval_start"] is None and summary["eval_end"] is not None
    assert [r["step"] for r in rows(tmp_path) if "loss/total" in r] == [0, 1, 2]  # step 1 once, not twice


@pytest.mark.parametrize("kwargs, match", [({"num_steps": 0}, "num_steps"), ({"num_steps": 2, "checkpoint_every": -1},
                                           "checkpoint_every"), ({"num_steps": 2, "eval_every": -2}, "eval_every")])
def test_bad_drive_config_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DriveConfig(**kwargs)


def test_an_on_step_error_stops_the_run_and_keeps_checkpoints(tmp_path):
    trainer = FakeTrainer()

    def boom(step, metrics):
        if step == 2:
            raise RuntimeError("stop here")

    with RunDir(tmp_path) as run, pytest.raises(RuntimeError, match="stop here"):
        drive(trainer, run, DriveConfig(num_steps=4, checkpoint_every=2, evaluate=False), run_config={}, on_step=boom)
    assert ("save", 2, None) in trainer.calls and ("save", 4, None) not in trainer.calls
    assert not (tmp_path / "summary.json").exists()

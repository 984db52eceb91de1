"""``--resume`` is robust (issue #24, item 3): damaged metrics lines are skipped with a warning, and a checkpoint
whose manifest matches but whose ``state.pt`` cannot be loaded is skipped, saying which one and why."""

from __future__ import annotations

import hashlib
import json
import logging

import torch

from composer_replication.engine import DriveConfig, RunDir, drive
from composer_replication.engine.checkpoint import latest_checkpoint, load_latest_checkpoint, save_checkpoint
from composer_replication.engine.driver import LocalReplica

DAMAGED = ["[1, 2]", '"a string"', "null", "7", '{"step": "3"}', '{"step": 1.5}', '{"step": true}',
           '{"total": 1.0}', "[" * 100_000 + "]" * 100_000, '{"step": 1, "tot']  # torn last line


class Core:
    """The smallest core a ``LocalReplica`` drives: one weight, a step counter."""

    def __init__(self) -> None:
        self.step, self.w = 0, torch.zeros(2)

    def train_step(self, step: int) -> dict[str, float]:
        self.step, self.w = step + 1, self.w + 1
        return {"loss/total": float(step)}

    def evaluate(self) -> dict[str, float]:
        return {}

    def state_dict(self) -> dict:
        return {"step": self.step, "w": self.w.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.w = state["step"], state["w"]


def _unreadable_with_a_matching_manifest(folder) -> None:
    """``state.pt`` replaced by bytes torch cannot load, and ``meta.json`` rewritten to match them."""
    raw = b"not a torch file" * 64
    (folder / "state.pt").write_bytes(raw)
    meta = json.loads((folder / "meta.json").read_text())
    meta["files"]["state.pt"], meta["sha256"]["state.pt"] = len(raw), hashlib.sha256(raw).hexdigest()
    (folder / "meta.json").write_text(json.dumps(meta))


def test_damaged_metrics_lines_are_skipped_with_a_warning(tmp_path, caplog):
    good = [json.dumps({"step": s, "loss/total": float(s)}) for s in range(4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(good[:2] + DAMAGED[:-1] + good[2:] + DAMAGED[-1:]) + "\n")
    with caplog.at_level(logging.WARNING), RunDir(tmp_path, tensorboard=False, resume_step=3) as run:
        assert [m["step"] for m in run.read_metrics()] == [0, 1, 2]
    warned = [r.getMessage() for r in caplog.records if "not a row (a JSON object" in r.getMessage()]
    assert len(warned) == len(DAMAGED) and "line 3 of" in warned[0]


def test_resume_falls_back_past_a_checkpoint_that_matches_its_manifest_but_cannot_load(tmp_path, caplog):
    with RunDir(tmp_path, tensorboard=False) as run:
        drive(LocalReplica(Core(), run), run, DriveConfig(num_steps=4, checkpoint_every=2, evaluate=False),
              run_config={})
    newest = tmp_path / "checkpoints" / "step_000004"
    _unreadable_with_a_matching_manifest(newest)
    assert latest_checkpoint(tmp_path) == newest  # the manifest check alone cannot tell
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write("[1, 2]\n")  # a line that is JSON but not an object
    core = Core()
    with caplog.at_level(logging.WARNING), RunDir(tmp_path, tensorboard=False) as run:
        summary = drive(LocalReplica(core, run), run, DriveConfig(num_steps=5, resume=True, evaluate=False),
                        run_config={})
    assert summary["start_step"] == 2 and core.step == 5 and torch.equal(core.w, torch.full((2,), 5.0))
    skipped = [r.getMessage() for r in caplog.records if str(newest) in r.getMessage()]
    assert skipped and "could not be read" in skipped[0] and "falling back" in skipped[0]
    assert [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3, 4]
    assert load_latest_checkpoint(tmp_path, max_step=4)[0].name == "step_000002"  # replicas resuming together


def test_no_loadable_checkpoint_is_a_fresh_start_for_the_replica(tmp_path):
    only = save_checkpoint(tmp_path, 2, {"step": 2, "w": torch.ones(1)})
    _unreadable_with_a_matching_manifest(only)
    assert load_latest_checkpoint(tmp_path) is None

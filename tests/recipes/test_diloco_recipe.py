"""DiLoCo on meshes, end to end on one node: 2 replicas (one proc mesh each) train one model.

One healthy run is shared by the module; the resume and fault runs restart from a copy of its folder
rewound to step 4 (``--resume`` reads ``pairs.jsonl`` back, so they skip the replay). Fault scenarios:
a replica process exits (``os._exit``), a replica's endpoint raises, and more failures than
``diloco.max_restarts``.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from recipe_helpers import run_recipe, session_overrides

from composer_replication.atomic import atomic_write_text
from composer_replication.engine.checkpoint import load_checkpoint

pytestmark = [pytest.mark.slow, pytest.mark.monarch]

FAST = ["teachers.slugs=[local:tiny]", "run.display=plain"]


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("diloco") / "run"
    rc, out, _ = run_recipe("--config", "diloco", f"run.dir={run_dir}", *FAST, *session_overrides())
    return rc, out, run_dir


def _rows(run_dir):
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _rewind(src, dst, step: int) -> None:
    """Copy a run folder and drop every replica's checkpoints after ``step`` (as if killed there)."""
    shutil.copytree(src, dst)
    for folder in [dst / "checkpoints", *dst.glob("replicas/rank_*/checkpoints")]:
        for ckpt in folder.glob("step_*"):
            if int(ckpt.name.split("_")[1]) > step:
                shutil.rmtree(ckpt)
        atomic_write_text(folder / "latest", f"step_{step:06d}\n")


def _sync_rows(rows):
    return [r for r in rows if "diloco/outer_step" in r]


def test_two_replicas_train_one_model(diloco_run):
    rc, out, run_dir = diloco_run
    assert rc == 0, out[-3000:]
    syncs = _sync_rows(_rows(run_dir))
    assert [int(r["step"]) for r in syncs] == [1, 3, 5, 7]  # sync_every 2: the round's last step
    assert [r["diloco/outer_step"] for r in syncs] == [1.0, 2.0, 3.0, 4.0]
    for r in syncs:
        assert r["diloco/participants"] == 2.0
        assert r["diloco/param_sha256/0"] == r["diloco/param_sha256/1"], r["step"]
    assert len({r["diloco/param_sha256/0"] for r in syncs}) == 4  # the model moves every round
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["restarts"] == {"0": 0, "1": 0}
    digests = summary["replica_param_sha256"]
    assert digests["0"] == digests["1"] == syncs[-1]["diloco/param_sha256/0"]
    assert summary["eval_end"] is not None and "replicas=2 restarts=0" in out
    # a finished replica never stalls the other: the run is far shorter than one quorum timeout (60 s)
    assert max(r.get("perf/step_time_s", 0.0) for r in _rows(run_dir)) < 30
    for rank_dir in (run_dir, run_dir / "replicas" / "rank_1"):
        state = load_checkpoint(rank_dir / "checkpoints" / "step_000008")
        assert state["diloco"]["manager"]["step"] == 4 and state["diloco"]["local_step"] == 0


def test_resume_continues_exactly(diloco_run, tmp_path):
    rc, out, run_dir = diloco_run
    assert rc == 0, out[-2000:]
    copy = tmp_path / "resumed"
    _rewind(run_dir, copy, 4)
    rc2, out2, _ = run_recipe("--resume", str(copy), "run.display=plain")
    assert rc2 == 0, out2[-3000:]
    a, b = _sync_rows(_rows(run_dir)), _sync_rows(_rows(copy))
    assert [r["diloco/param_sha256/0"] for r in a] == [r["diloco/param_sha256/0"] for r in b]
    full = load_checkpoint(run_dir / "checkpoints" / "step_000008")
    resumed = load_checkpoint(copy / "checkpoints" / "step_000008")
    for k in full["model"]:
        assert torch.equal(full["model"][k], resumed["model"][k]), k
    for x, y in zip(
        full["diloco"]["fragments"][0]["original_parameters"].values(),
        resumed["diloco"]["fragments"][0]["original_parameters"].values(),
    ):
        assert torch.equal(x, y)


@pytest.mark.parametrize("mode", ["exit", "raise"])
def test_a_failed_replica_is_restarted_and_heals(diloco_run, tmp_path, mode):
    """Replica 1 dies (``os._exit``) or raises at step 5: the survivor goes on alone, replica 1 comes back on
    a fresh proc mesh, heals from the survivor, and every later sync has identical parameters."""
    rc, out, run_dir = diloco_run
    assert rc == 0, out[-2000:]
    copy = tmp_path / f"fault-{mode}"
    _rewind(run_dir, copy, 4)
    rc2, out2, _ = run_recipe(
        "--resume",
        str(copy),
        "run.display=plain",
        "student.num_steps=32",
        f"mesh.inject_fault=trainer:1:5:{mode}",
    )
    assert rc2 == 0, out2[-3000:]
    assert f"replica 1 failed (actor 'trainer' rank 1 {'died' if mode == 'exit' else 'raised'}" in out2
    syncs = _sync_rows(_rows(copy))
    alone = [r for r in syncs if r["diloco/participants"] == 1.0]
    together = [r for r in syncs if r["diloco/participants"] == 2.0 and r["step"] > 5]
    assert alone and all("diloco/param_sha256/1" not in r for r in alone)  # the survivor went on alone
    assert together, "replica 1 never came back"
    for r in together[1:]:
        assert r["diloco/param_sha256/0"] == r["diloco/param_sha256/1"], r["step"]
    summary = json.loads((copy / "summary.json").read_text())
    assert summary["restarts"] == {"0": 0, "1": 1}
    assert summary["replica_param_sha256"]["0"] == summary["replica_param_sha256"]["1"]
    event = summary["diloco_events"][0]
    assert event["replica"] == 1 and event["kind"] == ("died" if mode == "exit" else "raised")
    assert event["rejoined_step"] > event["step"] == 5


def test_more_failures_than_max_restarts_stop_the_run(diloco_run, tmp_path):
    rc, out, run_dir = diloco_run
    assert rc == 0, out[-2000:]
    copy = tmp_path / "no-restarts"
    _rewind(run_dir, copy, 4)
    rc2, out2, wall = run_recipe(
        "--resume",
        str(copy),
        "run.display=plain",
        "diloco.max_restarts=0",
        "mesh.inject_fault=trainer:1:5:raise",
    )
    assert rc2 == 1, out2[-3000:]
    assert "error: actor 'trainer' rank 1 raised an error during train_step(5)" in out2
    assert "injected fault" in out2 and "more than 'diloco.max_restarts' = 0" in out2
    assert wall < 200


@pytest.mark.parametrize(
    "override,text",
    [
        ("diloco.sync_every=3", "'student.num_steps' (8) must be a multiple of 'diloco.sync_every' (3)"),
        ("diloco.min_replicas=3", "'diloco.min_replicas' (3) cannot exceed 'diloco.replicas' (2)"),
        (
            "diloco.fragment_sync_delay=2",
            "'diloco.fragment_sync_delay' must be in [0, sync_every/fragments = 2)",
        ),
        (
            "mesh.workers=[127.0.0.1:1]",
            "'mesh.workers' / 'mesh.spare_workers' entry '127.0.0.1:1' must look like tcp://HOST:PORT",
        ),
    ],
)
def test_a_bad_diloco_section_exits_2_before_spawning(tmp_path, override, text):
    rc, out, wall = run_recipe(
        "--config", "diloco", f"run.dir={tmp_path / 'run'}", override, *session_overrides()
    )
    assert rc == 2, out[-2000:]
    assert f"config error: {text}" in out
    assert not (tmp_path / "run" / "metrics.jsonl").exists()

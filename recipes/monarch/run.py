"""Composer-style post-training on Monarch actor meshes, on one node or on several hosts.

    python -m recipes.monarch.run                                   # preset single_node (SmolLM2-135M, CPU ok)
    python -m recipes.monarch.run --config tiny student.num_steps=4 # any preset or YAML, plus key.sub=value
    python -m recipes.monarch.run --config diloco                   # 2 DiLoCo replicas train one model
    python -m recipes.monarch.run --config multi_host mesh.workers=[tcp://h1:26601,tcp://h2:26601]
    python -m recipes.monarch.run --resume runs/monarch-20261130-171500

Ingest the traces, replay them with the teachers (TeacherReplay actor; pairs stream back as they form),
normalize the pairs, train the StudentTrainer replicas with all three channels (their metrics folded by
the Reducer; with ``diloco.replicas > 1`` they train one model, docs/diloco.md), checkpoint, evaluate, and
write the run folder (docs/recipes.md). Exit codes: 0 done,
1 an actor failed or timed out (named with its rank), 2 bad config (nothing spawned), 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from composer_replication.engine import DriveConfig, RunDir, drive, to_dict
from composer_replication.replaysim import DJNormalizer
from composer_replication.teacher_replay import load_pairs
from composer_replication.teacher_replay.ledger import ledger_spend
from meshes import (
    ActorFailure,
    Reducer,
    StudentTrainer,
    TeacherReplay,
    attach_meshes,
    install_fault_hook,
    local_meshes,
    stream,
    wait,
)
from recipes.monarch.config import RecipeConfig, load_config, open_run_dir, resume_config
from recipes.monarch.data import REPO_ROOT, load_eval_states, load_states, resolve_path
from recipes.monarch.display import Display
from recipes.monarch.mesh_trainer import MeshTrainer
from recipes.monarch.replicas import start_diloco
from recipes.monarch.report import recipe_report

log = logging.getLogger("recipes.monarch.run")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipes.monarch.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="single_node", help="preset name (recipes/monarch/configs) or YAML path")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its latest checkpoint")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. student.num_steps=20")
    return p.parse_args(argv)


def replay_pairs(cfg: RecipeConfig, teacher, states, run: RunDir, display: Display, resuming: bool):
    """Pairs for channel 3: streamed from the TeacherReplay actor (or read back from pairs.jsonl on resume), the
    replay's spend, and the normalizer's drops per reason (``replay/dropped/<reason>``; ``{}`` when not replayed)."""
    from monarch.actor import Channel

    if resuming and run.pairs_path.is_file():
        return load_pairs(run.pairs_path), ledger_spend(run.path / "teacher_ledger.jsonl"), {}
    if cfg.data.pairs:  # pairs written earlier (e.g. by `python -m composer_replication.teacher_replay`)
        pairs = load_pairs(resolve_path(cfg.data.pairs))
        run.write_pairs(pairs)
        return pairs, 0.0, {}
    port, recv = Channel.open()
    fut = teacher.replay.call_one(states, port=port, max_total_usd=cfg.teachers.max_total_usd,
                                  ledger_path=str(run.path / "teacher_ledger.jsonl"))
    n_pairs = 0

    def on_item(item) -> bool:  # ("pair", p) | ("progress", done, total, usd) | ("done", n, usd)
        nonlocal n_pairs
        n_pairs += item[0] == "pair"
        if item[0] == "progress":
            display.replay(item[1], item[2], n_pairs, item[3])
        return item[0] == "done"

    out = stream(recv, fut, actor="teacher", timeout_s=cfg.mesh.replay_timeout_s, what="replay", on_item=on_item)
    normalizer = DJNormalizer(skip_dj=not cfg.teachers.normalize)  # drops degenerate teacher output, counted
    pairs = normalizer.normalize(out["pairs"])
    run.write_pairs(pairs)
    return pairs, out["spent_usd"], normalizer.last_report.drop_counts("replay/dropped/")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # ---------------------------------------------------------------- config: every check before any spawn
    try:
        resuming = args.resume is not None  # `--resume ""` is an error, not a fresh run
        cfg = resume_config(args.resume, args.overrides) if resuming else load_config(args.config, args.overrides)
        states = load_states(cfg)
        eval_states = load_eval_states(cfg)  # held-out sessions: to the trainers' evaluation only, never replayed
        run = open_run_dir(cfg.run.dir, resuming=resuming)  # locked: one run per folder
    except ValueError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    m = cfg.mesh
    if not resuming:  # a resume rewrites config.yaml only once its checkpoint has loaded (engine.drive)
        run.write_config(to_dict(cfg))
    display = Display(cfg.run.display, num_steps=cfg.student.num_steps)
    faults, restore_hook = install_fault_hook()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM unwinds like Ctrl-C: finally runs
    live: dict = {"meshes": None, "diloco": None}  # what the finally: block stops
    try:
        mesh_trainer, spent, n_pairs, dropped = _build(cfg, run, display, states, eval_states, resuming, live)
        # ------------------------------------------------------------ training: the one driver
        drive_cfg = DriveConfig(num_steps=cfg.student.num_steps, checkpoint_every=cfg.run.checkpoint_every,
                                keep_last=cfg.run.keep_last, resume=resuming, evaluate=cfg.run.evaluate,
                                eval_every=cfg.run.eval_every)
        summary = drive(mesh_trainer, run, drive_cfg, run_config=to_dict(cfg),
                        extra_metrics={"replay/spent_usd": spent},
                        on_step=lambda step, metrics: display.step(step, metrics, spent),
                        on_resume=lambda step: display.message(f"resumed at step {step}"),
                        summary_extra={"run_dir": str(run.path), "n_states": len(states), "n_pairs": n_pairs,
                                       "replay/spent_usd": spent, **dropped})
        if live["diloco"] is not None:  # the digests after the last sync, restarts (known once training ended)
            summary.update(live["diloco"].summary())
            run.write_summary(summary)
        display.summary(summary)
        display.message(recipe_report(run.path))  # <run>/report.png: every channel, reward, eval/*
        return 0
    except ActorFailure as exc:
        display.close()
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        display.close()
        print("interrupted; stopping every mesh (resume with --resume " + str(run.path) + ")", file=sys.stderr)
        return 130
    finally:
        display.close()
        if live["diloco"] is not None:
            live["diloco"].stop(timeout_s=min(30.0, m.call_timeout_s))
        if live["meshes"] is not None:
            live["meshes"].stop(timeout_s=min(30.0, m.call_timeout_s))
        run.close()
        restore_hook()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if faults.failures:
            log.warning("%d actor failure(s) were reported by Monarch during the run", len(faults.failures))


def _build(cfg: RecipeConfig, run: RunDir, display: Display, states, eval_states, resuming: bool, live: dict):
    """Spawn the meshes and actors, replay the states into pairs, set the student replicas up.

    Returns ``(step trainer for engine.drive, teacher spend, number of pairs, replay drop counts)``; the
    meshes (and the DiLoCo replicas) go into ``live`` as soon as they exist, for the caller to stop.
    """
    m, d = cfg.mesh, cfg.diloco
    # ------------------------------------------------------------ meshes and actors
    replicas = d.replicas if d.enabled else m.num_replicas
    display.message(f"run folder {run.path}; spawning meshes ({replicas} trainer replica(s)"
                    f"{', DiLoCo' if d.enabled else ''}{f' on {len(m.workers)} workers' if m.workers else ''})")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    if m.workers:
        meshes = attach_meshes(m.workers, spares=m.spare_workers, teacher_worker=m.teacher_worker,
                               reducer_worker=m.reducer_worker)
    else:
        meshes = local_meshes(num_replicas=m.num_replicas, env=env, diloco=d.enabled)
    live["meshes"] = meshes
    teacher = meshes.add("teacher", meshes.teacher.spawn("teacher", TeacherReplay))
    trainer = None if d.enabled else meshes.add("trainer", meshes.trainer.spawn("trainer", StudentTrainer))
    reducer = meshes.add("reducer", meshes.reducer.spawn("reducer", Reducer))
    warm = None if d.enabled else trainer.warmup.call()  # imports torch while the teachers replay
    t = cfg.teachers
    tinfo = wait(teacher.setup.call_one(
        cfg.teacher_specs(), agreement_threshold=t.agreement_threshold, max_tokens=t.max_tokens,
        temperature=t.temperature, seed=t.seed, timeout_s=t.timeout_s,
        local_device="cuda" if cfg.student.device != "cpu" and _cuda() else "cpu",
        inject_fault=m.inject_fault, threads=m.threads_per_proc, student=cfg.student_samples()),
        actor="teacher", timeout_s=m.setup_timeout_s, what="setup")
    # ------------------------------------------------------------ teacher replay -> pairs
    display.message(f"replaying {len(states)} trace states with {', '.join(t.slugs)}")
    pairs, spent, dropped = replay_pairs(cfg, teacher, states, run, display, resuming=resuming)
    display.message(f"{len(pairs)} pairs; setting up the student ({cfg.student.model})")
    if d.enabled:  # one proc mesh per replica, a lighthouse here; replicas join at the first step
        diloco = live["diloco"] = start_diloco(cfg, meshes, reducer, run_dir=str(run.path), states=states,
                                               pairs=pairs, eval_states=eval_states, on_event=display.message)
        setup, mesh_trainer = diloco.setup, diloco.trainer
    else:
        wait(warm, actor="trainer", timeout_s=m.setup_timeout_s, what="warmup")
        setup = wait(trainer.setup.call(
            cfg.student, states=states, pairs=pairs, world_size=m.num_replicas, tasks_path=cfg.data.tasks,
            num_eval_prompts=cfg.data.num_eval_prompts, eval_states=eval_states,
            eval_max_new_tokens=cfg.data.eval_max_new_tokens, inject_fault=m.inject_fault,
            threads=m.threads_per_proc), actor="trainer", timeout_s=m.setup_timeout_s, what="setup").values()
        mesh_trainer = MeshTrainer(trainer, reducer, str(run.path), call_timeout_s=m.call_timeout_s)
    (run.path / "processes.json").write_text(json.dumps(
        {"controller": os.getpid(), "teacher": tinfo["pid"], "trainer": [s["pid"] for s in setup]}))
    return mesh_trainer, spent, len(pairs), dropped


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


if __name__ == "__main__":
    sys.exit(main())

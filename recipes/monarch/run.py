"""Composer-style post-training on Monarch actor meshes, on one node or on several hosts.

    python -m recipes.monarch.run                                   # preset single_node (SmolLM2-135M, CPU ok)
    python -m recipes.monarch.run --config tiny student.num_steps=4 # any preset or YAML, plus key.sub=value
    python -m recipes.monarch.run --config diloco                   # 2 DiLoCo replicas train one model
    python -m recipes.monarch.run --config multi_host mesh.workers=[tcp://h1:26601,tcp://h2:26601]
    python -m recipes.monarch.run --resume runs/monarch-20261130-171500

Ingest the traces, replay them with the teachers (TeacherReplay; pairs stream back as they form), normalize the
pairs, train the StudentTrainer replicas on all three channels (metrics folded by the Reducer; DiLoCo with
``diloco.replicas > 1``, docs/diloco.md), checkpoint, evaluate, write the run folder (docs/recipes.md).
Exit codes: 0 done, 1 an actor failed or timed out (named with its rank), 2 bad config (nothing spawned), 130 stopped.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys

from composer_replication.engine import DriveConfig, RunDir, drive
from composer_replication.engine.config import resolve_device, to_dict
from composer_replication.replaysim import DJNormalizer
from composer_replication.teacher_replay import load_pairs
from composer_replication.teacher_replay.ledger import ledger_spend
from meshes import ActorFailure, Reducer, StudentTrainer, TeacherReplay, install_fault_hook, stream, wait
from meshes.hosts import attach_meshes, local_meshes
from meshes.launch import LaunchError, slurm_hosts
from recipes.monarch.config import RecipeConfig, load_config, resume_config
from recipes.monarch.data import REPO_ROOT, load_agentic_tasks, load_data, resolve_path
from recipes.monarch.display import Display
from recipes.monarch.replicas import MeshReplicas, setup_kwargs, start_diloco
from recipes.monarch.report import recipe_report
from recipes.monarch.run_folder import open_run_dir


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m recipes.monarch.run", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="single_node", help="preset name (recipes/monarch/configs) or YAML path")
    p.add_argument("--resume", metavar="RUN_DIR", help="continue this run from its latest checkpoint")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides, e.g. student.num_steps=20")
    return p.parse_args(argv)


def replay_pairs(cfg: RecipeConfig, teacher, states, run: RunDir, display: Display, resuming: bool):
    """Channel-3 pairs streamed from the TeacherReplay actor (or read back from ``pairs.jsonl`` on resume, or from
    ``data.pairs``), the spend, and the normalizer's drops (``replay/dropped/<reason>``; ``{}`` when not replayed)."""
    from monarch.actor import Channel

    ledger = run.path / "teacher_ledger.jsonl"
    if resuming and run.pairs_path.is_file():
        return load_pairs(run.pairs_path), ledger_spend(ledger), {}
    if cfg.data.pairs:
        pairs, spent, dropped = load_pairs(resolve_path(cfg.data.pairs)), 0.0, {}
    else:
        port, recv = Channel.open()
        fut = teacher.replay.call_one(states, port=port, max_total_usd=cfg.teachers.max_total_usd,
                                      ledger_path=str(ledger))
        formed: list = []

        def on_item(item) -> bool:  # ("pair", p) | ("progress", done, total, usd) | ("done", n, usd)
            formed.extend(item[1:] if item[0] == "pair" else ())
            if item[0] == "progress":
                display.replay(item[1], item[2], len(formed), item[3])
            return item[0] == "done"

        out = stream(recv, fut, actor="teacher", timeout_s=cfg.mesh.replay_timeout_s, what="replay", on_item=on_item)
        normalizer = DJNormalizer(skip_dj=not cfg.teachers.normalize)  # drops degenerate teacher output, counted
        pairs, spent = normalizer.normalize(out["pairs"]), out["spent_usd"]
        dropped = normalizer.last_report.drop_counts("replay/dropped/")
    run.write_pairs(pairs)
    return pairs, spent, dropped


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        resuming = args.resume is not None  # `--resume ""` is an error, not a fresh run
        cfg = resume_config(args.resume, args.overrides) if resuming else load_config(args.config, args.overrides)
        states, eval_states = load_data(cfg)  # held-out sessions: to the trainers' evaluation only, never replayed
        tasks = load_agentic_tasks(cfg)  # agentic: (train, held-out) tasks; ([], []) otherwise
        run = open_run_dir(cfg.run.dir, resuming=resuming)  # locked: one run per folder
    except ValueError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    if not resuming:  # a resume rewrites config.yaml only once its checkpoint has loaded (engine.drive)
        run.write_config(to_dict(cfg))
    display = Display(cfg.run.display, num_steps=cfg.student.num_steps)
    _, restore_hook = install_fault_hook()
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM unwinds like Ctrl-C: finally runs
    live: dict = {"meshes": None, "diloco": None, "slurm": None}  # what the finally: block stops
    try:
        replicas, spent, n_pairs, dropped = _build(cfg, run, display, states, eval_states, tasks, resuming, live)
        r = cfg.run
        drive_cfg = DriveConfig(num_steps=cfg.student.num_steps, checkpoint_every=r.checkpoint_every,
                                keep_last=r.keep_last, resume=resuming, evaluate=r.evaluate, eval_every=r.eval_every)
        summary = drive(replicas, run, drive_cfg, run_config=to_dict(cfg), extra_metrics={"replay/spent_usd": spent},
                        on_step=lambda step, metrics: display.step(step, metrics, spent),
                        on_resume=lambda step: display.message(f"resumed at step {step}"),
                        summary_extra={"run_dir": str(run.path), "n_states": len(states), "n_pairs": n_pairs,
                                       "replay/spent_usd": spent, **dropped})
        if live["diloco"] is not None:  # the digests after the last sync, restarts (known once training ended)
            summary.update(live["diloco"].summary(), **(live["slurm"].summary() if live["slurm"] else {}))
            run.write_summary(summary)
        display.summary(summary)
        display.message(recipe_report(run.path))  # <run>/report.png: every channel, reward, eval/*
        return 0
    except (ActorFailure, LaunchError, KeyboardInterrupt) as exc:  # LaunchError: no hosts (a bad SLURM request: 2)
        display.close()
        stopped = isinstance(exc, KeyboardInterrupt)
        print(f"interrupted; stopping every mesh (resume with --resume {run.path})" if stopped else f"error: {exc}",
              file=sys.stderr)
        return 130 if stopped else getattr(exc, "exit_code", 1)
    finally:
        display.close()
        for key in ("diloco", "meshes"):
            if live[key] is not None:
                live[key].stop(timeout_s=min(30.0, cfg.mesh.call_timeout_s))
        if live["slurm"] is not None:  # never leave a job running
            live["slurm"].cancel()
        run.close()
        restore_hook()
        signal.signal(signal.SIGTERM, signal.SIG_DFL)  # each failure Monarch reported outside a call was logged


def _build(cfg: RecipeConfig, run: RunDir, display: Display, states, eval_states, tasks, resuming: bool, live: dict):
    """Spawn the meshes and actors, replay the states into pairs (``agentic``: no replay, channel 3 comes from the
    tasks' solutions), set the student replicas up: ``(Replicas for engine.drive, spend, number of pairs, replay
    drops)``; the meshes go into ``live`` at once, for the caller to stop."""
    m, d, t = cfg.mesh, cfg.diloco, cfg.teachers
    agentic = cfg.student.rollout.environment == "agentic"
    display.message(f"run folder {run.path}; spawning meshes ({d.replicas if d.enabled else m.num_replicas} trainer "
                    f"replica(s){', DiLoCo' if d.enabled else ''}{f' on {len(m.workers)} workers' if m.workers else ''})")
    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    if m.launcher == "slurm":  # one replica per node; nodes beyond that are spares
        slurm = live["slurm"] = slurm_hosts(m.slurm, m.slurm.nodes or d.replicas, log_dir=str(run.path / "slurm"),
                                            python=sys.executable)
        display.message(f"SLURM job {slurm.job_id} running on {', '.join(slurm.nodes)}")
        meshes = attach_meshes(slurm.workers[:d.replicas], spares=slurm.workers[d.replicas:],
                               relaunch=slurm.relaunch, nodes=slurm.node_of())
    elif m.workers:
        meshes = attach_meshes(m.workers, spares=m.spare_workers, teacher_worker=m.teacher_worker,
                               reducer_worker=m.reducer_worker)
    else:
        meshes = local_meshes(num_replicas=m.num_replicas, env=env, diloco=d.enabled)
    live["meshes"] = meshes
    teacher = None if agentic else meshes.add("teacher", meshes.teacher.spawn("teacher", TeacherReplay))
    trainer = None if d.enabled else meshes.add("trainer", meshes.trainer.spawn("trainer", StudentTrainer))
    reducer = meshes.add("reducer", meshes.reducer.spawn("reducer", Reducer))
    warm = None if d.enabled else trainer.warmup.call()  # imports torch while the teachers replay
    tinfo = {"pid": None} if agentic else wait(teacher.setup.call_one(
        cfg.teacher_specs(), agreement_threshold=t.agreement_threshold, max_tokens=t.max_tokens,
        temperature=t.temperature, seed=t.seed, timeout_s=t.timeout_s,
        local_device="cpu" if cfg.student.device == "cpu" else resolve_device("auto").type, inject_fault=m.inject_fault,
        threads=m.threads_per_proc, rejected_from_rollout=cfg.rejected_from_rollout()),
        actor="teacher", timeout_s=m.setup_timeout_s, what="setup")
    if agentic:
        pairs, spent, dropped = [], 0.0, {}
        display.message(f"{len(tasks[0])} agentic tasks, {len(tasks[1])} held out")
    else:
        display.message(f"replaying {len(states)} trace states with {', '.join(t.slugs)}")
        pairs, spent, dropped = replay_pairs(cfg, teacher, states, run, display, resuming=resuming)
    display.message(f"{len(pairs)} pairs; setting up the student ({cfg.student.model})")
    if d.enabled:  # one proc mesh per replica, a lighthouse here; replicas join at the first step
        replicas = live["diloco"] = start_diloco(cfg, meshes, reducer, run_dir=str(run.path), states=states,
                                                 pairs=pairs, eval_states=eval_states, tasks=tasks,
                                                 on_event=display.message)
        setup = replicas.setup
    else:
        wait(warm, actor="trainer", timeout_s=m.setup_timeout_s, what="warmup")
        kwargs = setup_kwargs(cfg, states=states, pairs=pairs, eval_states=eval_states, tasks=tasks,
                              world_size=m.num_replicas)
        setup = wait(trainer.setup.call(cfg.student, **kwargs), actor="trainer", timeout_s=m.setup_timeout_s,
                     what="setup").values()
        replicas = MeshReplicas(trainer, reducer, str(run.path), call_timeout_s=m.call_timeout_s)
    (run.path / "processes.json").write_text(json.dumps(
        {"controller": os.getpid(), "teacher": tinfo["pid"], "trainer": [s["pid"] for s in setup]}))
    return replicas, spent, len(pairs), dropped


if __name__ == "__main__":
    sys.exit(main())

"""Recipe overhead: the same training steps in one plain process and through the Monarch meshes.

    python -m benchmarks.recipe_overhead                    # tiny preset, 8 steps
    python -m benchmarks.recipe_overhead --preset single_node --steps 6

Both sides train the same ``StudentConfig`` on the same states and pairs (replayed once, here, first):
``run_plain`` in this process, then a ``StudentTrainer`` actor on a trainer proc mesh with the ``Reducer``
folding its metrics and the controller logging them, as ``recipes.monarch.run`` does. Compared: the median
wall time between consecutive logged steps (step 0 excluded; setup apart). Target: mesh / plain <= 1.10;
same seed on both sides, so the losses must match exactly.
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.report import command, parser, record


def _pairs(cfg, states):
    """The preset's teacher pairs of ``states``, replayed and normalized as the recipe does."""
    from composer_replication.replaysim import DJNormalizer
    from composer_replication.teacher_replay import PairCollector, TeacherReplayer

    t = cfg.teachers
    rp = TeacherReplayer(cfg.teacher_specs(), max_tokens=t.max_tokens, temperature=t.temperature, seed=cfg.student.seed)
    results = asyncio.run(rp.replay(states, max_total_usd=t.max_total_usd))
    coll = PairCollector(states, num_teachers=len(t.slugs), agreement_threshold=t.agreement_threshold)
    pairs = [p for r in results for p in coll.add(r)]
    return DJNormalizer(skip_dj=not t.normalize).normalize(pairs)


def plain_side(cfg, data, folder: Path) -> tuple[list[float], list[float], float]:
    """``run_plain``; returns (logged-step timestamps, totals, setup seconds)."""
    from composer_replication.engine import run_plain

    stamps, totals, t0 = [], [], time.perf_counter()

    def on_step(step, metrics):
        stamps.append(time.perf_counter())
        totals.append(metrics["loss/total"])

    run_plain(cfg.student, data, folder, checkpoint_every=0, evaluate=False, on_step=on_step)
    return stamps, totals, stamps[0] - t0


def mesh_side(cfg, states, pairs, folder: Path) -> tuple[list[float], list[float], float]:
    """The recipe's actors; returns (logged-step timestamps, totals, setup seconds)."""
    from composer_replication.engine import RunDir
    from meshes import Reducer, StudentTrainer, local_meshes, wait
    from recipes.monarch.data import REPO_ROOT

    t0 = time.perf_counter()
    meshes = local_meshes(num_replicas=1, env={"PYTHONPATH": str(REPO_ROOT)})
    run = RunDir(folder)
    try:
        trainer = meshes.add("trainer", meshes.trainer.spawn("trainer", StudentTrainer))
        reducer = meshes.add("reducer", meshes.reducer.spawn("reducer", Reducer))
        wait(trainer.setup.call(cfg.student, states=states, pairs=pairs, world_size=1,
                                num_eval_prompts=cfg.data.num_eval_prompts), actor="trainer", timeout_s=900)
        stamps, totals = [], []
        for step in range(cfg.student.num_steps):
            per_rank = wait(trainer.train_step.call(step), actor="trainer", timeout_s=900).values()
            metrics = wait(reducer.aggregate_metrics.call_one(list(per_rank)), actor="reducer", timeout_s=60)
            run.log_metrics(step, metrics)
            stamps.append(time.perf_counter())
            totals.append(metrics["loss/total"])
        return stamps, totals, stamps[0] - t0
    finally:
        run.close()
        meshes.stop()


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__)
    p.add_argument("--preset", default="tiny", help="recipe preset (recipes/monarch/configs)")
    p.add_argument("--steps", type=int, default=8, help="training steps on each side (>= 3)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the preset")
    args = p.parse_args(argv)
    from composer_replication.engine import build_training_data
    from meshes import install_fault_hook
    from recipes.monarch.config import load_config
    from recipes.monarch.data import load_states

    cfg = load_config(args.preset, [*args.overrides, f"student.num_steps={max(3, args.steps)}"])
    states = load_states(cfg)
    pairs = _pairs(cfg, states)
    data = build_training_data(cfg.student.rollout.environment, states=states, pairs=pairs,
                               num_eval_prompts=cfg.data.num_eval_prompts, seed=cfg.student.seed)
    _, restore = install_fault_hook()
    with tempfile.TemporaryDirectory() as tmp:
        ps, ptot, psetup = plain_side(cfg, data, Path(tmp) / "plain")
        ms, mtot, msetup = mesh_side(cfg, states, pairs, Path(tmp) / "mesh")
    restore()
    plain = statistics.median(b - a for a, b in zip(ps, ps[1:]))  # median: robust to other jobs' spikes
    mesh = statistics.median(b - a for a, b in zip(ms, ms[1:]))
    md = (f"# Recipe overhead: plain loop vs meshes\n\nCommand: `{command('recipe_overhead', argv)}` (preset `{args.preset}`, "
          f"{cfg.student.num_steps} steps, {len(states)} states, {len(pairs)} pairs; median wall time per step, "
          "step 0 excluded)\n\n| side | setup + step 0 (s) | median s / step |\n|---|---|---|\n"
          f"| plain (`run_plain`) | {psetup:.2f} | {plain:.3f} |\n| mesh (`StudentTrainer` + `Reducer`) | {msetup:.2f} | "
          f"{mesh:.3f} |\n\n**mesh / plain: {mesh / plain:.3f}** (target <= 1.10: "
          f"{'met' if mesh / plain <= 1.10 else 'not met'}); identical losses on both sides: {ptot == mtot}.\n")
    record(args, "recipe_overhead", md, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

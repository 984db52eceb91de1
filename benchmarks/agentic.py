"""Agentic learning: does training on episodes make the student better at fixing the held-out tasks?

    python -m benchmarks.agentic                                     # preset agentic, its steps, 3 seeds
    python -m benchmarks.agentic --seeds 1 student.num_steps=4       # a quick look
    python -m benchmarks.agentic --out runs/bench-agentic --reuse    # read seeds already run there

Each seed is one full ``python -m recipes.monarch.run --config agentic``, one after the other, evaluated every
``run.eval_every`` steps by one greedy episode per held-out task, in the sandbox, scored by the tests. Per seed:
``eval/solve_rate`` and ``eval/mean_reward`` at start and end, what else the episodes show
(``well_formed_call_rate``, ``tool_calls``, ``tool_error_rate``, ``mean_turns``) and the throughput (episode
turns per second of step time). Rule (issue #21): the solve rate or mean reward rises in every seed and its
mean gain exceeds twice its std; when neither does, the table shows what moved. Curves: ``docs/img/agentic.png``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from benchmarks.learning import draw, run_seed, seed_parser, verdict
from benchmarks.report import REPO, command, metrics_rows, record, table

PICTURE = REPO / "docs" / "img" / "agentic.png"
RULED = ("eval/solve_rate", "eval/mean_reward")
SHOWN = (*RULED, "eval/well_formed_call_rate", "eval/tool_calls", "eval/tool_error_rate", "eval/mean_turns")


def throughput(folder: Path) -> tuple[float, float]:
    """``(episode turns per second of step time, mean step seconds)`` over the run's training steps."""
    steps = [r for r in metrics_rows(folder) if "perf/step_time_s" in r]
    turns = sum(r["rollout/turns"] * r["rollout/num_episodes"] for r in steps)
    seconds = sum(r["perf/step_time_s"] for r in steps)
    return turns / seconds if seconds else 0.0, seconds / max(len(steps), 1)


def main(argv: list[str] | None = None) -> int:
    args = seed_parser(__doc__, "agentic").parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        for seed in range(args.seeds):
            res = run_seed(args.preset, seed, root / f"seed{seed}", args.overrides, reuse=args.reuse,
                           metric="eval/solve_rate")
            res["turns_per_s"], res["step_s"] = throughput(root / f"seed{seed}")
            results.append(res)
            start, end = res["eval_start"], res["eval_end"]
            print(f"seed {seed}: " + "; ".join(f"{k.split('/')[1]} {start[k]:.3f} -> {end[k]:.3f}" for k in SHOWN)
                  + f"; {res['steps']} steps, {res['step_s']:.0f} s/step, {res['bench_wall_s']:.0f} s", flush=True)
    verdicts = {k: verdict([r["eval_end"][k] - r["eval_start"][k] for r in results]) for k in SHOWN}
    learned = any(verdicts[k][2] for k in RULED)
    for k in SHOWN:
        mean, spread, rises = verdicts[k]
        print(f"held-out {k} gain: {mean:+.3f} +- {spread:.3f} (std){' (rises in every seed, > 2 std)' * rises}")
    print(f"learning {'SHOWN' if learned else 'NOT SHOWN'} on {' or '.join(RULED)} (rule: rises in every seed, "
          "mean gain > 2 std)")
    if not args.no_record:
        draw(results, PICTURE, metric="eval/well_formed_call_rate", title="held-out turns with a valid tool call")
    record(args, "agentic", _markdown(command("agentic", argv), args.preset, results, verdicts, learned))
    return 0


def _markdown(cmd: str, preset: str, results: list[dict], verdicts: dict, learned: bool) -> str:
    """The agentic section of docs/benchmarks.md: a row per seed, the gains, the verdict, the picture."""
    lines = ["# Agentic: held-out tasks solved by the student's own episodes", "",
             f"Command: `{cmd}` (preset `{preset}`). One greedy episode per held-out task (never trained on), in the "
             "sandbox, scored by the task's tests; start -> end of each run.", "",
             *table(["seed", "steps", *(k.removeprefix("eval/") for k in SHOWN), "s/step", "turns/s"],
                    [[seed, r["steps"], *(f"{r['eval_start'][k]:.3f} -> {r['eval_end'][k]:.3f}" for k in SHOWN),
                      f"{r['step_s']:.0f}", f"{r['turns_per_s']:.2f}"] for seed, r in enumerate(results)])]
    lines += ["", "Mean gain over seeds (+- std): " + "; ".join(
        f"`{k.removeprefix('eval/')}` {m:+.3f} +- {s:.3f}{' (rises in every seed)' * ok}"
        for k, (m, s, ok) in verdicts.items()) + ".", "",
        f"Learning on the solve rate or the mean reward: **{'shown' if learned else 'not shown'}** (rule: rises in "
        "every seed, mean gain above twice its std).", "", "![agentic learning curve](img/agentic.png)"]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

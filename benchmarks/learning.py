"""Learning: does the default run teach the right thing? Held-out next-action agreement, start vs end, over seeds.

    python -m benchmarks.learning                                    # single_node, its steps, 3 seeds
    python -m benchmarks.learning --preset tiny --seeds 2 student.num_steps=8
    python -m benchmarks.learning run.eval_every=8                   # the curve, an evaluation every 8 steps

Each seed is one full ``python -m recipes.monarch.run`` (own controller and meshes), one after the other,
evaluated on the held-out sessions (entering no training channel) at its start and end (``eval_start`` /
``eval_end`` of ``summary.json``, the curve from the ``eval/*`` rows of ``metrics.jsonl``). Per seed: the
agreement with the recorded action (``eval/agreement_partial``: partial credit per tool call;
``eval/agreement``: exact), the well-formed call rate and the training reward; then the mean gain and its
std over seeds. Rule: the agreement rises in every seed and the mean gain exceeds twice its std. The
curves go to ``docs/img/learning.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.report import REPO, command, metrics_rows, parser, record, run_recipe, table

PICTURE = REPO / "docs" / "img" / "learning.png"
METRIC = "eval/agreement_partial"
SHOWN = ("eval/agreement_partial", "eval/agreement", "eval/tool_choice_rate", "eval/well_formed_call_rate")


def run_seed(preset: str, seed: int, folder: Path, overrides: list[str], *, reuse: bool = False,
             metric: str = METRIC) -> dict:
    """One recipe run (or, with ``reuse``, the finished run already in ``folder``); returns its summary plus its
    eval curve ``[(step, {metric: value})]`` (the ``eval/*`` rows holding ``metric``)."""
    t0 = time.perf_counter()
    if not (reuse and (folder / "summary.json").is_file()):
        run_recipe(folder, "--config", preset, f"student.seed={seed}", "run.display=plain", "run.evaluate=true",
                   *overrides)
    summary = json.loads((folder / "summary.json").read_text())
    rows = metrics_rows(folder)
    summary["curve"] = [(r["step"], r) for r in rows if metric in r]
    summary["reward_curve"] = [(r["step"], r["reward/mean"]) for r in rows if r.get("reward/mean") is not None]
    summary["bench_wall_s"] = summary.get("wall_time_s", 0.0) if reuse else time.perf_counter() - t0
    return summary


def verdict(gains: list[float]) -> tuple[float, float, bool]:
    """``(mean, std, rises)``: rises in every seed and the mean gain exceeds twice its std (one seed: rises)."""
    mean = statistics.mean(gains)
    spread = statistics.stdev(gains) if len(gains) > 1 else float("nan")
    return mean, spread, all(g > 0 for g in gains) and (len(gains) == 1 or mean > 2 * spread)


def seed_parser(doc: str, preset: str) -> argparse.ArgumentParser:
    """The command line of :mod:`benchmarks.learning` and :mod:`benchmarks.agentic` (``preset``: the default)."""
    p = parser(doc)
    p.add_argument("--preset", default=preset, help="recipe preset (recipes/monarch/configs)")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (0, 1, ...)")
    p.add_argument("--out", default=None, help="keep the run folders here (default: a temporary folder)")
    p.add_argument("--reuse", action="store_true",
                   help="with --out: take seeds whose run folder already holds a finished run (summary.json) as they are "
                        "(e.g. seeds run in parallel with the command the benchmark prints) instead of running them again")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the preset")
    return p


def draw(results: list[dict], path: Path, metric: str = METRIC, title: str = "held-out agreement (partial credit)"
         ) -> None:
    """Held-out ``metric`` per evaluation and training reward per step, one line per seed (Agg, no pyplot state)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 3.6))
    FigureCanvasAgg(fig)
    left, right = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for seed, res in enumerate(results):
        steps = [s for s, _ in res["curve"]]
        left.plot(steps, [r[metric] for _, r in res["curve"]], marker="o", label=f"seed {seed}")
        right.plot(*zip(*res["reward_curve"]), label=f"seed {seed}", alpha=0.8)
    left.set(title=title, xlabel="step", ylabel=metric)
    right.set(title="training reward (rollouts)", xlabel="step", ylabel="reward/mean")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    args = seed_parser(__doc__, "single_node").parse_args(argv)
    results, gains = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        for seed in range(args.seeds):
            res = run_seed(args.preset, seed, root / f"seed{seed}", args.overrides, reuse=args.reuse)
            start, end = res["eval_start"], res["eval_end"]
            gains.append(end[METRIC] - start[METRIC])
            results.append(res)
            print(f"seed {seed}: {METRIC} {start[METRIC]:.3f} -> {end[METRIC]:.3f} ({gains[-1]:+.3f}); "
                  f"exact {start['eval/agreement']:.3f} -> {end['eval/agreement']:.3f}; well-formed "
                  f"{start['eval/well_formed_call_rate']:.3f} -> {end['eval/well_formed_call_rate']:.3f}; "
                  f"{res['steps']} steps, {res['bench_wall_s']:.0f} s", flush=True)
    mean, spread, learned = verdict(gains)
    print(f"\nheld-out {METRIC} gain over {len(gains)} seed(s): {mean:+.3f} +- {spread:.3f} (std); "
          f"learning {'SHOWN' if learned else 'NOT SHOWN'} (rule: rises in every seed, mean > 2 std)")
    if not args.no_record:
        draw(results, PICTURE)
    record(args, "learning", _markdown(command("learning", argv), args.preset, results, gains, mean, spread, learned))
    return 0 if learned else 1


def _markdown(cmd: str, preset: str, results: list[dict], gains: list[float], mean: float, spread: float,
              learned: bool) -> str:
    """The learning section of docs/benchmarks.md: one row per seed, the mean gain, the rule and the picture."""
    lines = ["# Learning: held-out agreement with the recorded actions", "",
             f"Command: `{cmd}` (preset `{preset}`). Held-out sessions only (never trained on); greedy answers.", "",
             *table(["seed", "steps", *(f"{m} start -> end" for m in SHOWN), "wall time"],
                    [[seed, res["steps"], *(f"{res['eval_start'][m]:.3f} -> {res['eval_end'][m]:.3f}" for m in SHOWN),
                      f"{res['bench_wall_s']:.0f} s"] for seed, res in enumerate(results)])]
    lines += ["", f"Gain in `{METRIC}`: {', '.join(f'{g:+.3f}' for g in gains)}; mean {mean:+.3f} +- {spread:.3f} "
              f"(std over seeds): learning **{'shown' if learned else 'not shown'}** (rule: the agreement rises "
              "in every seed and the mean gain exceeds twice its standard deviation).", "",
              "![learning curve](img/learning.png)"]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

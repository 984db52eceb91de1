"""Learning: does the default recipe raise the reward? First-quarter vs last-quarter mean reward, over seeds.

    python -m benchmarks.learning                                   # single_node, its steps, 3 seeds
    python -m benchmarks.learning --preset tiny --steps 8 --seeds 2 # shorter

Each seed is one full ``python -m recipes.monarch.run`` (own controller and meshes), run one after the
other (seeds after the first reuse its teacher ledger, so they skip the replay). From each run's ``metrics.jsonl`` the benchmark takes ``reward/mean`` per step, and reports the
mean of the first quarter of the steps, the mean of the last quarter, and their difference; then the
mean difference over seeds with its standard deviation (the spread), and whether the mean difference
exceeds the spread (the margin).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.report import write_section

REPO = Path(__file__).resolve().parents[1]


def quarters(rewards: list[float]) -> tuple[float, float]:
    """Mean of the first and of the last quarter (at least one step each) of a reward curve."""
    q = max(1, len(rewards) // 4)
    return statistics.mean(rewards[:q]), statistics.mean(rewards[-q:])


def run_seed(preset: str, seed: int, steps: int | None, folder: Path, overrides: list[str]) -> list[float]:
    """One recipe run; returns its per-step ``reward/mean`` curve (NaN steps dropped)."""
    args = [sys.executable, "-m", "recipes.monarch.run", "--config", preset, f"student.seed={seed}",
            f"run.dir={folder}", "run.display=plain", "run.evaluate=false", *overrides]
    if steps is not None:
        args.append(f"student.num_steps={steps}")
    proc = subprocess.run(args, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"seed {seed} failed (rc {proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [float(m["reward/mean"]) for m in lines if m.get("reward/mean") is not None]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="single_node", help="recipe preset (recipes/monarch/configs)")
    p.add_argument("--steps", type=int, default=None, help="steps per run (default: the preset's)")
    p.add_argument("--seeds", type=int, default=3, help="number of seeds (0, 1, ...)")
    p.add_argument("--out", default=None, help="keep the run folders here (default: a temporary folder)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the preset")
    p.add_argument("--no-record", action="store_true", help="do not update docs/benchmarks.md (section learning)")
    args = p.parse_args(argv)
    rows, deltas = [], []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        for seed in range(args.seeds):
            t0 = time.perf_counter()
            ledger = root / "seed0" / "teacher_ledger.jsonl"
            if seed > 0 and ledger.is_file():  # same teacher requests: reuse the replies, skip the replay
                (root / f"seed{seed}").mkdir(parents=True, exist_ok=True)
                shutil.copy(ledger, root / f"seed{seed}" / "teacher_ledger.jsonl")
            curve = run_seed(args.preset, seed, args.steps, root / f"seed{seed}", args.overrides)
            first, last = quarters(curve)
            deltas.append(last - first)
            rows.append((seed, len(curve), first, last, last - first, time.perf_counter() - t0))
            print(f"seed {seed}: steps {len(curve)}  first-quarter {first:.3f}  last-quarter {last:.3f}  "
                  f"delta {last - first:+.3f}  ({rows[-1][-1]:.0f} s)", flush=True)
    mean = statistics.mean(deltas)
    spread = statistics.stdev(deltas) if len(deltas) > 1 else float("nan")
    print(f"\npreset {args.preset}: last-quarter minus first-quarter mean reward over {len(deltas)} seed(s): "
          f"{mean:+.3f} +- {spread:.3f} (std)")
    learned = mean > 0 and (len(deltas) == 1 or mean > spread)
    print("learning: " + ("YES (mean gain exceeds its spread)" if learned else "NOT SHOWN"))
    if not args.no_record:
        cmd = " ".join(["python -m benchmarks.learning", *(sys.argv[1:] if argv is None else argv)])
        print(f"wrote {write_section('learning', _markdown(cmd, args.preset, rows, mean, spread, learned))}")
    return 0 if learned else 1


def _markdown(cmd: str, preset: str, rows: list[tuple], mean: float, spread: float, learned: bool) -> str:
    """The learning section of docs/benchmarks.md: one row per seed, the mean gain and the pass rule."""
    lines = ["# Learning: first-quarter vs last-quarter reward", "", f"Command: `{cmd}` (preset `{preset}`)", "",
             "| seed | steps | first-quarter reward | last-quarter reward | delta | wall time |", "|---|---|---|---|---|---|"]
    lines += [f"| {s} | {n} | {a:.3f} | {b:.3f} | {d:+.3f} | {t:.0f} s |" for s, n, a, b, d, t in rows]
    lines += ["", f"Mean gain {mean:+.3f} +- {spread:.3f} (std over seeds): learning "
              f"**{'shown' if learned else 'not shown'}** (rule: the mean gain is positive and exceeds its spread)."]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

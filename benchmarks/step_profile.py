"""Step profile: where the default run's training step spends its time, phase by phase and channel by channel.

    python -m benchmarks.step_profile                       # preset single_node, 4 steps
    python -m benchmarks.step_profile --steps 6 student.rollout.prompts_per_step=1

Part 1 runs the preset (evaluation off) and takes the median, after the first step, of every
``perf/<phase>_s`` metric the engine writes (generation, scoring, hint rows and channel-1 tensors, reference
log-probs, loss forward, loss backward, optimizer). Part 2 rebuilds step 0's batch here from the run's states
and ``pairs.jsonl`` and times each channel's loss forward + backward alone (channel 1; 1 + 2 minus 1;
1 + 3 minus 1), with the tokens each puts through the model.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.report import command, parser, record, run_recipe, table

PHASES = ("generate", "score", "assemble", "reference", "loss_forward", "loss_backward", "optimizer")


def channel_times(folder: Path, repeats: int = 2) -> list[tuple[str, float, int]]:
    """``(channel, seconds of forward + backward, tokens)`` for each channel alone, on step 0's batch."""
    import yaml

    from composer_replication.engine import StudentTrainerCore, build_training_data
    from composer_replication.engine.config import from_dict
    from composer_replication.losses import compose_loss
    from composer_replication.teacher_replay import load_pairs
    from recipes.monarch.config import RecipeConfig
    from recipes.monarch.data import load_states

    cfg = from_dict(RecipeConfig, yaml.safe_load((folder / "config.yaml").read_text()))
    data = build_training_data(cfg.student.rollout.environment, states=load_states(cfg),
                               pairs=load_pairs(folder / "pairs.jsonl"))
    core = StudentTrainerCore(cfg.student, data=data)
    batch, _ = core._build_batch(0)
    ch2 = {k for k in batch if k.startswith(("ctx_teacher_", "sdpo_"))}
    ch3 = {k for k in batch if k.startswith("dpo_")}
    base = {k: v for k, v in batch.items() if k not in ch2 | ch3}
    L = cfg.student.loss

    def timed(b: dict, **weights: float) -> float:
        best = float("inf")
        for _ in range(repeats):
            core.model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            compose_loss(core.model, b, L.__class__(**{**L.__dict__, **weights}),
                         max_completion_length=cfg.student.rollout.max_new_tokens).total.backward()
            best = min(best, time.perf_counter() - t0)
        return best

    t1 = timed(base, alpha_sdpo=0.0, beta_replay=0.0)
    rows = [("1 (" + ("grpo" if "advantages" in base else "lm_ce") + ")", t1, int(base["attention_mask"].sum()))]
    if ch2:
        t2 = timed({**base, **{k: batch[k] for k in ch2}}, beta_replay=0.0)
        rows.append((f"2 ({L.sdpo_wrapper}, hinted teacher rows)", t2 - t1, int(batch["ctx_teacher_attention_mask"].sum())))
    if ch3:
        t3 = timed({**base, **{k: batch[k] for k in ch3}}, alpha_sdpo=0.0)
        tokens = int(batch["dpo_chosen_attention_mask"].sum() + batch["dpo_rejected_attention_mask"].sum())
        rows.append((f"3 ({L.dpo_variant})", t3 - t1, tokens))
    core.model.zero_grad(set_to_none=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, prog="python -m benchmarks.step_profile")
    p.add_argument("--preset", default="single_node", help="recipe preset")
    p.add_argument("--steps", type=int, default=4, help="steps to run (the first is not counted)")
    p.add_argument("overrides", nargs="*", help="key.sub=value overrides of the preset")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_recipe(Path(tmp) / "run", "--config", args.preset, "run.display=plain", "run.evaluate=false",
                          f"student.num_steps={args.steps}", *args.overrides)
        rows = [r for r in rows if "loss/total" in r]
        counted = rows[1:] or rows
        phases = {ph: statistics.median(r.get(f"perf/{ph}_s", 0.0) for r in counted) for ph in PHASES}
        step = statistics.median(r["perf/step_time_s"] for r in counted)
        tokens = statistics.median(r["perf/tokens"] for r in counted)
        channels = channel_times(Path(tmp) / "run")
    md = "\n".join([
        "# Step profile of the default run", "",
        f"Command: `{command('step_profile', argv)}`. Median over {len(counted)} steps (the first not counted): "
        f"**{step:.2f} s per step**, {tokens:.0f} tokens through the model (torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads).", "",
        *table(["phase", "seconds", "share of the step"], [[ph, f"{s:.2f}", f"{100 * s / step:.1f} %"]
                                                          for ph, s in phases.items()]), "",
        "Loss forward + backward of each channel alone, on step 0's batch (best of 2):", "",
        *table(["channel", "seconds", "tokens"], [[c, f"{s:.2f}", n] for c, s, n in channels]),
    ])
    record(args, "step_profile", md, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Step throughput: the engine's GRPO step against TRL's ``GRPOTrainer``, side by side in one run.

Both train the same model (the embedded SmolLM2-135M by default) on the same prompts (the bundled
sessions' trace states), with the same ``num_generations``, ``max_new_tokens``, temperature, loss type
(``dapo``), batch (``prompts x G`` samples per optimizer step), no KL term, and one optimizer step per
generation batch; both score with the same next-action reward. Only channel 1 runs (channels 2 and 3
are TRL extensions). The figure is samples per second (generated completions per wall-clock second of a
whole step, generation included), after one warm-up step each.

    python -m benchmarks.step_throughput                      # SmolLM2, 2 prompts x 4, 32 tokens, 3 steps
    python -m benchmarks.step_throughput --model tiny --steps 2

Writes its section of docs/benchmarks.md (``--no-write`` to skip).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.report import write_section


def _states(n: int) -> list[dict[str, Any]]:
    from composer_replication.data import bundled_path
    from composer_replication.ingestion import ingest_any

    states: list[dict[str, Any]] = []
    for path in sorted(bundled_path("sessions").rglob("*.jsonl")):
        states += [dict(s) for s in ingest_any(path, max_history_tokens=192)]
        if len(states) >= n:
            break
    return states[:n]


def engine_side(args: argparse.Namespace, states: list[dict[str, Any]]) -> list[float]:
    """Seconds per ``StudentTrainerCore.train_step`` (channel 1 only)."""
    from composer_replication.engine import (
        LossConfig,
        OptimConfig,
        RolloutConfig,
        StudentConfig,
        StudentTrainerCore,
    )
    from composer_replication.engine.data import build_training_data

    cfg = StudentConfig(
        model=args.model, device="cpu", seed=0, num_steps=args.steps + 1, max_seq_len=1024,
        optim=OptimConfig(lr=1e-6), loss=LossConfig(alpha_sdpo=0.0, beta_replay=0.0, loss_type="dapo", kl_beta=0.0),
        rollout=RolloutConfig(prompts_per_step=args.prompts, num_generations=args.generations,
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature, pairs_per_step=0),
    )
    core = StudentTrainerCore(cfg, data=build_training_data("next_action", states=states))
    times = []
    for step in range(args.steps + 1):
        t0 = time.perf_counter()
        core.train_step(step)
        times.append(time.perf_counter() - t0)
    return times[1:]


def trl_side(args: argparse.Namespace, states: list[dict[str, Any]]) -> list[float]:
    """Seconds per ``GRPOTrainer`` optimizer step (generation included), same settings."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from composer_replication.models import load_model_and_tokenizer
    from composer_replication.rollout import NextActionEnvironment

    env = NextActionEnvironment(states)
    prompts = {p.prompt_id: p for p in env.prompts()}
    rows = [{"prompt": p.messages, "prompt_id": pid} for pid, p in prompts.items()]
    rows = (rows * (1 + (args.prompts * (args.steps + 1)) // len(rows)))[: args.prompts * (args.steps + 1)]

    def reward(completions, prompt_id, **_: Any) -> list[float]:
        return [env.score(prompts[pid], c[0]["content"]).reward for c, pid in zip(completions, prompt_id)]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_step_begin(self, *a: Any, **k: Any) -> None:
            self.marks.append(time.perf_counter())

        def on_step_end(self, *a: Any, **k: Any) -> None:
            self.marks.append(time.perf_counter())

    model, tok = load_model_and_tokenizer(args.model, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    clock = Clock()
    with tempfile.TemporaryDirectory() as out:
        trl_args = GRPOConfig(
            output_dir=out, use_vllm=False, use_cpu=True, bf16=False, gradient_checkpointing=False,
            per_device_train_batch_size=args.prompts * args.generations, num_generations=args.generations,
            max_completion_length=args.max_new_tokens, temperature=args.temperature, top_k=0, beta=0.0,
            loss_type="dapo", learning_rate=1e-6, max_steps=args.steps + 1, logging_steps=1, report_to="none",
            save_strategy="no", seed=0, shuffle_dataset=False,
        )
        trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=[reward], args=trl_args,
                              train_dataset=Dataset.from_list(rows), callbacks=[clock])
        trainer.train()
    spans = [b - a for a, b in zip(clock.marks[0::2], clock.marks[1::2])]
    return spans[1:]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.step_throughput", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default) or tiny")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="samples per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="completion length cap")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    p.add_argument("--steps", type=int, default=3, help="timed steps per side (after one warm-up)")
    p.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = p.parse_args(argv)
    states = _states(max(8, args.prompts * 4))
    samples = args.prompts * args.generations
    ours = engine_side(args, states)
    theirs = trl_side(args, states)
    ours_sps, trl_sps = samples / statistics.median(ours), samples / statistics.median(theirs)
    ratio = ours_sps / trl_sps
    print(f"engine: {ours_sps:.3f} samples/s (median {statistics.median(ours):.2f} s/step over {len(ours)} steps)")
    print(f"TRL:    {trl_sps:.3f} samples/s (median {statistics.median(theirs):.2f} s/step over {len(theirs)} steps)")
    print(f"ratio engine / TRL: {ratio:.2f}x (target >= 1.5x)")
    if not args.no_write:
        write_section("step_throughput", f"""# Step throughput: engine GRPO step vs TRL `GRPOTrainer`

`python -m benchmarks.step_throughput` ({time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPU
cores, torch {torch.__version__}). Model `{args.model}`, {args.prompts} prompts x {args.generations} samples,
{args.max_new_tokens} new tokens, temperature {args.temperature}, `dapo`, no KL, channel 1 only; median of
{args.steps} steps after one warm-up, generation included.

| trainer | s / step | samples / s |
|---|---|---|
| engine (`StudentTrainerCore.train_step`) | {statistics.median(ours):.2f} | {ours_sps:.3f} |
| TRL `GRPOTrainer` | {statistics.median(theirs):.2f} | {trl_sps:.3f} |

**Ratio: {ratio:.2f}x** TRL's samples per second (target >= 1.5x). Where the difference comes from: the
engine's loss pass packs a group's samples into their prefix tree (the prompt decoded once, no padding;
docs/losses.md) where TRL decodes the prompt once per sample; both generate with `model.generate` (KV cache;
the engine prefills the group's prompt once into a static cache) and skip the old-log-prob pass (one
optimizer step per generation batch).
""")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Step throughput: the engine's GRPO step against TRL's ``GRPOTrainer``, side by side in one run.

Same model (SmolLM2-135M by default), prompts (the bundled sessions' states), ``num_generations``,
``max_new_tokens``, temperature, loss (``dapo``), batch (``prompts x G``), no KL, one optimizer step per
generation batch, the same next-action reward; channel 1 only (2 and 3 are TRL extensions). Figure: samples
per wall-clock second of a whole step (generation included) after one warm-up step, with this process's CPU
seconds per step beside it (steadier on a shared machine). ``--ablate`` also times the engine without
shared-prefix generation (``rollout.generate.shared_prefix_cache``) and without the loss's shared-prefix
decoding (``LossConfig.share_prefix=False``).

    python -m benchmarks.step_throughput                      # SmolLM2, 2 prompts x 4, 32 tokens, 3 steps
    python -m benchmarks.step_throughput --model tiny --steps 2 --no-record
    python -m benchmarks.step_throughput --ablate --threads 1  # threads 1 on a machine shared with other jobs
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.report import command, parser, record, table


def _states(n: int) -> list[dict[str, Any]]:
    from composer_replication.data import bundled_path
    from composer_replication.ingestion import ingest_any

    states: list[dict[str, Any]] = []
    for path in sorted(bundled_path("sessions").rglob("*.jsonl")):
        states += [dict(s) for s in ingest_any(path, max_history_tokens=192)]
        if len(states) >= n:
            break
    return states[:n]


def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def engine_side(args: argparse.Namespace, states: list[dict[str, Any]], *, share_generate: bool = True,
                share_loss: bool = True) -> list[tuple[float, float]]:
    """``(wall, CPU)`` seconds per ``StudentTrainerCore.train_step`` (channel 1 only); ``share_*``: the
    shared-prefix speed-ups."""
    import composer_replication.rollout.generate as generate
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
        optim=OptimConfig(lr=1e-6),
        loss=LossConfig(alpha_sdpo=0.0, beta_replay=0.0, loss_type="dapo", kl_beta=0.0, share_prefix=share_loss),
        rollout=RolloutConfig(prompts_per_step=args.prompts, num_generations=args.generations,
                              max_new_tokens=args.max_new_tokens, temperature=args.temperature, pairs_per_step=0),
    )
    core = StudentTrainerCore(cfg, data=build_training_data("next_action", states=states))
    real, times = generate.shared_prefix_cache, []
    generate.shared_prefix_cache = real if share_generate else (lambda *a, **k: None)
    try:
        for step in range(args.steps + 1):
            t0 = _clock()
            core.train_step(step)
            times.append(tuple(b - a for a, b in zip(t0, _clock())))
    finally:
        generate.shared_prefix_cache = real
    return times[1:]


def trl_side(args: argparse.Namespace, states: list[dict[str, Any]]) -> list[tuple[float, float]]:
    """``(wall, CPU)`` seconds per ``GRPOTrainer`` optimizer step (generation included), same settings."""
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

    class Clock(TrainerCallback):  # marks: (wall, CPU) at each step's begin and end
        on_step_begin = on_step_end = lambda *a, **k: marks.append(_clock())  # noqa: E731

    model, tok = load_model_and_tokenizer(args.model, seed=0, dtype=torch.float32, device=torch.device("cpu"))
    clock, marks = Clock(), []
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
    spans = [(b[0] - a[0], b[1] - a[1]) for a, b in zip(marks[0::2], marks[1::2])]
    return spans[1:]


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__, prog="python -m benchmarks.step_throughput")
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m (default) or tiny")
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--generations", type=int, default=4, help="samples per prompt (G)")
    p.add_argument("--max-new-tokens", type=int, default=32, help="completion length cap")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    p.add_argument("--steps", type=int, default=3, help="timed steps per side (after one warm-up)")
    p.add_argument("--ablate", action="store_true", help="also time the engine without its shared-prefix speed-ups")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads (0: torch's default); 1 on a machine shared with other jobs, where threads "
                        "that wait for each other's core make both sides' times meaningless")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    states = _states(max(8, args.prompts * 4))
    samples = args.prompts * args.generations
    sides = {"engine (`StudentTrainerCore.train_step`)": engine_side(args, states),
             "TRL `GRPOTrainer`": trl_side(args, states)}
    if args.ablate:
        sides |= {"engine, generation without shared prefix": engine_side(args, states, share_generate=False),
                  "engine, loss without shared prefix": engine_side(args, states, share_loss=False)}
    wall = {k: statistics.median(w for w, _ in v) for k, v in sides.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in sides.items()}
    (e, t), ratio = list(sides)[:2], wall[list(sides)[1]] / wall[list(sides)[0]]
    rows = "\n".join(table(["trainer", "s / step", "CPU s / step", "samples / s"],
                           [[k, f"{wall[k]:.2f}", f"{cpu[k]:.2f}", f"{samples / wall[k]:.3f}"] for k in sides]))
    md = f"""# Step throughput: engine GRPO step vs TRL `GRPOTrainer`

`{command('step_throughput', argv)}` (torch {torch.__version__}). Model `{args.model}`, {args.prompts} prompts x
{args.generations} samples, {args.max_new_tokens} new tokens, temperature {args.temperature}, `dapo`, no KL, channel 1 only; median of
{args.steps} steps after one warm-up, generation included; {torch.get_num_threads()} torch thread(s).

{rows}

**Ratio: {ratio:.2f}x** TRL's samples per second ({cpu[t] / cpu[e]:.2f}x in CPU time; target >= 1.5x); why: the
prose after this section.
"""
    record(args, "step_throughput", md, echo=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Live progress and the final summary table of the Monarch recipe (rich, or plain lines, or nothing).

:class:`Display` shows the replay (calls done, pairs formed, teacher spend) and then one row of
progress per training step: step, each loss channel under the name of the loss that ran (``loss/grpo``
or ``loss/lm_ce``, ``loss/jsd``/``loss/taid``/``loss/entropy_opd``, ``loss/dpo``/``loss/simpo``), the total,
the reward, tokens/s and the teacher spend; with DiLoCo also the live replicas, the restarts and the outer
step at each sync.
:func:`summary_rows` / :meth:`Display.summary` render the end-of-run table.
"""

from __future__ import annotations

import math
import sys
from typing import Any

from composer_replication.engine.driver import CHANNEL_KEYS

__all__ = ["Display", "CHANNELS", "format_step", "summary_rows"]

CHANNELS = CHANNEL_KEYS


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def format_step(step: int, num_steps: int, metrics: dict[str, float], spent_usd: float) -> str:
    """One progress line: ``step 3/20 grpo=... taid=... dpo=... total=... reward=... tok/s=... spend=$...``."""
    parts = [f"step {step + 1}/{num_steps}",
             *(f"{k.removeprefix('loss/')}={_fmt(metrics[k])}" for k in CHANNELS if k in metrics),
             f"total={_fmt(metrics.get('loss/total'))}", f"reward={_fmt(metrics.get('reward/mean'), 3)}",
             f"tok/s={_fmt(metrics.get('perf/tokens_per_s'), 4)}", f"spend=${spent_usd:.4f}"]
    if "diloco/live_replicas" in metrics:
        parts.append(f"replicas={metrics['diloco/live_replicas']:.0f} restarts={metrics.get('diloco/restarts', 0):.0f}")
        if "diloco/outer_step" in metrics:
            parts.append(f"sync={metrics['diloco/outer_step']:.0f}(n={metrics.get('diloco/participants', 0):.0f})")
    return "  ".join(parts)


def summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    """``(name, value)`` rows of the final table from the recipe's summary dict."""
    rows: list[tuple[str, str]] = [
        ("run folder", str(summary.get("run_dir", ""))),
        ("steps", f"{summary.get('start_step', 0)} -> {summary.get('steps')}"),
        ("trace states / pairs", f"{summary.get('n_states')} / {summary.get('n_pairs')}"),
        ("teacher spend (USD)", f"{summary.get('replay/spent_usd', 0.0):.4f}"),
    ]
    shown = (*CHANNELS, "loss/total", "reward/mean", "perf/tokens_per_s")
    rows += [(f"final {k}", _fmt(v)) for k, v in (summary.get("final_metrics") or {}).items() if k in shown]
    rows += [(f"steps with {k} != 0", str(v)) for k, v in (summary.get("channel_nonzero_steps") or {}).items()]
    rows += [(f"{name} reward", _fmt(ev["eval/mean"])) for name in ("eval_start", "eval_end")
             if "eval/mean" in (ev := summary.get(name) or {})]
    if "restarts" in summary:
        rows.append(("replica restarts", ", ".join(f"{i}: {n}" for i, n in summary["restarts"].items())))
        digests = summary.get("replica_param_sha256") or {}
        same = len(set(digests.values())) == 1
        rows.append(("replica parameters (sha256)",
                     f"{len(digests)} replica(s), {'identical' if same else 'DIFFER'}: "
                     + ", ".join(f"{i}={d[:12]}" for i, d in digests.items())))
    rows.append(("wall time (s)", f"{summary.get('wall_time_s', 0.0):.1f}"))
    return rows


class Display:
    """Progress output of one run.

    Args:
        mode: ``rich`` (a live bar; falls back to ``plain`` when stdout is not a terminal), ``plain``
            (a line per step) or ``none``.
        num_steps: total steps of the run.
    """

    def __init__(self, mode: str, *, num_steps: int) -> None:
        self.num_steps = num_steps
        self.mode = "plain" if mode == "rich" and not sys.stdout.isatty() else mode
        self._progress: Any = None
        self._task: Any = None
        self._train: Any = None
        if self.mode == "rich":
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.console = Console()
            self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                      TimeElapsedColumn(), TextColumn("{task.fields[info]}"), console=self.console)
            self._progress.start()

    def message(self, text: str) -> None:
        """A phase message (``spawning meshes``, ``replaying 32 states``...)."""
        if self.mode == "rich":
            self.console.print(f"[bold]{text}")
        elif self.mode == "plain":
            print(text, flush=True)

    def replay(self, done: int, total: int, n_pairs: int, spent_usd: float) -> None:
        """Replay progress: calls done of total, pairs formed so far, spend."""
        info = f"pairs={n_pairs} spend=${spent_usd:.4f}"
        if self.mode == "rich":
            if self._task is None:
                self._task = self._progress.add_task("replay", total=total, info=info)
            self._progress.update(self._task, completed=done, info=info)
        elif self.mode == "plain" and (done == total or done % max(1, total // 5) == 0):
            print(f"replay {done}/{total}  {info}", flush=True)

    def step(self, step: int, metrics: dict[str, float], spent_usd: float) -> None:
        """Training progress after ``step`` (0-based)."""
        line = format_step(step, self.num_steps, metrics, spent_usd)
        if self.mode == "rich":
            if self._task is not None:
                self._progress.remove_task(self._task)
                self._task = None
            if self._train is None:
                self._train = self._progress.add_task("train", total=self.num_steps, info="")
            self._progress.update(self._train, completed=step + 1, info=line.split("  ", 1)[-1])
        elif self.mode == "plain":
            print(line, flush=True)

    def summary(self, summary: dict[str, Any]) -> None:
        """Print the final table."""
        rows = summary_rows(summary)
        self.close()  # the live bar ends above the table
        if self.mode == "rich":
            from rich.table import Table

            table = Table("what", "value", title="composer-replication: Monarch run")
            table.columns[1].justify = "right"
            for name, value in rows:
                table.add_row(name, value)
            self.console.print(table)
        elif self.mode == "plain":
            width = max(len(n) for n, _ in rows)
            print("\n".join(f"{n:<{width}}  {v}" for n, v in rows), flush=True)

    def close(self) -> None:
        """Stop the live display (idempotent)."""
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

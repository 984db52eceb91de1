"""Pictures of a run: every channel's loss, the reward, the evaluation and DiLoCo's health in one PNG.

    python -m recipes.monarch.report runs/tiny-20261201-054100            # writes <run>/report.png
    python -m recipes.monarch.report runs/tiny-20261201-054100 --out /tmp/run.png

Reads the run folder's ``metrics.jsonl`` (one row per step, the scheme of docs/recipes.md, "Metrics") and
``summary.json`` when it is there (a run still going has none yet), and draws with matplotlib's Agg
backend (no display, no pyplot state):

- one panel per loss channel, under the name of the loss that ran (``loss/grpo`` or ``loss/lm_ce``;
  ``loss/jsd``, ``loss/taid`` or ``loss/entropy_opd``; ``loss/dpo`` or ``loss/simpo``), then ``loss/total``;
- ``reward/mean`` with its ``reward/std`` band;
- every ``eval/*`` rate at the steps it was measured (a row at the start of a fresh run and one at the end);
- for DiLoCo runs, ``diloco/live_replicas`` per step, ``diloco/participants`` at each sync, and the restarts
  (``diloco/restarts``; ``restarts`` and ``diloco_events`` of ``summary.json``, each failure marked at its step).

The recipe (``recipes.monarch.run``) writes the picture at the end of every run and prints its path.
Damaged input (half lines, non-object or deeply nested lines, huge or non-finite steps and values, summary keys of
the wrong type) is skipped or clipped with one warning each. Exit codes: 0 written, 2 nothing usable to draw (one
line saying why).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ReportError", "RunRecord", "load_run", "report_figure", "write_report", "recipe_report", "main"]

# Channel of each loss name (docs/recipes.md, Metrics); a name not listed here gets its own panel.
CHANNELS = {"grpo": 1, "lm_ce": 1, "jsd": 2, "taid": 2, "entropy_opd": 2, "dpo": 3, "simpo": 3}
_NOT_CHANNELS = {"total", "lr", "grad_norm"}
_EVAL_SKIP = {"eval/num_scored"}  # a count, not a [0, 1] rate: written as text, not drawn
_MAX_ABS = 1e12  # steps and values beyond this are damage, not data (matplotlib overflows near 1e308)
_SUMMARY_TYPES = {"steps": (int, float), "start_step": (int, float), "wall_time_s": (int, float),
                  "n_states": (int, float), "n_pairs": (int, float), "restarts": dict, "diloco_events": list,
                  "channel_nonzero_steps": dict, "eval_start": dict, "eval_end": dict}


class ReportError(ValueError):
    """Nothing in the run folder can be drawn: missing, or no usable training step."""


@dataclass
class RunRecord:
    """What a run folder holds for its picture.

    Attributes:
        path: the run folder.
        train: one dict per training step (rows with ``loss/total``), in file order, finite numbers only.
        evals: one dict per evaluation row (rows with an ``eval/*`` key), finite numbers only.
        summary: ``summary.json``'s keys that have the type a run writes (``{}`` while the run has not ended).
        warnings: what was skipped or clipped, one line each.
    """

    path: Path
    train: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def channels(self) -> list[str]:
        """The ``loss/<name>`` series of the run, by channel (1, 2, 3, then unknown names), ``loss/total`` last."""
        names = {k for row in self.train for k in row if k.count("/") == 1 and k.startswith("loss/")}
        names = {n for n in names if n.split("/")[1] not in _NOT_CHANNELS}
        return [*sorted(names, key=lambda n: (CHANNELS.get(n.split("/")[1], 4), n)), "loss/total"]

    def series(self, key: str, rows: list[dict[str, float]] | None = None) -> tuple[list[float], list[float]]:
        """``(steps, values)`` of ``key`` over ``rows`` (default: the training rows); rows without it skipped."""
        pts = [(r["step"], r[key]) for r in (self.train if rows is None else rows) if key in r]
        return [p[0] for p in pts], [p[1] for p in pts]


def _number(v: Any) -> float | None:
    """``v`` as a finite float clipped to ``+-_MAX_ABS``; ``None`` for a non-number, NaN or inf."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    try:
        f = float(v)
    except OverflowError:  # an int too large for a float
        return None
    return max(-_MAX_ABS, min(_MAX_ABS, f)) if math.isfinite(f) else None


def _numbers(row: dict[str, Any], clipped: list[str]) -> dict[str, float]:
    """The finite numeric entries of a row (digests are strings: dropped); keys of clipped values go to ``clipped``."""
    out = {}
    for k, v in row.items():
        f = _number(v)
        if f is not None:
            out[str(k)[:200]] = f
            if f != v:
                clipped.append(str(k)[:80])
    return out


def _read_metrics(path: Path, warn: list[str]) -> list[dict[str, Any]]:
    if not path.is_file():
        raise ReportError(f"{path} not found: RUN_DIR must be a run folder written by python -m recipes.monarch.run "
                          "(it holds metrics.jsonl once the first step has ended)")
    rows = []
    for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except (ValueError, RecursionError) as exc:
            warn.append(f"{path} line {n} skipped: not JSON ({type(exc).__name__}; a run killed while writing can "
                        "leave half a line)")
            continue
        step = _number(row.get("step")) if isinstance(row, dict) else None
        if step is None or step != row["step"]:
            warn.append(f"{path} line {n} skipped: not a metrics row (a JSON object with a finite 'step' within "
                        f"+-{_MAX_ABS:g}): {line[:80]!r}")
            continue
        rows.append(row)
    return rows


def _read_summary(path: Path, warn: list[str]) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, RecursionError, UnicodeDecodeError) as exc:
        warn.append(f"{path} ignored: not JSON ({type(exc).__name__}); the metrics are drawn alone")
        return {}
    if not isinstance(summary, dict):
        warn.append(f"{path} ignored: a JSON {type(summary).__name__}, not an object")
        return {}
    out = {}
    for key, types in _SUMMARY_TYPES.items():
        v = summary.get(key)
        if v is None:
            continue
        if isinstance(v, types) and not isinstance(v, bool) and (types in (dict, list) or _number(v) == v):
            out[key] = v
        else:
            warn.append(f"{path}: {key!r} ignored (a {type(v).__name__}, not what a run writes there)")
    return out


def load_run(run_dir: str | Path) -> RunRecord:
    """Read ``metrics.jsonl`` and ``summary.json`` of ``run_dir``; damaged lines and keys are skipped, huge values
    clipped, each with a line in ``.warnings``.

    Raises:
        ReportError: the folder or ``metrics.jsonl`` is missing, or no usable training step is left.
    """
    path = Path(run_dir)
    if not path.is_dir():
        raise ReportError(f"run folder {path} does not exist (pass the folder printed by the recipe, e.g. runs/tiny-...)")
    warn: list[str] = []
    rec = RunRecord(path=path, summary=_read_summary(path / "summary.json", warn), warnings=warn)
    clipped: list[str] = []
    for row in _read_metrics(path / "metrics.jsonl", warn):
        nums = _numbers(row, clipped)
        if "loss/total" in nums:
            rec.train.append(nums)
        if any(k.startswith("eval/") for k in nums):
            rec.evals.append(nums)
    if clipped:
        warn.append(f"{len(clipped)} value(s) beyond +-{_MAX_ABS:g} clipped (e.g. {clipped[0]!r})")
    if not rec.train:
        raise ReportError(f"{path / 'metrics.jsonl'} has no usable training step (no row with a finite 'loss/total')"
                          + (f"; {len(warn)} problem(s), first: {warn[0]}" if warn else "; draw it once the run has "
                             "logged a step"))
    return rec


def _plot_line(ax: Any, xs: list[float], ys: list[float], label: str, **kw: Any) -> None:
    ax.plot(xs, ys, marker="o" if len(xs) <= 12 else None, markersize=3, label=label, **kw)


def _panel_loss(ax: Any, rec: RunRecord, key: str) -> None:
    xs, ys = rec.series(key)
    name = key.split("/")[1]
    channel = CHANNELS.get(name)
    ax.set_title(f"channel {channel}: {key}" if channel else key)
    _plot_line(ax, xs, ys, key, color="black" if name == "total" else None)
    nonzero = _number(rec.summary.get("channel_nonzero_steps", {}).get(key))
    if nonzero is not None:
        ax.text(0.98, 0.95, f"non-zero on {nonzero:g} step(s)", transform=ax.transAxes, ha="right", va="top", fontsize=7)


def _panel_reward(ax: Any, rec: RunRecord) -> None:
    ax.set_title("reward/mean (+- reward/std)")
    xs, ys = rec.series("reward/mean")
    if not xs:
        ax.text(0.5, 0.5, "no reward logged", transform=ax.transAxes, ha="center")
        return
    _plot_line(ax, xs, ys, "reward/mean", color="tab:green")
    std = dict(zip(*rec.series("reward/std")))
    if std:
        ax.fill_between(xs, [y - std.get(x, 0.0) for x, y in zip(xs, ys)], [y + std.get(x, 0.0) for x, y in zip(xs, ys)],
                        color="tab:green", alpha=0.15, linewidth=0)


def _eval_rows(rec: RunRecord) -> list[dict[str, float]]:
    """Evaluation rows of metrics.jsonl, or the summary's ``eval_start``/``eval_end`` when the file has none."""
    if rec.evals:
        return rec.evals
    ends = (("eval_start", rec.summary.get("start_step", 0)), ("eval_end", rec.summary.get("steps")))
    return [{"step": float(step), **_numbers(rec.summary[key], [])} for key, step in ends
            if isinstance(rec.summary.get(key), dict) and step is not None]


def _panel_eval(ax: Any, rec: RunRecord) -> None:
    ax.set_title("evaluation (eval/*)")
    rows = _eval_rows(rec)
    keys = sorted({k for r in rows for k in r if k.startswith("eval/") and k not in _EVAL_SKIP})
    if not keys:
        ax.text(0.5, 0.5, "no evaluation (run.evaluate=false)", transform=ax.transAxes, ha="center")
        return
    for key in keys:
        _plot_line(ax, *rec.series(key, rows), key.removeprefix("eval/"))
    scored = [r["eval/num_scored"] for r in rows if "eval/num_scored" in r]
    if scored:
        ax.text(0.02, 0.95, f"{scored[-1]:.0f} prompts scored", transform=ax.transAxes, va="top", fontsize=7)
    ax.legend(fontsize=6, ncol=2, loc="best")


def _restarts(rec: RunRecord) -> tuple[float, str]:
    """Total restarts and the per-replica detail: ``summary.json``'s ``restarts``, else the last row's count."""
    per = {str(k)[:20]: _number(v) for k, v in rec.summary.get("restarts", {}).items() if _number(v) is not None}
    if per:
        total = sum(per.values())
        return total, f" {per}" if total else ""
    counts = rec.series("diloco/restarts")[1]
    return (counts[-1] if counts else 0.0), ""


def _panel_diloco(ax: Any, rec: RunRecord) -> None:
    total, detail = _restarts(rec)
    ax.set_title(f"DiLoCo: replicas; restarts {total:g}{detail}")
    xs, ys = rec.series("diloco/live_replicas")
    if xs:
        ax.step(xs, ys, where="post", color="tab:gray", label="live replicas")
    xp, yp = rec.series("diloco/participants")
    if xp:
        ax.plot(xp, yp, "o", markersize=4, color="tab:purple", label="participants at a sync")
    ax.set_ylim(0, max([1.0, *ys, *yp]) + 1)
    steps = [r["step"] for r in rec.train]
    for ev in rec.summary.get("diloco_events", []):
        step = _number(ev.get("step")) if isinstance(ev, dict) else None
        if step is not None and min(steps) - 1 <= step <= max(steps) + 1:  # an event of another run is no mark here
            ax.axvline(step, color="tab:red", linestyle="--", linewidth=1)
            label = f" replica {str(ev.get('replica'))[:12]} {str(ev.get('kind', ''))[:20]}"
            ax.text(step, 0.2, label, color="tab:red", fontsize=6, rotation=90, va="bottom")
    ax.legend(fontsize=6, loc="lower right")


def _is_diloco(rec: RunRecord) -> bool:
    return any(k.startswith("diloco/") for row in rec.train for k in row) or "restarts" in rec.summary


def _title(rec: RunRecord) -> str:
    s = rec.summary
    if not s:
        return f"{rec.path.name}: {len(rec.train)} step(s) so far (no summary.json yet)"
    parts = [f"{rec.path.name}: steps {s.get('start_step', 0)} -> {s.get('steps', '?')}"]
    if "n_pairs" in s:
        parts.append(f"{s.get('n_states', '?')} states, {s['n_pairs']:g} pairs")
    if "wall_time_s" in s:
        parts.append(f"{s['wall_time_s']:.0f} s")
    return ", ".join(parts)


def report_figure(run_dir: str | Path | RunRecord) -> Any:
    """The run's picture as a ``matplotlib.figure.Figure`` on an Agg canvas (a notebook shows it inline).

    Uses no pyplot state and changes no backend, so it is safe in a notebook kernel and in threads.

    Raises:
        ReportError: see :func:`load_run`.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    rec = run_dir if isinstance(run_dir, RunRecord) else load_run(run_dir)
    panels = [*(lambda ax, k=k: _panel_loss(ax, rec, k) for k in rec.channels()),
              lambda ax: _panel_reward(ax, rec), lambda ax: _panel_eval(ax, rec)]
    if _is_diloco(rec):
        panels.append(lambda ax: _panel_diloco(ax, rec))
    cols, rows = 3, math.ceil(len(panels) / 3)
    fig = Figure(figsize=(4.2 * cols, 2.9 * rows))
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, draw in zip(axes.flat, panels):
        draw(ax)
        ax.set_xlabel("step", fontsize=8)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(_title(rec), fontsize=10)
    fig.tight_layout()
    return fig


def write_report(run_dir: str | Path | RunRecord, out: str | Path | None = None) -> Path:
    """Draw the run (a folder or its :class:`RunRecord`) and write the PNG to ``out`` (default
    ``<run_dir>/report.png``); its path.

    Raises:
        ReportError: see :func:`load_run`.
    """
    rec = run_dir if isinstance(run_dir, RunRecord) else load_run(run_dir)
    target = Path(out) if out is not None else rec.path / "report.png"
    report_figure(rec).savefig(target, dpi=90)
    return target


def recipe_report(run_dir: str | Path) -> str:
    """The recipe's last line: write ``<run_dir>/report.png`` and say where, or why there is no picture.

    Never raises: the run has ended and its folder is complete, whatever the picture does.
    """
    try:
        rec = load_run(run_dir)
        skipped = f" ({len(rec.warnings)} damaged line(s) or value(s) skipped or clipped)" if rec.warnings else ""
        return f"report {write_report(rec)}{skipped}"
    except Exception as exc:  # noqa: BLE001 - a picture is never worth a traceback after a finished run
        return f"no report picture: {str(exc)[:500]}"


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m recipes.monarch.report RUN_DIR [--out PNG]``; 0 written (damaged lines skipped with a
    warning each), 2 with one line when nothing can be drawn."""
    p = argparse.ArgumentParser(prog="python -m recipes.monarch.report", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", help="a run folder (holds metrics.jsonl), e.g. runs/tiny-20261201-054100")
    p.add_argument("--out", default=None, help="where to write the PNG (default: RUN_DIR/report.png)")
    args = p.parse_args(argv)
    try:
        rec = load_run(args.run_dir)
        for line in rec.warnings[:20]:
            print(f"report warning: {line}", file=sys.stderr)
        if len(rec.warnings) > 20:
            print(f"report warning: {len(rec.warnings) - 20} more", file=sys.stderr)
        path = write_report(rec, args.out)
    except ReportError as exc:
        print(f"report error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - damaged input never ends in a traceback
        print(f"report error: could not draw {args.run_dir}: {type(exc).__name__}: {str(exc)[:300]}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Replay trace states against N teachers and write consensus preference pairs (``docs/teacher_replay.md``).

    python -m composer_replication.teacher_replay STATES.jsonl --budget USD --ledger PATH --out PAIRS.jsonl \
        [--teachers SLUG[,SLUG...]] [--agreement 2] [--normalize [RECIPE]] [--base-url URL] ...

The key comes from ``$OPENROUTER_API_KEY`` or ``--dotenv`` (never the command line). A re-run resumes from the
ledger. Slugs outside ``DEFAULT_TEACHERS`` need ``--price-in``/``--price-out`` (in-process ones cost 0); with
``recorded`` (or ``--rejected-from-rollout``) the rejected side is left to the rollouts. Exit status: 0 when a
call succeeded (or there were none), 1 when every call failed, 2 on bad arguments (refused before any call).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from composer_replication.atomic import atomic_write_text
from composer_replication.teacher_replay import teachers as roster
from composer_replication.teacher_replay.keys import MissingAPIKeyError
from composer_replication.teacher_replay.ledger import LedgerLockedError
from composer_replication.teacher_replay.pairs import extract_dpo_pairs, save_pairs
from composer_replication.teacher_replay.replay import ReplayProgress, replay_trace_sync
from composer_replication.types import TeacherCallResult, TeacherSpec, TraceState

__all__ = ["main", "load_states"]


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser."""
    ap = argparse.ArgumentParser(prog="python -m composer_replication.teacher_replay", description=__doc__.split("\n")[0])
    slugs = ",".join(t["slug"] for t in roster.DEFAULT_TEACHERS)
    for flag, kind, default, text in [
        ("states", Path, None, "JSONL file of TraceState records"),
        ("--teachers", str, slugs, f"comma-separated slugs (default {slugs}; also 'recorded', 'local:MODEL')"),
        ("--budget", float, None, "hard spending cap in USD (the ledger's spend counts)"),
        ("--ledger", Path, None, "JSONL ledger to resume from and append to"),
        ("--out", Path, None, "where to write the pairs (JSONL)"),
        ("--agreement", int, 2, "teachers that must agree for a pair (default 2)"),
        ("--base-url", str, None, "OpenAI-compatible endpoint for every remote teacher"),
        ("--max-tokens", int, 1024, "completion cap per call (default 1024)"),
        ("--price-in", float, None, "USD per million input tokens of unknown slugs"),
        ("--price-out", float, None, "USD per million output tokens of unknown slugs"),
        ("--temperature", float, None, "sampling temperature sent to every teacher"),
        ("--seed", int, None, "sampling seed sent to every teacher"),
        ("--max-concurrency", int, 32, "calls in flight over all teachers"),
        ("--per-teacher-concurrency", int, 8, "calls in flight per teacher"),
        ("--timeout", float, 120.0, "total deadline of one request in seconds (default 120)"),
        ("--max-retries", int, 5, "retries of transient failures per call"),
        ("--dotenv", Path, None, "dotenv file holding OPENROUTER_API_KEY=..."),
        ("--results", Path, None, "also write every call's result here (JSONL)"),
    ]:  # fmt: skip
        required = {"required": default is None} if flag in ("--budget", "--ledger", "--out") else {}
        ap.add_argument(flag, type=kind, help=text, **({} if flag == "states" else {"default": default}), **required)
    norm = ap.add_mutually_exclusive_group()
    norm.add_argument("--normalize", nargs="?", const="", default=None, metavar="RECIPE",
                      help="filter the pairs with replaysim.DJNormalizer (the default recipe if no path)")
    norm.add_argument("--no-normalize", action="store_true", help="write the pairs unfiltered (the default)")
    ap.add_argument("--rejected-from-rollout", action="store_true",
                    help="leave each pair's rejected side to the training step's rollouts (implied by 'recorded')")
    ap.add_argument("--no-progress", action="store_true", help="no live progress bar")
    return ap


def load_states(path: Path) -> list[TraceState]:
    """Read TraceState JSONL; ``ValueError`` names the line of a bad record."""
    states = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except (ValueError, RecursionError) as exc:
                raise ValueError(f"{path}:{n}: not valid JSON ({type(exc).__name__})") from None
            missing = [k for k in ("state_id", "messages", "student_action") if not isinstance(rec, dict) or k not in rec]
            if missing:
                raise ValueError(f"{path}:{n}: a TraceState needs state_id, messages, student_action; missing {missing}")
            states.append(rec)
    return states


def resolve_teachers(slugs: str, *, base_url: str | None, price_in: float | None,
                     price_out: float | None) -> list[TeacherSpec]:
    """TeacherSpecs for comma-separated ``slugs`` (prices as in the module docstring)."""
    known, out = {t["slug"]: t for t in roster.DEFAULT_TEACHERS}, []
    for slug in filter(None, (s.strip() for s in slugs.split(","))):
        if slug in known:
            spec: Any = dict(known[slug])
        elif roster.in_process(slug) or (price_in is not None and price_out is not None):
            spec = {"slug": slug, "input_per_mtok": price_in or 0.0, "output_per_mtok": price_out or 0.0}
        else:
            raise ValueError(f"teacher {slug!r} has no known prices; pass --price-in and --price-out (USD per "
                             f"million tokens), or use one of {sorted(known)}.")
        if base_url and not roster.in_process(slug):
            spec["base_url"] = base_url
        out.append(spec)
    if not out:
        raise ValueError(f"--teachers must name at least one teacher; got {slugs!r}.")
    return out


def check_distinct_files(named: dict[str, Path | None]) -> None:
    """``ValueError`` when two of the named paths are one file (after links; by inode when both exist):
    pairs written over the ledger would forget what was paid, over the input would destroy it."""
    seen: list[tuple[str, Path]] = []
    for flag, path in named.items():
        if path is None:
            continue
        for other_flag, other in seen:
            same = os.path.realpath(path) == os.path.realpath(other)
            if same or (path.exists() and other.exists() and os.path.samefile(path, other)):
                raise ValueError(f"{flag} and {other_flag} are the same file ({path}); the input, --ledger, --out "
                                 "and --results must be four different files (the ledger holds what was paid).")
        seen.append((flag, path))


def _progress(total: int, budget: float, enabled: bool) -> tuple[Any, Callable[[ReplayProgress], None]]:
    """A rich progress bar on stderr and the replay's progress callback that feeds it."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("replay"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                   TimeElapsedColumn(), console=Console(stderr=True), disable=not enabled)
    task = bar.add_task("replay", total=total, info="")

    def update(ev: ReplayProgress) -> None:
        errors = ", ".join(f"{k} {v}" for k, v in sorted(ev.errors.items())) or "0"
        info = f"${ev.spent_usd:.4f} (+{ev.reserved_usd:.4f} held) / ${budget:.2f}  errors: {errors}"
        bar.update(task, completed=ev.done, info=info)

    return bar, update


def _summary(results: list[TeacherCallResult], n_pairs: int, out: Path) -> None:
    """Plain lines on stdout, never cut (a piped table once read ``0.0…`` in its cost columns)."""
    rows: dict[str, list[TeacherCallResult]] = defaultdict(list)
    for r in results:
        rows[r["teacher_slug"]].append(r)
    width = max([len("teacher"), *map(len, rows)])
    print("teacher replay")
    print(f"{'teacher':<{width}} {'ok':>6} {'errors':>6} {'in tok':>10} {'out tok':>10} {'USD':>12} {'mean s':>8}")
    for slug, rs in rows.items():
        ok = [r for r in rs if r["error"] is None]
        lat = sum(r["latency_s"] for r in ok) / len(ok) if ok else 0.0
        print(f"{slug:<{width}} {len(ok):>6} {len(rs) - len(ok):>6} {sum(r['prompt_tokens'] for r in rs):>10} "
              f"{sum(r['completion_tokens'] for r in rs):>10} {sum(r['cost_usd'] for r in rs):>12.6f} {lat:>8.2f}")
    kinds = Counter(roster.error_kind(r["error"]) for r in results if r["error"] is not None)
    if kinds:
        print("errors by kind: " + ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())))
    print(f"{n_pairs} pair(s) written to {out}")


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    from rich.console import Console
    from rich.logging import RichHandler

    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("budget", "timeout", "price_in", "price_out", "temperature"):
        if getattr(args, flag) is not None and not math.isfinite(getattr(args, flag)):
            parser.error(f"argument --{flag.replace('_', '-')}: must be a finite number; got {getattr(args, flag)!r}")
    pkg = logging.getLogger("composer_replication")  # this package's warnings on stderr, never the root logger
    if not any(isinstance(h, RichHandler) for h in pkg.handlers):
        handler = RichHandler(console=Console(stderr=True), show_path=False, show_time=False)
        handler.setLevel(logging.WARNING)
        pkg.addHandler(handler)
    try:  # everything that can be refused is refused before a call is paid
        if args.agreement < 1:
            raise ValueError(f"--agreement must be >= 1; got {args.agreement}.")
        check_distinct_files({"the states file": args.states, "--ledger": args.ledger, "--out": args.out,
                              "--results": args.results})
        normalizer = None
        if args.normalize is not None:
            from composer_replication.replaysim import DJNormalizer  # lazy: only with --normalize

            try:
                normalizer = DJNormalizer(args.normalize) if args.normalize else DJNormalizer()
            except (ImportError, RuntimeError, FileNotFoundError, ValueError) as exc:
                raise ValueError(f"--normalize: {exc}") from None
        teachers = resolve_teachers(args.teachers, base_url=args.base_url, price_in=args.price_in,
                                    price_out=args.price_out)
        states = load_states(args.states)
        bar, update = _progress(len(states) * len(teachers), args.budget, enabled=not args.no_progress)
        with bar:
            results = replay_trace_sync(
                states, teachers, args.budget, None, ledger_path=args.ledger, dotenv_path=args.dotenv,
                max_concurrency=args.max_concurrency, per_teacher_concurrency=args.per_teacher_concurrency,
                timeout_s=args.timeout, max_retries=args.max_retries, max_tokens=args.max_tokens,
                temperature=args.temperature, seed=args.seed, progress=update)
    except (ValueError, MissingAPIKeyError, FileNotFoundError, LedgerLockedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rollout = args.rejected_from_rollout or any(t["slug"] == roster.RECORDED_SLUG for t in teachers)
    pairs = extract_dpo_pairs(states, results, args.agreement, rejected_from_rollout=rollout)
    if normalizer is not None:
        pairs = normalizer.normalize(pairs)
    save_pairs(pairs, args.out)
    if args.results is not None:
        atomic_write_text(args.results, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    _summary(results, len(pairs), args.out)
    return 0 if any(r["error"] is None for r in results) or not results else 1


if __name__ == "__main__":
    sys.exit(main())

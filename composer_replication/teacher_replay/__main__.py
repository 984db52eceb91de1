"""Replay trace states against N teachers and write consensus DPO pairs.

    python -m composer_replication.teacher_replay STATES.jsonl --teachers SLUG[,SLUG...] \
        --budget USD --ledger PATH --out PAIRS.jsonl [--agreement 2] \
        [--normalize [RECIPE] | --no-normalize] [--base-url URL] [--max-tokens N]

STATES.jsonl holds one TraceState per line (``state_id``, ``messages``, ``student_action``). The API
key comes from ``$OPENROUTER_API_KEY`` or ``--dotenv FILE`` (never from the command line, which other
users can see). A live progress bar (stderr) shows calls done, spend against the budget and errors
by kind; a summary table is printed at the end. Re-running the same command after a crash resumes
from the ledger without paying again for finished calls.

Prices: a slug of ``DEFAULT_TEACHERS`` uses its prices, ``local:`` teachers cost 0, any other slug
needs ``--price-in`` and ``--price-out`` (USD per million tokens; they apply to every unknown slug).

The ``recorded`` teacher (cost 0) answers with each state's recorded action; with it, give the student
(``--student local:<model>``): its own sampled action at each state is the rejected side of the pairs
(``teacher_replay.recorded``), e.g. ``--teachers recorded --agreement 1 --student local:smollm2-135m``.
Exit status: 0 when at least one call succeeded, 1 when every call failed, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from composer_replication.atomic import atomic_write_text
from composer_replication.teacher_replay.keys import MissingAPIKeyError
from composer_replication.teacher_replay.ledger import LedgerLockedError
from composer_replication.teacher_replay.local import LOCAL_PREFIX, LocalTeacher, local_model_name
from composer_replication.teacher_replay.pairs import extract_dpo_pairs, save_pairs
from composer_replication.teacher_replay.recorded import StudentSampling, sample_student_actions
from composer_replication.teacher_replay.replay import ReplayProgress, replay_trace_sync
from composer_replication.teacher_replay.specs import DEFAULT_TEACHERS, error_kind
from composer_replication.types import TeacherCallResult, TeacherSpec, TraceState

__all__ = ["main", "build_parser", "check_distinct_files", "load_states", "resolve_teachers"]


def _finite(text: str) -> float:
    """An argparse type: a finite float (``nan`` and ``inf`` are refused)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number; got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The command-line parser (every option has help text)."""
    ap = argparse.ArgumentParser(
        prog="python -m composer_replication.teacher_replay",
        description="Replay trace states against N teachers under a hard budget; write consensus DPO pairs.",
    )
    ap.add_argument("states", type=Path, help="JSONL file of TraceState records")
    default_slugs = ",".join(t["slug"] for t in DEFAULT_TEACHERS)
    ap.add_argument(
        "--teachers", default=default_slugs, help=f"comma-separated slugs (default {default_slugs})"
    )
    ap.add_argument(
        "--budget", type=_finite, required=True, help="hard spending cap in USD (ledger spend counts)"
    )
    ap.add_argument("--ledger", type=Path, required=True, help="JSONL ledger to resume from and append to")
    ap.add_argument("--out", type=Path, required=True, help="where to write the pairs (JSONL)")
    ap.add_argument(
        "--agreement", type=int, default=2, help="teachers that must agree for a pair (default 2)"
    )
    norm = ap.add_mutually_exclusive_group()
    norm.add_argument(
        "--normalize",
        nargs="?",
        const="",
        default=None,
        metavar="RECIPE",
        help="normalize pairs with replaysim.DJNormalizer (optional recipe path; default recipe if omitted)",
    )
    norm.add_argument("--no-normalize", action="store_true", help="write raw DPO pairs (the default)")
    ap.add_argument("--base-url", default=None, help="OpenAI-compatible endpoint for every non-local teacher")
    ap.add_argument("--max-tokens", type=int, default=1024, help="completion cap per call (default 1024)")
    ap.add_argument(
        "--price-in", type=_finite, default=None, help="USD per million input tokens for unknown slugs"
    )
    ap.add_argument(
        "--price-out", type=_finite, default=None, help="USD per million output tokens for unknown slugs"
    )
    ap.add_argument(
        "--temperature", type=_finite, default=None, help="sampling temperature sent to every teacher"
    )
    ap.add_argument("--seed", type=int, default=None, help="sampling seed sent to every teacher")
    ap.add_argument("--student", default=None, metavar="local:MODEL",
                    help="the student model; its own sampled action at each state becomes the rejected side "
                         "(needed by the 'recorded' teacher)")
    ap.add_argument("--student-max-tokens", type=int, default=48, help="length cap of a student sample (default 48)")
    ap.add_argument("--student-temperature", type=_finite, default=1.0,
                    help="sampling temperature of the student's samples (default 1.0)")
    ap.add_argument("--max-concurrency", type=int, default=32, help="calls in flight over all teachers")
    ap.add_argument("--per-teacher-concurrency", type=int, default=8, help="calls in flight per teacher")
    ap.add_argument(
        "--timeout",
        type=_finite,
        default=120.0,
        help="total deadline of one request in seconds (default 120)",
    )
    ap.add_argument("--max-retries", type=int, default=5, help="retries of transient failures per call")
    ap.add_argument("--dotenv", type=Path, default=None, help="dotenv file holding OPENROUTER_API_KEY=...")
    ap.add_argument("--results", type=Path, default=None, help="also write every call's result here (JSONL)")
    ap.add_argument("--no-progress", action="store_true", help="no live progress bar")
    return ap


def load_states(path: Path) -> list[TraceState]:
    """Read TraceState JSONL; ``ValueError`` names the line of a bad record."""
    states: list[TraceState] = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not valid JSON ({exc})") from None
            missing = [
                k
                for k in ("state_id", "messages", "student_action")
                if not isinstance(rec, dict) or k not in rec
            ]
            if missing:
                raise ValueError(
                    f"{path}:{n}: a TraceState needs state_id, messages, student_action; missing {missing}"
                )
            states.append(rec)
    return states


def resolve_teachers(
    slugs: str, *, base_url: str | None, price_in: float | None, price_out: float | None
) -> list[TeacherSpec]:
    """TeacherSpecs for comma-separated ``slugs`` (prices as in the module docstring)."""
    known = {t["slug"]: t for t in DEFAULT_TEACHERS}
    out: list[TeacherSpec] = []
    for slug in (s.strip() for s in slugs.split(",")):
        if not slug:
            continue
        if slug in known:
            spec: TeacherSpec = dict(known[slug])  # type: ignore[assignment]
        elif slug.startswith(LOCAL_PREFIX) or slug == "recorded":
            spec = {"slug": slug, "input_per_mtok": price_in or 0.0, "output_per_mtok": price_out or 0.0}
        elif price_in is None or price_out is None:
            raise ValueError(
                f"teacher {slug!r} has no known prices; pass --price-in and --price-out (USD per million "
                f"tokens), or use one of {sorted(known)}."
            )
        else:
            spec = {"slug": slug, "input_per_mtok": price_in, "output_per_mtok": price_out}
        if base_url and not slug.startswith(LOCAL_PREFIX) and slug != "recorded":
            spec["base_url"] = base_url
        out.append(spec)
    if not out:
        raise ValueError(f"--teachers must name at least one teacher; got {slugs!r}.")
    return out


class _Display:
    """The rich progress bar (stderr), fed by the replay's progress callback."""

    def __init__(self, total: int, budget: float, enabled: bool) -> None:
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.budget = budget
        self.progress = Progress(
            TextColumn("replay"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[spend]}"),
            TextColumn("{task.fields[errors]}"),
            TimeElapsedColumn(),
            console=Console(stderr=True),
            disable=not enabled,
            transient=False,
        )
        self.task = self.progress.add_task(
            "replay", total=total, spend=self._spend(0.0, 0.0), errors="errors: 0"
        )

    def _spend(self, spent: float, reserved: float) -> str:
        return f"${spent:.4f} (+{reserved:.4f} held) / ${self.budget:.2f}"

    def __call__(self, ev: ReplayProgress) -> None:
        errs = ", ".join(f"{k} {v}" for k, v in sorted(ev.errors.items())) or "0"
        self.progress.update(
            self.task,
            completed=ev.done,
            spend=self._spend(ev.spent_usd, ev.reserved_usd),
            errors=f"errors: {errs}",
        )


def check_distinct_files(named: dict[str, Path | None]) -> None:
    """Raise ``ValueError`` when two of the named paths (input, --ledger, --out, --results) are one file.

    Writing the pairs over the ledger would forget what was paid (every re-run pays again); writing
    over the input would destroy it. Paths are compared after resolving links, and by inode when
    both exist (hard links).
    """
    seen: list[tuple[str, Path]] = []
    for flag, path in named.items():
        if path is None:
            continue
        for other_flag, other in seen:
            same = os.path.realpath(path) == os.path.realpath(other)
            if not same and path.exists() and other.exists():
                same = os.path.samefile(path, other)
            if same:
                raise ValueError(
                    f"{flag} and {other_flag} are the same file ({path}); the input, --ledger, --out and "
                    "--results must be four different files (the ledger holds what was paid)."
                )
        seen.append((flag, path))


def _summary(results: list[TeacherCallResult], n_pairs: int, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="teacher replay")
    table.add_column("teacher", no_wrap=True)
    for col in ("ok", "errors", "in tok", "out tok", "USD", "mean s"):
        table.add_column(col, justify="right")
    rows: dict[str, list[TeacherCallResult]] = defaultdict(list)
    for r in results:
        rows[r["teacher_slug"]].append(r)
    for slug, rs in rows.items():
        ok = [r for r in rs if r["error"] is None]
        lat = sum(r["latency_s"] for r in ok) / len(ok) if ok else 0.0
        table.add_row(
            slug,
            str(len(ok)),
            str(len(rs) - len(ok)),
            str(sum(r["prompt_tokens"] for r in rs)),
            str(sum(r["completion_tokens"] for r in rs)),
            f"{sum(r['cost_usd'] for r in rs):.6f}",
            f"{lat:.2f}",
        )
    console = Console()
    console.print(table)
    kinds = Counter(error_kind(r["error"]) for r in results if r["error"] is not None)
    if kinds:
        console.print("errors by kind: " + ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())))
    console.print(f"{n_pairs} pair(s) written to {out}")


def _log_to_stderr() -> None:
    """Show this package's warnings on stderr through rich (the package logger only, never the root)."""
    from rich.console import Console
    from rich.logging import RichHandler

    pkg = logging.getLogger("composer_replication")
    if not any(isinstance(h, RichHandler) for h in pkg.handlers):
        handler = RichHandler(console=Console(stderr=True), show_path=False, show_time=False)
        handler.setLevel(logging.WARNING)
        pkg.addHandler(handler)


def _student(args: argparse.Namespace) -> tuple[LocalTeacher | None, StudentSampling | None]:
    """The ``--student`` model (loaded on first use) and how its samples are drawn, or ``(None, None)``."""
    if args.student is None:
        return None, None
    sampling = StudentSampling(max_new_tokens=args.student_max_tokens, temperature=args.student_temperature,
                               seed=args.seed or 0)
    return LocalTeacher(local_model_name(args.student)), sampling


def _make_normalizer(recipe: str | None) -> Any:
    """``replaysim.DJNormalizer`` for ``--normalize [RECIPE]`` (built before any call is paid), else None."""
    if recipe is None:
        return None
    from composer_replication.replaysim import DJNormalizer  # lazy: only with --normalize

    return DJNormalizer(recipe) if recipe else DJNormalizer()


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = build_parser().parse_args(argv)
    _log_to_stderr()
    if args.agreement < 1:  # checked before any money is spent
        print(f"error: --agreement must be >= 1; got {args.agreement}.", file=sys.stderr)
        return 2
    try:
        check_distinct_files(
            {
                "the states file": args.states,
                "--ledger": args.ledger,
                "--out": args.out,
                "--results": args.results,
            }
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        normalizer = _make_normalizer(args.normalize)
    except (ImportError, RuntimeError, FileNotFoundError, ValueError) as exc:
        print(f"error: --normalize: {exc}", file=sys.stderr)
        return 2
    try:
        teachers = resolve_teachers(
            args.teachers, base_url=args.base_url, price_in=args.price_in, price_out=args.price_out
        )
        states = load_states(args.states)
        student, sampling = _student(args)
        display = _Display(len(states) * len(teachers), args.budget, enabled=not args.no_progress)
        with display.progress:
            results = replay_trace_sync(
                states,
                teachers,
                args.budget,
                None,
                ledger_path=args.ledger,
                dotenv_path=args.dotenv,
                max_concurrency=args.max_concurrency,
                per_teacher_concurrency=args.per_teacher_concurrency,
                timeout_s=args.timeout,
                max_retries=args.max_retries,
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                seed=args.seed,
                progress=display,
                student=student,
                student_sampling=sampling,
            )
        samples = sample_student_actions(student, states, sampling) if student is not None else None
    except (ValueError, MissingAPIKeyError, FileNotFoundError, LedgerLockedError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    pairs = extract_dpo_pairs(
        states, results, args.agreement, student_actions=samples,
        student_meta=sampling.metadata(0) if samples is not None else None)  # one pair record, normalized or not
    if normalizer is not None:
        pairs = normalizer.normalize(pairs)
    save_pairs(pairs, args.out)
    if args.results is not None:
        atomic_write_text(args.results, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in results))
    _summary(results, len(pairs), args.out)
    return 0 if any(r["error"] is None for r in results) or not results else 1


if __name__ == "__main__":
    sys.exit(main())

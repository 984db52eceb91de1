"""Ingest agent traces into one TraceState JSONL.

    python -m composer_replication.ingestion PATH... --out states.jsonl \
        [--format auto|claude_code|codex|openai|swe_agent] [--max-history-tokens N]

Folders are walked for ``*.jsonl``, ``*.json`` and ``*.traj`` files (Claude Code subagent files are
skipped and counted). The output is written atomically (a temp file, then ``os.replace``). A table of
per-file and total counts is printed. The exit status is non-zero only when nothing could be read.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from composer_replication.atomic import atomic_writer
from composer_replication.ingestion.claude_code import is_subagent_file
from composer_replication.ingestion.history import IngestionStats
from composer_replication.ingestion.registry import FORMATS, detect_format, make_ingester

_SUFFIXES = (".jsonl", ".json", ".traj")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m composer_replication.ingestion", description=__doc__.split("\n")[0]
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace files or folders to walk")
    p.add_argument("--out", required=True, help="output JSONL of TraceStates (written atomically)")
    p.add_argument(
        "--format", default="auto", choices=("auto", *FORMATS), help="trace format (default: detect)"
    )
    p.add_argument(
        "--max-history-tokens",
        type=int,
        default=None,
        help="drop the oldest history messages beyond this many tokens (estimated as chars/4)",
    )
    return p


def _files(paths: list[str]) -> tuple[list[Path], list[str]]:
    files, missing = [], []
    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            files.extend(sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in _SUFFIXES))
        elif p.is_file():
            files.append(p)
        else:
            missing.append(raw)
    return files, missing


class _NothingRead(Exception):
    """No input file could be read: the output is discarded."""


def _total_row(total: IngestionStats, n_read: int, n_states: int, n_subagent: int) -> tuple[str, ...]:
    return (
        "TOTAL",
        f"{n_read} files",
        str(n_states),
        str(total.n_records_total),
        str(total.n_records_skipped),
        str(total.skipped_truncated_lines),
        str(total.n_errors),
        f"{n_subagent} subagent files skipped" if n_subagent else "",
    )


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 when at least one file was read)."""
    args = _parser().parse_args(argv)
    if args.max_history_tokens is not None and args.max_history_tokens <= 0:
        _parser().error(f"--max-history-tokens={args.max_history_tokens} must be a positive number of tokens")
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    files, missing = _files(args.paths)
    out = Path(args.out)
    table = Table(title="ingestion")
    for col in ("file", "format", "states", "records", "skipped", "truncated", "errors", "note"):
        table.add_column(col, justify="left" if col in ("file", "format", "note") else "right")
    total, n_read, n_states, n_subagent, problems = IngestionStats(), 0, 0, 0, list(missing)
    try:
        with atomic_writer(out) as sink:
            for f in files:
                if args.format in ("auto", "claude_code") and f.suffix == ".jsonl" and is_subagent_file(f):
                    n_subagent += 1
                    total.skipped_subagent += 1
                    continue
                try:
                    fmt = detect_format(f) if args.format == "auto" else args.format
                    ing = make_ingester(fmt, max_history_tokens=args.max_history_tokens)
                    count = 0
                    for state in ing.ingest(f):
                        sink.write(json.dumps(state, ensure_ascii=False) + "\n")
                        count += 1
                except (ValueError, OSError) as e:
                    problems.append(f"{f}: {e}")
                    table.add_row(f.name, "?", "-", "-", "-", "-", "-", "unreadable")
                    continue
                st = ing.last_stats
                n_read += 1
                n_states += count
                total.add(st)
                note = "; ".join(st.version_warnings or [])[:60]
                table.add_row(
                    f.name,
                    fmt,
                    str(count),
                    str(st.n_records_total),
                    str(st.n_records_skipped),
                    str(st.skipped_truncated_lines),
                    str(st.n_errors),
                    note,
                )
            if n_read == 0:
                raise _NothingRead  # discards the (empty) output: nothing is written
    except _NothingRead:
        table.add_row(*_total_row(total, n_read, n_states, n_subagent))
        console.print(table)
        for line in problems:
            console.print(f"[red]cannot read[/red] {line}")
        reason = "no input files found" if not files and not missing else "no file could be read"
        if n_subagent:
            reason += f" ({n_subagent} subagent files skipped)"
        print(f"error: {reason}; nothing written to {out}", file=sys.stderr)
        return 1
    table.add_row(*_total_row(total, n_read, n_states, n_subagent))
    console.print(table)
    for line in problems:
        console.print(f"[yellow]skipped[/yellow] {line}")
    console.print(f"wrote {n_states} states to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

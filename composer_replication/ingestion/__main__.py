"""Ingest agent traces into one TraceState JSONL.

    python -m composer_replication.ingestion PATH... --out states.jsonl \
        [--format auto|claude_code|codex|openai|swe_agent] [--max-history-tokens N]

Folders are walked for ``*.jsonl``, ``*.json`` and ``*.traj`` files (Claude Code subagent files are
skipped and counted; folders that cannot be listed are reported). The output is written atomically
(a temp file, then ``os.replace``; a symlink is written through) and is never one of the inputs:
``--out`` equal to an input file or inside an input folder is refused. A file that cannot be read
(bad content, nesting deeper than Python's recursion limit, no permission) is skipped with its
reason and contributes nothing. A table of per-file and total counts is printed. The exit status is
1 when nothing could be read, 2 when ``--out`` cannot be used or written.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.table import Table

from composer_replication.atomic import atomic_writer
from composer_replication.ingestion.claude_code import is_subagent_file
from composer_replication.ingestion.history import IngestionStats
from composer_replication.ingestion.registry import FORMATS, detect_format, make_ingester
from composer_replication.ingestion.streaming import max_depth

_SUFFIXES = (".jsonl", ".json", ".traj")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m composer_replication.ingestion", description=__doc__.split("\n")[0]
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace files or folders to walk")
    p.add_argument(
        "--out",
        required=True,
        help="output JSONL of TraceStates (written atomically; not an input file nor inside an input folder)",
    )
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


# ---------------------------------------------------------------------------- inputs and output
def _files(paths: list[str]) -> tuple[list[Path], list[str]]:
    """The trace files under ``paths`` (sorted per argument) and one problem line per path that is
    missing or folder that cannot be listed."""
    files: list[Path] = []
    problems: list[str] = []

    def unlistable(err: OSError) -> None:
        problems.append(f"{err.filename}: cannot list this folder ({err.strerror}); its files were not read")

    for raw in paths:
        p = Path(raw)
        if p.is_dir():
            found = [
                Path(root) / name
                for root, _, names in os.walk(p, onerror=unlistable)
                for name in names
                if Path(name).suffix in _SUFFIXES and (Path(root) / name).is_file()
            ]
            files.extend(sorted(found))
        elif p.is_file():
            files.append(p)
        else:
            problems.append(f"{raw}: no such file or folder")
    return files, problems


def _out_problem(out: Path, paths: list[str]) -> str | None:
    """Why ``out`` cannot be the output (it would overwrite or sit among the inputs, it is a folder,
    a parent is a file), or None."""
    real = Path(os.path.realpath(out))
    for raw in paths:
        src = Path(os.path.realpath(raw))
        if real == src:
            return f"--out {out} is the input {raw}: it would be replaced by states; write to another file"
        if src.is_dir() and src in real.parents:
            return (
                f"--out {out} is inside the input folder {raw}: a re-run would read it back as a trace; "
                "write it outside the folders you ingest"
            )
    if real.is_dir():
        return f"--out {out} is a folder; give a file path such as {out / 'states.jsonl'}"
    for parent in real.parents:
        if parent.exists():
            if not parent.is_dir():
                return f"--out {out}: {parent} is a file, not a folder"
            break
    return None


class _OutputError(Exception):
    """Writing the output failed (disk full, no permission): the run stops."""


def _write(sink: TextIO, state: dict) -> None:
    try:
        sink.write(json.dumps(state, ensure_ascii=False) + "\n")
    except OSError as e:
        raise _OutputError(str(e)) from e


# ---------------------------------------------------------------------------- one file
def _ingest_file(f: Path, args: argparse.Namespace, sink: TextIO) -> tuple[str, int, IngestionStats]:
    """Write the states of ``f`` to ``sink``; on failure nothing of ``f`` stays in ``sink``.

    Raises:
        ValueError: the file cannot be ingested (the message says why).
        OSError: the file cannot be read.
    """
    sink.flush()
    start = sink.tell()
    try:
        fmt = detect_format(f) if args.format == "auto" else args.format
        ing = make_ingester(fmt, max_history_tokens=args.max_history_tokens)
        count = 0
        for state in ing.ingest(f):
            _write(sink, state)
            count += 1
    except (ValueError, OSError, RecursionError) as e:
        sink.seek(start)
        sink.truncate()
        if isinstance(e, RecursionError):
            raise ValueError(f"{f}: nested deeper than Python's recursion limit ({max_depth()})") from e
        raise
    return fmt, count, ing.last_stats


def _table() -> Table:
    table = Table(title="ingestion")
    for col in ("file", "format", "states", "records", "skipped", "truncated", "errors", "note"):
        table.add_column(col, justify="left" if col in ("file", "format", "note") else "right")
    return table


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


class _NothingRead(Exception):
    """No input file could be read: the output is discarded."""


def _run(files: list[Path], args: argparse.Namespace, table: Table, problems: list[str]) -> tuple:
    """Ingest every file into the atomic output; returns ``(total, n_read, n_states, n_subagent)``."""
    total, n_read, n_states, n_subagent = IngestionStats(), 0, 0, 0
    with atomic_writer(Path(args.out)) as sink:
        for f in files:
            if args.format in ("auto", "claude_code") and f.suffix == ".jsonl" and is_subagent_file(f):
                n_subagent += 1
                total.skipped_subagent += 1
                continue
            try:
                fmt, count, st = _ingest_file(f, args, sink)
            except (ValueError, OSError) as e:
                problems.append(str(e) if str(f) in str(e) else f"{f}: {e}")
                table.add_row(f.name, "?", "-", "-", "-", "-", "-", "unreadable")
                continue
            n_read, n_states = n_read + 1, n_states + count
            total.add(st)
            note = "; ".join(st.version_warnings or [])[:60]
            table.add_row(
                f.name, fmt, str(count), str(st.n_records_total), str(st.n_records_skipped),
                str(st.skipped_truncated_lines), str(st.n_errors), note,
            )  # fmt: skip
        if n_read == 0:
            raise _NothingRead(n_subagent)  # discards the (empty) output: nothing is written
    return total, n_read, n_states, n_subagent


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 when at least one file was read, 1 when none could
    be, 2 when ``--out`` is refused or cannot be written)."""
    args = _parser().parse_args(argv)
    if args.max_history_tokens is not None and args.max_history_tokens <= 0:
        _parser().error(f"--max-history-tokens={args.max_history_tokens} must be a positive number of tokens")
    out = Path(args.out)
    problem = _out_problem(out, args.paths)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    files, problems = _files(args.paths)
    table = _table()
    try:
        total, n_read, n_states, n_subagent = _run(files, args, table, problems)
    except _NothingRead as e:
        (n_subagent,) = e.args
        table.add_row(*_total_row(IngestionStats(), 0, 0, n_subagent))
        console.print(table)
        for line in problems:
            console.print(f"[red]cannot read[/red] {line}", soft_wrap=True)
        reason = "no input files found" if not files and not problems else "no file could be read"
        if n_subagent:
            reason += f" ({n_subagent} subagent files skipped)"
        print(f"error: {reason}; nothing written to {out}", file=sys.stderr)
        return 1
    except (_OutputError, OSError) as e:
        print(f"error: cannot write --out {out}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    table.add_row(*_total_row(total, n_read, n_states, n_subagent))
    console.print(table)
    for line in problems:
        console.print(f"[yellow]skipped[/yellow] {line}", soft_wrap=True)
    console.print(f"wrote {n_states} states to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

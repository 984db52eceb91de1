"""Ingest agent traces into one TraceState JSONL, secrets redacted.

    python -m composer_replication.ingestion PATH... --out states.jsonl \\
        [--format auto|claude_code|codex|openai|swe_agent] [--max-history-tokens N] [--no-redact] [--allow-empty]

Folders are walked for ``*.jsonl``, ``*.json`` and ``*.traj`` (subagent files skipped and counted). The output is
written atomically and is never an input; an unreadable file is skipped with its reason, one without states named.
Exit status 1 when nothing could be read or an input given yields no state (unless ``--allow-empty``); 2 when
``--out`` cannot be used. docs/ingestion.md has the table of guarantees.
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

_SUFFIXES = (".jsonl", ".json", ".traj")
_COLUMNS = ("file", "format", "states", "records", "skipped", "truncated", "errors", "redacted", "note")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m composer_replication.ingestion", description=__doc__.split("\n")[0])
    p.add_argument("paths", nargs="+", metavar="PATH", help="trace files or folders to walk")
    p.add_argument("--out", required=True, help="output JSONL (written atomically; not an input nor in an input folder)")
    p.add_argument("--format", default="auto", choices=("auto", *FORMATS), help="trace format (default: detect)")
    p.add_argument("--max-history-tokens", type=int, help="drop the oldest history beyond this many tokens (chars/4)")
    p.add_argument("--no-redact", action="store_true", help="keep secrets (keys, tokens, passwords, private keys) as "
                   "they are: they then reach teacher requests, pairs.jsonl and checkpoints")
    p.add_argument("--allow-empty", action="store_true", help="exit 0 even when an input yields no state")
    return p  # fmt: skip


def _files(paths: list[str]) -> tuple[list[tuple[int, Path]], list[str]]:
    """``(input index, file)`` of every trace file under ``paths`` (sorted per argument), and one problem
    line per path that is missing or folder that cannot be listed."""
    files: list[tuple[int, Path]] = []
    problems: list[str] = []
    for i, p in enumerate(map(Path, paths)):
        if p.is_dir():
            walk = os.walk(p, onerror=lambda e: problems.append(
                f"{e.filename}: cannot list this folder ({e.strerror}); its files were not read"))  # fmt: skip
            found = [Path(root) / n for root, _, names in walk for n in names if Path(n).suffix in _SUFFIXES]
            files.extend((i, f) for f in sorted(found) if f.is_file())
        elif p.is_file():
            files.append((i, p))
        else:
            problems.append(f"{p}: no such file or folder")
    return files, problems


def _out_problem(out: Path, paths: list[str]) -> str | None:
    """Why ``out`` cannot be the output (an input, inside an input folder, a folder, under a file), or None."""
    real = Path(os.path.realpath(out))
    for raw in paths:
        src = Path(os.path.realpath(raw))
        if real == src:
            return f"--out {out} is the input {raw}: it would be replaced by states; write to another file"
        if src.is_dir() and src in real.parents:
            return (f"--out {out} is inside the input folder {raw}: a re-run would read it back as a trace; "
                    "write it outside the folders you ingest")  # fmt: skip
    if real.is_dir():
        return f"--out {out} is a folder; give a file path such as {out / 'states.jsonl'}"
    parent = next((p for p in real.parents if p.exists()), None)
    return f"--out {out}: {parent} is a file, not a folder" if parent is not None and not parent.is_dir() else None


class _OutputError(Exception):
    """Writing the output failed (disk full, no permission): the run stops."""


def _write(sink: TextIO, state: dict) -> None:
    try:
        sink.write(json.dumps(state, ensure_ascii=False) + "\n")
    except OSError as e:
        raise _OutputError(str(e)) from e


def _ingest_file(f: Path, args: argparse.Namespace, sink: TextIO) -> tuple[str, int, IngestionStats]:
    """Write the states of ``f``; on failure nothing of ``f`` stays in ``sink`` (ValueError / OSError)."""
    sink.flush()
    start = sink.tell()
    try:
        fmt = detect_format(f) if args.format == "auto" else args.format
        ing = make_ingester(fmt, max_history_tokens=args.max_history_tokens, redact=not args.no_redact)
        count = 0
        for state in ing.ingest(f):
            _write(sink, state)
            count += 1
    except (ValueError, OSError, RecursionError) as e:
        sink.seek(start)
        sink.truncate()
        if isinstance(e, RecursionError):
            raise ValueError(f"{f}: nested deeper than Python's recursion limit ({sys.getrecursionlimit()})") from e
        raise
    return fmt, count, ing.last_stats


def _row(name: str, fmt: str, n: int, st: IngestionStats, note: str) -> tuple[str, ...]:
    counts = (n, st.n_records_total, st.n_records_skipped, st.skipped_truncated_lines, st.n_errors,
              sum(st.redactions.values()))  # fmt: skip
    return (name, fmt, *map(str, counts), note)


class _NothingRead(Exception):
    """No state was read (and ``--allow-empty`` is not given): the output is discarded."""


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (module docstring)."""
    args = _parser().parse_args(argv)
    if args.max_history_tokens is not None and args.max_history_tokens <= 0:
        _parser().error(f"--max-history-tokens={args.max_history_tokens} must be a positive number of tokens")
    out = Path(args.out)
    if problem := _out_problem(out, args.paths):
        print(f"error: {problem}", file=sys.stderr)
        return 2
    files, problems = _files(args.paths)
    table = Table(title="ingestion")
    for col in _COLUMNS:
        table.add_column(col, justify="left" if col in ("file", "format", "note") else "right")
    total, n_read, n_subagent, empty, per_input = IngestionStats(), 0, 0, [], [0] * len(args.paths)
    try:
        with atomic_writer(out) as sink:
            for i, f in files:
                if args.format in ("auto", "claude_code") and f.suffix == ".jsonl" and is_subagent_file(f):
                    n_subagent += 1
                    continue
                try:
                    fmt, count, st = _ingest_file(f, args, sink)
                except (ValueError, OSError) as e:
                    problems.append(str(e) if str(f) in str(e) else f"{f}: {e}")
                    table.add_row(f.name, "?", *["-"] * 6, "unreadable")
                    continue
                n_read, per_input[i] = n_read + 1, per_input[i] + count
                total.add(st)
                if not count:
                    empty.append(f"{f}: no states ({st.n_records_total} records read, {st.n_records_skipped} skipped)")
                table.add_row(*_row(f.name, fmt, count, st, "; ".join(st.version_warnings or [])[:60]))
            if not n_read or not (sum(per_input) or args.allow_empty):
                raise _NothingRead
    except _NothingRead:
        pass
    except (_OutputError, OSError) as e:
        print(f"error: cannot write --out {out}: {getattr(e, 'strerror', None) or e}", file=sys.stderr)
        return 2
    note = f"{n_subagent} subagent files skipped" if n_subagent else ""
    table.add_row(*_row("TOTAL", f"{n_read} files", sum(per_input), total, note))
    console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
    console.print(table)
    for tag, line in [*(("skipped", p) for p in problems), *(("warning", e) for e in empty)]:
        console.print(f"[yellow]{tag}[/yellow] {line}", soft_wrap=True)
    if total.redactions:
        console.print(f"redacted {', '.join(f'{n} {k}' for k, n in sorted(total.redactions.items()))}")
    if not n_read or not (sum(per_input) or args.allow_empty):
        reason = "no input files found" if not files and not problems else "no file could be read"
        reason = reason if not n_read else "the inputs yield no states (pass --allow-empty to accept that)"
        print(f"error: {reason}{f' ({note})' if note else ''}; nothing written to {out}", file=sys.stderr)
        return 1
    console.print(f"wrote {sum(per_input)} states to {out}")
    if (barren := [p for p, n in zip(args.paths, per_input) if not n]) and not args.allow_empty:
        print(f"error: no states from {', '.join(barren)} (pass --allow-empty to accept that)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

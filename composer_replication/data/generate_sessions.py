"""Generate the bundled **synthetic** Claude Code sessions (the recipe's train and held-out data).

The sessions are not recordings of real users or of a real model: a scripted agent fixes small,
hand-written Python bugs in made-up repositories, and this module writes what Claude Code would have
logged (``~/.claude/projects/.../<session>.jsonl``, version 2.1.x). They stand in for a user's own
Claude Code history, recorded from a strong agent, so that the default run, the tests and the
learning benchmark have data with the same shape: several tools (Read, Edit, Write, Bash, Grep),
failing tool calls with the errors Claude Code prints (an unknown tool, invalid input, a path that
does not exist, an ``old_string`` that does not match, ``command not found``), and test runs that
fail with tracebacks and then pass.

Variety: 12 bug families (a missing default, floor division, a strict limit, a mutable default...)
with 4-6 variants each, every session a different variant in a different made-up project, layout,
module name, test command and path through the fix. Held-out sessions are whole sessions: one
variant of each of the first ``num_heldout`` families, so every held-out bug has a training bug of the
same kind (the pattern is learnable) but none of its names or values (it cannot be memorised).

    python -m composer_replication.data.generate_sessions --out composer_replication/data/sessions

writes ``OUT/train/syn-NNN-<function>.jsonl`` and ``OUT/heldout/syn-NNN-<function>.jsonl``; the same
seed always gives byte-identical files (the bundled ones are this command's output with the defaults;
a test checks it). The five hand-written ``train/fix-*.jsonl`` sessions are not generated.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from composer_replication.data._synth_bugs import FAMILIES, make_bug
from composer_replication.data._synth_session import build_session

__all__ = [
    "DEFAULT_SEED",
    "DEFAULT_NUM_SESSIONS",
    "DEFAULT_NUM_HELDOUT",
    "generate_sessions",
    "write_sessions",
]

DEFAULT_SEED = 0
DEFAULT_NUM_SESSIONS = 48
DEFAULT_NUM_HELDOUT = 10


def _plan(seed: int, num_sessions: int, num_heldout: int) -> list[tuple[str, int, bool]]:
    """``(family, variant, held_out)`` per session, in session order."""
    combos = [(f, v) for f, (variants, _) in FAMILIES.items() for v in range(len(variants))]
    if not 1 <= num_sessions <= len(combos):
        raise ValueError(
            f"'num_sessions' must be in [1, {len(combos)}] (one per bug variant), got {num_sessions}"
        )
    if not 0 <= num_heldout <= min(len(FAMILIES), num_sessions - 1):
        raise ValueError(
            f"'num_heldout' must be in [0, {min(len(FAMILIES), num_sessions - 1)}] (at most one "
            f"per bug family, leaving one session to train on), got {num_heldout}"
        )
    rng = random.Random(f"plan:{seed}")
    rng.shuffle(combos)
    chosen = combos[:num_sessions]
    families = list(dict.fromkeys(f for f, _ in chosen))
    held: set[tuple[str, int]] = set()
    for family in families:
        if len(held) == num_heldout:
            break
        mine = [c for c in chosen if c[0] == family]
        if len(mine) > 1:  # keep at least one variant of the family for training
            held.add(mine[0])
    if len(held) < num_heldout:
        raise ValueError(
            f"only {len(held)} families have two or more sessions among {num_sessions}; "
            f"raise 'num_sessions' or lower 'num_heldout' ({num_heldout})"
        )
    return [(f, v, (f, v) in held) for f, v in chosen]


def generate_sessions(
    *,
    seed: int = DEFAULT_SEED,
    num_sessions: int = DEFAULT_NUM_SESSIONS,
    num_heldout: int = DEFAULT_NUM_HELDOUT,
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """The sessions as records: ``{"train": {stem: records}, "heldout": {stem: records}}``.

    Args:
        seed: everything (bugs drawn, projects, paths through the fix, ids, timestamps) follows from it.
        num_sessions: sessions in all (at most one per bug variant).
        num_heldout: sessions held out for evaluation (one per bug family at most).

    Raises:
        ValueError: a count out of range (names the allowed range).
    """
    out: dict[str, dict[str, list[dict[str, Any]]]] = {"train": {}, "heldout": {}}
    for i, (family, variant, held) in enumerate(_plan(seed, num_sessions, num_heldout)):
        bug = make_bug(family, variant)
        stem = f"syn-{i:03d}-{bug.fn.replace('_', '-')}"
        records = build_session(f"{seed}:{stem}", random.Random(f"session:{seed}:{i}"), bug)
        out["heldout" if held else "train"][stem] = records
    return out


def session_bytes(records: list[dict[str, Any]]) -> bytes:
    """One session file's bytes (one JSON record per line, UTF-8)."""
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")


def write_sessions(out: str | Path, **kwargs: Any) -> list[Path]:
    """Write :func:`generate_sessions` (same keyword arguments) under ``out/train`` and ``out/heldout``.

    Existing ``syn-*.jsonl`` files there are replaced; other files (the hand-written sessions) are kept.

    Returns:
        The written files.
    """
    written: list[Path] = []
    for split, sessions in generate_sessions(**kwargs).items():
        folder = Path(out) / split
        folder.mkdir(parents=True, exist_ok=True)
        for old in folder.glob("syn-*.jsonl"):
            old.unlink()
        for stem, records in sessions.items():
            path = folder / f"{stem}.jsonl"
            path.write_bytes(session_bytes(records))
            written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m composer_replication.data.generate_sessions", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--out", required=True, help="folder to write train/ and heldout/ into")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="seed of every random choice")
    parser.add_argument("--num-sessions", type=int, default=DEFAULT_NUM_SESSIONS, help="sessions in all")
    parser.add_argument(
        "--num-heldout",
        type=int,
        default=DEFAULT_NUM_HELDOUT,
        help="whole sessions held out for evaluation (at most one per bug family)",
    )
    args = parser.parse_args(argv)
    try:
        paths = write_sessions(
            args.out, seed=args.seed, num_sessions=args.num_sessions, num_heldout=args.num_heldout
        )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    n_held = sum(p.parent.name == "heldout" for p in paths)
    print(f"wrote {len(paths) - n_held} train and {n_held} held-out sessions under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

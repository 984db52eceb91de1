"""Judging a sandboxed run in the parent, from the child's nonce-tagged records (see :mod:`._sandbox_facts`).

Records are Python literals: ``('start', limits)``, ``('load', phase, error type, text)``,
``('check', test, site, ((leaf, value), ...))``, ``('end', test, error type or None, text)`` and
``('done',)``. A test passes when it reported an end without error and every assert it reported
holds when this process re-evaluates it; lines without the run's nonce are ignored.
"""

from __future__ import annotations

import ast

from composer_replication.rollout import _sandbox_facts as facts

__all__ = ["parse_records", "summarize"]


def parse_records(raw: bytes, nonce: str) -> list[tuple]:
    """The nonce-tagged Python-literal lines of the child; anything else is ignored."""
    records, tag = [], (nonce + " ").encode()
    for line in raw.split(b"\n"):
        if not line.startswith(tag) or len(line) > (4 << 20):
            continue
        try:
            rec = ast.literal_eval(line[len(tag) :].decode("utf-8", errors="replace"))
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            continue
        if isinstance(rec, tuple) and rec and isinstance(rec[0], str):
            records.append(rec)
    return records


def summarize(records: list[tuple], names: list[str], sites: list, raw: dict, timeout_s: float) -> dict:
    """The :class:`~composer_replication.rollout.sandbox.SandboxResult` fields judged from ``records``.

    ``names`` and ``sites`` come from the parent's own parse of the tests; ``raw`` holds
    ``returncode``, ``timed_out``, ``duration``, ``stdout`` and ``stderr`` of the run.
    """
    start = next((r for r in records if r[0] == "start" and len(r) == 2), ("start", ()))
    load = next((r for r in records if r[0] == "load" and len(r) == 4), None)
    done = any(r[0] == "done" for r in records)
    results, first_error = judge_tests(records, names, sites)
    n_passed = sum(results.values())
    error, error_type = None, None
    if raw["timed_out"]:
        error, error_type = f"timed out after {timeout_s:g}s (sandbox killed)", "Timeout"
    elif load is not None:
        error, error_type = str(load[3]), str(load[2])
    elif first_error is not None:
        error_type, error = first_error
    elif not done:
        tail = raw["stderr"].strip()[-800:]
        error = f"the run ended without reporting results (exit status {raw['returncode']})" + (
            f": {tail}" if tail else ""
        )
        error_type = "NoResult"
    rc = raw["returncode"]
    return dict(
        passed=done and not raw["timed_out"] and bool(names) and n_passed == len(names),
        n_passed=n_passed,
        n_total=len(names),
        stdout=raw["stdout"],
        stderr=raw["stderr"],
        timed_out=raw["timed_out"],
        killed=rc is not None and rc < 0,
        returncode=rc,
        error=error,
        error_type=error_type,
        test_results=results,
        duration_s=raw["duration"],
        limits_applied=[str(x) for x in start[1]] if isinstance(start[1], tuple) else [],
    )


def judge_tests(records: list[tuple], names: list[str], sites: list) -> tuple[dict[str, bool], tuple | None]:
    """``{test: passed}`` for the tests that reported an end, and the first failure (type, text)."""
    ends: dict[str, list] = {}
    checks: dict[str, list] = {}
    for r in records:
        if r[0] == "end" and len(r) == 4 and r[1] in names:
            ends.setdefault(r[1], []).append(r)
        elif r[0] == "check" and len(r) == 4 and r[1] in names:
            checks.setdefault(r[1], []).append(r)
    results, first_error = {}, None
    for name in names:
        if name not in ends:
            continue
        failed = next((e for e in ends[name] if e[2] is not None), None)
        if failed is not None:
            results[name] = False
            first_error = first_error or (str(failed[2]), str(failed[3]))
            continue
        bad = next((c for c in checks.get(name, []) if not _check_holds(c, sites)), None)
        results[name] = bad is None
        if bad is not None:
            first_error = first_error or (
                "AssertionError",
                f"{name}: assert #{bad[2]} does not hold on the values the child reported",
            )
    return results, first_error


def _check_holds(record: tuple, sites: list) -> bool:
    _, _, k, leaves = record
    if not isinstance(k, int) or not 0 <= k < len(sites) or not isinstance(leaves, tuple):
        return False
    if not all(isinstance(p, tuple) and len(p) == 2 for p in leaves):
        return False
    return facts.judge_check(sites[k], leaves)

"""Judging a sandboxed run in the parent, from the child's nonce-tagged records (see :mod:`._sandbox_facts`).

Records are Python literals: ``('start', limits)``, ``('load', phase, error type, text)``,
``('check', test, site, ((leaf, value), ...))``, ``('end', test, error type or None, text)`` and
``('done',)``. A test passes when it reported an end without error and every assert it reported
holds when this process re-evaluates it; lines without the run's nonce are ignored.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable, Iterable

from composer_replication.rollout import _sandbox_facts as facts

__all__ = ["decode", "judge_check", "parse_records", "summarize"]

_EVAL_OPS: dict[str, Callable[[object, object], object]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
    "in": lambda a, b: a in b,
    "not in": lambda a, b: a not in b,
    "is": operator.is_,
    "is not": operator.is_not,
}


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
    return judge_check(sites[k], leaves)


class _Missing(Exception):
    """A leaf the parent needs was not reported (the child short-circuited differently)."""


def decode(v: object, depth: int = 0) -> object:
    """A value serialized by the child's ``enc``, decoded into the same plain value (raises ``ValueError``)."""
    if depth > facts.MAX_DEPTH + 2 or not isinstance(v, tuple) or not v or not isinstance(v[0], str):
        raise ValueError(f"malformed value {str(v)[:80]!r}")
    tag, rest = v[0], v[1:]
    if tag == "n":
        return None
    if tag in ("b", "i", "s", "y") and len(rest) == 1:
        want = {"b": bool, "i": int, "s": str, "y": bytes}[tag]
        if type(rest[0]) is not want:
            raise ValueError(f"malformed {tag!r} value")
        return rest[0]
    if tag == "f" and len(rest) == 1:
        return float(rest[0])
    if tag == "c" and len(rest) == 2:
        return complex(float(rest[0]), float(rest[1]))
    if tag == "d" and len(rest) == 1:
        return {decode(a, depth + 1): decode(b, depth + 1) for a, b in rest[0]}
    if tag in ("l", "t", "S", "F") and len(rest) == 1:
        items = [decode(x, depth + 1) for x in rest[0]]
        return {"l": list, "t": tuple, "S": set, "F": frozenset}[tag](items)
    raise ValueError(f"unknown value tag {tag!r}")


def _evaluate(shape: object, leaves: dict[int, object]) -> object:
    kind = shape[0]
    if kind == "leaf":
        if shape[1] not in leaves:
            raise _Missing
        return leaves[shape[1]]
    if kind == "not":
        return not _evaluate(shape[1], leaves)
    if kind in ("and", "or"):
        value: object = None
        for part in shape[1]:
            value = _evaluate(part, leaves)
            if bool(value) != (kind == "and"):
                return value
        return value
    _, ops, operands = shape
    left = _evaluate(operands[0], leaves)
    for op, operand in zip(ops, operands[1:]):
        right = _evaluate(operand, leaves)
        if not _EVAL_OPS[op](left, right):
            return False
        left = right
    return True


def judge_check(shape: object, leaves: Iterable[tuple[int, object]]) -> bool:
    """True when the assert of structure ``shape`` holds on the reported (serialized) leaf values."""
    try:
        return bool(_evaluate(shape, {int(j): decode(v) for j, v in leaves}))
    except Exception:  # noqa: BLE001 - malformed, missing or incomparable values: the assert does not hold
        return False

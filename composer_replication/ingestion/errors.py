"""Error sites: a turn whose tool call failed, classified from the result text into one of ``types.ERROR_KINDS``
(table: docs/ingestion.md, "Error sites"); its :class:`~composer_replication.types.HintContext` (``error_meta``)
is what the hint generator turns into the hinted context of channel 2.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from composer_replication.types import ERROR_KINDS, HintContext

# substrings of the lowercased head are much faster than one case-insensitive regex over outputs of many kB;
# regexes only where a pattern needs them, and only after a cheap substring test
_TOOL_NOT_FOUND = (
    "no such tool", "unknown tool", "tool not found", "is not a valid tool", "unsupported call",
    "unsupported tool", "no tool named", "invalid tool name", "not an available tool",
)  # fmt: skip
_TOOL_NOT_FOUND_RE = re.compile(r"(?:tool|function) \S{1,60} (?:was |is )?(?:not found|does not exist)")
_VALIDATION = ("inputvalidationerror", "validationerror", "validation error")
_EXIT_RE = re.compile(r"[Ee]xit (?:code|status):? *[1-9]|\"exit_code\": *[1-9]|EXIT CODE:? *[1-9]")
_TEST_FAILURE = re.compile(r"^=+ .*\b(?:failed|error|errors)\b.* =+$")
_JSON = (
    "jsondecodeerror", "json.decoder", "expecting value", "expecting property name", "expecting ',' delimiter",
    "expecting ':' delimiter", "unterminated string", "extra data: line", "invalid control character",
    "invalid json", "not valid json", "failed to parse function arguments", "failed to parse tool arguments",
    "failed to parse arguments", "could not parse the tool input", "could not parse tool input",
    "could not parse arguments", "in json at position", "unexpected end of json", "malformed json",
    "error parsing tool input",
)  # fmt: skip
_JSON_HINTS = ("json", "expecting", "pars", "unterminated", "extra data", "control character")
_TYPE = (
    "invalid type", "required parameter", "missing required", "is a required property", "must be of type",
    "wrong type", "unexpected keyword argument", "unexpected argument", "unexpected parameter", "invalid input",
    "invalid argument", "invalid parameter", "is not of type", "type is expected as",
)  # fmt: skip
_TYPE_RE = re.compile(r"expected (?:a |an )?(?:string|number|integer|boolean|object|array|bool|int|str)\b")
_RUNTIME_WEAK = (
    "error", "exception", "failed", "failure", "command not found", "no such file or directory",
    "permission denied", "timed out", "timeout", "not permitted", "cannot ", "can't ", "could not", "non-zero",
)  # fmt: skip
_ERROR_LINE = re.compile(r"\[?(?:error|ERROR|Error)\]?[: ]|fatal:|[Ee]xception")
_DIGITS, _SPACES = re.compile(r"\d+"), re.compile(r"\s+")


def _any(needles: tuple[str, ...], hay: str) -> bool:
    return any(n in hay for n in needles)


def _test_failure(text: str) -> bool:
    """A pytest failure line: ``FAILED ...``, ``ERROR ...``, ``E   ...`` or ``=== 1 failed ... ===``."""
    return any(line.startswith(("FAILED ", "ERROR ", "E   "))
               or (line.startswith("=") and line.endswith("=") and _TEST_FAILURE.search(line))
               for line in text.splitlines())  # fmt: skip


def classify_tool_error(text: str) -> str:
    """The kind of a failed tool call's text, one of ``ERROR_KINDS`` (never ``repeated_failure``), from the most
    to the least specific: an unknown tool, a schema validation error, a traceback / non-zero exit / failing test
    (so a program's own ``JSONDecodeError`` is a ``runtime_error``), argument JSON errors, argument type errors,
    any other failure (``runtime_error``), else ``other``. Reads the first 1500 and last 500 characters.

    >>> classify_tool_error("<tool_use_error>Error: No such tool available: Serch</tool_use_error>")
    'tool_not_found'
    """
    text = text or ""
    text = text if len(text) <= 2000 else text[:1500] + "\n" + text[-500:]
    low = text.lower()
    if _any(_TOOL_NOT_FOUND, low[:300]) or _TOOL_NOT_FOUND_RE.search(low[:300]):
        return "tool_not_found"
    if _any(_VALIDATION, low[:300]):
        return "type_error"
    if "traceback (most recent call last)" in low or ("exit" in low and _EXIT_RE.search(text)) or _test_failure(text):
        return "runtime_error"
    if _any(_JSON_HINTS, low) and _any(_JSON, low):
        return "json_decode"
    if _any(_TYPE, low) or ("expected" in low and _TYPE_RE.search(low)):
        return "type_error"
    return "runtime_error" if _any(_RUNTIME_WEAK, low) else "other"


def looks_like_error(text: str) -> bool:
    """Whether a result without an error flag (OpenAI messages, Codex) reports a failure, conservatively: a
    traceback, a ``<tool_use_error>``, an unknown-tool or invalid-arguments message, a non-zero exit code, or a
    line opening with ``Error:`` / ``[error]`` / ``fatal:`` / ``Exception``."""
    head = (text or "")[:3000]
    short, low = head[:300].lower(), head.lower()
    if "Traceback (most recent call last)" in head or "<tool_use_error>" in head or "failed to parse" in short:
        return True
    if _any(_TOOL_NOT_FOUND, short) or _any(_VALIDATION, short) or ("exit" in low and _EXIT_RE.search(head)):
        return True
    if not ("error" in low or "fatal:" in low or "exception" in low):
        return False
    return any(s[:1] in "EeFf[" and _ERROR_LINE.match(s) for s in (ln.lstrip(" \t") for ln in head.splitlines()))


def error_site(*, kind: str, message: str, tool_name: str, available_tools: list[str],
               tool_schema: dict | None = None, intent: str = "") -> HintContext:  # fmt: skip
    """The :class:`~composer_replication.types.HintContext` of one failed call (message cut to 2000 characters,
    intent to 500); ``ValueError`` when ``kind`` is not one of ``ERROR_KINDS``."""
    if kind not in ERROR_KINDS:
        raise ValueError(f"kind={kind!r} is not an error kind; use one of {ERROR_KINDS}")
    site: HintContext = {"error_kind": kind, "error_message": (message or "")[:2000], "tool_name": tool_name,
                         "available_tools": list(available_tools), "intent": (intent or "")[:500]}  # fmt: skip
    if tool_schema:
        site["tool_schema"] = tool_schema
    return site


def offered_tools(calls: dict[str, str], failed: dict[str, str], declared: Iterable[str] = ()) -> list[str]:
    """The session's tools, sorted: ``declared`` plus every name called (``calls``: call id -> name), minus
    names only ever answered by a ``tool_not_found`` error (``failed``: call id -> text), which were invented."""
    refused = {c for c in calls if c in failed and classify_tool_error(failed[c]) == "tool_not_found"}
    declared = set(declared)
    return sorted(declared | {n for c, n in calls.items() if c not in refused} | ({calls[c] for c in refused} & declared))


class RepeatTracker:
    """Turns a second consecutive identical failure into ``repeated_failure``: :meth:`observe` once per turn,
    in order, with the turn's first failure or None (which breaks the run)."""

    def __init__(self) -> None:
        self._last: str | None = None

    def observe(self, failure: tuple[str, str, str] | None) -> str | None:
        """``failure`` is ``(tool_name, error_text, kind)``; returns the kind to record, or None. Failures are
        the same when their tool and first 200 characters (digits and spaces normalized) are."""
        sig = None if failure is None else failure[0] + "\x00" + _SPACES.sub(" ", _DIGITS.sub("#", (failure[1] or "")[:200])).strip()
        repeated, self._last = sig is not None and sig == self._last, sig
        return None if failure is None else "repeated_failure" if repeated else failure[2]

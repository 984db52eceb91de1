"""Error sites: classify a failed tool call from its result text.

Every ingester marks the turn whose tool calls came back with an error (``TraceState.error_kind``
and ``error_meta``, an :class:`~composer_replication.types.ErrorSite`). The hint generator turns
those sites into hinted contexts for the self-distillation channel; the rollout environments use
:func:`classify_tool_error` on their own tool errors so both speak the same kinds:

- ``tool_not_found``: the agent called a tool that does not exist ("No such tool available").
- ``json_decode``: the arguments were not valid JSON ("Expecting ',' delimiter").
- ``type_error``: the arguments did not match the tool's schema ("InputValidationError",
  "expected string, received number", a missing required parameter).
- ``runtime_error``: the tool ran and failed (a traceback, a non-zero exit code, a failing test).
- ``repeated_failure``: the same tool failed with the same error in two turns in a row
  (decided by :class:`RepeatTracker`, not from one text).
- ``other``: an error none of the above describes.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from composer_replication.types import ERROR_KINDS, ErrorSite

__all__ = [
    "ERROR_KINDS",
    "classify_tool_error",
    "looks_like_error",
    "error_signature",
    "make_error_site",
    "RepeatTracker",
    "offered_tools",
]


# Plain substrings (matched on the lowercased head of the text) are much faster than one big
# case-insensitive regex over tool outputs of many kB; regexes only where a pattern needs them.
_TOOL_NOT_FOUND = (
    "no such tool", "unknown tool", "tool not found", "is not a valid tool", "unsupported call",
    "unsupported tool", "no tool named", "invalid tool name", "not an available tool",
)  # fmt: skip
_TOOL_NOT_FOUND_RE = re.compile(r"(?:tool|function) \S{1,60} (?:was |is )?(?:not found|does not exist)")
_VALIDATION = ("inputvalidationerror", "validationerror", "validation error")
_RUNTIME_STRONG_RE = re.compile(r"[Ee]xit (?:code|status):? *[1-9]|\"exit_code\": *[1-9]|EXIT CODE:? *[1-9]")
_TEST_FAILURE = re.compile(r"^=+ .*\b(?:failed|error|errors)\b.* =+$")
_JSON = (
    "jsondecodeerror", "json.decoder", "expecting value", "expecting property name", "expecting ',' delimiter",
    "expecting ':' delimiter", "unterminated string", "extra data: line", "invalid control character",
    "invalid json", "not valid json", "failed to parse function arguments", "failed to parse tool arguments",
    "failed to parse arguments", "could not parse the tool input", "could not parse tool input",
    "could not parse arguments", "in json at position", "unexpected end of json", "malformed json",
    "error parsing tool input",
)  # fmt: skip
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
_LOOKS_LIKE_ERROR = re.compile(r"\[?(?:error|ERROR|Error)\]?[: ]|fatal:|[Ee]xception")
_DIGITS = re.compile(r"\d+")
_SPACES = re.compile(r"\s+")
_HEAD, _TAIL = 1500, 500


def _any(needles: tuple[str, ...], hay: str) -> bool:
    return any(n in hay for n in needles)


# the regexes below are slow on long non-ASCII text: each runs only when a cheap substring test passes
def _exit_code(text: str, low: str) -> bool:
    return ("exit" in low) and bool(_RUNTIME_STRONG_RE.search(text))


def _test_failure(text: str) -> bool:
    """A pytest-style failure line: ``FAILED ...``, ``ERROR ...``, ``E   ...`` or ``=== 1 failed ... ===``."""
    for line in text.splitlines():
        if line.startswith(("FAILED ", "ERROR ", "E   ")):
            return True
        if line.startswith("=") and line.endswith("=") and _TEST_FAILURE.search(line):
            return True
    return False


def _error_line(text: str) -> bool:
    """A line that starts (after indentation) with ``Error:``/``[error]``/``fatal:``/``Exception``."""
    for line in text.splitlines():
        s = line.lstrip(" \t")
        if s[:1] in "EeFf[" and _LOOKS_LIKE_ERROR.match(s):
            return True
    return False


def classify_tool_error(text: str) -> str:
    """Classify the text of a failed tool call into one of :data:`ERROR_KINDS` (never ``repeated_failure``).

    The checks run from the most to the least specific: an unknown tool, a schema validation error,
    then a traceback or a non-zero exit code (so a program's own ``JSONDecodeError`` inside a traceback
    is a ``runtime_error``), then argument JSON errors, argument type errors, any other failure
    (``runtime_error``), else ``other``. Only the head and the tail of a long text are read.

    >>> classify_tool_error("<tool_use_error>Error: No such tool available: Serch</tool_use_error>")
    'tool_not_found'
    """
    text = text or ""
    if len(text) > _HEAD + _TAIL:
        text = text[:_HEAD] + "\n" + text[-_TAIL:]
    low = text.lower()
    short = low[:300]
    if _any(_TOOL_NOT_FOUND, short) or _TOOL_NOT_FOUND_RE.search(short):
        return "tool_not_found"
    if _any(_VALIDATION, short):
        return "type_error"
    if "traceback (most recent call last)" in low or _exit_code(text, low) or _test_failure(text):
        return "runtime_error"
    if (
        "json" in low
        or "expecting" in low
        or "pars" in low
        or "unterminated" in low
        or "extra data" in low
        or "control character" in low
    ) and _any(_JSON, low):
        return "json_decode"
    if _any(_TYPE, low) or ("expected" in low and _TYPE_RE.search(low)):
        return "type_error"
    if _any(_RUNTIME_WEAK, low):
        return "runtime_error"
    return "other"


def looks_like_error(text: str) -> bool:
    """Guess whether a tool result without an explicit error flag reports a failure.

    Conservative (formats such as OpenAI messages carry no ``is_error``): an error/fatal prefix, a
    Python traceback, a non-zero exit code, a ``<tool_use_error>`` wrapper, or an unknown-tool /
    invalid-arguments message.
    """
    text = text or ""
    head = text[:3000]
    short = head[:300].lower()
    if "Traceback (most recent call last)" in head or "<tool_use_error>" in head:
        return True
    if _any(_TOOL_NOT_FOUND, short) or _any(_VALIDATION, short) or "failed to parse" in short:
        return True
    low = head.lower()
    if "exit" in low and _RUNTIME_STRONG_RE.search(head):
        return True
    return ("error" in low or "fatal:" in low or "exception" in low) and _error_line(head)


def error_signature(tool_name: str, text: str) -> str:
    """A comparable form of one failure: the tool and the error's first 200 characters, digits and
    whitespace normalized (so two runs of the same failing test compare equal)."""
    body = _SPACES.sub(" ", _DIGITS.sub("#", (text or "")[:200])).strip()
    return f"{tool_name}\x00{body}"


def make_error_site(
    *,
    kind: str,
    message: str,
    tool_name: str,
    available_tools: list[str],
    tool_schema: dict | None = None,
    intent: str = "",
    max_message_chars: int = 2000,
) -> ErrorSite:
    """Build the :class:`ErrorSite` for one failed tool call (``message`` cut to ``max_message_chars``)."""
    if kind not in ERROR_KINDS:
        raise ValueError(f"kind={kind!r} is not an error kind; use one of {ERROR_KINDS}")
    site: ErrorSite = {
        "error_kind": kind,
        "error_message": (message or "")[:max_message_chars],
        "tool_name": tool_name,
        "available_tools": list(available_tools),
        "intent": (intent or "")[:500],
    }
    if tool_schema:
        site["tool_schema"] = tool_schema
    return site


def offered_tools(
    calls: dict[str, str],
    results: dict[str, tuple[str, bool]],
    declared: Iterable[str] = (),
    classify: Callable[[str], str] | None = None,
) -> list[str]:
    """The session's tool names, sorted: ``declared`` plus every name called, minus names whose calls
    were only ever answered with a ``tool_not_found`` error (the agent invented them).

    ``calls`` maps call id -> tool name; ``results`` maps call id -> ``(text, is_error)``;
    ``classify`` defaults to :func:`classify_tool_error` (pass a memoized one to share work).
    """
    classify = classify or classify_tool_error
    bad: set[str] = set()
    good: set[str] = set()
    for cid, name in calls.items():
        res = results.get(cid)
        if res is not None and res[1] and classify(res[0]) == "tool_not_found":
            bad.add(name)
        else:
            good.add(name)
    return sorted(set(declared) | good | (bad & set(declared)))


@dataclass
class RepeatTracker:
    """Turns a second consecutive identical failure into ``repeated_failure``.

    Call :meth:`observe` once per turn, in turn order, with the turn's first failure (or ``None``):
    it returns the kind to record. A turn without an error breaks the run.
    """

    _last: str | None = field(default=None, repr=False)

    def observe(self, failure: tuple[str, str, str] | None) -> str | None:
        """``failure`` is ``(tool_name, error_text, base_kind)``; returns the kind for this turn or None."""
        if failure is None:
            self._last = None
            return None
        tool_name, text, kind = failure
        sig = error_signature(tool_name, text)
        repeated = sig == self._last
        self._last = sig
        return "repeated_failure" if repeated else kind

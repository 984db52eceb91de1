"""Hint templates for self-distillation at error sites (channel 2; the spec's module).

At an error site (a failed tool call: an unknown tool, bad JSON, wrong argument types, a runtime failure,
the same failure again) the same model is its own teacher once it is shown a short *hint* about what went
wrong. A template turns the site's :class:`HintContext` (``composer_replication.types``; the ingesters'
``error_meta``) into that hint, inserted as one user message before the failing turn
(``chat_format.build_hinted_teacher_sequence``). Each template uses the context it has (the tools on offer,
the tool's schema with its required fields and types, the error message, the agent's intent) and degrades to
a shorter generic sentence without it. ``other`` gets a generic hint quoting the error message; a kind that is
not registered gives ``None``.

:data:`HINT_TEMPLATES` is the spec's process-wide registry, which :func:`register` mutates; code that wants an
isolated set passes its own mapping to :func:`make_hint_generator`.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping
from typing import Any

from composer_replication.types import ERROR_KINDS, HintContext

__all__ = ["HintContext", "HintFn", "HINT_TEMPLATES", "ERROR_KINDS", "dispatch", "register",
           "make_hint_generator", "hint_tool_not_found", "hint_json_decode", "hint_type_error",
           "hint_runtime_error", "hint_repeated_failure"]  # fmt: skip

HintFn = Callable[[HintContext], str]  # a template: context in, hint text out

_MAX_MESSAGE, _MAX_TOOLS = 300, 25


def _message(ctx: Mapping[str, Any]) -> str:
    """The error message on one line ('' when absent); a long one keeps its head and its tail (the last line
    of a traceback is usually the informative one)."""
    msg = " ".join(str(ctx.get("error_message") or "").split())
    head = _MAX_MESSAGE // 3
    return msg if len(msg) <= _MAX_MESSAGE else msg[:head] + " ... " + msg[-(_MAX_MESSAGE - head - 5) :]


def _tools(ctx: Mapping[str, Any]) -> list[str]:
    raw = ctx.get("available_tools") or []
    return list(dict.fromkeys(str(t) for t in ([raw] if isinstance(raw, str) else raw) if str(t)))


def _tool_list(tools: list[str]) -> str:
    more = f" (and {len(tools) - _MAX_TOOLS} more)" if len(tools) > _MAX_TOOLS else ""
    return ", ".join(f"`{t}`" for t in tools[:_MAX_TOOLS]) + more


def _params(schema: Any) -> dict:
    """The JSON-schema object of a tool's arguments, whatever wrapper it came in."""
    if not isinstance(schema, Mapping):
        return {}
    schema = schema["function"] if isinstance(schema.get("function"), Mapping) else schema
    for key in ("parameters", "input_schema", "inputSchema"):
        if isinstance(schema.get(key), Mapping):
            return dict(schema[key])
    return dict(schema) if "properties" in schema or "required" in schema else {}


def _type_name(prop: Any) -> str:
    t = prop.get("type") if isinstance(prop, Mapping) else None
    if isinstance(t, list):
        return " or ".join(map(str, t))
    if t:
        return str(t)
    enum = prop.get("enum") if isinstance(prop, Mapping) else None
    return "one of " + ", ".join(map(repr, enum)) if enum else "any"


def _tool(ctx: Mapping[str, Any]) -> str:
    """The failing tool's name: ``tool_name``, else the schema's ``name`` ('' when unknown)."""
    schema = ctx.get("tool_schema")
    name = ctx.get("tool_name")
    if not name and isinstance(schema, Mapping):
        fn = schema.get("function")
        name = schema.get("name") or (fn.get("name") if isinstance(fn, Mapping) else None)
    return str(name) if name else ""


def _intent(ctx: Mapping[str, Any]) -> str:
    """`` Your goal: <intent>.`` (one line, at most 200 characters), or ''."""
    intent = " ".join(str(ctx.get("intent") or "").split()).rstrip(".")
    intent = intent[:197] + "..." if len(intent) > 200 else intent
    return f" Your goal: {intent}." if intent else ""


def _schema(ctx: Mapping[str, Any], tool: str) -> str:
    """`` `tool` requires: a (string), b (integer). Optional: c (boolean).`` from the schema, or ''."""
    params = _params(ctx.get("tool_schema"))
    props, required = params.get("properties") or {}, [str(r) for r in params.get("required") or []]
    req = ", ".join(f"{r} ({_type_name(props.get(r))})" for r in required)
    opt = ", ".join(f"{k} ({_type_name(v)})" for k, v in props.items() if k not in required)
    return (f" {f'`{tool}`' if tool else 'The tool'} requires: {req}." if req else "") + (f" Optional: {opt}." if opt else "")


# ---------------------------------------------------------------------------- templates
def hint_tool_not_found(ctx: HintContext) -> str:
    """The call named a tool that does not exist: name it, list the real ones, suggest the closest."""
    tool, tools = _tool(ctx), _tools(ctx)
    text = f"Reminder: there is no tool named `{tool}`." if tool else "Reminder: call only tools that exist."
    if not tools:
        return text + " Use exactly one of the tool names you were given." + _intent(ctx)
    close = difflib.get_close_matches(tool, tools, n=1, cutoff=0.5) if tool else []
    return text + (f" Did you mean `{close[0]}`?" if close else "") + f" The available tools are: {_tool_list(tools)}." + _intent(ctx)


def hint_json_decode(ctx: HintContext) -> str:
    """The arguments were not valid JSON: say so, quote the parser, and show the expected fields."""
    tool, msg = _tool(ctx), _message(ctx)
    text = "Reminder: tool arguments must be valid JSON"
    text += f": the arguments of `{tool}` must be one JSON object." if tool else ", one JSON object."
    text += (f" The parser reported: {msg}." if msg else "") + _schema(ctx, tool)
    return text + " Quote every key and string, escape quotes and newlines inside strings, and balance the braces." + _intent(ctx)


def hint_type_error(ctx: HintContext) -> str:
    """The arguments had wrong names or types: show the schema's required fields and their types."""
    tool, msg = _tool(ctx), _message(ctx)
    text = f"Reminder: the arguments passed to {f'`{tool}`' if tool else 'the tool'} have the wrong names or types."
    text += f" The error was: {msg}." if msg else ""
    return text + (_schema(ctx, tool) or " Check each argument's name and type against the tool's definition.") + _intent(ctx)


def hint_runtime_error(ctx: HintContext) -> str:
    """The call was well-formed but failed when it ran: quote the error and ask to fix the cause."""
    tool, msg = _tool(ctx), _message(ctx)
    text = f"Reminder: the call to `{tool}` fails when it runs" if tool else "Reminder: this tool call fails"
    text += f" with: {msg}." if msg else "."
    return text + " Fix the cause first (check that paths, names and preconditions hold) instead of repeating it." + _intent(ctx)


def hint_repeated_failure(ctx: HintContext) -> str:
    """The same call keeps failing: ask for a different approach, listing other tools on offer."""
    tool, msg = _tool(ctx), _message(ctx)
    text = f"Reminder: calling `{tool}` this way has already failed several times" if tool \
        else "Reminder: this approach has already failed several times"  # fmt: skip
    text += (f" (last error: {msg})." if msg else ".") + " Do not repeat it: change the arguments or take a different approach."
    others = [t for t in _tools(ctx) if t != tool]
    return text + (f" Other tools you can use: {_tool_list(others)}." if others else "") + _intent(ctx)


def hint_other(ctx: HintContext) -> str:
    """Any other failure: a generic hint that quotes the error message when there is one."""
    tool, msg = _tool(ctx), _message(ctx)
    check = " Check the tool name and each argument before calling it."
    if tool:
        text = f"Reminder: the call to `{tool}` fails" + (f" with: {msg}." if msg else ".") + check
    else:  # no failing call to name (no call was made): the message is the hint
        text = f"Reminder: {msg.rstrip('.')}." if msg else "Reminder: the next tool call fails." + check
    return text + _intent(ctx)


HINT_TEMPLATES: dict[str, HintFn] = {
    "tool_not_found": hint_tool_not_found,
    "json_decode": hint_json_decode,
    "type_error": hint_type_error,
    "runtime_error": hint_runtime_error,
    "repeated_failure": hint_repeated_failure,
    "other": hint_other,
}
"""The spec's registry: its five kinds plus ``other``. :func:`register` mutates it."""


# ---------------------------------------------------------------------------- registry API
def _validate(error_kind: Any, fn: Any) -> None:
    if not isinstance(error_kind, str) or not error_kind.strip():
        raise ValueError(f"register: error_kind must be a non-empty string, got {error_kind!r}")
    if not callable(fn):
        raise ValueError(f"register: fn for {error_kind!r} must be callable (ctx -> str), got {type(fn).__name__}")


def _run(templates: Mapping[str, HintFn], error_kind: str, ctx: Mapping[str, Any] | None) -> str | None:
    if (fn := templates.get(error_kind)) is None:
        return None
    text = fn({**(ctx or {}), "error_kind": (ctx or {}).get("error_kind", error_kind)})  # type: ignore[typeddict-item]
    if text is not None and not isinstance(text, str):
        raise ValueError(f"hint template for {error_kind!r} returned {type(text).__name__}, expected str")
    return (text or "").strip() or None


def dispatch(error_kind: str, ctx: HintContext | None = None) -> str | None:
    """The hint for ``error_kind`` from :data:`HINT_TEMPLATES` (``dispatch("tool_not_found", {"tool_name": "Reed",
    "available_tools": ["Read"]})`` names ``Reed`` and suggests ``Read``); ``None`` for an unregistered kind or an
    empty hint. ``ctx`` is copied (``error_kind`` added when missing), never mutated.

    Raises:
        ValueError: a template returned something other than a string.
    """
    return _run(HINT_TEMPLATES, error_kind, ctx)


def register(error_kind: str, fn: HintFn) -> None:
    """Add or override the template for ``error_kind`` in :data:`HINT_TEMPLATES` (process-wide, the spec's
    API; pass a mapping to :func:`make_hint_generator` for an isolated set).

    Raises:
        ValueError: ``error_kind`` is not a non-empty string, or ``fn`` is not callable.
    """
    _validate(error_kind, fn)
    HINT_TEMPLATES[error_kind] = fn


def make_hint_generator(templates: Mapping[str, HintFn] | None = None) -> Callable[[str, dict], str | None]:
    """A ``(error_kind, error_meta) -> hint | None`` callable for ``CollatorConfig.hint_generator``: ``None``
    looks kinds up in :data:`HINT_TEMPLATES` at call time (later :func:`register` calls apply); a mapping is
    validated, copied and used alone.

    Raises:
        ValueError: a key is not a non-empty string or a value is not callable.
    """
    if templates is None:
        return dispatch
    frozen = dict(templates)
    for kind, fn in frozen.items():
        _validate(kind, fn)
    return lambda error_kind, error_meta=None: _run(frozen, error_kind, error_meta)

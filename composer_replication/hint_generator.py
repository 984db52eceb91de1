"""Hint templates for self-distillation at error sites (channel 2).

At an error site (a tool call that failed: unknown tool, bad JSON, wrong argument types, a runtime
failure, the same failure again and again) the same model acts as its own teacher once it is shown
a short *hint* about what went wrong. This module turns an error kind plus its context into that
hint text. The hint is inserted as one user message before the failing assistant turn (see
``composer_replication.trainer.data_collator.build_hinted_teacher_sequence``).

Error kinds are the ones the ingesters emit: ``tool_not_found``, ``json_decode``, ``type_error``,
``runtime_error``, ``repeated_failure`` and ``other``. Every template *uses* its context (the tool
names on offer, the tool's schema with its required fields and their types, the error message, the
agent's intent) and degrades to a shorter generic sentence when a field is missing.

Decision for ``other``: it gets a generic hint that quotes the error message when there is one
(``hint_other``); kinds that are not registered at all return ``None`` from :func:`dispatch`.

``HINT_TEMPLATES`` is the registry the spec documents and :func:`register` mutates it (the spec's
public API, kept on purpose). Code that wants an isolated registry passes its own mapping to
:func:`make_hint_generator` instead of calling :func:`register`.
"""

from __future__ import annotations

import difflib
import logging
from collections.abc import Callable, Mapping
from typing import Any, TypedDict

from composer_replication.types import ERROR_KINDS

__all__ = [
    "HintContext",
    "HintFn",
    "HINT_TEMPLATES",
    "ERROR_KINDS",
    "dispatch",
    "register",
    "make_hint_generator",
    "hint_tool_not_found",
    "hint_json_decode",
    "hint_type_error",
    "hint_runtime_error",
    "hint_repeated_failure",
    "hint_other",
]

log = logging.getLogger(__name__)


_MAX_MESSAGE_CHARS = 300
_MAX_TOOLS = 25


class HintContext(TypedDict, total=False):
    """Per-error context consumed by the hint templates (all keys optional).

    Attributes:
        error_kind: one of :data:`ERROR_KINDS` (or a registered custom kind).
        error_message: the error text the tool or the parser returned.
        available_tools: names of the tools the session offers.
        tool_name: the tool the failing call named.
        tool_schema: that tool's schema: a JSON schema object, an OpenAI ``{"name", "parameters"}``
            function, ``{"type": "function", "function": {...}}``, or Anthropic ``{"name", "input_schema"}``.
        intent: what the agent was trying to do, in a few words.
    """

    error_kind: str
    error_message: str
    available_tools: list[str]
    tool_name: str
    tool_schema: dict
    intent: str


HintFn = Callable[[HintContext], str]
"""A template: context in, hint text out."""


# ---------------------------------------------------------------------------- context helpers


def _message(ctx: Mapping[str, Any]) -> str:
    """The error message on one line ('' when absent); a long one keeps its head and its tail
    (the last line of a traceback is usually the informative one) within a few hundred characters."""
    msg = " ".join(str(ctx.get("error_message") or "").split())
    if len(msg) > _MAX_MESSAGE_CHARS:
        head = _MAX_MESSAGE_CHARS // 3
        msg = msg[:head] + " ... " + msg[-(_MAX_MESSAGE_CHARS - head - 5) :]
    return msg


def _tools(ctx: Mapping[str, Any]) -> list[str]:
    """The available tool names (deduplicated, order kept)."""
    raw = ctx.get("available_tools") or []
    if isinstance(raw, str):
        raw = [raw]
    return list(dict.fromkeys(str(t) for t in raw if str(t)))


def _tool_list(tools: list[str]) -> str:
    shown = ", ".join(f"`{t}`" for t in tools[:_MAX_TOOLS])
    return shown + (f" (and {len(tools) - _MAX_TOOLS} more)" if len(tools) > _MAX_TOOLS else "")


def _schema_params(schema: Any) -> dict:
    """The JSON-schema object describing a tool's arguments, whatever wrapper it came in."""
    if not isinstance(schema, Mapping):
        return {}
    if isinstance(schema.get("function"), Mapping):
        schema = schema["function"]
    for key in ("parameters", "input_schema", "inputSchema"):
        if isinstance(schema.get(key), Mapping):
            return dict(schema[key])
    return dict(schema) if "properties" in schema or "required" in schema else {}


def _type_name(prop: Any) -> str:
    if not isinstance(prop, Mapping):
        return "any"
    t = prop.get("type")
    if isinstance(t, list):
        return " or ".join(str(x) for x in t)
    if t:
        return str(t)
    if "enum" in prop:
        return "one of " + ", ".join(repr(v) for v in prop["enum"])
    return "any"


def _describe_fields(schema: Any) -> tuple[str, str]:
    """(required fields with types, optional fields with types), each '' when there are none."""
    params = _schema_params(schema)
    props = params.get("properties") or {}
    required = [str(r) for r in params.get("required") or []]
    req = ", ".join(f"{r} ({_type_name(props.get(r))})" for r in required)
    opt = ", ".join(f"{k} ({_type_name(v)})" for k, v in props.items() if k not in required)
    return req, opt


def _tool(ctx: Mapping[str, Any]) -> str:
    """The failing tool's name: ``tool_name``, else the schema's ``name`` ('' when unknown)."""
    name = ctx.get("tool_name")
    schema = ctx.get("tool_schema")
    if not name and isinstance(schema, Mapping):
        fn = schema.get("function")
        name = schema.get("name") or (fn.get("name") if isinstance(fn, Mapping) else None)
    return str(name) if name else ""


def _intent_sentence(ctx: Mapping[str, Any]) -> str:
    """`` Your goal: <intent>.`` (one line, at most 200 characters), or '' without an intent."""
    intent = " ".join(str(ctx.get("intent") or "").split()).rstrip(".")
    if len(intent) > 200:
        intent = intent[:197] + "..."
    return f" Your goal: {intent}." if intent else ""


def _schema_sentence(ctx: Mapping[str, Any], tool: str) -> str:
    req, opt = _describe_fields(ctx.get("tool_schema"))
    who = f"`{tool}`" if tool else "The tool"
    out = ""
    if req:
        out += f" {who} requires: {req}."
    if opt:
        out += f" Optional: {opt}."
    return out


# ---------------------------------------------------------------------------- templates


def hint_tool_not_found(ctx: HintContext) -> str:
    """The call named a tool that does not exist: name it, list the real ones, suggest the closest."""
    tool, tools = _tool(ctx), _tools(ctx)
    text = f"Reminder: there is no tool named `{tool}`." if tool else "Reminder: call only tools that exist."
    if tools:
        close = difflib.get_close_matches(tool, tools, n=1, cutoff=0.5) if tool else []
        if close:
            text += f" Did you mean `{close[0]}`?"
        text += f" The available tools are: {_tool_list(tools)}."
    else:
        text += " Use exactly one of the tool names you were given."
    return text + _intent_sentence(ctx)


def hint_json_decode(ctx: HintContext) -> str:
    """The arguments were not valid JSON: say so, quote the parser, and show the expected fields."""
    tool = _tool(ctx)
    text = "Reminder: tool arguments must be valid JSON"
    text += f": the arguments of `{tool}` must be one JSON object." if tool else ", one JSON object."
    msg = _message(ctx)
    if msg:
        text += f" The parser reported: {msg}."
    text += _schema_sentence(ctx, tool)
    text += " Quote every key and string, escape quotes and newlines inside strings, and balance the braces."
    return text + _intent_sentence(ctx)


def hint_type_error(ctx: HintContext) -> str:
    """The arguments had wrong names or types: show the schema's required fields and their types."""
    tool = _tool(ctx)
    who = f"`{tool}`" if tool else "the tool"
    text = f"Reminder: the arguments passed to {who} have the wrong names or types."
    msg = _message(ctx)
    if msg:
        text += f" The error was: {msg}."
    schema = _schema_sentence(ctx, tool)
    text += schema if schema else " Check each argument's name and type against the tool's definition."
    return text + _intent_sentence(ctx)


def hint_runtime_error(ctx: HintContext) -> str:
    """The call was well-formed but failed when it ran: quote the error and ask to fix the cause."""
    tool = _tool(ctx)
    text = f"Reminder: the call to `{tool}` fails when it runs" if tool else "Reminder: this tool call fails"
    msg = _message(ctx)
    text += f" with: {msg}." if msg else "."
    text += " Fix the cause first (check that paths, names and preconditions hold) instead of repeating it."
    return text + _intent_sentence(ctx)


def hint_repeated_failure(ctx: HintContext) -> str:
    """The same call keeps failing: ask for a different approach, listing other tools on offer."""
    tool = _tool(ctx)
    text = (
        f"Reminder: calling `{tool}` this way has already failed several times"
        if tool
        else "Reminder: this approach has already failed several times"
    )
    msg = _message(ctx)
    text += f" (last error: {msg})." if msg else "."
    text += " Do not repeat it: change the arguments or take a different approach."
    others = [t for t in _tools(ctx) if t != tool]
    if others:
        text += f" Other tools you can use: {_tool_list(others)}."
    return text + _intent_sentence(ctx)


def hint_other(ctx: HintContext) -> str:
    """Any other failure: a generic hint that quotes the error message when there is one."""
    tool, msg = _tool(ctx), _message(ctx)
    if tool:
        text = f"Reminder: the call to `{tool}` fails" + (f" with: {msg}." if msg else ".")
        text += " Check the tool name and each argument before calling it."
    elif msg:  # no failing call to name (e.g. no call was made): the message is the hint
        text = f"Reminder: {msg.rstrip('.')}."
    else:
        text = "Reminder: the next tool call fails. Check the tool name and each argument before calling it."
    return text + _intent_sentence(ctx)


HINT_TEMPLATES: dict[str, HintFn] = {
    "tool_not_found": hint_tool_not_found,
    "json_decode": hint_json_decode,
    "type_error": hint_type_error,
    "runtime_error": hint_runtime_error,
    "repeated_failure": hint_repeated_failure,
    "other": hint_other,
}
"""The default registry (the spec's five kinds plus ``other``). :func:`register` mutates it."""


# ---------------------------------------------------------------------------- registry API


def _validate(error_kind: Any, fn: Any) -> None:
    if not isinstance(error_kind, str) or not error_kind.strip():
        raise ValueError(f"register: error_kind must be a non-empty string, got {error_kind!r}")
    if not callable(fn):
        raise ValueError(
            f"register: fn for {error_kind!r} must be callable (ctx -> str), got {type(fn).__name__}"
        )


def _run(templates: Mapping[str, HintFn], error_kind: str, ctx: Mapping[str, Any] | None) -> str | None:
    fn = templates.get(error_kind)
    if fn is None:
        return None
    full: dict[str, Any] = dict(ctx or {})
    full.setdefault("error_kind", error_kind)
    text = fn(full)  # type: ignore[arg-type]
    if text is not None and not isinstance(text, str):
        raise ValueError(f"hint template for {error_kind!r} returned {type(text).__name__}, expected str")
    return (text.strip() or None) if text else None


def dispatch(error_kind: str, ctx: HintContext | None = None) -> str | None:
    """The hint for ``error_kind`` from :data:`HINT_TEMPLATES`, or ``None`` when the kind is unknown.

    ``ctx`` is copied (never mutated); ``error_kind`` is added to it when missing. An empty hint
    from a template also gives ``None``.

    Example::

        dispatch("tool_not_found", {"tool_name": "Reed", "available_tools": ["Read", "Write"]})
        # 'Reminder: there is no tool named `Reed`. Did you mean `Read`? ...'
    """
    return _run(HINT_TEMPLATES, error_kind, ctx)


def register(error_kind: str, fn: HintFn) -> None:
    """Add or override the template for ``error_kind`` in the module registry :data:`HINT_TEMPLATES`.

    This mutates process-wide state (the spec's API). For an isolated set of templates pass a
    mapping to :func:`make_hint_generator` instead.

    Raises:
        ValueError: ``error_kind`` is not a non-empty string, or ``fn`` is not callable.
    """
    _validate(error_kind, fn)
    if error_kind in HINT_TEMPLATES:
        log.debug("hint_generator: overriding template for %r", error_kind)
    HINT_TEMPLATES[error_kind] = fn


def make_hint_generator(
    templates: Mapping[str, HintFn] | None = None,
) -> Callable[[str, dict], str | None]:
    """A ``(error_kind, error_meta) -> hint | None`` callable for ``CollatorConfig.hint_generator``.

    Args:
        templates: the templates to use. ``None`` looks kinds up in :data:`HINT_TEMPLATES` at call
            time (so later :func:`register` calls apply); a mapping is validated and copied, and only
            it is used.

    Raises:
        ValueError: a key is not a non-empty string or a value is not callable.
    """
    if templates is None:
        return dispatch
    frozen = dict(templates)
    for kind, fn in frozen.items():
        _validate(kind, fn)

    def generate(error_kind: str, error_meta: dict | None = None) -> str | None:
        return _run(frozen, error_kind, error_meta)

    return generate

"""Next-action prediction on trace states: the embedded default environment (DESIGN.md 4.12).

Each :class:`~composer_replication.types.TraceState` becomes a prompt (its history); a sampled action is scored
against the *reference action*: the teachers' consensus (the ``chosen`` of a pair for that ``state_id``, most
agreeing teachers first) unless it is degenerate (``replaysim.normalize.degeneracy``), else the recorded action.
Reward = ``format`` (well-formed, offered tools) + ``json`` (arguments are JSON objects) + ``agreement`` (1 on
canonical equality; else per call in order, 0 for another tool and ``0.5 + 0.5 * equal keys / keys`` for the same,
or the token F1 of two texts), weighted by :class:`RewardWeights`. Error kinds, on the first failing call:
``tool_not_found``, ``json_decode``, ``type_error`` (against the reference call, or ``tool_schemas``); a tool-call
reference answered without a call is ``other``. The table of every case: docs/rollouts.md. Offered tools are the
state's ``tools``, else those called in its history and reference; with neither, any valid name is accepted.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from composer_replication.actions import ActionBlock, canonical_action, parse_action
from composer_replication.chat_format import content_text
from composer_replication.replaysim.normalize import degeneracy
from composer_replication.rollout.environment import Prompt, Score
from composer_replication.types import recorded_action

__all__ = ["RewardWeights", "NextActionEnvironment"]

_NAME = re.compile(r"^[A-Za-z_][\w.\-]*$")
_JSON_TYPES = {"boolean": bool, "string": str, "object": dict, "array": list, "null": type(None)}


@dataclass(kw_only=True)
class RewardWeights:
    """Weights of the next-action reward components (their sum is the maximum reward)."""

    format: float = 0.2
    """Well-formed action; tool calls name an offered tool."""
    json: float = 0.2
    """Tool-call arguments parse as a JSON object."""
    agreement: float = 0.6
    """Agreement with the reference action (canonical equality, else partial credit)."""

    def __post_init__(self) -> None:
        for name in ("format", "json", "agreement"):
            if getattr(self, name) < 0:
                raise ValueError(f"RewardWeights.{name} must be >= 0, got {getattr(self, name)!r}.")
        if self.format + self.json + self.agreement <= 0:
            raise ValueError("RewardWeights: at least one weight must be positive; got all zeros.")


class NextActionEnvironment:
    """Score sampled next actions on trace states (see the module docstring for the reward).

    Args:
        states: the trace states (``TraceState`` dicts).
        pairs: optional preference pairs; a pair's ``chosen`` becomes its state's reference (most agreeing
            teachers first) unless degenerate: then the recorded action stays (``metadata["reference_skipped"]``
            names the rule).
        weights: the reward weights. tool_schemas: optional ``{tool name: JSON schema}`` for argument types.

    Raises:
        ValueError: a state lacks ``state_id`` / ``messages`` / its recorded action, or ids repeat.
    """

    name = "next_action"

    def __init__(self, states: Sequence[dict[str, Any]], pairs: Sequence[dict[str, Any]] | None = None, *,
                 weights: RewardWeights | None = None, tool_schemas: dict[str, dict[str, Any]] | None = None) -> None:
        self.weights = weights or RewardWeights()
        self.tool_schemas = dict(tool_schemas or {})
        by_state: dict[str, list[Any]] = {}
        for p in pairs or []:
            by_state.setdefault(p["state_id"], []).append(p)
        self._prompts: list[Prompt] = []
        for i, s in enumerate(states):
            recorded = recorded_action(s)
            missing = [k for k in ("state_id", "messages") if k not in s] + ["student_action"] * (recorded is None)
            if missing:
                raise ValueError(f"states[{i}] lacks {missing}; pass TraceState dicts from the ingesters.")
            if any(p.prompt_id == s["state_id"] for p in self._prompts):
                raise ValueError(f"states[{i}]: state_id {s['state_id']!r} repeats; state ids must be unique.")
            pair, skipped = _consensus(by_state.get(s["state_id"], []), recorded)
            reference = pair["chosen"] if pair else recorded
            meta = {"reference_source": "consensus" if pair else "recorded",
                    "n_teachers_agreeing": pair.get("n_teachers_agreeing", 0) if pair else 0,
                    "source": s.get("source", ""), **({"reference_skipped": skipped} if skipped else {})}
            self._prompts.append(Prompt(prompt_id=s["state_id"], messages=list(s["messages"]),
                                        tools=_offered_tools(s, reference), reference=reference, metadata=meta))

    def prompts(self) -> list[Prompt]:
        """One prompt per state, in the order given."""
        return list(self._prompts)

    def score(self, prompt: Prompt, action_text: str) -> Score:
        """Score one sampled action for ``prompt`` (see the module docstring)."""
        calls = [b for b in parse_action(action_text) if b.kind == "tool_use"]
        reference = prompt.reference or ""
        ref_calls = [b for b in parse_action(reference) if b.kind == "tool_use"]
        names_ok = all(self._offered(prompt, c.name) for c in calls)
        args_ok = all(c.arguments_valid for c in calls)
        canon, ref_canon = canonical_action(action_text), canonical_action(reference)
        if ref_calls:
            fmt, js = bool(calls) and names_ok, bool(calls) and args_ok
        else:
            fmt, js = bool(canon) and names_ok, args_ok
        if canon == ref_canon and canon:
            agreement = 1.0
        else:
            agreement = tool_call_agreement(calls, ref_calls) if ref_calls else text_f1(canon, ref_canon)
        w = self.weights
        details = {"format": float(fmt), "json": float(js), "agreement": agreement,
                   "reference_source": prompt.metadata.get("reference_source", "recorded")}
        kind, message, call = self._error(prompt, calls, ref_calls)
        meta = None
        if kind is not None:
            meta = {"error_kind": kind, "error_message": message, "available_tools": list(prompt.tools),
                    "intent": _intent(prompt.messages)}
            if call is not None:
                meta["tool_name"] = call.name
                if call.name in self.tool_schemas:
                    meta["tool_schema"] = self.tool_schemas[call.name]
        return Score(w.format * fmt + w.json * js + w.agreement * agreement, error_kind=kind, error_meta=meta,
                     details=details)

    def _offered(self, prompt: Prompt, name: str) -> bool:
        return name in prompt.tools if prompt.tools else bool(_NAME.match(name))

    def _error(self, prompt: Prompt, calls: list[ActionBlock], ref_calls: list[ActionBlock]
               ) -> tuple[str | None, str, ActionBlock | None]:
        """``(error kind, message, failing call)`` of the first failure, ``(None, "", None)`` when none."""
        if ref_calls and not calls:
            avail = ", ".join(f"`{t}`" for t in prompt.tools) or "one of the session's tools"
            return "other", (f"this step needs a tool call and the answer makes none; call {avail} "
                             "as [TOOL_USE] name=<tool> input={<JSON arguments>}"), None
        ref_by_name = {c.name: c for c in ref_calls if c.arguments_valid}
        for c in calls:
            if not self._offered(prompt, c.name):
                avail = ", ".join(prompt.tools) or "(unknown)"
                return "tool_not_found", f"Tool '{c.name}' is not available. Available tools: {avail}.", c
            if not c.arguments_valid:
                return "json_decode", _json_problem(c), c
            problem = _type_problem(c.arguments, self.tool_schemas.get(c.name), ref_by_name.get(c.name))
            if problem:
                return "type_error", f"Tool '{c.name}': {problem}", c
        return None, "", None


# ---------------------------------------------------------------------------- scoring helpers


def _consensus(pairs: list[Any], recorded: str) -> tuple[Any | None, str]:
    """The state's reference pair (most agreeing teachers, first on ties) among pairs whose ``chosen`` is
    not degenerate, and the rule that ruled out the best degenerate one (``""`` if none was)."""
    best, skipped = None, ""
    for p in pairs:
        if best is not None and p.get("n_teachers_agreeing", 0) <= best.get("n_teachers_agreeing", 0):
            continue
        bad = degeneracy(p["chosen"], recorded_action=recorded)
        if bad is not None:
            skipped = skipped or bad.rule
            continue
        best = p
    return best, skipped if best is None else ""


def tool_call_agreement(calls: Sequence[ActionBlock], ref_calls: Sequence[ActionBlock]) -> float:
    """Partial agreement of tool calls aligned in order, in [0, 1] (see the module docstring)."""
    n = max(len(calls), len(ref_calls))
    if n == 0:
        return 1.0
    total = 0.0
    for c, r in zip(calls, ref_calls):
        if c.name != r.name:
            continue
        a = c.arguments if isinstance(c.arguments, dict) else {}
        b = r.arguments if isinstance(r.arguments, dict) else {}
        keys = set(a) | set(b)
        same = sum(1 for k in keys if k in a and k in b and a[k] == b[k])
        total += 0.5 + 0.5 * (same / len(keys) if keys else 1.0)
    return total / n


def text_f1(text: str, reference: str) -> float:
    """Token-overlap F1 of two whitespace-tokenized texts (1.0 for two empty texts)."""
    a, b = text.split(), reference.split()
    common = sum((Counter(a) & Counter(b)).values())
    return 1.0 if not a and not b else 2 * common / (len(a) + len(b))


def _json_type(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return "number"
    return next((name for name, t in _JSON_TYPES.items() if isinstance(value, t)), type(value).__name__)


def _type_problem(args: dict[str, Any], schema: dict[str, Any] | None, ref: ActionBlock | None) -> str | None:
    """Describe the first argument whose type disagrees with the schema (else the reference call)."""
    if schema:
        props = schema.get("properties", {})
        missing = [key for key in schema.get("required", []) if key not in args]
        if missing:
            return f"missing required argument '{missing[0]}'"
        for key, value in args.items():
            want = props.get(key, {}).get("type")
            wants = [want] if isinstance(want, str) else list(want or [])
            wants = ["number" if w == "integer" else w for w in wants]
            if wants and _json_type(value) not in wants:
                return f"argument '{key}' must be {'/'.join(wants)}, got {_json_type(value)} ({value!r})"
        return None
    for key, value in args.items() if ref is not None else ():
        if key in ref.arguments and _json_type(value) != _json_type(ref.arguments[key]):
            return f"argument '{key}' should be {_json_type(ref.arguments[key])}, got {_json_type(value)} ({value!r})"
    return None


def _json_problem(call: ActionBlock) -> str:
    if call.arguments is not None:
        return f"Tool '{call.name}': arguments must be a JSON object, got a JSON {_json_type(call.arguments)}."
    try:
        json.loads(call.text)
    except json.JSONDecodeError as e:
        return f"Tool '{call.name}': invalid JSON arguments ({e.msg} at position {e.pos}): {call.text[:200]}"
    return f"Tool '{call.name}': missing arguments (expected input={{...}})."


def _offered_tools(state: dict[str, Any], reference: str) -> list[str]:
    if state.get("tools"):
        return list(state["tools"])
    names = [str(c.get("function", c).get("name", "")) for m in state["messages"] for c in m.get("tool_calls") or []]
    names += [b.name for b in parse_action(reference) if b.kind == "tool_use"]
    return list(dict.fromkeys(n for n in names if n))


def _intent(messages: list[dict[str, Any]]) -> str:
    return next((content_text(m.get("content"))[:300] for m in reversed(messages) if m.get("role") == "user"), "")

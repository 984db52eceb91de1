"""Next-action prediction on trace states: the embedded default environment (DESIGN.md 4.12).

Each ingested :class:`~composer_replication.types.TraceState` becomes a prompt (its history); a
sampled action is scored against the *reference action*: the teachers' consensus (the ``chosen``
of a :class:`~composer_replication.types.DPOPair` for that ``state_id``) where one exists and is
not degenerate (:func:`composer_replication.replaysim.degenerate.degeneracy`, the normalizer's own
check: empty, a cut-off tool call, repetition, or text where the recorded action calls a tool),
otherwise the student's recorded action. The reward is a weighted sum of three components in
[0, 1] (weights :class:`RewardWeights`, default 0.2 / 0.2 / 0.6, so a perfect action scores 1.0):

- ``format``: when the reference calls a tool, the sample makes at least one well-formed
  ``[TOOL_USE]`` call and every called tool is one the session offers; when the reference is
  plain text, the sample is non-empty and any tool it calls is offered.
- ``json``: every tool call's arguments parse as a JSON object (vacuously true for a text
  sample answering a text reference; false when a tool call was expected and none was made).
- ``agreement``: 1.0 when ``canonical_action`` of sample and reference are equal. Otherwise, for a
  tool-call reference, calls are aligned in order and each pair scores 0 for different tool names
  and ``0.5 + 0.5 * (argument keys with equal values / keys in either)`` for the same name (missing
  calls score 0, the mean is taken over the longer list); for a text reference, the token-overlap
  F1 of the two canonical texts.

Failures that a hint can address become error kinds, checked in this order on the first failing
call: a tool the session does not offer -> ``tool_not_found``; arguments that are not a JSON object
-> ``json_decode``; an argument whose JSON type differs from the reference call's (or from the tool
schema, when ``tool_schemas`` is given; a missing required argument counts too) -> ``type_error``.
When the reference calls a tool and the sample makes no tool call at all (plain text, or a call cut
off before its ``[TOOL_USE]`` marker), the kind is ``other``, its message naming the offered tools and
the call form: the most common failure of a small model, and the one a hint fixes most directly.

Offered tools are the state's ``tools``; when a state has none, the tools called in its history and
in the reference stand in. When even those are empty, any syntactically valid name is accepted.
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
from composer_replication.replaysim.degenerate import degeneracy
from composer_replication.rollout.environment import Prompt, Score

__all__ = ["RewardWeights", "NextActionEnvironment", "tool_call_agreement", "text_f1"]

_NAME = re.compile(r"^[A-Za-z_][\w.\-]*$")
_JSON_TYPES = {"string": str, "boolean": bool, "object": dict, "array": list, "null": type(None)}


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
        pairs: optional DPO pairs; a pair's ``chosen`` becomes the reference for its state (the one
            with the most agreeing teachers when a state has several), unless it is degenerate: then the
            recorded action stays the reference (``metadata["reference_skipped"]`` names the rule).
        weights: the reward weights.
        tool_schemas: optional ``{tool name: JSON schema}`` used for argument type checks.

    Raises:
        ValueError: a state lacks ``state_id`` / ``messages`` / ``student_action``, or ids repeat.
    """

    name = "next_action"

    def __init__(
        self,
        states: Sequence[dict[str, Any]],
        pairs: Sequence[dict[str, Any]] | None = None,
        *,
        weights: RewardWeights | None = None,
        tool_schemas: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.weights = weights or RewardWeights()
        self.tool_schemas = dict(tool_schemas or {})
        by_state: dict[str, list[Any]] = {}
        for p in pairs or []:
            by_state.setdefault(p["state_id"], []).append(p)
        self._prompts: list[Prompt] = []
        seen: set[str] = set()
        for i, s in enumerate(states):
            missing = [k for k in ("state_id", "messages", "student_action") if k not in s]
            if missing:
                raise ValueError(f"states[{i}] lacks {missing}; pass TraceState dicts from the ingesters.")
            if s["state_id"] in seen:
                raise ValueError(f"states[{i}]: state_id {s['state_id']!r} repeats; state ids must be unique.")
            seen.add(s["state_id"])
            pair, skipped = _consensus(by_state.get(s["state_id"], []), s["student_action"])
            reference = pair["chosen"] if pair else s["student_action"]
            meta = {"reference_source": "consensus" if pair else "recorded",
                    "n_teachers_agreeing": pair.get("n_teachers_agreeing", 0) if pair else 0,
                    "source": s.get("source", "")}
            if skipped:
                meta["reference_skipped"] = skipped
            self._prompts.append(Prompt(
                prompt_id=s["state_id"], messages=list(s["messages"]),
                tools=_offered_tools(s, reference), reference=reference, metadata=meta,
            ))

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
        elif ref_calls:
            agreement = tool_call_agreement(calls, ref_calls)
        else:
            agreement = text_f1(canon, ref_canon)
        w = self.weights
        reward = w.format * fmt + w.json * js + w.agreement * agreement
        details = {"format": float(fmt), "json": float(js), "agreement": agreement,
                   "reference_source": prompt.metadata.get("reference_source", "recorded")}
        kind, meta = self._error(prompt, calls, ref_calls)
        return Score(reward, error_kind=kind, error_meta=meta, details=details)

    # ------------------------------------------------------------------------ errors

    def _offered(self, prompt: Prompt, name: str) -> bool:
        return name in prompt.tools if prompt.tools else bool(_NAME.match(name))

    def _error(self, prompt: Prompt, calls: list[ActionBlock], ref_calls: list[ActionBlock]
               ) -> tuple[str | None, dict[str, Any] | None]:
        if ref_calls and not calls:
            avail = ", ".join(f"`{t}`" for t in prompt.tools) or "one of the session's tools"
            message = (f"this step needs a tool call and the answer makes none; call {avail} "
                       "as [TOOL_USE] name=<tool> input={<JSON arguments>}")
            return "other", self._meta(prompt, None, "other", message)
        ref_by_name = {c.name: c for c in ref_calls if c.arguments_valid}
        for c in calls:
            if not self._offered(prompt, c.name):
                avail = ", ".join(prompt.tools) or "(unknown)"
                return "tool_not_found", self._meta(prompt, c, "tool_not_found",
                                                    f"Tool '{c.name}' is not available. Available tools: {avail}.")
            if not c.arguments_valid:
                return "json_decode", self._meta(prompt, c, "json_decode", _json_problem(c))
            problem = _type_problem(c.arguments, self.tool_schemas.get(c.name), ref_by_name.get(c.name))
            if problem:
                return "type_error", self._meta(prompt, c, "type_error", f"Tool '{c.name}': {problem}")
        return None, None

    def _meta(self, prompt: Prompt, call: ActionBlock | None, kind: str, message: str) -> dict[str, Any]:
        """The hint context of an error; ``call`` is the failing call (``None``: no call was made)."""
        meta: dict[str, Any] = {"error_kind": kind, "error_message": message,
                                "available_tools": list(prompt.tools), "intent": _intent(prompt.messages)}
        if call is not None:
            meta["tool_name"] = call.name
            if call.name in self.tool_schemas:
                meta["tool_schema"] = self.tool_schemas[call.name]
        return meta


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
    if not a and not b:
        return 1.0
    common = sum((Counter(a) & Counter(b)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(a), common / len(b)
    return 2 * precision * recall / (precision + recall)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    for name, t in _JSON_TYPES.items():
        if isinstance(value, t):
            return name
    return type(value).__name__


def _type_problem(args: dict[str, Any], schema: dict[str, Any] | None, ref: ActionBlock | None) -> str | None:
    """Describe the first argument whose type disagrees with the schema (else the reference call)."""
    if schema:
        props = schema.get("properties", {})
        for key in schema.get("required", []):
            if key not in args:
                return f"missing required argument '{key}'"
        for key, value in args.items():
            want = props.get(key, {}).get("type")
            wants = [want] if isinstance(want, str) else list(want or [])
            wants = ["number" if w == "integer" else w for w in wants]
            if wants and _json_type(value) not in wants:
                return f"argument '{key}' must be {'/'.join(wants)}, got {_json_type(value)} ({value!r})"
        return None
    if ref is not None:
        for key, value in args.items():
            if key in ref.arguments and _json_type(value) != _json_type(ref.arguments[key]):
                return (f"argument '{key}' should be {_json_type(ref.arguments[key])}, "
                        f"got {_json_type(value)} ({value!r})")
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
    names: list[str] = []
    for m in state["messages"]:
        for call in m.get("tool_calls") or []:
            names.append(str(call.get("function", call).get("name", "")))
    names += [b.name for b in parse_action(reference) if b.kind == "tool_use"]
    return list(dict.fromkeys(n for n in names if n))


def _intent(messages: list[dict[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            return content_text(m.get("content"))[:300]
    return ""

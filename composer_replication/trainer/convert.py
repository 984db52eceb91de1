"""TraceState -> TraceExample: the ingestion records as collator input.

A :class:`~composer_replication.types.TraceState` is one step of a recorded trace: the history (``messages``)
and the action the session recorded next (``types.recorded_action``). As a ``TraceExample``: every history
message becomes a turn (assistant ``tool_calls`` become action text, tool results stay ``role="tool"``); the
recorded action becomes the final assistant turn, marked as the error site when the state carries ``error_kind``
/ ``error_meta`` (``available_tools`` filled from the state's ``tools``), so channel 2 fires on it; DPO pairs with
the state's ``state_id`` attach as ``dpo_pairs``. Consecutive states of a trace repeat the history: collate them
with ``CollatorConfig(response_turns="last")`` so each recorded action is trained on once.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from composer_replication.chat_format import to_chat_messages
from composer_replication.trainer.collator_config import TraceExample, TraceTurn
from composer_replication.types import DPOPair, TraceState, recorded_action

__all__ = ["trace_states_to_examples"]


def _error_turn_fields(state: Mapping[str, Any]) -> dict[str, Any]:
    """``tool_error`` / ``error_meta`` for the final turn, or ``{}`` when the state has no error."""
    if not state.get("error_kind") and not state.get("error_meta"):
        return {}
    meta = dict(state.get("error_meta") or {})
    kind = state.get("error_kind") or meta.get("error_kind") or "other"
    meta.setdefault("error_kind", kind)
    if state.get("tools") and not meta.get("available_tools"):
        meta["available_tools"] = list(state["tools"])
    return {"tool_error": kind, "error_meta": meta}


def _check_pairs(pairs: Iterable[Any]) -> list[Mapping[str, Any]]:
    for k, p in enumerate(pairs := list(pairs)):
        if not isinstance(p, Mapping) or not isinstance(p.get("state_id"), str):
            raise ValueError(f"pairs[{k}] must be a DPOPair dict with a string 'state_id', got {p!r:.80}")
    return pairs


def trace_state_to_example(state: TraceState, *, pairs: Sequence[DPOPair] | None = None,
                           reward: float | None = None) -> TraceExample:
    """One :class:`TraceState` as a :class:`TraceExample` (module docstring); ``pairs`` with its ``state_id``
    attach, ``reward`` becomes ``final_reward`` (omitted when ``None``). ``ValueError`` for a missing field, no
    messages, an unknown role, a pair without ``state_id``, a non-finite reward."""
    if not isinstance(state, Mapping):
        raise ValueError(f"state must be a TraceState dict, got {type(state).__name__}")
    sid, action = state.get("state_id"), recorded_action(state)
    for key, value, typ in (("state_id", sid, str), ("messages", state.get("messages"), list), ("student_action", action, str)):
        if not isinstance(value, typ):
            raise ValueError(f"state {sid!r}: {key!r} must be a {typ.__name__}, got {value!r:.60}")
    if not state["messages"]:
        raise ValueError(f"state {sid!r} has no messages: the recorded action needs a history (at least the user's "
                         "request) before it")
    try:
        history = to_chat_messages(state["messages"])
    except ValueError as e:
        raise ValueError(f"state {sid!r}: {e}") from e
    final: TraceTurn = {"role": "assistant", "content": action, **_error_turn_fields(state)}  # type: ignore[typeddict-item]
    example: TraceExample = {"trace_id": sid, "turns": [*({"role": m["role"], "content": m["content"]} for m in history), final]}
    if reward is not None:
        if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
            raise ValueError(f"state {sid!r}: reward must be a finite number or None, got {reward!r}")
        example["final_reward"] = float(reward)
    if matching := [dict(p) for p in _check_pairs(pairs or []) if p["state_id"] == sid]:
        example["dpo_pairs"] = matching
    return example


def trace_states_to_examples(states: Iterable[TraceState], *, pairs: Sequence[DPOPair] | None = None,
                             rewards: Mapping[str, float] | None = None) -> list[TraceExample]:
    """Many states at once; ``pairs`` are matched by ``state_id`` in one pass, ``rewards`` maps ``state_id`` to a
    reward (states absent from it get no ``final_reward``)."""
    by_state: dict[str, list[Mapping[str, Any]]] = {}
    for p in _check_pairs(pairs or []):
        by_state.setdefault(p["state_id"], []).append(p)
    out = []
    for state in states:
        sid = state.get("state_id") if isinstance(state, Mapping) else None
        out.append(trace_state_to_example(state, pairs=by_state.get(sid, []),  # type: ignore[arg-type]
                                          reward=(rewards or {}).get(sid) if sid is not None else None))
    return out

"""Teacher specs: the default teachers, validation, which teachers need a key, and error kinds.

Result errors (``TeacherCallResult.error``) read like ``"skipped: budget"``,
``"skipped: teacher stopped after HTTP 402 (insufficient credits)"``,
``"HTTP 429 (rate limited): ...; gave up after 6 attempts"``, ``"timeout: ..."`` or
``"malformed response: ..."``; :func:`error_kind` maps them to short kinds for summaries.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

from composer_replication.teacher_replay.local import LOCAL_PREFIX
from composer_replication.types import TeacherCallResult, TeacherSpec, TraceState

__all__ = [
    "DEFAULT_TEACHERS",
    "OPENROUTER_BASE_URL",
    "BUDGET_SKIP",
    "STOPPED_PREFIX",
    "error_kind",
    "teacher_needs_key",
    "validate_teachers",
    "validate_states",
    "make_result",
]

OPENROUTER_BASE_URL = "https://openrouter.ai/api/v1"
BUDGET_SKIP = "skipped: budget"
STOPPED_PREFIX = "skipped: teacher stopped after "
_LOOPBACK_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})

DEFAULT_TEACHERS: list[TeacherSpec] = [
    {"slug": "anthropic/claude-opus-4.7", "input_per_mtok": 5.0, "output_per_mtok": 25.0},
    {"slug": "openai/gpt-5", "input_per_mtok": 1.25, "output_per_mtok": 10.0},
    {"slug": "deepseek/deepseek-v4-pro", "input_per_mtok": 0.58, "output_per_mtok": 1.16},
]
"""The paper-baseline teachers with OpenRouter list prices (USD per million tokens) used for the
worst-case reservation; the settled cost is OpenRouter's reported ``usage.cost``."""


def teacher_needs_key(teacher: TeacherSpec) -> bool:
    """False for ``local:`` teachers, the ``recorded`` teacher and loopback ``base_url`` endpoints; True otherwise."""
    if teacher["slug"].startswith(LOCAL_PREFIX) or teacher["slug"] == "recorded":  # in-process teachers
        return False
    host = urlparse(teacher.get("base_url", OPENROUTER_BASE_URL)).hostname or ""
    return host not in _LOOPBACK_HOSTS


def error_kind(error: str | None) -> str:
    """Short kind of a result's error text: ``ok``, ``budget``, ``teacher stopped``, ``http 429`` ..."""
    if error is None:
        return "ok"
    if error == BUDGET_SKIP:
        return "budget"
    if error.startswith(STOPPED_PREFIX):
        return "teacher stopped"
    for prefix, kind in (("HTTP ", "http"), ("provider error ", "provider")):
        if error.startswith(prefix):
            code = error[len(prefix) :].split(" ", 1)[0]
            return f"{kind} {code}" if code.isdigit() else kind
    return error.split(":", 1)[0].split(" (", 1)[0][:40]


def check_number(name: str, value: Any, *, minimum: float = 1, integer: bool = True) -> None:
    """Raise ``ValueError`` naming ``name`` unless ``value`` is a finite number (integer) >= ``minimum``.

    NaN and infinities are refused (``nan < minimum`` is False, so a plain comparison lets NaN through).
    """
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value < minimum:
        raise ValueError(
            f"{name} must be {'an integer' if integer else 'a finite number'} >= {minimum}; got {value!r}."
        )


def validate_teachers(teachers: Sequence[TeacherSpec]) -> list[TeacherSpec]:
    """Check slugs (unique), prices, base_url, max_tokens, temperature, max_concurrency; copy each."""
    if isinstance(teachers, (str, dict)) or not teachers:
        raise ValueError(f"teachers must be a non-empty list of TeacherSpec dicts; got {teachers!r}.")
    out, seen = [], set()
    for t in teachers:
        if not isinstance(t, dict) or not isinstance(t.get("slug"), str) or not t["slug"].strip():
            raise ValueError(f"each teacher needs a non-empty 'slug'; got {t!r}.")
        slug = t["slug"]
        if slug in seen:
            raise ValueError(f"teacher {slug!r} is listed twice; each slug may appear once.")
        seen.add(slug)
        for key in ("input_per_mtok", "output_per_mtok"):
            check_number(f"teacher {slug!r} {key}", t.get(key), minimum=0, integer=False)
        if "base_url" in t and not str(t["base_url"]).startswith(("http://", "https://")):
            raise ValueError(
                f"teacher {slug!r} base_url must start with http:// or https://; got {t['base_url']!r}."
            )
        if "max_tokens" in t:
            check_number(f"teacher {slug!r} max_tokens", t["max_tokens"])
        if "max_concurrency" in t:
            check_number(f"teacher {slug!r} max_concurrency", t["max_concurrency"])
        if "temperature" in t:
            check_number(f"teacher {slug!r} temperature", t["temperature"], minimum=0, integer=False)
        out.append(dict(t))  # type: ignore[arg-type]
    return out


def validate_states(states: Sequence[TraceState]) -> list[TraceState]:
    """Check that states are dicts with unique string ``state_id``s and a list of ``messages``."""
    if isinstance(states, (str, dict)):
        raise ValueError(f"states must be a sequence of TraceState dicts; got {type(states).__name__}.")
    seen: set[str] = set()
    for i, s in enumerate(states):
        if not isinstance(s, dict) or not isinstance(s.get("state_id"), str):
            raise ValueError(
                f"states[{i}] must be a TraceState dict with a string 'state_id'; got {s!r:.200}."
            )
        messages = s.get("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(
                f"state {s['state_id']!r}: 'messages' must be a list of chat-message dicts; "
                f"got {type(messages).__name__}."
            )
        if s["state_id"] in seen:
            raise ValueError(f"state_id {s['state_id']!r} appears twice; state ids must be unique.")
        seen.add(s["state_id"])
    return list(states)


def make_result(state_id: str, slug: str, *, error: str | None = None, **kw: Any) -> TeacherCallResult:
    """A :class:`TeacherCallResult`; ``kw``: text, latency_s, prompt_tokens, completion_tokens, cost_usd."""
    return {
        "state_id": state_id,
        "teacher_slug": slug,
        "response_text": kw.get("text"),
        "latency_s": float(kw.get("latency_s", 0.0)),
        "prompt_tokens": int(kw.get("prompt_tokens", 0)),
        "completion_tokens": int(kw.get("completion_tokens", 0)),
        "cost_usd": float(kw.get("cost_usd", 0.0)),
        "error": error,
    }

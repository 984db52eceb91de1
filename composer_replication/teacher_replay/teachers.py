"""The teachers: specs and their checks, what a teacher is sent, and the in-process teachers.

``recorded`` answers with the action the session recorded (a frontier agent's): free, never sent, reserved or
written to the ledger. ``local:<model>`` generates in-process. A remote teacher is sent the history as plain
alternating text (tool results as ``[TOOL_RESULT]`` user turns) after an instruction asking for the next action.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import math
import threading
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlparse

from composer_replication.actions import tool_calls_to_action
from composer_replication.chat_format import content_text
from composer_replication.types import TeacherCallResult, TeacherSpec, TraceState, recorded_action

__all__ = ["DEFAULT_TEACHERS", "RECORDED_TEACHER", "LocalTeacher", "error_kind"]

log = logging.getLogger(__name__)

OPENROUTER_BASE_URL, LOCAL_PREFIX, RECORDED_SLUG = "https://openrouter.ai/api/v1", "local:", "recorded"
BUDGET_SKIP, STOPPED_PREFIX = "skipped: budget", "skipped: teacher stopped after "  # result errors
_LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1"})

DEFAULT_TEACHERS: list[TeacherSpec] = [
    {"slug": "anthropic/claude-opus-4.7", "input_per_mtok": 5.0, "output_per_mtok": 25.0},
    {"slug": "openai/gpt-5", "input_per_mtok": 1.25, "output_per_mtok": 10.0},
    {"slug": "deepseek/deepseek-v4-pro", "input_per_mtok": 0.58, "output_per_mtok": 1.16},
]
"""The paper-baseline teachers at OpenRouter list prices (USD per million tokens: they size the reservations)."""
RECORDED_TEACHER: TeacherSpec = {"slug": RECORDED_SLUG, "input_per_mtok": 0.0, "output_per_mtok": 0.0}
FAILED_CALL_KINDS = frozenset({"tool_not_found", "json_decode", "type_error", "repeated_failure"})
"""``error_kind`` values where the recorded action was itself a failed call: the recorded teacher abstains."""

REPLAY_INSTRUCTION = (
    "You are replaying a recorded coding-agent session. The conversation below is the agent's history: "
    "its earlier actions are written as action text, tool results appear as user messages starting "
    "with [TOOL_RESULT]. Reply with the agent's NEXT action only, nothing else. To call a tool, write "
    "one line per call exactly as\n"
    '[TOOL_USE] name=TOOL_NAME input={"argument": "value"}\n'
    "with the arguments as one JSON object on that line. Otherwise reply with plain text."
)


def in_process(slug: str) -> bool:
    """True for the teachers that run in this process (``recorded`` and ``local:...``)."""
    return slug == RECORDED_SLUG or slug.startswith(LOCAL_PREFIX)


def teacher_needs_key(teacher: TeacherSpec) -> bool:
    """False for in-process teachers and loopback ``base_url`` endpoints; True otherwise."""
    host = urlparse(teacher.get("base_url", OPENROUTER_BASE_URL)).hostname or ""
    return not in_process(teacher["slug"]) and host not in _LOOPBACK


def error_kind(error: str | None) -> str:
    """Short kind of a result's error: ``ok``, ``budget``, ``teacher stopped``, ``http 429``, ``timeout``..."""
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
    """``ValueError`` naming ``name`` unless ``value`` is a finite number (an integer) >= ``minimum``."""
    kind = int if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kind) or not math.isfinite(value) or value < minimum:
        raise ValueError(f"{name} must be {'an integer' if integer else 'a finite number'} >= {minimum}; "
                         f"got {value!r:.200}.")


def validate_teachers(teachers: Sequence[TeacherSpec]) -> list[TeacherSpec]:
    """Copies of ``teachers`` after checking slugs (unique), prices, base_url and the optional numbers."""
    if isinstance(teachers, (str, dict)) or not teachers:
        raise ValueError(f"teachers must be a non-empty list of TeacherSpec dicts; got {teachers!r:.200}.")
    out, seen = [], set()
    for t in teachers:
        if not isinstance(t, dict) or not isinstance(t.get("slug"), str) or not t["slug"].strip():
            raise ValueError(f"each teacher needs a non-empty 'slug'; got {t!r:.200}.")
        slug = t["slug"]
        if slug in seen:
            raise ValueError(f"teacher {slug!r} is listed twice; each slug may appear once.")
        seen.add(slug)
        for key in ("input_per_mtok", "output_per_mtok", *(("temperature",) if "temperature" in t else ())):
            check_number(f"teacher {slug!r} {key}", t.get(key), minimum=0, integer=False)
        for key in ("max_tokens", "max_concurrency"):
            if key in t:
                check_number(f"teacher {slug!r} {key}", t[key])
        if "base_url" in t and not str(t["base_url"]).startswith(("http://", "https://")):
            raise ValueError(f"teacher {slug!r} base_url must start with http:// or https://; "
                             f"got {t['base_url']!r:.200}.")
        out.append(dict(t))
    return out  # type: ignore[return-value]


def _check_messages(state: Any) -> list[dict[str, Any]]:
    messages = state.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise ValueError(f"state {state.get('state_id')!r}: 'messages' must be a list of chat-message dicts; "
                         f"got {type(messages).__name__}.")
    return messages


def validate_states(states: Sequence[TraceState]) -> list[TraceState]:
    """``states`` as a list, after checking for dicts with unique string ``state_id``s and message lists."""
    if isinstance(states, (str, dict)):
        raise ValueError(f"states must be a sequence of TraceState dicts; got {type(states).__name__}.")
    seen: set[str] = set()
    for i, s in enumerate(states):
        if not isinstance(s, dict) or not isinstance(s.get("state_id"), str):
            raise ValueError(f"states[{i}] must be a TraceState dict with a string 'state_id'; got {s!r:.200}.")
        _check_messages(s)
        if s["state_id"] in seen:
            raise ValueError(f"state_id {s['state_id']!r} appears twice; state ids must be unique.")
        seen.add(s["state_id"])
    return list(states)


def make_result(state_id: str, slug: str, *, error: str | None = None, text: str | None = None,
                latency_s: float = 0.0, prompt_tokens: int = 0, completion_tokens: int = 0,
                cost_usd: float = 0.0) -> TeacherCallResult:
    """A :class:`TeacherCallResult`."""
    return {"state_id": state_id, "teacher_slug": slug, "response_text": text, "latency_s": float(latency_s),
            "prompt_tokens": int(prompt_tokens), "completion_tokens": int(completion_tokens),
            "cost_usd": float(cost_usd), "error": error}


def recorded_result(state: TraceState) -> TeacherCallResult:
    """The recorded teacher's answer at ``state``: its recorded action, cost 0. It abstains (an error, no
    part in the vote) without a recorded action, or where the recorded call failed (:data:`FAILED_CALL_KINDS`)."""
    action = recorded_action(state)
    error = None if action and action.strip() else "no recorded action"
    if error is None and state.get("error_kind") in FAILED_CALL_KINDS:
        error = f"recorded action failed: {state['error_kind']}"
    return make_result(state["state_id"], RECORDED_SLUG, error=error, text=None if error else action)


# ------------------------------------------------------------------------------------------ the request


def _render(message: dict[str, Any]) -> tuple[str, str]:
    role, text = message.get("role", "user"), content_text(message.get("content"))
    if role == "assistant":
        return "assistant", tool_calls_to_action(text, message.get("tool_calls"))
    if role == "tool":
        call_id = message.get("tool_call_id") or message.get("name") or ""
        return "user", (f"[TOOL_RESULT] id={call_id}" if call_id else "[TOOL_RESULT]") + f"\n{text}".rstrip()
    return ("system" if role in ("system", "developer") else "user"), text


def build_teacher_messages(state: TraceState, *, instruction: str = REPLAY_INSTRUCTION) -> list[dict[str, str]]:
    """The plain-text chat messages a teacher is sent for ``state`` (module docstring); ``state["tools"]``,
    when present, is listed in the instruction. ``ValueError`` when ``messages`` is not a list of dicts."""
    messages, system = _check_messages(state), instruction
    if state.get("tools"):
        system += "\nTools available in this session: " + ", ".join(map(str, state["tools"])) + "."
    out = [{"role": "system", "content": system}]
    for message in messages:
        role, text = _render(message)
        if not text.strip():
            continue
        if role == "system" and len(out) > 1:
            role = "user"  # a late system message is kept as context, not as a second system turn
        if out[-1]["role"] == role:
            out[-1]["content"] += "\n\n" + text
        else:
            out.append({"role": role, "content": text})
    if out[-1]["role"] != "user":
        out.append({"role": "user", "content": "What is your next action?"})
    return out


def reply_to_action(message: dict[str, Any]) -> str:
    """Action text of a chat-completions ``message`` (``content`` plus ``tool_calls``)."""
    text = content_text(message.get("content")).strip()
    return tool_calls_to_action(text, message["tool_calls"]) if message.get("tool_calls") else text


# ------------------------------------------------------------------------------------------ local teachers


def local_model_name(slug: str) -> str:
    """``"local:tiny"`` -> ``"tiny"``; ``"local:"`` -> ``"smollm2-135m"``."""
    if not slug.startswith(LOCAL_PREFIX):
        raise ValueError(f"{slug!r} is not a local teacher slug; local slugs look like 'local:tiny'.")
    return slug[len(LOCAL_PREFIX) :].strip() or "smollm2-135m"


LocalGeneration = collections.namedtuple("LocalGeneration", "text prompt_tokens completion_tokens")  # one reply


class LocalTeacher:
    """An in-process causal LM teacher, loaded once on first use (or ``preloaded=(model, tokenizer)``, on
    ``device``, used read-only). ``model_seed`` initialises the ``tiny`` preset."""

    def __init__(self, model: str = "smollm2-135m", *, device: str = "cpu", model_seed: int = 0,
                 preloaded: tuple[Any, Any] | None = None) -> None:
        self.model_name, self.device, self.model_seed = model, device, model_seed
        self._lock = threading.Lock()
        self._model, self._tokenizer = preloaded if preloaded is not None else (None, None)

    def __repr__(self) -> str:
        state = "loaded" if self._model is not None else "not loaded"
        return f"LocalTeacher({self.model_name!r}, device={self.device!r}, {state})"

    def generate(self, messages: list[dict[str, str]], *, state_id: str, max_new_tokens: int,
                 temperature: float = 0.7, seed: int = 0) -> LocalGeneration:
        """Reply to ``messages`` (blocking, thread-safe), deterministic in ``(seed, state_id)``; greedy at
        ``temperature <= 0``; a prompt over the context keeps its last tokens. ``ValueError`` when
        ``max_new_tokens`` does not fit the context."""
        import torch

        with self._lock:
            if self._model is None:
                from composer_replication.models import load_model_and_tokenizer

                log.info("loading local teacher %s", self.model_name)
                self._model, self._tokenizer = load_model_and_tokenizer(self.model_name, seed=self.model_seed,
                                                                        device=self.device)
            tok, model = self._tokenizer, self._model
            ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                               return_dict=False))
            limit = int(getattr(model.config, "max_position_embeddings", 2048)) - max_new_tokens
            if limit < 1:
                raise ValueError(f"max_tokens={max_new_tokens} does not fit the local model's context "
                                 f"({model.config.max_position_embeddings} positions); lower max_tokens.")
            if len(ids) > limit:
                log.warning("state %s: prompt of %d tokens truncated to its last %d", state_id, len(ids), limit)
                ids = ids[-limit:]
            eos = model.generation_config.eos_token_id
            stop = set(eos if isinstance(eos, list) else [eos]) | {tok.eos_token_id}
            digest = hashlib.sha256(f"{seed}\x00{state_id}".encode()).digest()
            gen = torch.Generator(device="cpu").manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
            x, past, out = torch.tensor([ids], device=self.device), None, []  # x: [1, T]
            with torch.inference_mode():
                for _ in range(max_new_tokens):
                    res = model(input_ids=x, past_key_values=past, use_cache=True)
                    past, logits = res.past_key_values, res.logits[0, -1].float()  # logits: [V]
                    if temperature <= 0:
                        nxt = int(torch.argmax(logits))
                    else:
                        nxt = int(torch.multinomial(torch.softmax(logits / temperature, -1).cpu(), 1, generator=gen))
                    if nxt in stop:
                        break
                    out.append(nxt)
                    x = torch.tensor([[nxt]], device=self.device)  # [1, 1]
        return LocalGeneration(tok.decode(out, skip_special_tokens=True).strip(), len(ids), len(out))

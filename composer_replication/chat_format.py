"""Chat formatting shared by the whole pipeline: content flattening, prompts, responses, hinted teachers.

One rule everywhere (the batch contract): a *prompt* is the tokenizer's chat template of the
messages with the generation prompt; a *response* is the action text's tokens followed by the
end-of-turn token (``<|im_end|>`` for ChatML). So ``prompt + response`` equals the template's own
rendering of ``messages + [assistant]`` up to the template's trailing newline. Assistant tool calls
become action text (``[TOOL_USE] name=NAME input={json}``, ``composer_replication.actions``), never
the template's structured ``tool_calls``, so student, teachers and rollouts share one textual form.

Everything that turns messages into text or token ids goes through this module: the batching module
(:mod:`composer_replication.batching`), rollouts, evaluation, teacher prompts and the pair record.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from composer_replication.actions import format_tool_use, tool_calls_to_action

__all__ = ["TokenizerLike", "content_text", "messages_action", "to_chat_messages", "end_of_turn_id",
           "encode_text", "render_chat_text", "build_prompt_ids", "build_response_ids",
           "build_hinted_teacher_sequence"]

ROLES = ("system", "user", "assistant", "tool")
"""The roles a turn or message may have."""


@runtime_checkable
class TokenizerLike(Protocol):
    """What the collator needs from a tokenizer (a Hugging Face tokenizer qualifies)."""

    pad_token_id: int | None

    def __call__(self, text: str | list[str], **kwargs: Any) -> Any: ...

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> Any: ...


def content_text(content: Any) -> str:
    """A message's ``content`` as text (the one content flattening of the project): the string itself, or the
    string and ``{"text": ...}`` parts of a list joined by newlines (other parts dropped); ``None`` is ``""``.

    Raises:
        ValueError: ``content`` is neither ``None``, a string nor a list of parts.
    """
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            p if isinstance(p, str) else str(p.get("text", "")) for p in content if isinstance(p, (str, dict))
        ]
        return "\n".join(p for p in parts if p)
    raise ValueError(f"message content must be a string or a list of parts, got {type(content).__name__}")


def messages_action(messages: str | Sequence[Mapping[str, Any]] | None) -> str:
    """The action text of assistant messages (``composer_replication.actions`` form): each one's content and
    ``tool_calls`` (:func:`~composer_replication.actions.tool_calls_to_action`), joined by a blank line; other
    roles skipped; a string returned unchanged."""
    if isinstance(messages, str):
        return messages
    parts = [
        tool_calls_to_action(content_text(m.get("content")), m["tool_calls"]) if m.get("tool_calls")
        else content_text(m.get("content"))  # kept verbatim: a pair's action is the teacher's original text
        for m in messages or []
        if m.get("role", "assistant") == "assistant"
    ]
    return "\n\n".join(p for p in parts if p)


def _tool_call_text(call: Any) -> str:
    """One tool call (TraceTurn / OpenAI / Anthropic shape) as ``[TOOL_USE] name=... input=...``."""
    fn = call.get("function") if isinstance(call, Mapping) and isinstance(call.get("function"), Mapping) else call
    if not isinstance(fn, Mapping) or not fn.get("name"):
        raise ValueError(f"tool call must be a dict with a 'name' (or 'function': {{'name'}}), got {call!r}")
    return format_tool_use(str(fn["name"]), fn.get("arguments", fn.get("input", {})))


def to_chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Normalize turns or OpenAI-style messages to ``{"role", "content"}`` for the chat template: assistant
    ``tool_calls`` (a list) and ``tool_call`` (one) become action-text lines appended to the content (unless it
    already has a ``[TOOL_USE]`` line for that tool); other keys are dropped. Idempotent on its own output.

    Raises:
        ValueError: a message is not a dict, has a role outside :data:`ROLES`, or a malformed tool call.
    """
    out: list[dict[str, str]] = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise ValueError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if role not in ROLES:
            raise ValueError(f"message {i} has role {role!r}; expected one of {ROLES} (map other roles, e.g. "
                             "'developer' -> 'system', before collating)")  # fmt: skip
        content = content_text(m.get("content"))
        if role == "assistant":
            calls = list(m.get("tool_calls") or []) + ([m["tool_call"]] if m.get("tool_call") else [])
            lines = [_tool_call_text(call) for call in calls]
            lines = [line for line in lines if line.split(" input=", 1)[0] + " " not in content]
            content = "\n".join(([content] if content.strip() else []) + lines)
        out.append({"role": role, "content": content})
    return out


def _as_ids(out: Any) -> list[int]:
    """Token ids from a list, a tensor, or a tokenizer output dict (transformers 5 returns dicts)."""
    if isinstance(out, Mapping) or hasattr(out, "keys"):
        out = out["input_ids"]
    if hasattr(out, "tolist"):
        out = out.tolist()
    if out and isinstance(out[0], list):  # a batch of one
        out = out[0]
    return [int(t) for t in out]


def encode_text(tokenizer: TokenizerLike, text: str) -> list[int]:
    """``text``'s token ids with no special tokens added (``[]`` for empty text)."""
    return _as_ids(tokenizer(text, add_special_tokens=False)) if text else []


def render_chat_text(tokenizer: TokenizerLike, messages: list[dict], generation_prompt: bool) -> str:
    """The chat template's text for already-normalized ``messages`` (see :func:`to_chat_messages`)."""
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False)


def end_of_turn_id(tokenizer: TokenizerLike) -> int:
    """The end-of-turn token: ``<|im_end|>`` when the vocabulary has it, else ``eos_token_id``.

    Raises:
        ValueError: the tokenizer has neither.
    """
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is not None:
        tid = convert("<|im_end|>")
        if isinstance(tid, int) and tid >= 0 and tid != getattr(tokenizer, "unk_token_id", None):
            return tid
    eos = getattr(tokenizer, "eos_token_id", None)
    if isinstance(eos, int):
        return eos
    raise ValueError("tokenizer has no '<|im_end|>' token and no eos_token_id: cannot end a response")


def build_prompt_ids(tokenizer: TokenizerLike, messages: Sequence[Mapping[str, Any]]) -> list[int]:
    """``apply_chat_template(to_chat_messages(messages), add_generation_prompt=True)`` as token ids."""
    chat = to_chat_messages(messages)
    return _as_ids(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False))


def build_response_ids(tokenizer: TokenizerLike, text: str) -> list[int]:
    """The response ``text``'s tokens (no special tokens added) and the end-of-turn token:
    ``build_prompt_ids(tok, msgs) + build_response_ids(tok, text)`` is the chat template of
    ``msgs + [{"role": "assistant", "content": text}]`` up to its trailing newline."""
    if not isinstance(text, str):
        raise ValueError(f"response text must be a string, got {type(text).__name__}")
    return encode_text(tokenizer, text) + [end_of_turn_id(tokenizer)]


def build_hinted_teacher_sequence(
    tokenizer: TokenizerLike, history: list[dict], hint: str, response_ids: list[int]
) -> tuple[list[int], int]:
    """The channel-2 teacher sequence: ``prompt(history + [hint as user]) + response_ids``.

    Returns ``(teacher_ids, response_start)``: ``teacher_ids[response_start:] == response_ids``.

    Raises:
        ValueError: ``hint`` is empty or ``response_ids`` is empty.
    """
    if not isinstance(hint, str) or not hint.strip():
        raise ValueError(f"hint must be a non-empty string, got {hint!r}")
    if not response_ids:
        raise ValueError("response_ids is empty: the teacher needs the student's response tokens")
    prompt = build_prompt_ids(tokenizer, [*history, {"role": "user", "content": hint}])
    return prompt + [int(t) for t in response_ids], len(prompt)

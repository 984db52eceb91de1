"""Degenerate actions: the one check that keeps broken teacher output out of pairs and reward references.

An action (``composer_replication.actions`` text) is *degenerate* when it cannot be a good next
action, whatever the state. The rules, checked in this order (the first that fires names the drop):

- ``empty``: no text and no tool call (a thinking block alone counts as empty).
- ``truncated_call``: a tool call cut off or malformed: ``[TOOL_USE] name=X input=...`` whose
  arguments are not one JSON object (cut off inside the JSON, or no ``input=``), a tool name that is
  not an identifier, or a ``[TOOL_USE`` marker left inside text (cut before ``name=``).
- ``repetition``: the action repeats itself: a sentence of at least ``min_sentence_words`` words said
  twice; a share of repeated word n-grams above ``max_ngram_repeat_ratio``; a short unit (1-10
  characters) repeated ``max_unit_repeats`` times in a row; or the same tool call made twice. Only
  text is read for this: a well-formed tool call's arguments (code edits repeat lines legitimately)
  are never checked.
- ``text_for_call``: plain text where the state's recorded action calls a tool (only when the
  recorded action is given).

:func:`degeneracy` is used by the replaysim normalizer (operator ``degenerate_action_filter`` of the
default recipe, on each pair's ``chosen``) and by the next-action reward
(``rollout.NextActionEnvironment`` never takes a degenerate ``chosen`` as its reference), so one
definition guards local and frontier teachers alike. Example of what it stops (a 135M greedy
teacher): ``"The config file is loaded with a `retries` key. The config file is loaded with a
`retries` key. The"`` where the session recorded ``[TOOL_USE] name=Read input={...}``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import NamedTuple

from composer_replication.actions import TOOL_USE_PREFIX, canonical_action, parse_action

__all__ = ["RULES", "DegeneracyLimits", "Degeneracy", "degeneracy", "is_degenerate"]

RULES = ("empty", "truncated_call", "repetition", "text_for_call")
"""The rule names, in the order they are checked (also the drop-count keys: ``replay/dropped/<rule>``)."""

_NAME = re.compile(r"^[A-Za-z_][\w.\-]*$")
_SENTENCE_SPLIT = re.compile(r"(?<=[.!?])\s+|\n+")
_WORD = re.compile(r"[^\W_]+(?:['’][^\W_]+)*|\S", re.UNICODE)


@dataclass(frozen=True, kw_only=True)
class DegeneracyLimits:
    """Thresholds of the ``repetition`` rule (the other rules have none)."""

    ngram_size: int = 3
    """Word n-gram length of the repeated-n-gram share."""
    max_ngram_repeat_ratio: float = 0.3
    """Highest share of word n-grams that repeat an earlier one (``1 - unique / total``) still accepted."""
    min_ngrams: int = 4
    """The n-gram share is only judged on texts with at least this many n-grams."""
    min_sentence_words: int = 3
    """A sentence (split at ``.!?`` and newlines) of at least this many words may not appear twice."""
    max_unit_repeats: int = 20
    """A unit of 1-10 characters repeated this many times in a row is repetition (``"ab" * 20``)."""

    def __post_init__(self) -> None:
        for key in ("ngram_size", "min_ngrams", "min_sentence_words", "max_unit_repeats"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2 - (key == "min_ngrams"):
                raise ValueError(
                    f"DegeneracyLimits.{key} must be an integer >= 2 (min_ngrams >= 1), got {value!r}"
                )
        if not 0.0 <= self.max_ngram_repeat_ratio < 1.0:
            raise ValueError(
                f"DegeneracyLimits.max_ngram_repeat_ratio must be in [0, 1), got {self.max_ngram_repeat_ratio!r}"
            )


class Degeneracy(NamedTuple):
    """Why an action is degenerate: the rule (one of :data:`RULES`) and a readable detail."""

    rule: str
    detail: str


def degeneracy(
    action: str, *, recorded_action: str | None = None, limits: DegeneracyLimits | None = None
) -> Degeneracy | None:
    """The first rule ``action`` breaks (see the module docstring), or ``None`` for a usable action.

    Args:
        action: the action text (``[TOOL_USE] name=... input={...}`` lines, text, thinking).
        recorded_action: the state's recorded action; enables ``text_for_call``.
        limits: thresholds of the repetition rule (defaults: :class:`DegeneracyLimits`).
    """
    if not isinstance(action, str):
        raise ValueError(f"an action must be text, got {type(action).__name__}")
    limits = limits or DegeneracyLimits()
    blocks = parse_action(action)
    calls = [b for b in blocks if b.kind == "tool_use"]
    texts = [b.text for b in blocks if b.kind == "text"]
    if not calls and not any(t.strip() for t in texts):
        return Degeneracy("empty", "no text and no tool call")
    for call in calls:
        if not _NAME.match(call.name):
            return Degeneracy("truncated_call", f"tool call with an invalid name {call.name[:40]!r}")
        if not call.arguments_valid:
            return Degeneracy(
                "truncated_call", f"tool {call.name!r}: arguments are not one JSON object: {call.text[:60]!r}"
            )
    if any("[TOOL_USE" in t for t in texts) or _ends_in_marker(blocks):
        return Degeneracy("truncated_call", "a [TOOL_USE marker cut off before its name= and input=")
    repeated = _repetition(texts, calls, limits)
    if repeated is not None:
        return Degeneracy("repetition", repeated)
    if recorded_action is not None and not calls:
        if any(b.kind == "tool_use" for b in parse_action(recorded_action)):
            return Degeneracy("text_for_call", "plain text where the recorded action calls a tool")
    return None


def is_degenerate(
    action: str, *, recorded_action: str | None = None, limits: DegeneracyLimits | None = None
) -> bool:
    """``degeneracy(...) is not None``."""
    return degeneracy(action, recorded_action=recorded_action, limits=limits) is not None


def _repetition(texts: list[str], calls: list, limits: DegeneracyLimits) -> str | None:
    """A description of the first repetition found in the text blocks or the calls, else ``None``."""
    seen_calls: set[str] = set()
    for call in calls:
        canon = canonical_action(f"[TOOL_USE] name={call.name} input={call.text}")
        if canon in seen_calls:
            return f"the same tool call twice ({call.name})"
        seen_calls.add(canon)
    text = "\n".join(t for t in texts if t.strip())
    run = re.search(r"(.{1,10}?)\1{" + str(limits.max_unit_repeats - 1) + ",}", text, re.DOTALL)
    if run is not None:
        return f"{run.group(1)!r} repeated {len(run.group(0)) // len(run.group(1))} times in a row"
    sentences: set[str] = set()
    for sentence in _SENTENCE_SPLIT.split(text):
        words = _words(sentence)
        if len(words) < limits.min_sentence_words:
            continue
        key = " ".join(words)
        if key in sentences:
            return f"the sentence {sentence.strip()[:60]!r} twice"
        sentences.add(key)
    words = _words(text)
    n = limits.ngram_size
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if len(grams) >= limits.min_ngrams:
        ratio = 1.0 - len(set(grams)) / len(grams)
        if ratio > limits.max_ngram_repeat_ratio:
            return f"{ratio:.2f} of its word {n}-grams repeat (limit {limits.max_ngram_repeat_ratio})"
    return None


def _ends_in_marker(blocks: list) -> bool:
    """True when the action ends in text that ends in the start of a ``[TOOL_USE] name=`` marker (``[TO``...)."""
    tail = blocks[-1].text.rstrip() if blocks and blocks[-1].kind == "text" else ""
    return any(tail.endswith(TOOL_USE_PREFIX[:k]) for k in range(3, len(TOOL_USE_PREFIX) + 1))


def _words(text: str) -> list[str]:
    """Lower-cased words of ``text``, punctuation dropped."""
    return [w for w in _WORD.findall(text.lower()) if w[0].isalnum()]

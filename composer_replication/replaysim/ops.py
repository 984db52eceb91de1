"""Native implementations of the data-juicer operators the replaysim recipes use.

Each operator follows data-juicer 1.x semantics (``data_juicer/ops/filter/*``, ``ops/deduplicator``):

- ``text_length_filter(min_len=10, max_len=sys.maxsize)``: keep ``min_len <= len(text) <= max_len``.
- ``words_num_filter(lang="en", tokenization=False, min_num=10, max_num=sys.maxsize)``: split on
  ``" "``, ``"\\n"``, ``"\\t"``, drop empty words, strip special characters from both ends of each word,
  drop words left empty, keep ``min_num <= count <= max_num``.
- ``special_characters_filter(min_ratio=0.0, max_ratio=0.25)``: ratio of characters in
  ``SPECIAL_CHARACTERS`` to ``len(text)`` (0 for empty text), keep ``min_ratio <= r <= max_ratio``.
- ``document_deduplicator(lowercase=False, ignore_non_character=False)``: md5 of the text
  (lower-cased, whitespace/digits/ASCII punctuation removed when asked, then stripped); the first
  record with a hash is kept.

One operator is replaysim's own (not data-juicer's; it runs natively under either backend):

- ``degenerate_action_filter(ngram_size=3, max_ngram_repeat_ratio=0.3, min_ngrams=4, min_sentence_words=3,
  max_unit_repeats=20, check_text_for_call=True)``: drop a pair whose action (``text_key``, default
  ``chosen``) is degenerate (:mod:`composer_replication.replaysim.degenerate`: empty, a cut-off tool
  call, repetition, or plain text where the state's recorded action calls a tool).

Differences: ``tokenization=True`` (a sentencepiece model) is refused here; and without the optional
``emoji`` package the emoji part of ``SPECIAL_CHARACTERS`` is the single code points of the Unicode
emoji blocks, which is what data-juicer's per-character test can match anyway.
"""

from __future__ import annotations

import hashlib
import re
import string
import sys
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from composer_replication.replaysim.degenerate import DegeneracyLimits

__all__ = [
    "SPECIAL_CHARACTERS",
    "NATIVE_OPS",
    "REPLAYSIM_OPS",
    "OpDef",
    "validate_op_args",
    "op_stat",
    "op_keep",
    "dedup_hash",
    "action_limits",
]

# ---------------------------------------------------------------------------------------------------
# Special characters (set as in data-juicer ops/common/special_characters.py, Apache-2.0, itself from
# huggingface/text-data-filtering): ASCII punctuation, digits, whitespace, a list of symbols, emoji.
# ---------------------------------------------------------------------------------------------------
_OTHER_SPECIAL = (
    "’“”–ー一▬…✦�£•€«»°·═×士＾˘⇓↓↑←→（）§″′´¿−±∈¢ø‚„½¼¾¹²³―⁃，ˌ¸‹›ʺˈʻ¦‐⠀‰‑≤≥‖"
    "◆●■►▼▲▴∆▻¡★☆✱ːº。¯˜¥ɪ≈†上ン：∼⁄・♡✓⊕․．⋅÷１‟；،、¨ाাी्े◦˚"
    "゜ʼ≖ʼ¤ッツシ℃√！【】‿∞➤～πه۩☛₨➩☻๑٪♥ıॽ《‘©﴿٬？▷Г♫∟™ª₪®「—❖"
    "」﴾》"
)
_EMOJI_RANGES = ((0x1F000, 0x1FAFF), (0x2600, 0x27BF), (0x2B00, 0x2BFF), (0x1F1E6, 0x1F1FF))


def _build_special_characters() -> frozenset[str]:
    chars = set(string.punctuation + string.digits + string.whitespace + _OTHER_SPECIAL)
    # The unicode space separators of data-juicer's list (U+2000..U+200A, U+3000, ...) and U+FFFC.
    chars.update(chr(c) for c in range(0x80, 0x3001) if unicodedata.category(chr(c)) == "Zs")
    chars.update({"\ufffc", "\u200b", "\u2060", "\ufeff", "\u200d", "\ufe0f"})
    try:
        import emoji  # optional: exactly data-juicer's set when present

        chars.update(k for k in emoji.EMOJI_DATA if len(k) == 1)
    except ImportError:
        for lo, hi in _EMOJI_RANGES:
            chars.update(chr(c) for c in range(lo, hi + 1))
    return frozenset(chars)


SPECIAL_CHARACTERS: frozenset[str] = _build_special_characters()

_NON_CHARACTER = re.compile(r"\s+|\d+|[" + re.escape(string.punctuation) + "]")
_WORD_SPLIT = re.compile(r" |\n|\t")


# ---------------------------------------------------------------------------------------------------
# Operator table
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class OpDef:
    """A native operator: its kind, its arguments ``name -> (types, default)`` and its statistic."""

    kind: str
    """``"filter"`` (keeps a record when its statistic is in range), ``"deduplicator"``, or ``"action_filter"``
    (replaysim's own: keeps a record whose action is not degenerate; reads the record's recorded action)."""
    params: dict[str, tuple[tuple[type, ...], Any]]
    """Accepted arguments with their types and data-juicer defaults."""
    stat: Callable[[str, dict[str, Any]], float] | None = None
    """Filters only: ``(text, args) -> statistic``."""
    bounds: tuple[str, str] | None = None
    """Filters only: the names of the lower and upper bound arguments."""
    stat_name: str = ""
    """How the statistic is named in drop reasons."""


def _strip(word: str) -> str:
    i, j = 0, len(word)
    while i < j and word[i] in SPECIAL_CHARACTERS:
        i += 1
    while j > i and word[j - 1] in SPECIAL_CHARACTERS:
        j -= 1
    return word[i:j]


def _num_words(text: str, args: dict[str, Any]) -> float:
    words = [w for w in _WORD_SPLIT.split(text) if w]
    return len([w for w in (_strip(w) for w in words) if w])


def _special_ratio(text: str, args: dict[str, Any]) -> float:
    return sum(c in SPECIAL_CHARACTERS for c in text) / len(text) if text else 0.0


_INT = (int,)
_NUM = (int, float)
_MAX = sys.maxsize
# Execution hints data-juicer accepts on every operator; the native backend accepts and ignores them.
_COMMON: dict[str, tuple[tuple[type, ...], Any]] = {"batch_size": (_INT, 1000), "num_proc": (_INT, 1)}

NATIVE_OPS: dict[str, OpDef] = {
    "text_length_filter": OpDef(
        kind="filter", params={"min_len": (_INT, 10), "max_len": (_INT, _MAX)},
        stat=lambda text, args: len(text), bounds=("min_len", "max_len"), stat_name="len",
    ),
    "words_num_filter": OpDef(
        kind="filter",
        params={"lang": ((str,), "en"), "tokenization": ((bool,), False), "min_num": (_INT, 10),
                "max_num": (_INT, _MAX)},
        stat=_num_words, bounds=("min_num", "max_num"), stat_name="num_words",
    ),
    "special_characters_filter": OpDef(
        kind="filter", params={"min_ratio": (_NUM, 0.0), "max_ratio": (_NUM, 0.25)},
        stat=_special_ratio, bounds=("min_ratio", "max_ratio"), stat_name="special_char_ratio",
    ),
    "document_deduplicator": OpDef(
        kind="deduplicator", params={"lowercase": ((bool,), False), "ignore_non_character": ((bool,), False)},
    ),
    "degenerate_action_filter": OpDef(
        kind="action_filter",
        params={"ngram_size": (_INT, 3), "max_ngram_repeat_ratio": (_NUM, 0.3), "min_ngrams": (_INT, 4),
                "min_sentence_words": (_INT, 3), "max_unit_repeats": (_INT, 20),
                "check_text_for_call": ((bool,), True)},
    ),
}

REPLAYSIM_OPS = frozenset({"degenerate_action_filter"})
"""Operators data-juicer does not have: they run natively under the ``data_juicer`` backend too."""


def action_limits(args: dict[str, Any]) -> DegeneracyLimits:
    """The :class:`DegeneracyLimits` of validated ``degenerate_action_filter`` arguments.

    Raises:
        ValueError: a limit out of range (e.g. ``max_ngram_repeat_ratio >= 1``).
    """
    return DegeneracyLimits(**{k: v for k, v in args.items() if k != "check_text_for_call"})


def validate_op_args(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """Check ``args`` of native operator ``name`` (``text_key`` removed) and fill in defaults.

    Raises:
        ValueError: an unknown argument, a bound pair with ``min > max``, a negative bound, or
            ``tokenization=True``.
        TypeError: an argument of the wrong type (``bool`` is not accepted as a number).
    """
    op = NATIVE_OPS[name]
    params = {**op.params, **_COMMON}
    unknown = sorted(set(args) - set(params) - {"text_key"})
    if unknown:
        raise ValueError(f"unknown argument(s) {unknown}; accepted: {sorted(op.params)} and text_key")
    full: dict[str, Any] = {}
    for key, (types, default) in params.items():
        value = args.get(key, default)
        numeric = types in (_INT, _NUM)
        if not isinstance(value, types) or (numeric and isinstance(value, bool)):
            want = " or ".join(t.__name__ for t in types)
            raise TypeError(f"argument {key} must be {want}, got {value!r} ({type(value).__name__})")
        if numeric and value < 0:
            raise ValueError(f"argument {key} must be >= 0, got {value!r}")
        if key in op.params:
            full[key] = value
    if op.bounds is not None:
        lo, hi = op.bounds
        if full[lo] > full[hi]:
            raise ValueError(f"{lo}={full[lo]!r} is greater than {hi}={full[hi]!r}")
    if name == "degenerate_action_filter":
        action_limits(full)
    if full.get("tokenization"):
        raise ValueError("tokenization=True needs a sentencepiece model; use backend='data_juicer' for it")
    return full


def op_stat(name: str, text: str, args: dict[str, Any]) -> float:
    """The statistic filter ``name`` computes on ``text`` (length, word count or special ratio)."""
    return NATIVE_OPS[name].stat(text, args)


def op_keep(name: str, text: str, args: dict[str, Any]) -> tuple[bool, str]:
    """Apply filter ``name`` to ``text``: ``(kept, reason)``, the reason naming the statistic and range."""
    op = NATIVE_OPS[name]
    value = op.stat(text, args)
    lo, hi = (args[b] for b in op.bounds)
    kept = lo <= value <= hi
    shown = f"{value:.4g}" if isinstance(value, float) else str(value)
    hi_shown = "inf" if hi == _MAX else hi
    return kept, f"{op.stat_name}={shown} outside [{lo}, {hi_shown}]"


def dedup_hash(text: str, args: dict[str, Any]) -> str:
    """data-juicer's ``document_deduplicator`` hash: md5 of the normalised, stripped text."""
    if args["lowercase"]:
        text = text.lower()
    if args["ignore_non_character"]:
        text = _NON_CHARACTER.sub("", text)
    return hashlib.md5(text.strip().encode("utf-8")).hexdigest()

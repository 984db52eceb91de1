"""replaysim: filter preference pairs with a data-juicer-shaped recipe (``docs/replaysim.md``). The native
operators (``default.yaml``'s: :func:`degeneracy`'s filter, ``text_length_filter``, ``document_deduplicator``)
read a ``PreferencePair``'s ``chosen``, ``rejected`` or ``text``; others run under data-juicer when it is
importable (never a dependency). A rollout-rejected pair skips rejected-side rules; dedup is by state + chosen.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import string
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, ClassVar

import yaml

from composer_replication import teacher_replay
from composer_replication.actions import TOOL_USE_PREFIX, canonical_action, parse_action
from composer_replication.types import PreferencePair, TeacherCallResult

__all__ = ["NormalizedDPOPair", "DJNormalizer", "DroppedPair", "NormalizeReport", "RecipeError", "RULES",
           "degeneracy", "replay_and_normalize_trace", "replay_and_normalize_trace_sync"]

log = logging.getLogger(__name__)
NormalizedDPOPair = PreferencePair  # the spec's name of a pair after normalisation (its metadata annotated)

RULES = ("empty", "truncated_call", "repetition", "text_for_call")  # in checking order: the drop kinds
LIMITS = {"ngram_size": 3, "max_ngram_repeat_ratio": 0.3, "min_ngrams": 4, "min_sentence_words": 3,
          "max_unit_repeats": 20}  # repetition: of word n-grams, of sentences, of a 1-10 character unit
_NAME, _SENTENCE = re.compile(r"^[A-Za-z_][\w.\-]*$"), re.compile(r"(?<=[.!?])\s+|\n+")
_WORD, _NON_CHARACTER = re.compile(r"[^\W_]+(?:['’][^\W_]+)*|\S"), re.compile(rf"\s+|\d+|[{re.escape(string.punctuation)}]")
Degeneracy = collections.namedtuple("Degeneracy", "rule detail")  # the rule broken, and a readable detail
DroppedPair = collections.namedtuple("DroppedPair", "index state_id op reason kind", defaults=("",))  # kind: the rule


class RecipeError(ValueError):
    """A recipe that is not valid YAML, has the wrong shape, or names unknown operators or arguments."""


def _words(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w[0].isalnum()]


def degeneracy(action: str, *, recorded_action: str | None = None, **limits: Any) -> Degeneracy | None:
    """The first rule ``action`` breaks, or ``None``: ``empty`` (no text, no call), ``truncated_call`` (arguments
    that are not one JSON object, a bad tool name, a cut ``[TOOL_USE`` marker), ``repetition`` (of its text, never
    of a well-formed call's arguments; one call twice), ``text_for_call`` (text where ``recorded_action`` calls a
    tool). ``limits``: :data:`LIMITS` overrides (``ValueError`` for an unknown or out-of-range one)."""
    if not isinstance(action, str):
        raise ValueError(f"an action must be text, got {type(action).__name__}")
    lim = {**LIMITS, **limits}
    if set(lim) != set(LIMITS) or not 0 <= lim["max_ngram_repeat_ratio"] < 1 or not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1 + (k != "min_ngrams")
            for k, v in lim.items() if k != "max_ngram_repeat_ratio"):
        raise ValueError(f"degeneracy limits: unknown or out of range in {limits}; integers >= 2 (min_ngrams >= 1), "
                         "max_ngram_repeat_ratio must be in [0, 1)")
    blocks = parse_action(action)
    calls, texts = [b for b in blocks if b.kind == "tool_use"], [b.text for b in blocks if b.kind == "text"]
    if not calls and not any(t.strip() for t in texts):
        return Degeneracy("empty", "no text and no tool call")
    for c in calls:
        if not _NAME.match(c.name) or not c.arguments_valid:
            return Degeneracy("truncated_call", f"tool {c.name[:40]!r}: a bad name, or arguments that are not one "
                                                f"JSON object: {c.text[:60]!r}")
    tail = blocks[-1].text.rstrip() if blocks[-1].kind == "text" else ""
    if any("[TOOL_USE" in t for t in texts) or any(tail.endswith(TOOL_USE_PREFIX[:k]) for k in range(3, 17)):
        return Degeneracy("truncated_call", "a [TOOL_USE marker cut off before its name= and input=")
    if len({canonical_action(f"{TOOL_USE_PREFIX}{c.name} input={c.text}") for c in calls}) < len(calls):
        return Degeneracy("repetition", "the same tool call twice")
    text, seen = "\n".join(t for t in texts if t.strip()), set()
    if run := re.search(r"(.{1,10}?)\1{" + str(lim["max_unit_repeats"] - 1) + ",}", text, re.DOTALL):
        return Degeneracy("repetition", f"{run.group(1)!r} repeated {len(run.group(0)) // len(run.group(1))} times")
    for sentence in _SENTENCE.split(text):
        if len(words := _words(sentence)) >= lim["min_sentence_words"]:
            if " ".join(words) in seen:
                return Degeneracy("repetition", f"the sentence {sentence.strip()[:60]!r} twice")
            seen.add(" ".join(words))
    words, n = _words(text), lim["ngram_size"]
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    if len(grams) >= lim["min_ngrams"] and (share := 1 - len(set(grams)) / len(grams)) > lim["max_ngram_repeat_ratio"]:
        return Degeneracy("repetition", f"{share:.2f} of its word {n}-grams repeat")
    if recorded_action is not None and not calls and any(b.kind == "tool_use" for b in parse_action(recorded_action)):
        return Degeneracy("text_for_call", "plain text where the recorded action calls a tool")
    return None


_OPS: dict[str, dict[str, Any]] = {  # the native operators and their arguments' defaults (data-juicer's)
    "degenerate_action_filter": {**LIMITS, "check_text_for_call": True},
    "text_length_filter": {"min_len": 10, "max_len": sys.maxsize},
    "document_deduplicator": {"lowercase": False, "ignore_non_character": False},
}


@dataclasses.dataclass
class NormalizeReport:
    """What the last ``normalize`` did (``backend``: ``native``, ``data_juicer`` or ``skipped``)."""

    backend: str
    recipe: str | None
    n_in: int
    n_out: int
    ops: list[str] = dataclasses.field(default_factory=list)
    dropped: list[DroppedPair] = dataclasses.field(default_factory=list)

    def drop_counts(self, prefix: str = "") -> dict[str, int]:
        """Drops per kind, sorted, every kind that ran listed (``{"replay/dropped/repetition": 3, ...}``)."""
        counts = collections.Counter({prefix + k: 0 for op in self.ops for k in
                                      (RULES if op == "degenerate_action_filter" else (op,))})
        counts.update(prefix + (d.kind or d.op) for d in self.dropped)
        return dict(sorted(counts.items()))


def _text(pair: PreferencePair, key: str) -> str | None:
    """What an operator reads of ``pair``: ``chosen``, ``rejected`` (``None`` from the rollouts) or ``text``."""
    if key == "chosen" or (key == "rejected" and pair.rejected_from_rollout):
        return pair.chosen if key == "chosen" else None
    if pair.rejected_from_rollout:
        return json.dumps(pair.state_messages, sort_keys=True, ensure_ascii=False) + "\n" + pair.chosen
    return pair.rejected if key == "rejected" else f"{pair.chosen}\n{pair.rejected}"


class DJNormalizer:
    """Filter pairs with a recipe (``None``: :attr:`DEFAULT_RECIPE`); ``skip_dj`` passes them through (``metadata
    ["skipped"]``), reading no recipe. ``FileNotFoundError``: no recipe; ``RecipeError``: a malformed recipe, a bad
    argument, or an operator that is not native while data-juicer is not installed (named, with the fix)."""

    DEFAULT_RECIPE: ClassVar[Path] = Path(__file__).with_name("default.yaml")

    def __init__(self, recipe_path: str | os.PathLike[str] | None = None, *, skip_dj: bool = False) -> None:
        self.recipe_path, self.skip_dj = Path(recipe_path or self.DEFAULT_RECIPE).expanduser(), skip_dj
        self.ops: list[tuple[str, str, dict[str, Any]]] = []  # (operator, text_key, arguments), run natively
        self.dj: list[dict[str, Any]] = []  # the steps handed to data-juicer (a recipe with foreign operators)
        self.last_report: NormalizeReport | None = None
        if skip_dj:
            return
        if not self.recipe_path.is_file():
            raise FileNotFoundError(f"replaysim recipe not found: {self.recipe_path} (pass recipe_path=... or skip_dj=True)")
        where = f"recipe {self.recipe_path}"
        try:
            self.raw = yaml.safe_load(self.recipe_path.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            raise RecipeError(f"{where} is not valid YAML: {exc}") from None
        steps = self.raw.get("process") if isinstance(self.raw, dict) else None
        keys = self.raw.get("text_keys", "text") if isinstance(steps, list) else None
        if not isinstance(steps, list) or not (default := keys[0] if isinstance(keys, list) and keys else keys) \
                or not isinstance(default, str):
            raise RecipeError(f"{where} must be a YAML mapping with a 'process' list of operators and text_keys a "
                              f"string or a list of them (got {type(self.raw).__name__}, text_keys {keys!r})")
        foreign = any(isinstance(s, dict) and next(iter(s), None) not in _OPS for s in steps)
        for i, step in enumerate(steps):
            ((name, args),) = step.items() if isinstance(step, dict) and len(step) == 1 else ((None, None),)
            if not isinstance(name, str) or not isinstance(args, dict | None):
                raise RecipeError(f"{where}: process[{i}] must be '- op_name: {{arguments}}' (one operator name, "
                                  f"its arguments a mapping), got {step!r:.80}")
            if name not in _OPS and importlib.util.find_spec("data_juicer") is None:
                raise RecipeError(f"{where}: process[{i}] uses {name!r}, which is not a native operator ("
                                  f"{sorted(_OPS)}) and data-juicer is not installed: install it (pip install "
                                  "py-data-juicer) or remove the operator")
            if foreign and name != "degenerate_action_filter":  # data-juicer checks its own operators
                self.dj.append({name: args})
                continue
            args, here = dict(args or {}), f"{where}: process[{i}] ({name})"
            if (key := args.pop("text_key", default)) not in ("chosen", "rejected", "text"):
                raise RecipeError(f"{here} reads text_key {key!r}; pairs have 'chosen', 'rejected' and 'text'")
            self.ops.append((name, key, self._args(here, name, args)))

    @staticmethod
    def _args(here: str, name: str, args: dict[str, Any]) -> dict[str, Any]:
        if unknown := sorted(set(args) - set(_OPS[name]) - {"batch_size", "num_proc"}):  # data-juicer's hints
            raise RecipeError(f"{here}: unknown argument(s) {unknown}; accepted: {sorted(_OPS[name])} and text_key")
        full = {k: args.get(k, v) for k, v in _OPS[name].items()}
        for k, v in full.items():
            kind = (int, float) if isinstance(_OPS[name][k], float) else type(_OPS[name][k])
            if not isinstance(v, kind) or (kind is not bool and (isinstance(v, bool) or v < 0)):
                raise RecipeError(f"{here}: argument {k} must be {getattr(kind, '__name__', 'a number')}"
                                  f"{'' if kind is bool else ' >= 0'}, got {v!r}")
        if full.get("min_len", 0) > full.get("max_len", 1):
            raise RecipeError(f"{here}: min_len={full['min_len']} is greater than max_len={full['max_len']}")
        if name == "degenerate_action_filter":
            try:
                degeneracy("ok", **{k: full[k] for k in LIMITS})
            except ValueError as exc:
                raise RecipeError(f"{here}: {exc}") from None
        return full

    def normalize(self, pairs: Iterable[PreferencePair | Mapping[str, Any]]) -> list[PreferencePair]:
        """The pairs the recipe keeps, in input order, their ``metadata`` annotated (``backend``, ``recipe``,
        ``ops``, ``source_index``); ``DPOPair`` dicts are read with ``PreferencePair.from_mapping`` (its
        ``ValueError`` for a malformed one)."""
        items = [PreferencePair.from_mapping(p, where=f"pairs[{i}]") for i, p in enumerate(pairs)]
        if self.skip_dj:
            self.last_report = NormalizeReport("skipped", None, len(items), len(items))
            return [dataclasses.replace(p, metadata={**p.metadata, "skipped": True}) for p in items]
        alive, dropped = self._native(items)
        ran = [{"op": name, "text_key": key, "backend": "native"} for name, key, _ in self.ops]
        if self.dj:
            alive, dropped = self._data_juicer(items, alive, dropped)
            ran += [{"op": next(iter(step)), "backend": "data_juicer"} for step in self.dj]
        meta = {"backend": "data_juicer" if self.dj else "native", "recipe": str(self.recipe_path), "ops": ran}
        self.last_report = NormalizeReport(meta["backend"], meta["recipe"], len(items), len(alive),
                                           [o["op"] for o in ran], sorted(dropped, key=lambda d: d.index))
        return [dataclasses.replace(items[i], metadata={**items[i].metadata, **meta, "source_index": i}) for i in alive]

    def _native(self, items: list[PreferencePair]) -> tuple[list[int], list[DroppedPair]]:
        alive, dropped = list(range(len(items))), []
        for name, key, a in self.ops:
            kept, seen = [], {}
            for i in alive:
                pair, text, kind, why = items[i], _text(items[i], key), name, None
                if text is None:  # a rejected side drawn from the rollouts: nothing to judge here
                    pass
                elif name == "degenerate_action_filter":
                    recorded = pair.metadata.get("recorded_action")  # else, for frontier pairs, the rejected side
                    recorded = recorded if isinstance(recorded, str) else None if pair.rejected_from_rollout else pair.rejected
                    bad = degeneracy(text, recorded_action=recorded if a["check_text_for_call"] else None,
                                     **{k: a[k] for k in LIMITS})
                    kind, why = (bad.rule, f"{bad.rule}: {bad.detail}") if bad else (name, None)
                elif name == "text_length_filter" and not a["min_len"] <= len(text) <= a["max_len"]:
                    why = f"len={len(text)} outside [{a['min_len']}, {'inf' if a['max_len'] == sys.maxsize else a['max_len']}]"
                elif name == "document_deduplicator":  # md5 of the normalised, stripped text; the first is kept
                    text = _NON_CHARACTER.sub("", text) if a["ignore_non_character"] else text
                    digest = hashlib.md5((text.lower() if a["lowercase"] else text).strip().encode()).hexdigest()
                    if (first := seen.setdefault(digest, i)) != i:
                        why = f"duplicate of pair #{first} ({items[first].state_id})"
                if why is None:
                    kept.append(i)
                else:
                    dropped.append(DroppedPair(i, pair.state_id, name, f"{name} on {key}: {why}", kind))
            alive = kept
        return alive, dropped

    def _data_juicer(self, items: list[PreferencePair], alive: list[int],
                     dropped: list[DroppedPair]) -> tuple[list[int], list[DroppedPair]]:
        from data_juicer.config import init_configs
        from data_juicer.core import DefaultExecutor

        with tempfile.TemporaryDirectory(prefix="replaysim_dj_") as tmp:
            data, out, cfg = Path(tmp) / "pairs.jsonl", Path(tmp) / "out" / "result.jsonl", Path(tmp) / "recipe.yaml"
            data.write_text("".join(json.dumps({  # a rollout pair's rejected side: its chosen (rejected rules pass)
                "state_id": items[i].state_id, "chosen": items[i].chosen, "text": _text(items[i], "text"),
                "rejected": _text(items[i], "rejected") or items[i].chosen, "_replaysim_index": i}) + "\n"
                for i in alive), encoding="utf-8")
            config = {"np": 1, **self.raw, "process": self.dj, "dataset_path": str(data), "export_path": str(out)}
            cfg.write_text(yaml.safe_dump(config), encoding="utf-8")
            DefaultExecutor(init_configs(args=["--config", str(cfg)])).run()
            lines = out.read_text(encoding="utf-8").splitlines() if out.exists() else []
        kept = {int(json.loads(line)["_replaysim_index"]) for line in lines if line.strip()}
        return sorted(kept), dropped + [DroppedPair(i, items[i].state_id, "data_juicer", "dropped by data-juicer")
                                        for i in alive if i not in kept]


async def replay_and_normalize_trace(
    *, states: Any, teachers: Any = None, agreement_threshold: int = 2, max_total_usd: float = 5.0,
    normalizer: DJNormalizer | None = None, rejected_from_rollout: bool | None = None, **replay_kwargs: Any,
) -> tuple[list[TeacherCallResult], list[NormalizedDPOPair]]:
    """``replay_trace`` -> ``extract_dpo_pairs`` -> ``normalizer.normalize`` (default ``DJNormalizer()``);
    ``teachers=None``: ``replay_trace``'s defaults; ``replay_kwargs`` go to ``replay_trace``;
    ``rejected_from_rollout=None``: True when the teachers include ``recorded``. Returns ``(results, pairs)``."""
    if normalizer is not None and not isinstance(normalizer, DJNormalizer):
        raise TypeError(f"normalizer must be a DJNormalizer or None, got {type(normalizer).__name__}")
    if teachers is not None:
        replay_kwargs["teachers"] = teachers
    if rejected_from_rollout is None:
        rejected_from_rollout = any(isinstance(t, dict) and t.get("slug") == "recorded" for t in teachers or ())
    raw = await teacher_replay.replay_trace(states, max_total_usd=max_total_usd, **replay_kwargs)
    pairs = teacher_replay.extract_dpo_pairs(states, raw, agreement_threshold=agreement_threshold,
                                             rejected_from_rollout=rejected_from_rollout)
    normalized = (normalizer or DJNormalizer()).normalize(pairs)
    log.info("replaysim: %d teacher results, %d pairs, %d after normalisation", len(raw), len(pairs), len(normalized))
    return raw, normalized


def replay_and_normalize_trace_sync(*args: Any, **kwargs: Any) -> tuple[list[TeacherCallResult], list[NormalizedDPOPair]]:
    """``asyncio.run(replay_and_normalize_trace(...))`` (a ``RuntimeError`` inside a running event loop)."""
    return asyncio.run(replay_and_normalize_trace(*args, **kwargs))

"""Preference pairs from teacher consensus (``actions.canonical_action``), and ``pairs.jsonl``.

Per state each teacher counts once (its first successful, non-empty reply); the largest group wins, ties to the
earliest first reply (the teacher listed first); a pair needs ``agreement_threshold`` agreeing teachers and
``chosen`` is the earliest winner's original text. The rejected side is the state's recorded action (which takes
part in the vote and wins its ties: no pair where the teachers' favourite is, or ties with, it); with
``rejected_from_rollout=True`` (the ``recorded`` teacher) it is not stored (``rejected_messages == []``,
``metadata["rejected_source"] == types.ROLLOUT_REJECTED``: each training step draws it from its own
rollouts) and a pair is made wherever enough teachers agree. ``metadata``: ``teachers``, ``recorded_action``.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_replication import types
from composer_replication.actions import canonical_action
from composer_replication.atomic import atomic_write_text

__all__ = ["extract_dpo_pairs", "save_pairs", "load_pairs", "PairCollector"]


def extract_dpo_pairs(states: Sequence[types.TraceState], teacher_actions: Sequence[types.TeacherCallResult],
                      agreement_threshold: int = 2, *, rejected_from_rollout: bool = False) -> list[types.PreferencePair]:
    """At most one :class:`~composer_replication.types.PreferencePair` per state, in ``states`` order (module
    docstring); results with errors, empty replies or unknown state ids are ignored. ``ValueError`` for a
    threshold that is not an integer >= 1, or duplicate state ids."""
    if isinstance(agreement_threshold, bool) or not isinstance(agreement_threshold, int) or agreement_threshold < 1:
        raise ValueError(f"agreement_threshold must be an integer >= 1; got {agreement_threshold!r:.60}. "
                         "Use 2 (the default) to require two agreeing teachers.")
    by_state: dict[str, list[tuple[int, types.TeacherCallResult]]] = {}
    for s in states:
        if s["state_id"] in by_state:
            raise ValueError(f"state_id {s['state_id']!r} appears twice in states; ids must be unique.")
        by_state[s["state_id"]] = []
    for pos, r in enumerate(teacher_actions):
        if r.get("state_id") in by_state:
            by_state[r["state_id"]].append((pos, r))
    pairs = []
    for s in states:
        groups: dict[str, list[tuple[int, str, str]]] = {}  # canonical action -> [(position, text, slug)]
        seen: set[str] = set()
        for pos, r in by_state[s["state_id"]]:
            text = r.get("response_text")
            if r.get("error") is not None or not isinstance(text, str) or r["teacher_slug"] in seen:
                continue
            if canon := canonical_action(text):
                seen.add(r["teacher_slug"])
                groups.setdefault(canon, []).append((pos, text, r["teacher_slug"]))
        recorded = types.recorded_action(s) or ""
        student = None if rejected_from_rollout else canonical_action(recorded)
        if not groups:
            continue
        best = min(groups, key=lambda c: (-len(groups[c]), c != student, groups[c][0][0]))
        members = groups[best]
        if best == student or len(members) < agreement_threshold:
            continue
        meta: dict[str, Any] = {"teachers": [slug for _, _, slug in members], "recorded_action": recorded,
                                "rejected_source": types.ROLLOUT_REJECTED if rejected_from_rollout else "recorded"}
        rejected = [] if rejected_from_rollout else [{"role": "assistant", "content": recorded}]
        pairs.append(types.PreferencePair(state_id=s["state_id"], state_messages=list(s["messages"]),
                                    chosen_messages=[{"role": "assistant", "content": members[0][1]}],
                                    rejected_messages=rejected, n_teachers_agreeing=len(members), metadata=meta))
    return pairs


def save_pairs(pairs: Sequence[types.PreferencePair | Mapping[str, Any]], path: str | os.PathLike[str]) -> None:
    """Write ``pairs`` (records, or the spec's ``DPOPair`` dicts) as ``pairs.jsonl``, atomically, parents
    created; ``ValueError`` for a malformed pair."""
    records = [types.PreferencePair.from_mapping(p, where=f"pairs[{i}]").to_json() for i, p in enumerate(pairs)]
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def load_pairs(path: str | os.PathLike[str]) -> list[types.PreferencePair]:
    """Read a ``pairs.jsonl`` (:func:`save_pairs`, or ``DPOPair`` dicts); ``ValueError`` names a bad line."""
    pairs = []
    with open(Path(path).expanduser(), encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if line.strip():
                try:
                    rec = json.loads(line)
                except ValueError as exc:
                    raise ValueError(f"{path}:{n}: not a JSON line ({exc}); was it written by save_pairs?") from None
                pairs.append(types.PreferencePair.from_mapping(rec, where=f"{path}:{n}"))
    return pairs


class PairCollector:
    """Collects streamed results per state and extracts a state's pair once its ``num_teachers`` answered
    (the Monarch teacher actor sends pairs on as they form); arguments as :func:`extract_dpo_pairs`."""

    def __init__(self, states: Sequence[types.TraceState], *, num_teachers: int, agreement_threshold: int,
                 rejected_from_rollout: bool = False) -> None:
        self.states = {s["state_id"]: s for s in states}
        self.num_teachers, self.agreement_threshold = num_teachers, agreement_threshold
        self.rejected_from_rollout = rejected_from_rollout
        self._results: dict[str, list[types.TeacherCallResult]] = defaultdict(list)

    def add(self, result: types.TeacherCallResult) -> list[types.PreferencePair]:
        """Record one result; the state's pairs (0 or 1) when it is complete, else ``[]``."""
        sid = result["state_id"]
        self._results[sid].append(result)
        if len(self._results[sid]) < self.num_teachers or sid not in self.states:
            return []
        return extract_dpo_pairs([self.states[sid]], self._results.pop(sid), self.agreement_threshold,
                                 rejected_from_rollout=self.rejected_from_rollout)

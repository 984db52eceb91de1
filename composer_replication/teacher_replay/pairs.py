"""DPO pairs from teacher consensus: where >= k teachers agree on an action the student did not take.

Agreement is judged on :func:`composer_replication.actions.canonical_action` (whitespace-normalized
text; tool calls by name and canonical JSON arguments, so key order and spacing do not matter;
thinking ignored). For each state, the successful teacher replies are grouped by canonical action,
each teacher counted once (its first successful result). The winning group is the largest one; ties
go to the group whose first reply comes earliest in ``teacher_actions`` (for ``replay_trace`` output,
the teacher listed first). A group equal to the student's own action takes part in the vote and wins
its ties: when the teachers' favourite is (or ties with) what the student did, no pair is made. A
pair is made when the winner differs from the student and has ``>= agreement_threshold`` teachers;
``chosen`` is the earliest winning teacher's ORIGINAL text, ``rejected`` the student's action, both held
in the one pair record, :class:`~composer_replication.types.PreferencePair`.

The student's action is the state's recorded one (frontier teachers replaying the student's recorded
traces), or, when ``student_actions`` is given, the student's own sample at that state (the
``recorded`` teacher's mode, :mod:`.recorded`). Each pair's ``metadata`` says which teachers agreed
(``teachers``), where the rejected side came from (``rejected_source``: ``"recorded"`` or
``"student_sample"``, then ``student_sample`` holds the sampling settings and step), and the state's
``recorded_action`` (the normalizer's ``text_for_call`` rule reads it).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_replication.actions import canonical_action
from composer_replication.atomic import atomic_write_text
from composer_replication.teacher_replay.recorded import REJECTED_SOURCE_SAMPLE
from composer_replication.types import PreferencePair, TeacherCallResult, TraceState

__all__ = ["extract_dpo_pairs", "save_pairs", "load_pairs", "PairCollector"]


def _groups(results: list[tuple[int, TeacherCallResult]]) -> dict[str, list[tuple[int, str, str]]]:
    """canonical action -> [(position in teacher_actions, original text, slug)], one entry per teacher."""
    seen: set[str] = set()
    groups: dict[str, list[tuple[int, str]]] = {}
    for pos, r in results:
        text = r.get("response_text")
        if r.get("error") is not None or not isinstance(text, str) or r["teacher_slug"] in seen:
            continue
        canon = canonical_action(text)
        if not canon:
            continue
        seen.add(r["teacher_slug"])
        groups.setdefault(canon, []).append((pos, text, r["teacher_slug"]))
    return groups


def extract_dpo_pairs(
    states: Sequence[TraceState],
    teacher_actions: Sequence[TeacherCallResult],
    agreement_threshold: int = 2,
    *,
    student_actions: Mapping[str, str] | None = None,
    student_meta: Mapping[str, Any] | None = None,
) -> list[PreferencePair]:
    """One :class:`~composer_replication.types.PreferencePair` per state where >= ``agreement_threshold`` teachers agree against the student.

    Args:
        states: the states that were replayed (unique ``state_id``s); pairs come out in this order.
        teacher_actions: ``replay_trace`` results; errors and empty replies are ignored, as are
            results for state ids not in ``states``.
        agreement_threshold: teachers that must agree (>= 1).
        student_actions: ``{state_id: the student's sampled action}`` (``recorded`` teacher mode): the
            student's side of the vote and the pair's rejected side; states missing here use their
            recorded action.
        student_meta: recorded as ``metadata["student_sample"]`` of pairs whose rejected side is a sample
            (``recorded.StudentSampling.metadata(step)``).

    Returns:
        At most one pair per state (the most-agreed action; ties as in the module docstring).

    Raises:
        ValueError: a threshold that is not an integer >= 1, or duplicate state ids.
    """
    if (
        isinstance(agreement_threshold, bool)
        or not isinstance(agreement_threshold, int)
        or agreement_threshold < 1
    ):
        raise ValueError(
            f"agreement_threshold must be an integer >= 1; got {agreement_threshold!r}. "
            "Use 2 (the default) to require two agreeing teachers."
        )
    by_state: dict[str, list[tuple[int, TeacherCallResult]]] = {}
    for s in states:
        if s["state_id"] in by_state:
            raise ValueError(f"state_id {s['state_id']!r} appears twice in states; ids must be unique.")
        by_state[s["state_id"]] = []
    for pos, r in enumerate(teacher_actions):
        if r.get("state_id") in by_state:
            by_state[r["state_id"]].append((pos, r))
    pairs: list[PreferencePair] = []
    for s in states:
        groups = _groups(by_state[s["state_id"]])
        if not groups:
            continue
        sampled = student_actions is not None and s["state_id"] in student_actions
        rejected = student_actions[s["state_id"]] if sampled else s.get("student_action") or ""
        student = canonical_action(rejected)
        # largest group; ties: the student's own group first, then the earliest first reply
        best = min(groups, key=lambda c: (-len(groups[c]), c != student, groups[c][0][0]))
        members = groups[best]
        if best == student or len(members) < agreement_threshold:
            continue
        meta: dict[str, Any] = {"teachers": [slug for _, _, slug in members],
                                "rejected_source": REJECTED_SOURCE_SAMPLE if sampled else "recorded",
                                "recorded_action": s.get("student_action") or ""}
        if sampled:
            meta["student_sample"] = dict(student_meta or {})
        pairs.append(
            PreferencePair.from_actions(
                state_id=s["state_id"],
                state_messages=s["messages"],
                chosen=members[0][1],
                rejected=rejected,
                n_teachers_agreeing=len(members),
                metadata=meta,
            )
        )
    return pairs


def save_pairs(pairs: Sequence[PreferencePair | Mapping[str, Any]], path: str | os.PathLike[str]) -> None:
    """Write ``pairs`` as ``pairs.jsonl`` atomically (one :meth:`PreferencePair.to_json` record per line).

    Spec ``DPOPair`` dicts are accepted and written in the same format. Creates parent folders.

    Raises:
        ValueError: a pair is malformed (see :meth:`PreferencePair.from_mapping`).
    """
    records = [PreferencePair.from_mapping(p, where=f"pairs[{i}]").to_json() for i, p in enumerate(pairs)]
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


def load_pairs(path: str | os.PathLike[str]) -> list[PreferencePair]:
    """Read a ``pairs.jsonl`` written by :func:`save_pairs` (or lines of the spec's ``DPOPair`` dicts).

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: a line is not JSON or not a pair (the message gives the line number).
    """
    pairs: list[PreferencePair] = []
    with open(Path(path).expanduser(), encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path}:{n}: not a JSON line ({exc}); was it written by save_pairs?") from None
            pairs.append(PreferencePair.from_mapping(rec, where=f"{path}:{n}"))
    return pairs


class PairCollector:
    """Groups streamed replay results by state and extracts a state's pair once all its teachers answered.

    Used where results arrive one by one (the Monarch teacher actor), so pairs can be sent on as they form.

    Args:
        states: the states being replayed. num_teachers: answers expected per state.
        agreement_threshold: teachers that must agree (:func:`extract_dpo_pairs`).
        student_actions / student_meta: the student's sampled actions (:func:`extract_dpo_pairs`).
    """

    def __init__(self, states: Sequence[TraceState], *, num_teachers: int, agreement_threshold: int,
                 student_actions: Mapping[str, str] | None = None,
                 student_meta: Mapping[str, Any] | None = None) -> None:
        self.states = {s["state_id"]: s for s in states}
        self.num_teachers = num_teachers
        self.agreement_threshold = agreement_threshold
        self.student_actions = student_actions
        self.student_meta = student_meta
        self._results: dict[str, list[TeacherCallResult]] = defaultdict(list)

    def add(self, result: TeacherCallResult) -> list[PreferencePair]:
        """Record one result; returns the state's pairs (0 or 1) when it is complete, else ``[]``."""
        sid = result["state_id"]
        self._results[sid].append(result)
        if len(self._results[sid]) < self.num_teachers or sid not in self.states:
            return []
        return extract_dpo_pairs([self.states[sid]], self._results.pop(sid), self.agreement_threshold,
                                 student_actions=self.student_actions, student_meta=self.student_meta)

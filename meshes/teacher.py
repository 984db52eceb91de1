"""The ``TeacherReplay`` actor: hosts the teacher backends and streams preference pairs back as they form.

A thin async shell over :class:`composer_replication.teacher_replay.TeacherReplayer` (any OpenAI-compatible
endpoint, ``local:<model>`` in-process, or ``recorded``: the session's own action, free):

- ``setup(teachers, ...)`` builds the replayer (validates the teachers; the API key never leaves this
  process). ``rejected_from_rollout=True`` (the recorded teacher's mode) leaves each pair's rejected side to
  the training step's own rollouts at the pair's state;
- ``replay(states, port=..., max_total_usd=..., ledger_path=...)`` replays every state against every teacher
  under the hard budget with the write-ahead ledger, and sends each state's consensus pair on ``port`` as
  ``("pair", PreferencePair)`` once all its teachers answered, ``("progress", done, total, spent_usd)`` after
  each call and ``("done", n_pairs, spent_usd)`` last. It returns ``{"pairs", "spent_usd", "n_calls", "errors"}``.
"""

from __future__ import annotations

import os
from typing import Any

from monarch.actor import Actor, current_rank

from meshes.supervision import FaultSpec, rank_endpoint

endpoint = rank_endpoint("teacher")  # errors name "teacher rank <r>"

__all__ = ["TeacherReplay"]


class TeacherReplay(Actor):
    """Teacher replay on one process of the teacher mesh (async: calls to the teachers overlap)."""

    def __init__(self) -> None:
        self.rank = int(current_rank().rank)
        self.replayer: Any = None
        self.agreement_threshold, self.rejected_from_rollout = 2, False
        self.fault: FaultSpec | None = None

    @endpoint
    async def setup(self, teachers: list[dict[str, Any]], *, agreement_threshold: int = 2, max_tokens: int = 256,
                    temperature: float | None = None, seed: int | None = 0, timeout_s: float = 120.0,
                    local_device: str = "cpu", inject_fault: str | None = None, threads: int = 0,
                    rejected_from_rollout: bool = False) -> dict[str, Any]:
        """Build the ``TeacherReplayer`` (``local:`` models load on the first replay); ``{"rank", "pid", "teachers"}``."""
        import torch

        from composer_replication.teacher_replay import TeacherReplayer

        if threads > 0:
            torch.set_num_threads(threads)
        self.replayer = TeacherReplayer(teachers, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                        timeout_s=timeout_s, local_device=local_device)
        self.agreement_threshold, self.rejected_from_rollout = agreement_threshold, rejected_from_rollout
        self.fault = FaultSpec(inject_fault) if inject_fault else None
        return {"rank": self.rank, "pid": os.getpid(), "teachers": [t["slug"] for t in self.replayer.teachers]}

    @endpoint
    async def replay(self, states: list[dict[str, Any]], *, port: Any = None, max_total_usd: float = 0.0,
                     ledger_path: str | None = None) -> dict[str, Any]:
        """Replay ``states`` against every teacher; stream pairs on ``port`` (a ``monarch.actor.Port``).

        Returns:
            ``{"pairs": [PreferencePair, ...] (state order), "spent_usd", "n_calls", "errors": {kind: count}}``.
        """
        if self.replayer is None:
            raise RuntimeError("call setup() before replay()")
        from composer_replication.teacher_replay import PairCollector

        if self.fault is not None:
            self.fault.maybe_fire("teacher", self.rank, 0)
        collector = PairCollector(states, num_teachers=len(self.replayer.teachers),
                                  agreement_threshold=self.agreement_threshold,
                                  rejected_from_rollout=self.rejected_from_rollout)
        formed: dict[str, Any] = {}
        errors: dict[str, int] = {}
        send = port.send if port is not None else lambda item: None

        def progress(event: Any) -> None:
            errors.clear()
            errors.update(event.errors)
            for pair in collector.add(event.result):
                formed[pair.state_id] = pair
                send(("pair", pair))
            send(("progress", event.done, event.total, event.spent_usd))

        results = await self.replayer.replay(states, max_total_usd=max_total_usd, ledger_path=ledger_path,
                                             progress=progress)
        pairs = [formed[s["state_id"]] for s in states if s["state_id"] in formed]
        spent = float(sum(r["cost_usd"] for r in results))
        send(("done", len(pairs), spent))
        return {"pairs": pairs, "spent_usd": spent, "n_calls": len(results), "errors": dict(errors)}

"""The ``TeacherReplay`` actor: hosts the teacher backends and streams DPO pairs back as they form.

A thin async shell over :class:`composer_replication.teacher_replay.TeacherReplayer` (HTTP teachers
through any OpenAI-compatible endpoint, ``local:<model>`` in-process, or ``recorded``: the session's own
action; the last two offline, cost 0):

- ``setup(teachers, ...)`` builds the replayer (validates the teacher list; resolves the API key,
  which never leaves this process); with ``student={...}`` it also loads the student model, whose own
  sampled action at each state is the rejected side of the pairs (the ``recorded`` teacher's mode);
- ``replay(states, port=..., max_total_usd=..., ledger_path=...)`` replays every state against every
  teacher under the hard budget, appending each finished call to the JSONL ledger (a killed replay
  resumes without paying twice), and, as soon as every teacher has answered a state, extracts that
  state's consensus pair and sends it on ``port`` as ``("pair", PreferencePair)``; progress goes out as
  ``("progress", done, total, spent_usd)``; a final ``("done", n_pairs, spent_usd)`` closes the stream.
  It returns ``{"pairs", "spent_usd", "n_calls", "errors"}``.
"""

from __future__ import annotations

import os
from typing import Any

from monarch.actor import Actor, current_rank, endpoint

from meshes.supervision import FaultSpec, names_rank

__all__ = ["TeacherReplay"]


class TeacherReplay(Actor):
    """Teacher replay on one process of the teacher mesh (async: calls to the teachers overlap)."""

    def __init__(self) -> None:
        self.rank = int(current_rank().rank)
        self.replayer: Any = None
        self.agreement_threshold = 2
        self.fault: FaultSpec | None = None

    @endpoint
    @names_rank("teacher")
    async def setup(
        self,
        teachers: list[dict[str, Any]],
        *,
        agreement_threshold: int = 2,
        max_tokens: int = 256,
        temperature: float | None = None,
        seed: int | None = 0,
        timeout_s: float = 120.0,
        local_device: str = "cpu",
        inject_fault: str | None = None,
        threads: int = 0,
        student: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Build the ``TeacherReplayer`` (``local:`` models load lazily on the first replay).

        ``student``: ``{"model", "model_seed", "max_new_tokens", "temperature", "top_p", "seed"}``
        (``RecipeConfig.student_samples()``), or ``None`` to keep the recorded action as the rejected side.

        Returns ``{"rank", "pid", "teachers"}``.
        """
        import torch

        from composer_replication.teacher_replay import LocalTeacher, TeacherReplayer
        from composer_replication.teacher_replay.recorded import StudentSampling

        if threads > 0:
            torch.set_num_threads(threads)
        sampler, sampling = None, None
        if student:
            s = dict(student)
            sampler = LocalTeacher(s.pop("model"), model_seed=s.pop("model_seed", 0), device=local_device)
            sampling = StudentSampling(**s)
        self.replayer = TeacherReplayer(teachers, max_tokens=max_tokens, temperature=temperature, seed=seed,
                                        timeout_s=timeout_s, local_device=local_device, student=sampler,
                                        student_sampling=sampling)
        self.agreement_threshold = agreement_threshold
        self.fault = FaultSpec(inject_fault) if inject_fault else None
        return {"rank": self.rank, "pid": os.getpid(), "teachers": [t["slug"] for t in self.replayer.teachers]}

    @endpoint
    @names_rank("teacher")
    async def replay(
        self,
        states: list[dict[str, Any]],
        *,
        port: Any = None,
        max_total_usd: float = 0.0,
        ledger_path: str | None = None,
    ) -> dict[str, Any]:
        """Replay ``states`` against every teacher; stream pairs on ``port`` (a ``monarch.actor.Port``) as they form.

        Returns:
            ``{"pairs": [DPOPair, ...] (state order), "spent_usd", "n_calls", "errors": {kind: count}}``.
        """
        if self.replayer is None:
            raise RuntimeError("call setup() before replay()")
        from composer_replication.teacher_replay import PairCollector

        if self.fault is not None:
            self.fault.maybe_fire("teacher", self.rank, 0)
        rp = self.replayer  # the student's own actions first: the rejected side of the pairs (recorded mode)
        samples = await rp.sample_student(states) if rp.student is not None else None
        collector = PairCollector(states, num_teachers=len(rp.teachers), agreement_threshold=self.agreement_threshold,
                                  student_actions=samples,
                                  student_meta=rp.student_sampling.metadata(0) if samples is not None else None)
        formed: dict[str, Any] = {}
        errors: dict[str, int] = {}

        def progress(event: Any) -> None:
            errors.clear()
            errors.update(event.errors)
            for pair in collector.add(event.result):
                formed[pair["state_id"]] = pair
                if port is not None:
                    port.send(("pair", pair))
            if port is not None:
                port.send(("progress", event.done, event.total, event.spent_usd))

        results = await self.replayer.replay(states, max_total_usd=max_total_usd, ledger_path=ledger_path,
                                             progress=progress)
        pairs = [formed[s["state_id"]] for s in states if s["state_id"] in formed]
        spent = float(sum(r["cost_usd"] for r in results))
        if port is not None:
            port.send(("done", len(pairs), spent))
        return {"pairs": pairs, "spent_usd": spent, "n_calls": len(results), "errors": dict(errors)}

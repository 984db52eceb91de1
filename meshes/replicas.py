"""DiLoCo replicas on meshes: one proc mesh per replica, a supervisor that restarts, moves or drops them.

:class:`ReplicaSet` is the controller's side of DiLoCo. Each replica slot ``i`` is a ``StudentTrainer`` in
its own 1-proc mesh (spawned by :class:`~meshes.hosts.ReplicaHosts`, on this host or on a worker), set up on
its disjoint data shard and joined to the torchft lighthouse (``join_diloco``). :meth:`ReplicaSet.step`
runs one inner step on every live replica at once (the outer sync runs inside the round's last step,
between the replicas, over gloo) and supervises them:

- **a replica raises or its process dies**: its proc mesh is stopped at once (its heartbeat ends, so the
  survivors' quorum goes on without it), the survivors' results are returned, and a fresh proc mesh is
  spawned and set up in the background. It joins at the first step where it can (same position in the
  round as the survivors) and heals from a live peer at the next sync (torchft checkpoint transport).
- **a replica does not answer within ``call_timeout_s``** (a lost host: Monarch reports nothing): the same
  on this host; on a worker, ``diloco.on_host_loss`` says ``replace`` (a spare worker), ``shrink`` or ``stop``.
- **more than ``diloco.max_restarts`` failures of one slot**, or fewer than ``diloco.min_replicas`` replicas
  left with none coming back: :class:`~meshes.supervision.ActorFailure` naming the replica and the cause.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from meshes.hosts import stop_quietly
from meshes.supervision import ActorFailure, to_failure, wait
from meshes.trainer import StudentTrainer

__all__ = ["ReplicaSet", "Replica"]


@dataclass
class Replica:
    """One replica slot's current incarnation."""

    index: int
    procs: Any
    actor: Any
    setup: Any = None
    """The pending ``setup`` future (``None`` once set up)."""
    started: float = field(default_factory=time.monotonic)


def _failure(rank: int | None, kind: str, what: str, detail: str) -> ActorFailure:
    return ActorFailure(actor="trainer", rank=rank, kind=kind, what=what, detail=detail)


def _poll(fut: Any, poll_s: float, deadline: float, what: str, timeout_s: float) -> tuple[bool, Any]:
    """``(finished, result)`` of ``fut`` after waiting up to ``poll_s``; the result is an :class:`ActorFailure` when
    the call failed, or when it has not answered by ``deadline`` (``time.monotonic()``)."""
    try:
        return True, fut.get(timeout=poll_s)
    except TimeoutError:
        if time.monotonic() < deadline:
            return False, None
        return True, to_failure(TimeoutError(), actor="trainer", what=what, timeout_s=timeout_s)
    except Exception as exc:  # noqa: BLE001 - classified by to_failure
        return True, to_failure(exc, actor="trainer", what=what)


class ReplicaSet:
    """Spawn, step, supervise and stop the DiLoCo replicas (see the module docstring).

    Args:
        hosts: a :class:`~meshes.hosts.ReplicaHosts` (where each slot's proc mesh goes).
        diloco: the ``DilocoConfig``.
        lighthouse_addr: ``http://host:port`` of the lighthouse (run by the controller).
        setup_args: ``setup_args(index) -> (args, kwargs)`` of ``StudentTrainer.setup`` for slot ``index``.
        setup_timeout_s / call_timeout_s: timeouts of a setup and of every other call.
        on_event: called with a text line for each restart, move or drop (the display).
    """

    def __init__(self, hosts: Any, diloco: Any, *, lighthouse_addr: str,
                 setup_args: Callable[[int], tuple[tuple, dict]], setup_timeout_s: float, call_timeout_s: float,
                 on_event: Callable[[str], None] | None = None) -> None:
        self.hosts, self.cfg, self.lighthouse_addr, self.setup_args = hosts, diloco, lighthouse_addr, setup_args
        self.setup_timeout_s, self.call_timeout_s = setup_timeout_s, call_timeout_s
        self.on_event = on_event or (lambda line: None)
        self.live: dict[int, Replica] = {}
        """Replicas that joined the DiLoCo group and train."""
        self.ready: dict[int, Replica] = {}
        """Set up, waiting to join (at the next step where a replica can join)."""
        self.pending: dict[int, Replica] = {}
        """Spawned, ``setup`` still running."""
        self.joining: dict[int, tuple[Replica, Any]] = {}
        """Replacements whose first step (waiting for the group's next quorum, then healing) is in flight."""
        self.restarts: dict[int, int] = dict.fromkeys(range(diloco.replicas), 0)
        self.dropped: set[int] = set()
        self.events: list[dict[str, Any]] = []
        """One entry per failure: ``{"replica", "kind", "detail", "step", "time"}`` (and ``"rejoined_step"``)."""

    def start(self) -> list[dict[str, Any]]:
        """Spawn and set up every replica (blocking); returns their ``setup`` infos, by slot.

        They join the DiLoCo group at the first :meth:`step` (after a resume has loaded their checkpoints).
        """
        for i in range(self.cfg.replicas):
            self._spawn(i)
        infos = []
        for i in range(self.cfg.replicas):
            rep = self.pending.pop(i)
            infos.append(wait(rep.setup, actor="trainer", timeout_s=self.setup_timeout_s, what=f"setup (replica {i})"))
            rep.setup = None
            self.ready[i] = rep
        return infos

    def _spawn(self, index: int) -> None:
        procs = self.hosts.spawn(index)
        actor = procs.spawn("trainer", StudentTrainer)
        args, kwargs = self.setup_args(index)
        self.pending[index] = Replica(index, procs, actor, setup=actor.setup.call_one(*args, **kwargs))

    def replicas(self) -> dict[int, Replica]:
        """Live and set-up replicas by slot (the ones a checkpoint load or an evaluation reaches)."""
        return dict(sorted({**self.ready, **self.live}.items()))

    def call(self, index: int, endpoint: str, *args: Any, what: str = "", **kwargs: Any) -> Any:
        """``endpoint(*args, **kwargs)`` on set-up replica ``index``, with the call timeout."""
        fut = getattr(self.replicas()[index].actor, endpoint).call_one(*args, **kwargs)
        return wait(fut, actor="trainer", timeout_s=self.call_timeout_s, what=what or endpoint)

    def call_all(self, endpoint: str, *args: Any, what: str = "", live_only: bool = False, **kwargs: Any) -> dict:
        """``endpoint`` on every set-up replica (``live_only``: every live one) at once; ``{index: result}``.

        Raises:
            ActorFailure: any replica failed.
        """
        targets = self.live if live_only else self.replicas()
        futs = {i: getattr(r.actor, endpoint).call_one(*args, **kwargs) for i, r in targets.items()}
        return {i: wait(f, actor="trainer", timeout_s=self.call_timeout_s, what=what or endpoint)
                for i, f in futs.items()}

    def step(self, step: int) -> dict[int, dict[str, Any]]:
        """Inner step ``step`` on every live replica; ``{index: metrics}`` (joiners' first step is not included).

        Raises:
            ActorFailure: a slot failed more than ``max_restarts`` times, a lost host under ``on_host_loss:
                stop`` or with no spare left, or no replica left to train.
        """
        self._admit(step)
        futures = {i: r.actor.train_step.call_one(step) for i, r in self.live.items()}
        results: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + self.call_timeout_s
        while futures:
            for i, fut in list(futures.items()):
                done, out = _poll(fut, 0.02, deadline, f"train_step({step})", self.call_timeout_s)
                if not done:
                    continue
                del futures[i]
                if isinstance(out, ActorFailure):
                    self._fail_replica(self.live.pop(i), out, step)
                else:
                    results[i] = out
        quorum = max((m.get("diloco/participants", 0.0) for m in results.values()), default=0.0)
        self._settle_joiners(step, wait=quorum > len(results))
        if not results and not self.joining:
            raise _failure(None, "died", f"train_step({step})", "no DiLoCo replica is left to train")
        return results

    def _admit(self, step: int) -> None:
        """Join the replicas whose setup is done; wait for replacements while fewer than ``min_replicas`` train.

        At the first step every replica joins in lockstep (the lighthouse has no earlier quorum, so the first
        one waits for all of them). A replacement joining a running group instead starts its own round at
        once (``local_step = period - delay - 1``): its first step asks for a quorum and blocks there until
        the group's next quorum takes it in and it heals from a peer. That step runs in flight
        (``joining``); the replica trains with the group from the step after that quorum.
        """
        period, delay = self.cfg.period, self.cfg.fragment_sync_delay
        while True:
            self._collect_setups(step)
            first = not self.live and not self.joining
            for i in sorted(self.ready):
                rep = self.live[i] = self.ready.pop(i)
                local_step = min(step % period, period - delay - 1) if first else period - delay - 1
                self.call(i, "join_diloco", self.cfg, lighthouse_addr=self.lighthouse_addr,
                          host=self.hosts.advertise_host(i), local_step=local_step, what="join_diloco")
                if not first:  # its first step runs in flight until the group's next quorum takes it in
                    self.joining[i] = (self.live.pop(i), rep.actor.train_step.call_one(step))
                for ev in self.events:
                    if ev["replica"] == i and ev.get("joined_step") is None:
                        ev["joined_step"] = step
            if len(self.live) + len(self.joining) >= self.cfg.min_replicas:
                return
            if not self.pending and not self.ready:
                raise _failure(None, "died", f"train_step({step})", f"only {len(self.live)} replica(s) left, "
                               f"'diloco.min_replicas' is {self.cfg.min_replicas}, and none is coming back")
            time.sleep(0.2)

    def _settle_joiners(self, step: int, *, wait: bool) -> None:
        """Move joiners whose first (in-flight) step finished into ``live``; with ``wait`` (the last quorum had
        more members than the live replicas), wait for them: they were in it and are finishing its sync."""
        for i, (rep, fut) in list(self.joining.items()):
            done, out = _poll(fut, self.call_timeout_s if wait else 0.01, float("-inf") if wait else float("inf"),
                              "first step after joining", self.call_timeout_s)
            if not done:
                continue
            self.joining.pop(i)
            if isinstance(out, ActorFailure):
                self._fail_replica(rep, out, step)
                continue
            self.live[i] = rep
            self.live = dict(sorted(self.live.items()))
            for ev in self.events:
                if ev["replica"] == i and "rejoined_step" not in ev:
                    ev["rejoined_step"], ev["healed_time"] = step, time.monotonic()
                    ev["healed_outer_step"] = out.get("diloco/outer_step")

    def _collect_setups(self, step: int) -> None:
        """Move replicas whose ``setup`` finished from ``pending`` to ``ready`` (a failed setup is a failure)."""
        for i, rep in list(self.pending.items()):
            done, out = _poll(rep.setup, 0.01, rep.started + self.setup_timeout_s, "setup", self.setup_timeout_s)
            if not done:
                continue
            self.pending.pop(i)
            if isinstance(out, ActorFailure):
                self._fail_replica(rep, out, step)
            else:
                rep.setup = None
                self.ready[i] = rep

    def _fail_replica(self, rep: Replica, failure: ActorFailure, step: int) -> None:
        """Stop the replica's procs, then restart it, move it, drop it, or raise (see the module docstring)."""
        i = rep.index
        if failure.rank != i:  # a replica's own 1-proc mesh reports its proc as rank 0: name the replica
            failure = _failure(i, failure.kind, failure.what, failure.detail)
        self.events.append({"replica": i, "kind": failure.kind, "detail": failure.detail[:300], "step": step,
                            "time": time.monotonic()})
        stop_quietly(f"replica {i} procs", rep.procs, 5.0, [])  # a dead or unreachable one may not stop cleanly
        where = self.hosts.where(i)
        if failure.kind == "timeout" and where != "local":
            lost, policy = self.hosts.describe(where), self.cfg.on_host_loss
            if policy == "stop":
                raise _failure(i, "timeout", f"train_step({step})", f"worker {lost} stopped answering (no reply "
                               f"within {self.call_timeout_s} s); 'diloco.on_host_loss' is stop")
            if policy == "shrink":
                self.dropped.add(i)
                self.on_event(f"replica {i}: worker {lost} lost; going on with {len(self.live)} replica(s)")
                return
            spare = self.hosts.spares[:1]
            new = self.hosts.replace_worker(i)
            if new is None:
                raise _failure(i, "timeout", f"train_step({step})", f"worker {lost} stopped answering and no spare "
                               "worker is left ('mesh.spare_workers', or its node to restart it on); add spares or "
                               "set diloco.on_host_loss: shrink")
            self.on_event(f"replica {i}: worker {lost} lost; moving it to "
                          f"{'spare worker' if spare == [new] else 'a new worker'} {self.hosts.describe(new)}")
        self.restarts[i] += 1
        if self.restarts[i] > self.cfg.max_restarts:
            raise _failure(i, failure.kind, failure.what, f"{failure.detail} (replica {i} failed {self.restarts[i]} "
                           f"time(s), more than 'diloco.max_restarts' = {self.cfg.max_restarts})")
        self.on_event(f"replica {i} failed ({failure}); restart {self.restarts[i]}/{self.cfg.max_restarts} "
                      "on a fresh proc mesh")
        self._spawn(i)

    def stop(self, *, timeout_s: float = 30.0) -> list[str]:
        """Stop every replica's manager (no quorum waits for a finished replica), then its procs; the errors met."""
        errors: list[str] = []
        futs = {i: r.actor.leave_diloco.call_one() for i, r in self.live.items()}
        for i, fut in futs.items():
            try:
                fut.get(timeout=timeout_s)
            except Exception as exc:  # noqa: BLE001 - shutdown goes on
                errors.append(f"replica {i} leave_diloco: {type(exc).__name__}: {str(exc)[:200]}")
        joining = {i: r for i, (r, _) in self.joining.items()}
        for i, rep in [*self.live.items(), *joining.items(), *self.ready.items(), *self.pending.items()]:
            stop_quietly(f"replica {i} procs", rep.procs, timeout_s, errors)
        for group in (self.live, self.joining, self.ready, self.pending):
            group.clear()
        return errors

"""MockManager: the ``torchft.Manager`` surface that torchft's ``DiLoCo`` uses, over an object-store allreduce.

torchft 0.2.0's DiLoCo reads ``_use_async_quorum`` and calls ``register_state_dict_fn``, ``allow_state_dict_read`` /
``disallow_state_dict_read``, ``start_quorum``, ``current_step`` (it picks the fragment), ``allreduce`` (a work with
``.wait()`` and ``.get_future()``) and ``should_commit``; ``tests/diloco/serverless/test_manager.py`` reads torchft's
source and fails when DiLoCo calls a member this class lacks (run it after a torchft upgrade). The first
``work.wait()`` of a sync sends every queued tensor as one round; a dropped round is dropped on every replica, so
``should_commit()`` is ``False`` everywhere and DiLoCo restores the last global parameters everywhere.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from composer_replication.diloco.serverless.allreduce import ObjectStoreAllReduce, RunConflictError

__all__ = ["MockManager", "DroppedRoundError"]

log = logging.getLogger(__name__)


class DroppedRoundError(RuntimeError):
    """More consecutive rounds were dropped than ``max_dropped_rounds`` allows."""


class _StoreWork:
    """What ``MockManager.allreduce`` returns: ``wait()`` runs the queued round once (errors go to ``should_commit``)."""

    def __init__(self, manager: MockManager, tensor: torch.Tensor) -> None:
        self._manager, self._tensor = manager, tensor
        self._future: torch.futures.Future = torch.futures.Future()

    def wait(self, timeout: timedelta | None = None) -> bool:
        self._manager._flush()
        return True

    def get_future(self) -> torch.futures.Future:
        """Completed with ``[tensor]`` once the round ran (``.then`` callbacks run then)."""
        return self._future


class MockManager:
    """A duck-typed ``torchft.Manager`` for DiLoCo whose allreduce goes through ``allreduce`` (the replica's
    :class:`ObjectStoreAllReduce`: its ``rank``, ``world_size`` and ``min_world_size``, torchft's
    ``_min_replica_size``).

    ``max_dropped_rounds``: ``None`` logs a dropped round and tries the next; ``k`` raises :class:`DroppedRoundError`
    from ``should_commit`` at the ``k+1``-th consecutive one (after DiLoCo restored the global parameters).
    ``dropped_rounds`` counts them. A :class:`RunConflictError` is never a dropped round: it propagates.
    """

    def __init__(self, allreduce: ObjectStoreAllReduce, *, max_dropped_rounds: int | None = None) -> None:
        if max_dropped_rounds is not None and (not isinstance(max_dropped_rounds, int) or max_dropped_rounds < 0):
            raise ValueError(f"max_dropped_rounds must be None or an int >= 0, got {max_dropped_rounds!r}")
        self._allreduce, self.max_dropped_rounds = allreduce, max_dropped_rounds
        self.rank, self.world_size = allreduce.rank, allreduce.world_size
        self._use_async_quorum, self._min_replica_size = False, allreduce.min_world_size
        self._step = self._batches_committed = 0
        self._queue: list[tuple[_StoreWork, bool]] = []
        self._error: Exception | None = None
        self._last_participants, self._readable = allreduce.world_size, True
        self._fns: dict[str, tuple[Callable[[Any], None], Callable[[], Any]]] = {}
        self.dropped_rounds = self.consecutive_dropped_rounds = 0

    def num_participants(self) -> int:
        """Replicas averaged in the last round (fewer under elastic membership), or 1 after a dropped round."""
        return self._last_participants

    def register_state_dict_fn(self, key: str, load_state_dict: Callable[[Any], None],
                               state_dict: Callable[[], Any]) -> None:
        """Register a component's ``(load, save)`` functions; keys are unique, as in torchft."""
        if key in self._fns:
            raise ValueError(f"state dict key {key!r} is already registered; build one DiLoCo per manager")
        self._fns[key] = (load_state_dict, state_dict)

    def allow_state_dict_read(self) -> None:
        self._readable = True

    def disallow_state_dict_read(self) -> None:
        self._readable = False

    def state_dict(self) -> dict[str, int]:
        """``{"step", "batches_committed"}``, as ``torchft.Manager.state_dict``."""
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        self._step, self._batches_committed = int(state_dict["step"]), int(state_dict["batches_committed"])

    def user_state_dict(self) -> dict[str, Any]:
        """Every registered component's state (DiLoCo's backups and outer optimizers), for a checkpoint.

        Raises:
            RuntimeError: called during a sync, while DiLoCo has disallowed state-dict reads.
        """
        if not self._readable:
            raise RuntimeError("state dict read during a DiLoCo sync; checkpoint between inner steps")
        return {key: save() for key, (_, save) in self._fns.items()}

    def load_user_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`user_state_dict` returned (build DiLoCo first: its keys must be registered)."""
        for key, value in state.items():
            self._fns[key][0](value)

    def start_quorum(self, allow_heal: bool = True, shrink_only: bool = False,
                     timeout: timedelta | None = None) -> None:
        """Begin a sync: forget the previous round's error (membership is the store's)."""
        self._error = None

    def allreduce(self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None) -> _StoreWork:
        """Queue ``tensor`` (any shape, floating) to be averaged in place across replicas.

        ``should_quantize`` is ignored (full precision). ``reduce_op``: ``None``/``ReduceOp.AVG`` average,
        ``ReduceOp.SUM`` sums (the mean times the participants).
        """
        name = (getattr(reduce_op, "name", None) or str(reduce_op or "AVG").rsplit(".", 1)[-1]).upper()
        if name not in ("AVG", "SUM"):
            raise ValueError(f"MockManager.allreduce supports ReduceOp.AVG and ReduceOp.SUM, got {reduce_op!r}")
        work = _StoreWork(self, tensor)
        self._queue.append((work, name == "SUM"))
        return work

    def _flush(self) -> None:
        """Run the queued tensors as one round; a failure is recorded for ``should_commit`` (a conflict raises)."""
        if not self._queue:
            return
        queue, self._queue = self._queue, []
        if self._error is None:
            try:
                self._allreduce.allreduce_tensors([w._tensor for w, _ in queue], name=f"step_{self._step}")
                self._last_participants = len(self._allreduce.last_participants)
                for w, as_sum in queue:
                    if as_sum:
                        w._tensor.mul_(self._last_participants)
            except RunConflictError:
                raise
            except Exception as exc:  # noqa: BLE001 - reported through should_commit, like torchft
                self.report_error(exc)
        for w, _ in queue:
            w._future.set_result([w._tensor])

    def report_error(self, e: Exception) -> None:
        """Mark the current round as failed; ``should_commit`` will return ``False``."""
        log.warning("replica %d: round at step %d failed: %s", self.rank, self._step, e)
        self._error = e

    def errored(self) -> Exception | None:
        return self._error

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """``True`` when the round's allreduce succeeded (on every replica alike); then the step advances.

        Raises:
            DroppedRoundError: more than ``max_dropped_rounds`` consecutive rounds were dropped.
        """
        self._flush()
        if self._error is None:
            self._step += 1
            self._batches_committed += self._last_participants
            self.consecutive_dropped_rounds = 0
            return True
        self._last_participants, error, self._error = 1, self._error, None
        self.dropped_rounds, self.consecutive_dropped_rounds = self.dropped_rounds + 1, self.consecutive_dropped_rounds + 1
        if self.max_dropped_rounds is not None and self.consecutive_dropped_rounds > self.max_dropped_rounds:
            raise DroppedRoundError(
                f"replica {self.rank}: {self.consecutive_dropped_rounds} consecutive round(s) dropped "
                f"(max_dropped_rounds={self.max_dropped_rounds}); last error: {error}. The parameters are the last "
                "global ones; restart the missing replicas, or pass max_dropped_rounds=None to go on") from error
        return False

    def current_step(self) -> int:
        """Committed rounds so far (the same on every replica; DiLoCo picks the fragment from it)."""
        return self._step

    def shutdown(self, wait: bool = True) -> None:
        """Release the store's run (``ObjectStoreAllReduce.close``)."""
        self._allreduce.close()

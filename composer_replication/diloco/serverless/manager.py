"""MockManager: the ``torchft.Manager`` surface that torchft's ``DiLoCo`` uses, over an object-store allreduce.

torchft's DiLoCo (``torchft.local_sgd``, torchft 0.2.0) talks to its manager through a handful of members:
``_use_async_quorum`` (read by the constructor), ``register_state_dict_fn``, ``allow_state_dict_read`` /
``disallow_state_dict_read``, ``start_quorum``, ``current_step`` (picks the fragment to sync),
``allreduce(t, should_quantize=...)`` returning a work with ``.wait()`` and ``.get_future()``, and
``should_commit``. This class implements exactly that, plus the read-only members a training loop asks
(``num_participants``, ``rank``, ``errored``, ``state_dict``), with no lighthouse, no TCP store and no
process group: the pseudo-gradients go through :class:`ObjectStoreAllReduce`.

A sync round: DiLoCo calls ``allreduce`` once per parameter (or bucket); the tensors are queued and the
first ``work.wait()`` sends them all as one object-store round. If that round is aborted (a replica did
not write in time), it was aborted on every replica, so ``should_commit()`` returns ``False`` everywhere,
DiLoCo restores the last global parameters on every replica and the replicas stay identical. With
``max_dropped_rounds`` set, one drop too many raises :class:`DroppedRoundError` from ``should_commit``
after DiLoCo has restored those parameters: the run stops cleanly instead of training alone.

The surface test (tests/diloco/serverless/test_manager_surface.py) reads torchft's DiLoCo source and
fails when it calls a manager member that this class lacks: run it after every torchft upgrade.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from composer_replication.diloco.serverless.allreduce import ObjectStoreAllReduce

__all__ = ["MockManager", "DroppedRoundError"]

log = logging.getLogger(__name__)


class DroppedRoundError(RuntimeError):
    """More consecutive rounds were dropped than ``max_dropped_rounds`` allows."""


class _StoreWork:
    """The work object ``MockManager.allreduce`` returns: ``wait()`` runs the queued round once."""

    def __init__(self, manager: MockManager, tensor: torch.Tensor) -> None:
        self._manager = manager
        self._tensor = tensor
        self._future: torch.futures.Future = torch.futures.Future()

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Send every queued tensor as one round (the first call does), then return ``True``.

        A failed round does not raise here: like torchft, the error is reported to the manager and
        ``should_commit()`` returns ``False``.
        """
        self._manager._flush()
        return True

    def get_future(self) -> torch.futures.Future:
        """A future completed with ``[tensor]`` once the round ran (callbacks added with ``.then`` run then)."""
        return self._future

    def is_completed(self) -> bool:
        """Whether the round carrying this tensor has run."""
        return self._future.done()

    def block_current_stream(self, timeout: timedelta | None = None) -> None:
        """Same as ``wait`` (the object-store round is synchronous)."""
        self.wait(timeout)

    def synchronize(self) -> None:
        """Same as ``wait``."""
        self.wait()


class MockManager:
    """A duck-typed ``torchft.Manager`` for DiLoCo whose allreduce goes through an object store.

    Args:
        allreduce: the replica's :class:`ObjectStoreAllReduce` (its ``rank`` and ``world_size`` are the
            replica's).
        max_dropped_rounds: ``None`` (default): a dropped round is logged and training goes on (DiLoCo
            restores the last global parameters and the next round tries again). An int ``k``: the
            ``k+1``-th consecutive dropped round raises :class:`DroppedRoundError` from ``should_commit``.

    Members DiLoCo touches: ``allreduce``, ``should_commit``, ``start_quorum``, ``current_step``,
    ``register_state_dict_fn``, ``allow_state_dict_read``, ``disallow_state_dict_read``,
    ``_use_async_quorum`` (private torchft attribute, always ``False``). Extras: ``num_participants``,
    ``rank``, ``world_size``, ``errored``, ``report_error``, ``state_dict``, ``load_state_dict``,
    ``batches_committed``, ``is_participating``, ``participating_rank``, ``wait_quorum``, ``shutdown``.
    """

    def __init__(self, allreduce: ObjectStoreAllReduce, *, max_dropped_rounds: int | None = None) -> None:
        for member in ("allreduce_tensors", "rank", "world_size"):
            if not hasattr(allreduce, member):
                raise TypeError(
                    f"MockManager needs an ObjectStoreAllReduce (missing .{member}), got "
                    f"{type(allreduce).__name__}"
                )
        if max_dropped_rounds is not None and (
            not isinstance(max_dropped_rounds, int) or max_dropped_rounds < 0
        ):
            raise ValueError(f"max_dropped_rounds must be None or an int >= 0, got {max_dropped_rounds!r}")
        self._allreduce = allreduce
        self._use_async_quorum = False
        self.max_dropped_rounds = max_dropped_rounds
        self._step = 0
        self._batches_committed = 0
        self._queue: list[tuple[_StoreWork, bool]] = []
        self._error: Exception | None = None
        self._last_participants = allreduce.world_size
        self._load_fns: dict[str, Callable[[Any], None]] = {}
        self._save_fns: dict[str, Callable[[], Any]] = {}
        self._state_dict_readable = True
        self.dropped_rounds = 0
        self.consecutive_dropped_rounds = 0

    # ------------------------------------------------------------------------ identity

    @property
    def rank(self) -> int:
        """This replica's rank among the replicas."""
        return self._allreduce.rank

    @property
    def world_size(self) -> int:
        """Number of replicas."""
        return self._allreduce.world_size

    def num_participants(self) -> int:
        """Replicas averaged in the last round (``world_size``, fewer under an elastic allreduce), or 1 (this
        one) after a dropped round."""
        return self._last_participants

    def participating_rank(self) -> int | None:
        """The rank, as torchft reports it for a participating replica."""
        return self.rank

    def is_participating(self) -> bool:
        """Always ``True``: every replica contributes to every round (there is no healing)."""
        return True

    # ------------------------------------------------------------------------ state dict

    def register_state_dict_fn(
        self, key: str, load_state_dict: Callable[[Any], None], state_dict: Callable[[], Any]
    ) -> None:
        """Register a component's ``(load, save)`` functions; keys are unique, as in torchft."""
        if key in self._load_fns:
            raise ValueError(f"state dict key {key!r} is already registered; build one DiLoCo per manager")
        self._load_fns[key] = load_state_dict
        self._save_fns[key] = state_dict

    def allow_state_dict_read(self) -> None:
        """DiLoCo calls this when its parameters are consistent again."""
        self._state_dict_readable = True

    def disallow_state_dict_read(self) -> None:
        """DiLoCo calls this while it swaps parameters during a sync."""
        self._state_dict_readable = False

    def state_dict(self) -> dict[str, int]:
        """``{"step", "batches_committed"}``, as ``torchft.Manager.state_dict``."""
        return {"step": self._step, "batches_committed": self._batches_committed}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Restore the step counters saved by :meth:`state_dict`."""
        self._step = int(state_dict["step"])
        self._batches_committed = int(state_dict["batches_committed"])

    def user_state_dict(self) -> dict[str, Any]:
        """Every registered component's state (DiLoCo's backups and outer optimizers), for a checkpoint.

        Raises:
            RuntimeError: called during a sync, while DiLoCo has disallowed state-dict reads.
        """
        if not self._state_dict_readable:
            raise RuntimeError("state dict read during a DiLoCo sync; checkpoint between inner steps")
        return {key: fn() for key, fn in self._save_fns.items()}

    def load_user_state_dict(self, state: dict[str, Any]) -> None:
        """Load what :meth:`user_state_dict` returned (keys must be registered)."""
        for key, value in state.items():
            if key not in self._load_fns:
                raise KeyError(f"no state dict function registered for {key!r}; build DiLoCo before loading")
            self._load_fns[key](value)

    # ------------------------------------------------------------------------ rounds

    def start_quorum(
        self, allow_heal: bool = True, shrink_only: bool = False, timeout: timedelta | None = None
    ) -> None:
        """Begin a sync: forget the previous round's error (there is no quorum to compute)."""
        self._error = None

    def wait_quorum(self) -> None:
        """Nothing to wait for: membership is fixed."""

    def allreduce(
        self, tensor: torch.Tensor, should_quantize: bool = False, reduce_op: Any = None
    ) -> _StoreWork:
        """Queue ``tensor`` (any shape, floating) to be averaged in place across replicas.

        ``should_quantize`` is accepted and ignored (tensors travel at full precision). ``reduce_op``:
        ``None`` or ``ReduceOp.AVG`` average, ``ReduceOp.SUM`` sums (mean times participants).
        """
        name = getattr(reduce_op, "name", None) or str(reduce_op or "AVG").rsplit(".", 1)[-1]
        if name.upper() not in ("AVG", "SUM"):
            raise ValueError(
                f"MockManager.allreduce supports ReduceOp.AVG and ReduceOp.SUM, got {reduce_op!r}"
            )
        work = _StoreWork(self, tensor)
        self._queue.append((work, name.upper() == "SUM"))
        return work

    def _flush(self) -> None:
        """Run the queued tensors as one object-store round; record a failure instead of raising."""
        if not self._queue:
            return
        queue, self._queue = self._queue, []
        tensors = [w._tensor for w, _ in queue]
        if self._error is None:
            try:
                self._allreduce.allreduce_tensors(tensors, name=f"step_{self._step}")
                for w, as_sum in queue:
                    if as_sum:
                        w._tensor.mul_(self.world_size)
            except Exception as exc:  # noqa: BLE001 - reported through should_commit, like torchft
                self.report_error(exc)
        for w, _ in queue:
            w._future.set_result([w._tensor])

    def report_error(self, e: Exception) -> None:
        """Mark the current round as failed; ``should_commit`` will return ``False``."""
        log.warning("replica %d: round at step %d failed: %s", self.rank, self._step, e)
        self._error = e

    def errored(self) -> Exception | None:
        """The current round's error, or ``None``."""
        return self._error

    def should_commit(self, timeout: timedelta | None = None) -> bool:
        """``True`` when the round's allreduce succeeded (on every replica alike); then the step advances.

        Raises:
            DroppedRoundError: more than ``max_dropped_rounds`` consecutive rounds were dropped.
        """
        self._flush()
        if self._error is None:
            self._step += 1
            self._batches_committed += self.world_size
            self._last_participants = len(
                getattr(self._allreduce, "last_participants", range(self.world_size))
            )
            self.consecutive_dropped_rounds = 0
            return True
        self._last_participants = 1
        self.dropped_rounds += 1
        self.consecutive_dropped_rounds += 1
        error, self._error = self._error, None
        if self.max_dropped_rounds is not None and self.consecutive_dropped_rounds > self.max_dropped_rounds:
            raise DroppedRoundError(
                f"replica {self.rank}: {self.consecutive_dropped_rounds} consecutive round(s) dropped "
                f"(max_dropped_rounds={self.max_dropped_rounds}); last error: {error}. The parameters are the "
                "last global ones; restart the missing replicas, or pass max_dropped_rounds=None to go on"
            ) from error
        return False

    def current_step(self) -> int:
        """Committed rounds so far (the same on every replica; DiLoCo picks the fragment from it)."""
        return self._step

    def batches_committed(self) -> int:
        """Replica-rounds committed so far (``world_size`` per committed round)."""
        return self._batches_committed

    def shutdown(self, wait: bool = True) -> None:
        """Nothing to stop (no threads, no sockets)."""

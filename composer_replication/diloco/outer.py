"""DiLoCo outer loop: a validating constructor over ``torchft.local_sgd.DiLoCo``, with a finiteness guard.

DiLoCo (Douillard et al., arXiv 2311.08105): ``sync_every`` inner steps, then the replicas average the
pseudo-gradient ``theta_global - theta_local`` and apply it with an outer SGD (lr 0.7, momentum 0.9, Nesterov);
Streaming DiLoCo (arXiv 2501.18512) syncs fragments in turn. The algorithm is torchft's; this module builds one
outer optimizer per fragment, names misconfigurations, and keeps a non-finite pseudo-gradient out of the mean
(torchft averages whatever it is given: one replica's NaN would reach every replica's model).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

try:  # torchft is a pinned dependency, but keep the package importable without it
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.work import _DummyWork

    _TORCHFT_AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only where torchft is absent
    DiLoCo = Manager = _DummyWork = None
    _TORCHFT_AVAILABLE = False

__all__ = ["DiLoCo", "Manager", "_DummyWork", "_TORCHFT_AVAILABLE", "make_diloco_outer_loop"]

log = logging.getLogger(__name__)


def _finite(tensors: Any) -> bool:
    """No NaN or inf in ``tensors`` (a sum first, 2-5x cheaper; an overflowing sum is checked element-wise)."""
    return all(bool(t.sum().isfinite()) or bool(torch.isfinite(t).all()) for t in tensors)


class FiniteGuard:
    """Keeps a replica's non-finite pseudo-gradient out of the outer mean, on every manager alike.

    A replica whose pseudo-gradient holds a NaN or inf sends zeros and a 0 (else 1) in one more
    ``allreduce(flag, reduce_op=SUM)``; the mean is then rescaled to the finite replicas. Fewer of them than the
    manager's ``_min_replica_size`` reports the same error on every replica (the round is dropped everywhere). The
    replica that sent zeros skips its local step: its parameters take the global ones before DiLoCo merges, and the
    non-finite entries of its inner optimizer's state are dropped. Of the last sync: ``excluded`` (replicas left
    out), ``own`` (this one was), ``own_rounds``, ``streak`` (consecutive syncs it was). It also uses the manager's
    ``num_participants``, ``errored``, ``report_error`` and ``current_step``.
    """

    def __init__(self, manager: Any, inner_optimizer: torch.optim.Optimizer, fragments: list[Any]) -> None:
        self.manager, self.inner = manager, inner_optimizer
        self.min_finite = max(1, int(getattr(manager, "_min_replica_size", 1) or 1))
        self.excluded, self.own, self.own_rounds, self.streak = 0, False, 0, 0
        for frag in fragments:
            self._hook(frag)

    def _hook(self, frag: Any) -> None:
        from torch.distributed import ReduceOp

        save_grads, wait, save_local = frag._save_grads, frag.wait, frag._save_local_parameters
        state: dict[str, Any] = {"work": None, "own": False}

        def guarded_save_grads() -> None:
            save_grads()
            grads = list(frag._grads.values())
            state["own"] = own = not _finite(grads)
            for g in grads if own else ():
                g.zero_()
            state["flag"] = torch.full((1,), 0.0 if own else 1.0, device=grads[0].device)
            state["work"] = self.manager.allreduce(state["flag"], reduce_op=ReduceOp.SUM)

        def guarded_wait() -> None:
            pending = bool(frag._allreduce_work) and state["work"] is not None
            wait()
            if pending:
                state["work"], work = None, state["work"]
                work.wait()
                self._settle(frag, state["own"], float(state["flag"].item()))

        def guarded_save_local() -> None:
            if state["own"]:  # the skipped local step: the global parameters stand in for the local ones
                frag.restore_parameters()
            save_local()

        frag._save_grads, frag.wait, frag._save_local_parameters = guarded_save_grads, guarded_wait, guarded_save_local

    def _settle(self, frag: Any, own: bool, n_finite: float) -> None:
        n, finite = int(self.manager.num_participants()), int(round(n_finite))
        self.excluded, self.own = max(n - finite, 0), own
        self.own_rounds, self.streak = self.own_rounds + own, self.streak + 1 if own else 0
        if own:
            for p in [p for p, s in self.inner.state.items() if not _finite(v for v in s.values() if torch.is_tensor(v))]:
                del self.inner.state[p]
        if self.manager.errored() or n < 1:
            return
        grads = list(frag._grads.values())
        if finite < self.min_finite:
            self.manager.report_error(RuntimeError(
                f"outer round at manager step {self.manager.current_step()}: {n - finite} of {n} replica(s) sent a "
                f"non-finite pseudo-gradient (NaN or inf); {finite} finite is fewer than the {self.min_finite} a round "
                "needs, so the round is dropped on every replica"))
        elif finite < n:
            for g in grads:
                g.mul_(n / finite)
        if not _finite(grads):
            self.manager.report_error(RuntimeError("the averaged pseudo-gradient overflowed; the round is dropped"))


def _validate(model_fragments: Any, inner_optimizer: Any, outer_lr: float, outer_momentum: float, nesterov: bool,
              sync_every: Any, fragment_sync_delay: Any, fragment_update_alpha: float) -> None:
    """Raise ``ValueError``/``TypeError`` naming the first bad argument (see ``make_diloco_outer_loop``)."""
    if not isinstance(model_fragments, (list, tuple)) or len(model_fragments) == 0:
        raise ValueError(f"model_fragments must be a non-empty list of nn.Module, got {model_fragments!r}; pass "
                         "[model] for vanilla DiLoCo or a list of sub-modules for Streaming DiLoCo")
    for i, frag in enumerate(model_fragments):
        if not isinstance(frag, torch.nn.Module):
            raise TypeError(f"model_fragments[{i}] must be a torch.nn.Module, got {type(frag).__name__}")
        if next(iter(frag.parameters()), None) is None:
            raise ValueError(f"model_fragments[{i}] has no parameters; drop it from model_fragments")
    if not isinstance(inner_optimizer, torch.optim.Optimizer):
        raise TypeError(f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}")
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1 (inner steps per outer round), got {sync_every!r}")
    n = len(model_fragments)
    checks = [
        (sync_every % n == 0, f"sync_every={sync_every} must be a multiple of the number of fragments ({n}): each "
         "fragment syncs every sync_every/len(model_fragments) steps"),
        (isinstance(fragment_sync_delay, int) and fragment_sync_delay >= 0,
         f"fragment_sync_delay must be an int >= 0, got {fragment_sync_delay!r}"),
        (not isinstance(fragment_sync_delay, int) or fragment_sync_delay < sync_every // n, f"fragment_sync_delay={fragment_sync_delay} must be < "
         f"sync_every/len(model_fragments)={sync_every // n}; lower the delay or raise sync_every"),
        (0.0 <= float(fragment_update_alpha) <= 1.0, "fragment_update_alpha must be in [0, 1] (0 = take the global "
         f"weights), got {fragment_update_alpha!r}"),
        (float(outer_lr) > 0.0, f"outer_lr must be > 0 (DiLoCo uses 0.7), got {outer_lr!r}"),
        (0.0 <= float(outer_momentum) < 1.0, f"outer_momentum must be in [0, 1) (DiLoCo uses 0.9), got {outer_momentum!r}"),
        (not nesterov or outer_momentum != 0.0, "nesterov=True needs outer_momentum > 0; set nesterov=False or "
         "outer_momentum=0.9"),
    ]
    for ok, message in checks:
        if not ok:
            raise ValueError(message)


def make_diloco_outer_loop(manager: Any, model_fragments: list[torch.nn.Module], inner_optimizer: torch.optim.Optimizer,
                           *, outer_lr: float = 0.7, outer_momentum: float = 0.9, nesterov: bool = True,
                           sync_every: int = 100, fragment_sync_delay: int = 0,
                           fragment_update_alpha: float = 0.0) -> Any:
    """Build a ``torchft.local_sgd.DiLoCo`` with one outer SGD per fragment and a :class:`FiniteGuard`.

    Build it after the weights are loaded (torchft snapshots them as the first global backup and registers
    ``StreamingDiLoCoFragment_<i>`` state with the manager: one per manager). ``with outer:`` hooks
    ``inner_optimizer.step()``; the outer step runs inside the ``sync_every``-th inner step.

    Args:
        manager: a ``torchft.Manager`` with ``use_async_quorum=False``, or any object with the surface DiLoCo uses
            (``MockManager``).
        model_fragments: one module for vanilla DiLoCo, N disjoint modules for Streaming DiLoCo.
        inner_optimizer: the optimizer stepped every batch (e.g. AdamW over the whole model).
        outer_lr, outer_momentum, nesterov: the outer SGD.
        sync_every: inner steps per outer round (one sweep over all fragments).
        fragment_sync_delay: steps by which a fragment's allreduce starts early (0 = vanilla).
        fragment_update_alpha: after a sync ``theta = global + alpha * (local - global)`` (0 = global).

    Returns:
        The ``DiLoCo`` instance; ``.finite_guard`` is its :class:`FiniteGuard`.

    Raises:
        RuntimeError: torchft is not installed.
        ValueError / TypeError: a bad argument (the message names it and the fix), or an asynchronous quorum.
    """
    if not _TORCHFT_AVAILABLE:
        raise RuntimeError("make_diloco_outer_loop needs torchft, which is not importable: pip install torchft==0.2.0 "
                           "(it is a dependency of composer-replication: pip install -e .)")
    _validate(model_fragments, inner_optimizer, outer_lr, outer_momentum, nesterov, sync_every, fragment_sync_delay,
              fragment_update_alpha)
    if getattr(manager, "_use_async_quorum", False):
        raise ValueError("DiLoCo needs a synchronous quorum: build the torchft Manager with use_async_quorum=False")
    outer_optimizers = [torch.optim.SGD(f.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
                        for f in model_fragments]
    log.info("DiLoCo: %d fragment(s), sync_every=%d, delay=%d, alpha=%s, outer SGD(lr=%s, momentum=%s, nesterov=%s)",
             len(model_fragments), sync_every, fragment_sync_delay, fragment_update_alpha, outer_lr, outer_momentum,
             nesterov)
    outer = DiLoCo(manager, list(model_fragments), inner_optimizer, outer_optimizers, sync_every=sync_every,
                   fragment_sync_delay=fragment_sync_delay, fragment_update_alpha=fragment_update_alpha)
    outer.finite_guard = FiniteGuard(manager, inner_optimizer, outer._fragments)
    return outer

"""DiLoCo outer loop: a thin, validating constructor over ``torchft.local_sgd.DiLoCo``.

DiLoCo (Douillard et al., arXiv 2311.08105) runs ``sync_every`` local inner-optimizer steps, then
averages the pseudo-gradient ``Δ = θ_global - θ_local`` across replicas and applies it with an
outer SGD (lr 0.7, momentum 0.9, Nesterov). Streaming DiLoCo (arXiv 2501.18512) splits the model
into fragments that sync in turn, optionally ``fragment_sync_delay`` steps early, and mixes the
result as ``θ = global + α·(local - global)``.

The algorithm itself is torchft's; this module only builds one outer optimizer per fragment (torchft
takes optimizers, not an ``outer_lr``) and turns misconfigurations into errors that say how to fix them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

try:  # torchft is a pinned dependency, but keep the package importable without it.
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager
    from torchft.work import _DummyWork

    _TORCHFT_AVAILABLE = True
except ImportError:  # pragma: no cover - exercised only where torchft is absent
    DiLoCo = None
    Manager = None
    _DummyWork = None
    _TORCHFT_AVAILABLE = False

__all__ = ["DiLoCo", "Manager", "_DummyWork", "_TORCHFT_AVAILABLE", "make_diloco_outer_loop"]

log = logging.getLogger(__name__)

_INSTALL_HINT = "pip install torchft==0.2.0 (it is a dependency of composer-replication: pip install -e .)"


def _validate(
    model_fragments: list[torch.nn.Module],
    inner_optimizer: Any,
    *,
    outer_lr: float,
    outer_momentum: float,
    nesterov: bool,
    sync_every: int,
    fragment_sync_delay: int,
    fragment_update_alpha: float,
) -> None:
    """Raise ``ValueError``/``TypeError`` naming the first bad argument (see ``make_diloco_outer_loop``)."""
    if not isinstance(model_fragments, (list, tuple)) or len(model_fragments) == 0:
        raise ValueError(
            f"model_fragments must be a non-empty list of nn.Module, got {model_fragments!r}; "
            "pass [model] for vanilla DiLoCo or a list of sub-modules for Streaming DiLoCo"
        )
    for i, frag in enumerate(model_fragments):
        if not isinstance(frag, torch.nn.Module):
            raise TypeError(f"model_fragments[{i}] must be a torch.nn.Module, got {type(frag).__name__}")
        if next(iter(frag.parameters()), None) is None:
            raise ValueError(f"model_fragments[{i}] has no parameters; drop it from model_fragments")
    if not isinstance(inner_optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"inner_optimizer must be a torch.optim.Optimizer, got {type(inner_optimizer).__name__}"
        )
    if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
        raise ValueError(f"sync_every must be an int >= 1 (inner steps per outer round), got {sync_every!r}")
    n_frag = len(model_fragments)
    if sync_every % n_frag != 0:
        raise ValueError(
            f"sync_every={sync_every} must be a multiple of the number of fragments ({n_frag}): "
            "each fragment syncs every sync_every/len(model_fragments) steps"
        )
    per_fragment = sync_every // n_frag
    if not isinstance(fragment_sync_delay, int) or fragment_sync_delay < 0:
        raise ValueError(f"fragment_sync_delay must be an int >= 0, got {fragment_sync_delay!r}")
    if fragment_sync_delay >= per_fragment:
        raise ValueError(
            f"fragment_sync_delay={fragment_sync_delay} must be < sync_every/len(model_fragments)="
            f"{per_fragment}; lower the delay or raise sync_every"
        )
    if not 0.0 <= float(fragment_update_alpha) <= 1.0:
        raise ValueError(
            f"fragment_update_alpha must be in [0, 1] (0 = take the global weights), got {fragment_update_alpha!r}"
        )
    if not float(outer_lr) > 0.0:
        raise ValueError(f"outer_lr must be > 0 (DiLoCo uses 0.7), got {outer_lr!r}")
    if not 0.0 <= float(outer_momentum) < 1.0:
        raise ValueError(f"outer_momentum must be in [0, 1) (DiLoCo uses 0.9), got {outer_momentum!r}")
    if nesterov and outer_momentum == 0.0:
        raise ValueError("nesterov=True needs outer_momentum > 0; set nesterov=False or outer_momentum=0.9")


def make_diloco_outer_loop(
    manager: Any,
    model_fragments: list[torch.nn.Module],
    inner_optimizer: torch.optim.Optimizer,
    *,
    outer_lr: float = 0.7,
    outer_momentum: float = 0.9,
    nesterov: bool = True,
    sync_every: int = 100,
    fragment_sync_delay: int = 0,
    fragment_update_alpha: float = 0.0,
) -> Any:
    """Build a ``torchft.local_sgd.DiLoCo`` with one outer SGD optimizer per fragment.

    Build it after the weights are loaded: torchft snapshots the parameters as the first global
    backup, and registers ``StreamingDiLoCoFragment_<i>`` state with the manager (so build at most
    one per manager). Use it as a context manager: ``with outer:`` hooks ``inner_optimizer.step()``,
    and the outer step runs inside the ``sync_every``-th inner step.

    Args:
        manager: a ``torchft.Manager`` built with ``use_async_quorum=False``, or any object with the
            surface DiLoCo uses (``_use_async_quorum``, ``register_state_dict_fn``,
            ``allow_state_dict_read``, ``disallow_state_dict_read``, ``start_quorum``, ``current_step``,
            ``allreduce(t, should_quantize=False)`` averaging in place and returning a work with
            ``.wait()``, ``should_commit``).
        model_fragments: one module for vanilla DiLoCo, N disjoint modules for Streaming DiLoCo.
        inner_optimizer: the optimizer stepped every batch (e.g. AdamW over the whole model).
        outer_lr: outer SGD learning rate.
        outer_momentum: outer SGD momentum.
        nesterov: Nesterov momentum on the outer SGD.
        sync_every: inner steps per outer round (per full sweep over all fragments).
        fragment_sync_delay: steps by which a fragment's allreduce starts early (0 = vanilla).
        fragment_update_alpha: mix after a sync, ``θ = global + α·(local - global)`` (0 = global).

    Returns:
        The ``torchft.local_sgd.DiLoCo`` instance.

    Raises:
        RuntimeError: torchft is not installed.
        ValueError: empty fragments, ``sync_every < 1`` or not a multiple of the fragment count,
            ``fragment_sync_delay >= sync_every / len(model_fragments)``, alpha outside ``[0, 1]``,
            a non-positive ``outer_lr``, momentum outside ``[0, 1)``, Nesterov without momentum.
        TypeError: a fragment that is not an ``nn.Module`` or an inner optimizer that is not one.

    Example:
        >>> opt = torch.optim.AdamW(model.parameters(), lr=1e-5)  # doctest: +SKIP
        >>> outer = make_diloco_outer_loop(mgr, [model], opt, sync_every=100)  # doctest: +SKIP
        >>> with outer:  # doctest: +SKIP
        ...     for batch in data:
        ...         opt.zero_grad(); loss_fn(model, batch).backward(); opt.step()
    """
    if not _TORCHFT_AVAILABLE:
        raise RuntimeError(f"make_diloco_outer_loop needs torchft, which is not importable: {_INSTALL_HINT}")
    _validate(model_fragments, inner_optimizer, outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov,
              sync_every=sync_every, fragment_sync_delay=fragment_sync_delay,
              fragment_update_alpha=fragment_update_alpha)
    if getattr(manager, "_use_async_quorum", False):
        raise ValueError(
            "DiLoCo needs a synchronous quorum: build the torchft Manager with use_async_quorum=False"
        )
    outer_optimizers = [
        torch.optim.SGD(frag.parameters(), lr=outer_lr, momentum=outer_momentum, nesterov=nesterov)
        for frag in model_fragments
    ]
    log.info(
        "DiLoCo: %d fragment(s), sync_every=%d, delay=%d, alpha=%s, outer SGD(lr=%s, momentum=%s, nesterov=%s)",
        len(model_fragments), sync_every, fragment_sync_delay, fragment_update_alpha,
        outer_lr, outer_momentum, nesterov,
    )
    return DiLoCo(manager, list(model_fragments), inner_optimizer, outer_optimizers, sync_every=sync_every,
                  fragment_sync_delay=fragment_sync_delay, fragment_update_alpha=fragment_update_alpha)

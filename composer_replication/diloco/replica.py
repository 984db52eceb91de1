"""One DiLoCo replica around a student trainer: torchft ``Manager`` + ``DiLoCo`` hooked on its inner optimizer.

DiLoCo (Douillard et al., arXiv 2311.08105) lets R replicas train one model, talking once every ``sync_every``
inner steps. :class:`DilocoReplica` sets one replica (a trainer with ``model``, ``optimizer``, ``train_step``,
``state_dict``, ``load_state_dict``) up in the order that works (``../shared/notes/torchft.md``): its own
``TCPStore`` and gloo group; a ``Manager(use_async_quorum=False, init_sync=False)`` registering the trainer's full
state (a late joiner heals model *and* optimizer from a live peer); ``make_diloco_outer_loop`` after the weights
are loaded, entered once.
"""

from __future__ import annotations

import hashlib
import logging
from datetime import timedelta
from typing import Any

import torch

from composer_replication.diloco.config import DilocoConfig
from composer_replication.diloco.outer import make_diloco_outer_loop

__all__ = ["DilocoReplica", "Lighthouse", "NonFiniteReplicaError", "param_sha256", "shard_training_data"]

log = logging.getLogger(__name__)
_OUTER_KEYS = ("outer_lr", "outer_momentum", "nesterov", "sync_every", "fragment_sync_delay", "fragment_update_alpha")


def param_sha256(model: torch.nn.Module) -> str:
    """SHA-256 (hex) of the model's parameters, in ``named_parameters`` order (tied tensors once), bytes as stored."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        t = p.detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def split_fragments(model: torch.nn.Module, n: int) -> list[torch.nn.Module]:
    """The trainable parameters split into ``n`` contiguous groups of about equal size (Streaming DiLoCo).

    Each fragment is an ``nn.ParameterList`` holding the model's own ``Parameter`` objects (no copy), so
    tied tensors stay in one fragment. ``n == 1`` returns ``[model]``.

    Raises:
        ValueError: ``n < 1`` or more fragments than trainable parameter tensors.
    """
    if n == 1:
        return [model]
    params = [p for p in model.parameters() if p.requires_grad]
    if not 1 <= n <= len(params):
        raise ValueError(f"'diloco.fragments' must be in [1, {len(params)}] for this model, got {n}")
    total, groups, acc = sum(p.numel() for p in params), [[]], 0
    for i, p in enumerate(params):
        left_params, left_groups = len(params) - i, n - len(groups)
        if groups[-1] and left_groups > 0 and (acc >= total * len(groups) / n or left_params == left_groups):
            groups.append([])
        groups[-1].append(p)
        acc += p.numel()
    return [torch.nn.ParameterList(g) for g in groups]


def shard_training_data(data: Any, rank: int, world_size: int, *, keep_eval: int = 0) -> Any:
    """Replica ``rank``'s disjoint shard of a ``TrainingData`` (prompts and pairs ``rank::world_size``; the other
    fields kept). With no held-out prompts, the first ``keep_eval`` prompts become every replica's evaluation set.

    Raises:
        ValueError: ``rank`` out of range, or a shard with neither prompts nor pairs (names the fix).
    """
    import dataclasses

    if not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    prompts, pairs = data.prompts[rank::world_size], data.pairs[rank::world_size]
    if not prompts and not pairs:
        raise ValueError(f"replica {rank} of {world_size} gets no prompt and no pair ({len(data.prompts)} prompts, "
                         f"{len(data.pairs)} pairs); use fewer 'diloco.replicas' or more data ('data.max_states')")
    return dataclasses.replace(data, prompts=prompts, pairs=pairs,
                               eval_prompts=data.eval_prompts or data.prompts[:keep_eval] or None)


class Lighthouse:
    """The torchft lighthouse (quorum server) in this process; replicas connect to ``address``.

    ``config`` gives ``min_replicas``, ``heartbeat_timeout_ms`` and ``quorum_timeout_s`` (half of it is the join
    timeout); ``host`` is the name replicas reach this process at (the server reports ``gethostname()``, which may
    not resolve in containers).
    """

    def __init__(self, config: DilocoConfig, *, host: str = "127.0.0.1") -> None:
        from torchft.coordination import LighthouseServer

        self.server = LighthouseServer(bind="[::]:0", min_replicas=config.min_replicas,
                                       join_timeout_ms=int(config.quorum_timeout_s * 1000 / 2),
                                       heartbeat_timeout_ms=config.heartbeat_timeout_ms)
        self.address = f"http://{host}:{self.server.address().rsplit(':', 1)[1]}"

    def shutdown(self) -> None:
        """Stop the server (idempotent)."""
        if self.server is not None:
            self.server.shutdown()
            self.server = None


class NonFiniteReplicaError(RuntimeError):
    """A replica sent a non-finite pseudo-gradient in more consecutive syncs than ``diloco.max_nonfinite_rounds``."""


class DilocoReplica:
    """The torchft side of one replica. Build it after the trainer's weights are loaded.

    Args:
        trainer: object with ``model``, ``optimizer``, ``train_step(step)``, ``state_dict()``, ``load_state_dict(s)``.
        config: the DiLoCo settings.
        replica_id: a name unique per replica slot (``replica_0``...); torchft adds a UUID per incarnation.
        lighthouse_addr: ``http://host:port`` of the lighthouse.
        host: the host name other replicas reach this one at (store, checkpoint server).
        local_step: inner steps already taken in the current round (a replica joining mid-round).

    Raises:
        RuntimeError: torchft is not installed. ValueError: a bad setting (see ``make_diloco_outer_loop``).
    """

    def __init__(self, trainer: Any, config: DilocoConfig, *, replica_id: str, lighthouse_addr: str,
                 host: str = "127.0.0.1", local_step: int = 0) -> None:
        from torch.distributed import TCPStore
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        self.trainer, self.config, self.label = trainer, config, replica_id.removeprefix("replica_")
        self.store = TCPStore(host_name=host, port=0, is_master=True, wait_for_workers=False)
        timeout = timedelta(seconds=config.quorum_timeout_s)
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timedelta(seconds=config.pg_timeout_s)), load_state_dict=trainer.load_state_dict,
            state_dict=trainer.state_dict, min_replica_size=config.min_replicas, use_async_quorum=False,
            init_sync=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout, rank=0, world_size=1,
            store_addr=host, store_port=self.store.port, hostname=host, lighthouse_addr=lighthouse_addr,
            replica_id=replica_id)
        self.outer = make_diloco_outer_loop(self.manager, split_fragments(trainer.model, config.fragments),
                                            trainer.optimizer, **{k: getattr(config, k) for k in _OUTER_KEYS})
        self.outer.__enter__()
        self.set_local_step(local_step)

    def set_local_step(self, local_step: int) -> None:
        """Place this replica ``local_step`` inner steps into the current round (before its quorum is taken)."""
        last = self.config.period - self.config.fragment_sync_delay - 1
        if not 0 <= local_step <= last:
            raise ValueError(f"a replica can join at inner step 0..{last} of a round, got {local_step}; wait for "
                             "the next round")
        self.outer._local_step = int(local_step)

    def train_step(self, step: int) -> dict[str, Any]:
        """One inner step of the trainer (the outer sync runs inside it when the round ends); its metrics.

        Adds ``diloco/synced`` (1.0 when a sync ran), ``diloco/participants`` at every quorum, and after a sync
        ``diloco/outer_step`` (the manager's step after it), ``diloco/committed``, ``diloco/fragment``,
        ``diloco/nonfinite`` (replicas left out for a NaN or inf), ``diloco/nonfinite/<i>`` (1.0, on replica ``i``
        when it was one of them) and ``diloco/param_sha256`` (:func:`param_sha256`).

        Raises:
            NonFiniteReplicaError: this replica was left out in more than ``max_nonfinite_rounds`` consecutive syncs.
        """
        before, fragment = self.manager.current_step(), self.outer._current_fragment()
        metrics = dict(self.trainer.train_step(step))
        if self.outer._local_step != 0:
            metrics["diloco/synced"] = 0.0
            if self.outer._local_step == self.config.period - self.config.fragment_sync_delay:  # quorum taken early
                metrics["diloco/participants"] = float(self.manager.num_participants())
            return metrics
        after, guard = self.manager.current_step(), self.outer.finite_guard
        metrics.update({"diloco/synced": 1.0, "diloco/outer_step": float(after), "diloco/committed": float(after > before),
                        "diloco/participants": float(self.manager.num_participants()),
                        "diloco/fragment": float(fragment), "diloco/param_sha256": param_sha256(self.trainer.model),
                        "diloco/nonfinite": float(guard.excluded)})
        if guard.own:
            metrics[f"diloco/nonfinite/{self.label}"] = 1.0
        if guard.streak > self.config.max_nonfinite_rounds:
            raise NonFiniteReplicaError(
                f"replica {self.label} sent a non-finite pseudo-gradient (NaN or inf) in {guard.streak} consecutive "
                f"syncs, more than 'diloco.max_nonfinite_rounds' = {self.config.max_nonfinite_rounds}; restart it "
                "from the survivors' state (its supervisor does)")
        return metrics

    def state_dict(self) -> dict[str, Any]:
        """What torchft holds outside the trainer: manager step, position in the round, per fragment the
        global backup (``original_parameters``) and the outer optimizer's state."""
        return {"manager": self.manager.state_dict(), "local_step": int(self.outer._local_step),
                "fragments": [{"outer_optimizer": f._outer_optimizer.state_dict(),
                               "original_parameters": {k: v.detach().clone() for k, v in f.original_parameters.items()}}
                              for f in self.outer._fragments]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (after the trainer's own state: the backups overwrite the snapshot).

        Raises:
            ValueError: the checkpoint has another number of fragments than the config.
        """
        frags = state["fragments"]
        if len(frags) != len(self.outer._fragments):
            raise ValueError(f"the checkpoint holds {len(frags)} DiLoCo fragment(s), the config asks for "
                             f"{len(self.outer._fragments)}; resume with the run's 'diloco.fragments'")
        self.manager.load_state_dict(state["manager"])
        self.outer._local_step = int(state["local_step"])
        with torch.no_grad():
            for frag, saved in zip(self.outer._fragments, frags):
                for name, value in saved["original_parameters"].items():
                    frag.original_parameters[name].copy_(value)
                frag._outer_optimizer.load_state_dict(saved["outer_optimizer"])

    def shutdown(self) -> None:
        """Unhook the inner optimizer and stop the manager (its heartbeat ends, so no quorum waits for it)."""
        if self.outer is not None:
            self.outer.__exit__(None, None, None)
            self.outer = None
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

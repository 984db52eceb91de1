"""make_diloco_outer_loop: validation, and one-replica DiLoCo rounds checked against a hand computation."""

from __future__ import annotations

import copy

import pytest
import torch

from composer_replication import diloco
from composer_replication.diloco import _TORCHFT_AVAILABLE, make_diloco_outer_loop

pytestmark = pytest.mark.skipif(not _TORCHFT_AVAILABLE, reason="torchft is not installed")


class OneReplicaManager:
    """The Manager surface torchft's DiLoCo touches (notes/torchft.md §5), plus what FiniteGuard reads
    (``num_participants``, ``errored``, ``report_error``, ``allreduce(t, reduce_op=SUM)``), for a single replica."""

    _use_async_quorum = False

    def __init__(self, commit: bool = True) -> None:
        self.commit = commit
        self.step = 0
        self.state_fns: dict = {}
        self.n_allreduce = 0
        self.n_quorum = 0
        self.error = None

    def register_state_dict_fn(self, key, load_fn, save_fn) -> None:
        assert key not in self.state_fns, key
        self.state_fns[key] = (load_fn, save_fn)

    def allow_state_dict_read(self) -> None:
        pass

    def disallow_state_dict_read(self) -> None:
        pass

    def start_quorum(self) -> None:
        self.n_quorum += 1

    def current_step(self) -> int:
        return self.step

    def allreduce(self, tensor, should_quantize=False, reduce_op=None):
        self.n_allreduce += reduce_op is None  # the mean over one replica is the tensor itself; flags not counted
        return diloco._DummyWork(tensor)

    def num_participants(self) -> int:
        return 1

    def errored(self):
        return self.error

    def report_error(self, e: Exception) -> None:
        self.error = e

    def should_commit(self) -> bool:
        commit, self.error = self.commit and self.error is None, None
        self.step += commit
        return commit


def _data():
    g = torch.Generator().manual_seed(0)
    return torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randn(8, 2, generator=g, dtype=torch.float64)


def _model():
    torch_gen = torch.Generator().manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 2)).double()
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=torch_gen, dtype=torch.float64))
    return m


def _inner_step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def test_one_replica_rounds_match_outer_sgd_by_hand():
    x, y = _data()
    model, ref = _model(), _model()
    h, lr, mom = 3, 0.7, 0.9
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = OneReplicaManager()
    outer = make_diloco_outer_loop(mgr, [model], opt, sync_every=h)
    assert len(mgr.state_fns) == 1
    with outer:
        for _ in range(2 * h):
            _inner_step(model, opt, x, y)
    assert mgr.step == 2 and mgr.n_quorum == 2
    assert mgr.n_allreduce == 2 * len(list(model.parameters()))

    # Hand computation: H plain SGD steps, pseudo-gradient Δ = θ_global - θ_local, outer Nesterov SGD.
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    bufs = None
    local_after_round1 = None
    for r in range(2):
        glob = [p.detach().clone() for p in ref.parameters()]
        for _ in range(h):
            _inner_step(ref, ref_opt, x, y)
        delta = [g - p.detach() for g, p in zip(glob, ref.parameters())]
        if r == 0:
            local_after_round1 = [p.detach().clone() for p in ref.parameters()]
        bufs = [d.clone() for d in delta] if bufs is None else [mom * b + d for b, d in zip(bufs, delta)]
        with torch.no_grad():
            for p, g, d, b in zip(ref.parameters(), glob, delta, bufs):
                p.copy_(g - lr * (d + mom * b))
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, atol=1e-10, rtol=1e-10)
    # The first outer step moved past the local weights: θ1 = θ0 - 0.7·1.9·Δ, not θ_local.
    assert not torch.allclose(next(iter(model.parameters())), local_after_round1[0])


def test_a_nonfinite_local_step_is_dropped_and_skipped():
    """A NaN pseudo-gradient on the only replica: the round is dropped, the model stays at the global weights,
    and the inner optimizer's non-finite state is dropped too."""
    x, y = _data()
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    mgr = OneReplicaManager()
    outer = make_diloco_outer_loop(mgr, [model], opt, sync_every=2)
    with outer:
        _inner_step(model, opt, x, y)
        _inner_step(model, opt, x * float("nan"), y)
    assert mgr.step == 0 and outer.finite_guard.own and outer.finite_guard.streak == 1
    for p, s in zip(model.parameters(), start):
        torch.testing.assert_close(p.detach(), s)
    assert not opt.state  # the NaN moments are gone: the next step starts afresh
    with outer:
        _inner_step(model, opt, x, y)
        _inner_step(model, opt, x, y)
    assert mgr.step == 1 and outer.finite_guard.streak == 0
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_rejected_commit_rolls_back_to_global():
    x, y = _data()
    model = _model()
    start = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = OneReplicaManager(commit=False)
    with make_diloco_outer_loop(mgr, [model], opt, sync_every=2):
        for _ in range(2):
            _inner_step(model, opt, x, y)
    assert mgr.step == 0
    for p, s in zip(model.parameters(), start):
        torch.testing.assert_close(p.detach(), s)


def test_streaming_two_fragments_sync_in_turn():
    x, y = _data()
    model = _model()
    frags = [model[0], model[2]]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mgr = OneReplicaManager()
    with make_diloco_outer_loop(mgr, frags, opt, sync_every=4, fragment_sync_delay=1, fragment_update_alpha=0.5):
        for _ in range(4):
            _inner_step(model, opt, x, y)
    assert mgr.step == 2  # each fragment synced once
    assert set(mgr.state_fns) == {"StreamingDiLoCoFragment_0", "StreamingDiLoCoFragment_1"}
    assert mgr.n_allreduce == len(list(model.parameters()))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"model_fragments": []}, "non-empty list"),
        ({"sync_every": 0}, "sync_every must be an int >= 1"),
        ({"sync_every": 3, "fragment_sync_delay": 3}, "fragment_sync_delay=3 must be <"),
        ({"fragment_update_alpha": 1.5}, r"fragment_update_alpha must be in \[0, 1\]"),
        ({"fragment_update_alpha": -0.1}, r"fragment_update_alpha must be in \[0, 1\]"),
        ({"outer_lr": 0.0}, "outer_lr must be > 0"),
        ({"outer_momentum": 1.0}, r"outer_momentum must be in \[0, 1\)"),
        ({"outer_momentum": 0.0}, "nesterov=True needs outer_momentum > 0"),
    ],
)
def test_bad_arguments(kwargs, match):
    model = _model()
    args = {"model_fragments": [model], "sync_every": 4} | kwargs
    with pytest.raises(ValueError, match=match):
        make_diloco_outer_loop(OneReplicaManager(), inner_optimizer=torch.optim.SGD(model.parameters(), lr=0.1), **args)


def test_fragment_count_must_divide_sync_every():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="multiple of the number of fragments"):
        make_diloco_outer_loop(OneReplicaManager(), [model[0], model[2]], opt, sync_every=3)


def test_async_quorum_manager_rejected():
    model = _model()
    mgr = OneReplicaManager()
    mgr._use_async_quorum = True
    with pytest.raises(ValueError, match="use_async_quorum=False"):
        make_diloco_outer_loop(mgr, [model], torch.optim.SGD(model.parameters(), lr=0.1))


def test_missing_torchft_is_a_runtime_error(monkeypatch):
    from composer_replication.diloco import outer as outer_mod

    monkeypatch.setattr(outer_mod, "_TORCHFT_AVAILABLE", False)
    model = copy.deepcopy(_model())
    with pytest.raises(RuntimeError, match="pip install torchft"):
        outer_mod.make_diloco_outer_loop(OneReplicaManager(), [model], torch.optim.SGD(model.parameters(), lr=0.1))


def test_module_attributes_are_torchft_classes():
    from torchft.local_sgd import DiLoCo
    from torchft.manager import Manager

    assert diloco.DiLoCo is DiLoCo and diloco.Manager is Manager
    assert diloco._TORCHFT_AVAILABLE is True

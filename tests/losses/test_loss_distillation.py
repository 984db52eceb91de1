"""SimPO, TAID (+ scheduler) and entropy-aware OPD against references written from their formulas."""

from __future__ import annotations

import io
import math

import pytest
import torch

from composer_replication.losses import (
    TAIDScheduler,
    avg_sequence_logprob,
    entropy_aware_opd_loss,
    simpo_loss,
    taid_loss,
    teacher_entropy,
)
from composer_replication.losses.entropy_aware_opd import entropy_aware_opd_per_token
from composer_replication.losses.taid import taid_per_token

ATOL = 1e-6
B, T, V = 3, 5, 7


def _logits(seed: int, *shape: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(*shape, generator=g, dtype=torch.float64)).requires_grad_(True)


def _grads_close(out, ref, inputs):
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    w = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).view(out.shape)
    g1 = torch.autograd.grad((out * w).sum(), inputs, retain_graph=True, allow_unused=True)
    g2 = torch.autograd.grad((ref * w).sum(), inputs, retain_graph=True, allow_unused=True)
    for a, b, x in zip(g1, g2, inputs):
        a = torch.zeros_like(x) if a is None else a
        b = torch.zeros_like(x) if b is None else b
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


def _softmax(z):
    e = torch.exp(z - z.max())
    return e / e.sum()


# --------------------------------------------------------------------------------------------------
# SimPO
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("beta", "gamma"), [(2.0, 1.0), (2.5, 0.0), (0.7, 1.6)])
def test_simpo_matches_formula(beta, gamma):
    c, r = _logits(1, 5), _logits(2, 5)
    out = simpo_loss(c, r, beta=beta, gamma=gamma)
    terms = [-torch.log(1 / (1 + torch.exp(-(beta * (c[i] - r[i]) - gamma)))) for i in range(5)]
    ref = torch.stack(terms).sum() / 5
    _grads_close(out, ref, (c, r))


def test_avg_sequence_logprob_matches_loop_and_ignores_masked_values():
    lp = _logits(3, B, T)
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    garbage = lp + torch.where(mask.bool(), 0.0, math.nan)  # NaN outside the mask must not leak
    out = avg_sequence_logprob(garbage, mask)
    ref = torch.stack([sum(lp[b, t] for t in range(T) if mask[b, t]) / int(mask[b].sum()) for b in range(B)])
    _grads_close(out, ref, (lp,))


def test_simpo_errors():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="same shape"):
        simpo_loss(x, torch.zeros(4))
    with pytest.raises(ValueError, match="chosen_avg_logprobs must be a non-empty \\[B\\] tensor"):
        simpo_loss(torch.zeros(3, 2), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="rejected_avg_logprobs must be a non-empty"):
        simpo_loss(x, torch.zeros(0))
    with pytest.raises(ValueError, match="beta must be a number > 0"):
        simpo_loss(x, x, beta=0.0)
    with pytest.raises(ValueError, match="gamma must be a number >= 0"):
        simpo_loss(x, x, gamma=-0.5)
    with pytest.raises(ValueError, match="no response token in rows \\[1\\]"):
        avg_sequence_logprob(torch.zeros(2, 3), torch.tensor([[1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="response_mask must have model_logprobs' shape"):
        avg_sequence_logprob(torch.zeros(2, 3), torch.ones(2, 4))
    with pytest.raises(ValueError, match="model_logprobs must be a \\[B, T\\] tensor"):
        avg_sequence_logprob(torch.zeros(3), torch.ones(3))


# --------------------------------------------------------------------------------------------------
# TAID loss
# --------------------------------------------------------------------------------------------------


def _taid_ref_token(zs, zt, t):
    a = (1 - t) * zs.detach() + t * zt
    p = _softmax(a)
    logq = zs - torch.log(torch.exp(zs).sum())
    return -(p * logq).sum()


@pytest.mark.parametrize("t", [0.0, 0.4, 0.77, 1.0])
@pytest.mark.parametrize("use_mask", [True, False])
def test_taid_matches_formula(t, use_mask):
    s, te = _logits(4, B, T, V), _logits(5, B, T, V)
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1]]) if use_mask else None
    out = taid_loss(s, te, mask, t=t)
    keep = mask.bool() if mask is not None else torch.ones(B, T, dtype=torch.bool)
    terms = [_taid_ref_token(s[b, i], te[b, i], t) for b in range(B) for i in range(T) if keep[b, i]]
    ref = torch.stack(terms).sum() / len(terms)
    _grads_close(out, ref, (s, te))


def test_taid_per_token_on_flat_rows_and_tensor_t():
    s, te = _logits(6, 4, V), _logits(7, 4, V)
    out = taid_per_token(s, te, t=torch.tensor(0.3))
    ref = torch.stack([_taid_ref_token(s[i], te[i], 0.3) for i in range(4)])
    _grads_close(out, ref, (s, te))


def test_taid_at_t0_has_no_student_gradient_and_at_t1_is_forward_kl_gradient():
    s, te = _logits(8, B, T, V), _logits(9, B, T, V)
    (g0,) = torch.autograd.grad(taid_loss(s, te, t=0.0), s)
    assert torch.allclose(g0, torch.zeros_like(g0), atol=1e-12)
    (g1,) = torch.autograd.grad(taid_loss(s, te.detach(), t=1.0), s)
    expected = (torch.softmax(s.detach(), -1) - torch.softmax(te.detach(), -1)) / (B * T)
    torch.testing.assert_close(g1, expected, atol=ATOL, rtol=0)


def test_taid_ignores_infinite_student_logits():
    s = _logits(10, 2, V).detach().clone()
    te = _logits(11, 2, V).detach()
    s[:, 0] = -math.inf
    s.requires_grad_(True)
    out = taid_per_token(s, te, t=0.5)
    (g,) = torch.autograd.grad(out.sum(), s)
    assert torch.isfinite(out).all() and torch.isfinite(g).all()


def test_taid_errors():
    s, te = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="t must be in \\[0, 1\\]"):
            taid_loss(s, te, t=bad)
    with pytest.raises(ValueError, match="t must be a scalar"):
        taid_loss(s, te, t=torch.tensor([0.1, 0.2]))
    with pytest.raises(ValueError, match="mask must have shape \\(2, 3\\)"):
        taid_loss(s, te, torch.ones(2, 4), t=0.5)
    with pytest.raises(ValueError, match="mask selects no token"):
        taid_loss(s, te, torch.zeros(2, 3), t=0.5)
    with pytest.raises(ValueError, match="same shape"):
        taid_loss(s, te[:, :2], t=0.5)


# --------------------------------------------------------------------------------------------------
# TAID scheduler
# --------------------------------------------------------------------------------------------------

LOSSES = [5.0, 4.0, math.nan, 3.5, 3.6, math.inf, 2.0, 1.0, 1.2, 0.8, 0.5, 0.45, 0.44, 0.3, 0.2]


def _reference_trajectory(losses, n, t_start, t_end, alpha, beta, disable_adaptive):
    """algorithms.md section 3 (upstream TAID.update_t), plus: non-finite losses are skipped."""
    t, prev, m = t_start, None, 0.0
    out = []
    for step, loss in enumerate(losses):
        if not math.isfinite(loss):
            out.append((t, None))
            continue
        if prev is None:
            prev = loss
            out.append((t, None))
            continue
        rel = (prev - loss) / (prev + 1e-15)
        m = beta * m + (1 - beta) * rel
        delta = alpha * (1 / (1 + math.exp(-m))) * (1 - t)
        t_lin = t_start + (t_end - t_start) * min(step / n, 1.0)
        t = t_lin if disable_adaptive else min(t_end, max(t_lin, t + delta))
        prev = loss
        out.append((t, delta))
    return out


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_train_steps": 100},  # paper defaults: the linear floor wins
        {
            "num_train_steps": 12,
            "alpha": 0.3,
            "beta": 0.5,
            "t_start": 0.2,
            "t_end": 0.9,
        },  # adaptive + ceiling
        {"num_train_steps": 8, "alpha": 0.05, "disable_adaptive": True},
    ],
)
def test_scheduler_follows_the_recurrence(kwargs):
    sched = TAIDScheduler(**kwargs)
    ref = _reference_trajectory(
        LOSSES,
        kwargs["num_train_steps"],
        kwargs.get("t_start", 0.4),
        kwargs.get("t_end", 1.0),
        kwargs.get("alpha", 5e-4),
        kwargs.get("beta", 0.99),
        kwargs.get("disable_adaptive", False),
    )
    assert sched.t == kwargs.get("t_start", 0.4)
    prev_t = sched.t
    for step, (loss, (t_ref, delta_ref)) in enumerate(zip(LOSSES, ref)):
        loss_arg = torch.tensor(loss, dtype=torch.float64) if step % 2 else loss  # tensors and floats
        delta = sched.update_t(loss_arg, global_step=step)
        if delta_ref is None:
            assert delta is None
        else:
            assert float(delta) == pytest.approx(delta_ref, abs=1e-12)
        assert sched.t == pytest.approx(t_ref, abs=1e-12)
        assert sched.t >= prev_t and sched.t <= kwargs.get("t_end", 1.0)
        prev_t = sched.t


def test_scheduler_adaptive_bump_exceeds_linear_floor_and_caps_at_t_end():
    sched = TAIDScheduler(1000, alpha=0.5, beta=0.0, t_end=0.8)
    sched.update_t(10.0, 0)
    sched.update_t(5.0, 1)  # big improvement -> large bump above the floor 0.4 + 0.6 * 1/1000
    assert sched.t > 0.4 + 0.4 * 1 / 1000 + 0.05
    for step in range(2, 60):
        sched.update_t(5.0 / step, step)
    assert sched.t == pytest.approx(0.8)


def test_scheduler_disable_adaptive_is_the_linear_schedule():
    n = 10
    sched = TAIDScheduler(n, t_start=0.3, t_end=0.9, alpha=1.0, disable_adaptive=True)
    sched.update_t(1.0, 0)
    assert sched.t == 0.3
    for step in range(1, 15):
        sched.update_t(1.0 / (step + 1), step)
        assert sched.t == pytest.approx(0.3 + 0.6 * min(step / n, 1.0), abs=1e-12)


def test_scheduler_state_dict_round_trip_continues_identically():
    kwargs = {"num_train_steps": 20, "alpha": 0.2, "beta": 0.7}
    a = TAIDScheduler(**kwargs)
    for step, loss in enumerate(LOSSES[:6]):
        a.update_t(loss, step)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    b = TAIDScheduler(**kwargs)
    b.load_state_dict(torch.load(buf))
    assert b.t == a.t
    for step, loss in enumerate(LOSSES[6:], start=6):
        da, db = a.update_t(loss, step), b.update_t(loss, step)
        assert a.t == b.t and float(da) == float(db)
    fresh = TAIDScheduler(**kwargs)  # an unseeded state round-trips as unseeded
    c = TAIDScheduler(**kwargs)
    c.load_state_dict(fresh.state_dict())
    assert c.update_t(3.0, 0) is None


def test_scheduler_errors():
    with pytest.raises(ValueError, match="num_train_steps must be an int >= 1"):
        TAIDScheduler(0)
    with pytest.raises(ValueError, match="need 0 <= t_start <= t_end <= 1"):
        TAIDScheduler(10, t_start=0.9, t_end=0.5)
    with pytest.raises(ValueError, match="need 0 <= t_start <= t_end <= 1"):
        TAIDScheduler(10, t_end=1.2)
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0"):
        TAIDScheduler(10, alpha=-1.0)
    with pytest.raises(ValueError, match="beta \\(momentum decay\\) must be in \\[0, 1\\)"):
        TAIDScheduler(10, beta=1.0)
    sched = TAIDScheduler(10)
    with pytest.raises(ValueError, match="global_step must be an int >= 0"):
        sched.update_t(1.0, -1)
    with pytest.raises(ValueError, match="loss must be a scalar"):
        sched.update_t(torch.ones(2), 0)
    with pytest.raises(ValueError, match="missing keys \\['momentum'\\]"):
        sched.load_state_dict({k: v for k, v in sched.state_dict().items() if k != "momentum"})
    with pytest.raises(ValueError, match="num_train_steps=20 but this scheduler has num_train_steps=10"):
        sched.load_state_dict(TAIDScheduler(20).state_dict())


# --------------------------------------------------------------------------------------------------
# Entropy-aware OPD
# --------------------------------------------------------------------------------------------------


def _kl(p, q):
    return (p * (torch.log(p) - torch.log(q))).sum()


def _ea_ref_token(zs, zt, h_max, temperature):
    ps, pt = _softmax(zs / temperature), _softmax(zt / temperature)
    h = -(pt * torch.log(pt)).sum().detach()
    w = min(max(float(h) / h_max, 0.0), 1.0)
    return w * _kl(pt, ps) + (1 - w) * _kl(ps, pt)


def test_teacher_entropy_matches_loop():
    z = _logits(12, B, T, V)
    ref = torch.stack(
        [-(p * torch.log(p)).sum() for p in (_softmax(z[b, t]) for b in range(B) for t in range(T))]
    )
    _grads_close(teacher_entropy(z), ref.view(B, T), (z,))
    assert teacher_entropy(torch.zeros(4, 9)).sub(math.log(9)).abs().max() < 1e-6


@pytest.mark.parametrize("h_max", [None, 0.9, 50.0])
@pytest.mark.parametrize("temperature", [1.0, 1.6])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize("use_labels", [True, False])
def test_entropy_aware_matches_formula(h_max, temperature, reduction, use_labels):
    s, te = _logits(13, B, T, V), _logits(14, B, T, V)
    labels = torch.tensor([[1, 1, 0, 1, 0], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1]]) if use_labels else None
    out = entropy_aware_opd_loss(
        s, te, labels=labels, h_max=h_max, temperature=temperature, reduction=reduction
    )
    hm = math.log(V) if h_max is None else h_max
    per = torch.stack([_ea_ref_token(s[b, t], te[b, t], hm, temperature) for b in range(B) for t in range(T)])
    per = per.view(B, T)
    keep = labels.bool() if labels is not None else torch.ones(B, T, dtype=torch.bool)
    per = per * keep
    n = int(keep.sum())
    ref = {
        "sum": per.sum(),
        "batchmean": per.sum() / (n if labels is not None else B),
        "mean": per.sum() / (n * V),
        "none": per,
    }[reduction]
    _grads_close(out, ref, (s, te))


def test_entropy_aware_gate_limits():
    s, te = _logits(15, 4, V), _logits(16, 4, V)
    fwd = entropy_aware_opd_per_token(s, te, h_max=1e-9)  # every w = 1: forward KL(T || S)
    rev = entropy_aware_opd_per_token(s, te, h_max=1e12)  # every w ~ 0: reverse KL(S || T)
    ps, pt = torch.softmax(s, -1), torch.softmax(te, -1)
    torch.testing.assert_close(fwd, (pt * (pt.log() - ps.log())).sum(-1), atol=ATOL, rtol=0)
    torch.testing.assert_close(rev, (ps * (ps.log() - pt.log())).sum(-1), atol=ATOL, rtol=0)


def test_entropy_aware_errors():
    s, te = torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="labels must be a 0/1 \\(or bool\\) token mask"):
        entropy_aware_opd_loss(s, te, labels=torch.tensor([[1, -100, 1], [1, 1, 1]]))
    with pytest.raises(ValueError, match="labels must be a 0/1 mask of shape \\(2, 3\\)"):
        entropy_aware_opd_loss(s, te, labels=torch.ones(2, 2))
    with pytest.raises(ValueError, match="reduction must be one of"):
        entropy_aware_opd_loss(s, te, reduction="avg")
    for bad in (0.0, -1.0, math.inf):
        with pytest.raises(ValueError, match="h_max must be None \\(log V\\) or a finite number > 0"):
            entropy_aware_opd_loss(s, te, h_max=bad)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        entropy_aware_opd_loss(s, te, temperature=0.0)
    with pytest.raises(ValueError, match="pass h_max > 0 explicitly"):
        entropy_aware_opd_per_token(torch.zeros(3, 1), torch.zeros(3, 1))
    with pytest.raises(ValueError, match="same shape"):
        entropy_aware_opd_per_token(s, te[..., :3])
    with pytest.raises(ValueError, match='reduction="mean" is undefined'):
        entropy_aware_opd_loss(s, te, labels=torch.zeros(2, 3), reduction="mean")
    with pytest.raises(ValueError, match="teacher_logits must be a floating tensor"):
        teacher_entropy(torch.ones(3, dtype=torch.long))

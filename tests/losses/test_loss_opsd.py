"""Generalized JSD (composer_replication.opsd) against a from-the-formula reference and TRL's implementation."""

from __future__ import annotations

import math

import pytest
import torch

from composer_replication.losses.jsd import generalized_jsd_loss, generalized_jsd_per_token

B, T, V = 3, 5, 7
ATOL = 1e-6


def _inputs(seed: int = 0, b: int = B, t: int = T, v: int = V):
    g = torch.Generator().manual_seed(seed)
    s = (2 * torch.randn(b, t, v, generator=g, dtype=torch.float64)).requires_grad_(True)
    te = (2 * torch.randn(b, t, v, generator=g, dtype=torch.float64)).requires_grad_(True)
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, :2] = -100
    labels[2, 4] = -100
    return s, te, labels


def _softmax(z: torch.Tensor) -> torch.Tensor:
    e = torch.exp(z - z.max())
    return e / e.sum()


def _kl(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (p * (torch.log(p) - torch.log(q))).sum()


def _ref_token(zs, zt, beta, temperature, top_k=None, probs=False):
    """One token, written from the formula in probability space (no log-sum-exp tricks)."""
    if probs:
        ps, pt = zs, zt
        if top_k is not None:
            order = sorted(range(zt.shape[0]), key=lambda i: -float(zt[i].detach()))[:top_k]
            ps, pt = ps[order] / ps[order].sum(), pt[order] / pt[order].sum()
    else:
        if top_k is not None:
            order = sorted(range(zt.shape[0]), key=lambda i: -float(zt[i].detach()))[:top_k]
            zs, zt = zs[order], zt[order]
        ps, pt = _softmax(zs / temperature), _softmax(zt / temperature)
    if beta == 0:
        return _kl(pt, ps)
    if beta == 1:
        return _kl(ps, pt)
    m = beta * pt + (1 - beta) * ps
    return beta * _kl(pt, m) + (1 - beta) * _kl(ps, m)


def _ref_per_token(s, te, beta, temperature, top_k=None, token_clip=None, probs=False):
    rows = []
    for b in range(s.shape[0]):
        for t in range(s.shape[1]):
            d = _ref_token(s[b, t], te[b, t], beta, temperature, top_k, probs)
            if token_clip is not None:
                d = torch.clamp(d, max=token_clip)
            rows.append(d)
    return torch.stack(rows).view(s.shape[0], s.shape[1])


def _ref_loss(per_tok, labels, reduction, num_classes):
    if labels is None:
        mask = torch.ones_like(per_tok, dtype=torch.bool)
    else:
        mask = labels != -100
    total = sum(per_tok[b, t] for b in range(per_tok.shape[0]) for t in range(per_tok.shape[1]) if mask[b, t])
    n = int(mask.sum())
    if reduction == "sum":
        return total
    if reduction == "batchmean":
        return total / (max(n, 1) if labels is not None else per_tok.shape[0])
    if reduction == "mean":
        return total / (n * num_classes)
    return per_tok * mask


def _assert_same(out, ref, inputs, *, weight=None):
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    if weight is None:
        weight = torch.linspace(0.5, 1.5, out.numel(), dtype=out.dtype).view(out.shape)
    g_out = torch.autograd.grad((out * weight).sum(), inputs, retain_graph=True, allow_unused=True)
    g_ref = torch.autograd.grad((ref * weight).sum(), inputs, retain_graph=True, allow_unused=True)
    for a, b in zip(g_out, g_ref):
        a = torch.zeros_like(inputs[0]) if a is None else a
        b = torch.zeros_like(inputs[0]) if b is None else b
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.3])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean", "none"])
@pytest.mark.parametrize("use_labels", [True, False])
def test_jsd_matches_formula(beta, temperature, reduction, use_labels):
    s, te, labels = _inputs(seed=int(beta * 10 + temperature * 3))
    labels = labels if use_labels else None
    out = generalized_jsd_loss(s, te, labels, beta=beta, temperature=temperature, reduction=reduction)
    ref = _ref_loss(_ref_per_token(s, te, beta, temperature), labels, reduction, V)
    _assert_same(out, ref, (s, te))


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.8, 1.0])
@pytest.mark.parametrize("top_k", [1, 3, V])
def test_top_k_gathers_teacher_topk_and_renormalizes(beta, top_k):
    s, te, labels = _inputs(seed=11)
    out = generalized_jsd_loss(s, te, labels, beta=beta, temperature=1.3, top_k=top_k)
    ref = _ref_loss(_ref_per_token(s, te, beta, 1.3, top_k=top_k), labels, "batchmean", top_k)
    _assert_same(out, ref, (s, te))
    mean = generalized_jsd_loss(s, te, labels, beta=beta, temperature=1.3, top_k=top_k, reduction="mean")
    torch.testing.assert_close(
        mean, _ref_loss(_ref_per_token(s, te, beta, 1.3, top_k=top_k), labels, "mean", top_k)
    )
    if top_k == 1:  # one entry renormalized to probability 1 on both sides: zero divergence
        assert float(out.detach()) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_token_clip_clamps_each_token_and_stops_its_gradient(beta):
    s, te, labels = _inputs(seed=5)
    unclipped = generalized_jsd_per_token(s, te, beta=beta)
    vals = unclipped.detach().flatten().sort().values
    mid = vals.numel() // 2
    clip = float(vals[mid - 1] + vals[mid]) / 2  # strictly between two tokens' values
    out = generalized_jsd_loss(s, te, labels, beta=beta, token_clip=clip, reduction="none")
    ref = _ref_loss(_ref_per_token(s, te, beta, 1.0, token_clip=clip), labels, "none", V)
    _assert_same(out, ref, (s, te))
    per = generalized_jsd_per_token(s, te, beta=beta, token_clip=clip)
    assert float(per.detach().max()) <= clip
    (g,) = torch.autograd.grad(per.sum(), s)
    clipped = unclipped.detach() > clip
    assert clipped.any() and (~clipped).any()
    assert torch.all(g[clipped] == 0)
    assert torch.all(g[~clipped].abs().sum(-1) > 0)


@pytest.mark.parametrize("beta", [0.0, 0.4, 1.0])
@pytest.mark.parametrize("top_k", [None, 3])
def test_logits_are_probs(beta, top_k):
    s, te, labels = _inputs(seed=3)
    ps = torch.softmax(s.detach(), -1).requires_grad_(True)
    pt = torch.softmax(te.detach(), -1).requires_grad_(True)
    out = generalized_jsd_loss(ps, pt, labels, beta=beta, logits_are_probs=True, top_k=top_k, reduction="sum")
    ref = _ref_loss(_ref_per_token(ps, pt, beta, 1.0, top_k=top_k, probs=True), labels, "sum", V)
    _assert_same(out, ref, (ps, pt))
    from_logits = generalized_jsd_loss(s, te, labels, beta=beta, top_k=top_k, reduction="sum")
    torch.testing.assert_close(out, from_logits, atol=ATOL, rtol=0)


def test_per_token_is_the_loss_before_reduction_and_works_on_flat_rows():
    s, te, labels = _inputs(seed=8)
    none = generalized_jsd_loss(s, te, labels, beta=0.3, temperature=0.9, reduction="none")
    flat = generalized_jsd_per_token(s.reshape(-1, V), te.reshape(-1, V), beta=0.3, temperature=0.9)
    assert flat.shape == (B * T,)
    mask = (labels != -100).reshape(-1)
    torch.testing.assert_close(none.reshape(-1)[mask], flat[mask], atol=0, rtol=0)
    assert torch.all(none.reshape(-1)[~mask] == 0)


def test_batchmean_with_every_token_masked_is_zero_with_a_grad_path():
    s, te, _ = _inputs()
    labels = torch.full((B, T), -100)
    out = generalized_jsd_loss(s, te, labels)
    assert float(out.detach()) == 0.0
    (g,) = torch.autograd.grad(out, s)
    assert torch.all(g == 0)


def test_half_precision_is_computed_in_float32():
    s, te, labels = _inputs()
    out = generalized_jsd_loss(s.detach().bfloat16(), te.detach().bfloat16(), labels)
    assert out.dtype == torch.float32 and math.isfinite(float(out))


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_minus_inf_logits_give_finite_loss_and_grad(beta):
    s, te, _ = _inputs(seed=2)
    s = s.detach().clone()
    te = te.detach().clone()
    s[..., 0] = -math.inf
    te[..., 0] = -math.inf
    s.requires_grad_(True)
    out = generalized_jsd_loss(s, te, beta=beta)
    (g,) = torch.autograd.grad(out, s)
    assert math.isfinite(float(out.detach())) and torch.isfinite(g).all()
    ref = generalized_jsd_loss(s.detach()[..., 1:], te[..., 1:], beta=beta)
    torch.testing.assert_close(out.detach(), ref, atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------------
# TRL as a second reference
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("beta", [0.0, 0.3, 0.5, 1.0])
@pytest.mark.parametrize("temperature", [1.0, 0.9, 1.7])
@pytest.mark.parametrize("use_labels", [True, False])
@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
def test_matches_trl(beta, temperature, use_labels, reduction):
    pytest.importorskip("trl")
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from trl.experimental.gkd.gkd_trainer import GKDTrainer
    s, te, labels = _inputs(seed=21)
    labels = labels if use_labels else None
    out = generalized_jsd_loss(s, te, labels, beta=beta, temperature=temperature, reduction=reduction)
    ref = GKDTrainer.generalized_jsd_loss(
        s, te, labels, beta=beta, temperature=temperature, reduction=reduction
    )
    _assert_same(out, ref, (s, te), weight=torch.tensor(1.0, dtype=torch.float64))
    if reduction == "batchmean":  # TRL's "none" is elementwise [.., V]; ours is its vocab sum, masked
        none = generalized_jsd_loss(s, te, labels, beta=beta, temperature=temperature, reduction="none")
        ref_none = GKDTrainer.generalized_jsd_loss(
            s, te, labels, beta=beta, temperature=temperature, reduction="none"
        )
        ours = none[labels != -100] if labels is not None else none
        torch.testing.assert_close(ours, ref_none.sum(-1), atol=ATOL, rtol=0)


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"beta": -0.1}, "beta must be a number in \\[0, 1\\]"),
        ({"beta": 1.5}, "beta must be a number in \\[0, 1\\]"),
        ({"temperature": 0.0}, "temperature must be a finite number > 0"),
        ({"temperature": -1.0}, "temperature must be a finite number > 0"),
        ({"top_k": 0}, "top_k must be None or an int in \\[1, V=7\\]"),
        ({"top_k": V + 1}, "top_k must be None or an int"),
        ({"top_k": 2.0}, "top_k must be None or an int"),
        ({"token_clip": 0.0}, "token_clip must be None or a number > 0"),
        ({"token_clip": -1.0}, "token_clip must be None or a number > 0"),
        ({"reduction": "avg"}, "reduction must be one of"),
        ({"logits_are_probs": True, "temperature": 2.0}, "has no effect when logits_are_probs=True"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    s, te, labels = _inputs()
    with pytest.raises(ValueError, match=match):
        generalized_jsd_loss(s, te, labels, **kwargs)


def test_bad_shapes_raise():
    s, te, labels = _inputs()
    with pytest.raises(ValueError, match="must have the same shape"):
        generalized_jsd_loss(s, te[:, :-1])
    with pytest.raises(ValueError, match="labels must be a tensor of shape \\(3, 5\\)"):
        generalized_jsd_loss(s, te, labels[:, :-1])
    with pytest.raises(ValueError, match="at least 2 dims"):
        generalized_jsd_per_token(s[0, 0], te[0, 0])
    with pytest.raises(ValueError, match="floating point"):
        generalized_jsd_per_token(torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match='reduction="mean" is undefined when labels masks every token'):
        generalized_jsd_loss(s, te, torch.full((B, T), -100), reduction="mean")

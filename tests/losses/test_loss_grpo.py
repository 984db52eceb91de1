"""GRPO loss and advantages (composer_replication.losses.grpo) against loop references of TRL's formulas."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from composer_replication.losses.grpo import GRPOLossConfig, group_advantages, grpo_loss

ATOL = 1e-6
B, T = 4, 6
MASK = torch.tensor(
    [
        [0, 0, 1, 1, 1, 0],
        [0, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 1, 0],
        [1, 1, 0, 1, 1, 1],
    ]
)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    lp = (old + 0.4 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_(True)
    ref = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=torch.float64)
    return lp, old, ref, adv


# --------------------------------------------------------------------------------------------------
# Advantages
# --------------------------------------------------------------------------------------------------


def _ref_advantages(rewards, groups, scale):
    out = []
    valid_all = [r for r in rewards if not math.isnan(r)]
    batch_std = statistics.stdev(valid_all) if len(valid_all) > 1 else 0.0  # unbiased, like TRL's nanstd
    for r, g in zip(rewards, groups):
        members = [x for x, h in zip(rewards, groups) if h == g and not math.isnan(x)]
        if math.isnan(r) or len(members) < 2:
            out.append(0.0)
            continue
        centered = r - sum(members) / len(members)
        std = {"group": statistics.stdev(members), "batch": batch_std, "none": None}[scale]
        out.append(centered if std is None else centered / (std + 1e-4))
    return out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_reference(scale):
    rewards = [1.0, 0.0, 0.5, 2.0, -1.0, 3.0, 3.0, math.nan, 0.25, 7.0]
    groups = [10, 10, 10, 3, 3, 42, 42, 42, 10, 99]  # non-contiguous ids, a singleton (99), a NaN reward
    out = group_advantages(
        torch.tensor(rewards, dtype=torch.float64), torch.tensor(groups), scale_rewards=scale
    )
    ref = torch.tensor(_ref_advantages(rewards, groups, scale), dtype=torch.float64)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    assert out[-1] == 0 and out[7] == 0  # singleton group and unscorable sample
    assert out[5] == 0 and out[6] == 0  # identical rewards in a group


def test_group_advantages_match_trl_nanstd_for_equal_groups():
    pytest.importorskip("trl")
    from trl.trainer.utils import nanstd

    r = torch.tensor([0.1, 0.9, 0.4, 0.4, 1.0, 0.0, 0.3, 0.8], dtype=torch.float64)
    ids = torch.arange(2).repeat_interleave(4)
    mean = r.view(2, 4).mean(1).repeat_interleave(4)
    trl_group = (r - mean) / (nanstd(r.view(2, 4), dim=1).repeat_interleave(4) + 1e-4)
    trl_batch = (r - mean) / (nanstd(r) + 1e-4)
    # atol 1e-6: TRL's Bessel factor count / (count - 1) is computed in float32
    torch.testing.assert_close(group_advantages(r, ids, scale_rewards="group"), trl_group, atol=ATOL, rtol=0)
    torch.testing.assert_close(group_advantages(r, ids, scale_rewards="batch"), trl_batch, atol=ATOL, rtol=0)


def test_group_advantages_errors():
    r, ids = torch.zeros(3), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="scale_rewards must be one of"):
        group_advantages(r, ids, scale_rewards="std")
    with pytest.raises(ValueError, match="rewards must be a float \\[B\\] tensor"):
        group_advantages(torch.zeros(3, 2), ids)
    with pytest.raises(ValueError, match="rewards must be a float"):
        group_advantages(torch.zeros(3, dtype=torch.long), ids)
    with pytest.raises(ValueError, match="group_ids must be an integer tensor of shape \\(3,\\)"):
        group_advantages(r, torch.zeros(3))
    with pytest.raises(ValueError, match="group_ids must be an integer tensor"):
        group_advantages(r, torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="rewards contain \\+-inf"):
        group_advantages(torch.tensor([1.0, math.inf, 0.0]), ids)


# --------------------------------------------------------------------------------------------------
# Loss
# --------------------------------------------------------------------------------------------------


def _ref_loss(lp, old, adv, mask, cfg, ref=None):
    """Explicit loops over sequences and tokens (TRL _compute_loss)."""
    bsz, tlen = lp.shape
    lengths = [int(mask[b].sum()) for b in range(bsz)]
    seq_log_ratio = [
        sum(lp[b, t] - old[b, t] for t in range(tlen) if mask[b, t]) / max(lengths[b], 1) for b in range(bsz)
    ]
    rows = []
    for b in range(bsz):
        row = []
        for t in range(tlen):
            if not mask[b, t]:
                continue
            lr = seq_log_ratio[b] if cfg.importance_sampling_level == "sequence" else lp[b, t] - old[b, t]
            rho = torch.exp(lr)
            clipped = torch.clamp(rho, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
            ell = -torch.minimum(rho * adv[b], clipped * adv[b])
            if cfg.kl_beta > 0:
                d = ref[b, t] - lp[b, t]
                ell = ell + cfg.kl_beta * (torch.exp(d) - d - 1)
            row.append(ell)
        rows.append(row)
    total = sum(sum(r) for r in rows if r)
    if cfg.loss_type == "grpo":
        return sum(sum(r) / max(len(r), 1) for r in rows) / bsz
    if cfg.loss_type in ("bnpo", "dapo"):
        return total / sum(lengths)
    max_len = tlen  # max_completion_length=None: the batch's T
    return total / (bsz * max_len)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.1, 0.28)])
def test_grpo_loss_matches_reference(loss_type, level, beta, eps):
    lp, old, ref, adv = _batch(seed=hash((loss_type, level)) % 1000)
    cfg = GRPOLossConfig(
        loss_type=loss_type,
        importance_sampling_level=level,
        kl_beta=beta,
        epsilon_low=eps[0],
        epsilon_high=eps[1],
    )
    loss, metrics = grpo_loss(lp, old, adv, MASK, config=cfg, ref_logprobs=ref)
    expected = _ref_loss(lp, old, adv, MASK, cfg, ref)
    torch.testing.assert_close(loss, expected, atol=ATOL, rtol=0)
    (g1,) = torch.autograd.grad(loss, lp)
    (g2,) = torch.autograd.grad(expected, lp)
    torch.testing.assert_close(g1, g2, atol=ATOL, rtol=0)
    assert metrics["grpo/loss"] == pytest.approx(float(expected.detach()), abs=ATOL)
    assert set(metrics) >= {
        "grpo/ratio_mean",
        "grpo/clip_ratio",
        "grpo/clip_ratio_low",
        "grpo/clip_ratio_high",
        "grpo/kl",
    }


def test_normalizers_of_each_loss_type():
    # ratio 1, A = [1, 2] -> per-token loss -A; lengths 1 and 3
    lp = torch.zeros(2, 5, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[0, 1, 0, 0, 0], [0, 1, 1, 1, 0]])
    adv = torch.tensor([1.0, 2.0], dtype=torch.float64)

    def run(max_completion_length=None, **kw):
        loss, _ = grpo_loss(lp, lp.detach(), adv, mask, config=GRPOLossConfig(**kw),
                            max_completion_length=max_completion_length)
        return float(loss.detach())

    assert run(loss_type="grpo") == pytest.approx(-(1 + 2) / 2)
    assert run(loss_type="bnpo") == pytest.approx(-(1 + 6) / 4)
    assert run(loss_type="dapo") == pytest.approx(-(1 + 6) / 4)
    assert run(loss_type="dr_grpo") == pytest.approx(-7 / (2 * 5))  # default: the batch's T
    assert run(loss_type="dr_grpo", max_completion_length=8) == pytest.approx(-7 / (2 * 8))


@pytest.mark.parametrize(
    ("adv", "log_ratio", "zero_grad"),
    [
        (1.0, math.log(1.5), True),  # A > 0, ratio above 1 + eps: clipped, no gradient
        (1.0, math.log(0.5), False),  # A > 0, ratio below 1 - eps: unclipped side, gradient
        (-1.0, math.log(0.5), True),  # A < 0, ratio below 1 - eps: clipped
        (-1.0, math.log(1.5), False),  # A < 0, ratio above 1 + eps: unclipped side
        (1.0, math.log(1.1), False),  # inside the band
    ],
)
def test_clipping_gradient(adv, log_ratio, zero_grad):
    old = torch.full((1, 3), -2.0, dtype=torch.float64)
    lp = (old + log_ratio).requires_grad_(True)
    mask = torch.ones(1, 3)
    loss, metrics = grpo_loss(
        lp, old, torch.tensor([adv], dtype=torch.float64), mask, config=GRPOLossConfig()
    )
    (g,) = torch.autograd.grad(loss, lp)
    if zero_grad:
        assert torch.all(g == 0)
        assert metrics["grpo/clip_ratio"] == 1.0
        key = "grpo/clip_ratio_high" if adv > 0 else "grpo/clip_ratio_low"
        assert metrics[key] == 1.0
    else:
        torch.testing.assert_close(g, torch.full_like(g, -adv * math.exp(log_ratio) / 3), atol=1e-12, rtol=0)
        assert metrics["grpo/clip_ratio"] == 0.0
    assert metrics["grpo/ratio_mean"] == pytest.approx(math.exp(log_ratio))


def test_sequence_level_ratio_is_exp_of_masked_mean_log_ratio():
    lp, old, _, adv = _batch(seed=3)
    cfg = GRPOLossConfig(importance_sampling_level="sequence", epsilon_low=0.5, epsilon_high=100.0)
    _, metrics = grpo_loss(lp, old, adv, MASK, config=cfg)
    seq = [
        math.exp(
            sum(float(lp[b, t].detach() - old[b, t]) for t in range(T) if MASK[b, t]) / int(MASK[b].sum())
        )
        for b in range(B)
    ]
    assert metrics["grpo/ratio_mean"] == pytest.approx(sum(seq) / B, abs=1e-12)


def test_k3_kl_metric_and_term():
    lp, old, ref, adv = _batch(seed=4)
    _, m0 = grpo_loss(lp, old, adv, MASK, config=GRPOLossConfig(kl_beta=0.0), ref_logprobs=ref)
    d = (ref - lp).detach()
    kl = [math.exp(float(d[b, t])) - float(d[b, t]) - 1 for b in range(B) for t in range(T) if MASK[b, t]]
    assert m0["grpo/kl"] == pytest.approx(sum(kl) / len(kl), abs=1e-12)
    l0, _ = grpo_loss(lp, old, adv, MASK, config=GRPOLossConfig(kl_beta=0.0), ref_logprobs=ref)
    l1, _ = grpo_loss(lp, old, adv, MASK, config=GRPOLossConfig(kl_beta=0.5), ref_logprobs=ref)
    assert float((l1 - l0).detach()) == pytest.approx(0.5 * sum(kl) / len(kl), abs=1e-12)  # dapo: / sum(mask)
    _, m_none = grpo_loss(lp, old, adv, MASK, config=GRPOLossConfig())
    assert "grpo/kl" not in m_none


def test_values_outside_the_mask_are_ignored():
    lp, old, ref, adv = _batch(seed=5)
    loss, _ = grpo_loss(lp, old, adv, MASK, config=GRPOLossConfig(kl_beta=0.1), ref_logprobs=ref)
    junk = torch.where(MASK.bool(), 0.0, 1e4).double()
    nan = torch.where(MASK.bool(), 0.0, math.nan).double()
    lp2 = (lp.detach() + junk).requires_grad_(True)
    loss2, m2 = grpo_loss(lp2, old + nan, adv, MASK, config=GRPOLossConfig(kl_beta=0.1), ref_logprobs=ref - junk)
    torch.testing.assert_close(loss2, loss, atol=1e-12, rtol=0)
    (g,) = torch.autograd.grad(loss2, lp2)
    assert torch.isfinite(g).all() and torch.all(g[~MASK.bool()] == 0)
    assert all(math.isfinite(v) for v in m2.values())


def test_per_token_advantages_are_accepted():
    lp, old, _, adv = _batch(seed=6)
    l1, _ = grpo_loss(lp, old, adv, MASK, config=GRPOLossConfig(loss_type="grpo"))
    l2, _ = grpo_loss(lp, old, adv[:, None].expand(B, T), MASK, config=GRPOLossConfig(loss_type="grpo"))
    torch.testing.assert_close(l1, l2, atol=0, rtol=0)


# --------------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"loss_type": "ppo"}, "'loss.loss_type' must be one of"),
        ({"importance_sampling_level": "tok"}, "'loss.importance_sampling_level' must be one of"),
        ({"scale_rewards": "std"}, "'loss.scale_rewards' must be one of"),
        ({"epsilon_low": 1.0}, "'loss.epsilon_low' must be a number in \\[0, 1\\)"),
        ({"epsilon_low": -0.1}, "'loss.epsilon_low' must be a number in \\[0, 1\\)"),
        ({"epsilon_high": -0.1}, "'loss.epsilon_high' must be a number in .0, "),
        ({"kl_beta": -1.0}, "'loss.kl_beta' must be a number in .0, "),
    ],
)
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GRPOLossConfig(**kwargs)


def test_config_is_keyword_only():
    with pytest.raises(TypeError):
        GRPOLossConfig("grpo")  # type: ignore[misc]


def test_loss_errors():
    lp, old, ref, adv = _batch()
    cfg = GRPOLossConfig()
    with pytest.raises(ValueError, match="config.kl_beta=0.1 > 0 needs ref_logprobs"):
        grpo_loss(lp, old, adv, MASK, config=GRPOLossConfig(kl_beta=0.1))
    with pytest.raises(ValueError, match="old_logprobs must have shape \\(4, 6\\)"):
        grpo_loss(lp, old[:, :-1], adv, MASK, config=cfg)
    with pytest.raises(ValueError, match="response_mask must have shape"):
        grpo_loss(lp, old, adv, MASK[:2], config=cfg)
    with pytest.raises(ValueError, match="ref_logprobs must have shape"):
        grpo_loss(lp, old, adv, MASK, config=cfg, ref_logprobs=ref[:2])
    with pytest.raises(ValueError, match="advantages must have shape \\(4,\\) or \\(4, 6\\)"):
        grpo_loss(lp, old, adv[:3], MASK, config=cfg)
    with pytest.raises(ValueError, match="logprobs must be a \\[B, T\\] tensor"):
        grpo_loss(lp[0], old[0], adv, MASK[0], config=cfg)
    with pytest.raises(ValueError, match="response_mask is all zero"):
        grpo_loss(lp, old, adv, torch.zeros(B, T), config=cfg)
    with pytest.raises(ValueError, match="max_completion_length=3 is shorter than a response"):
        grpo_loss(lp, old, adv, MASK, config=GRPOLossConfig(loss_type="dr_grpo"), max_completion_length=3)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="max_completion_length must be None or an int >= 1"):
            grpo_loss(lp, old, adv, MASK, config=GRPOLossConfig(loss_type="dr_grpo"), max_completion_length=bad)
    with pytest.raises(ValueError, match="config must be a GRPOLossConfig"):
        grpo_loss(lp, old, adv, MASK, config={"loss_type": "dapo"})  # type: ignore[arg-type]

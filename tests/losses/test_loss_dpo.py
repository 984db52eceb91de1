"""DPO loss and log-prob helpers (composer_replication.losses.dpo) against loop references."""

from __future__ import annotations

import math

import pytest
import torch

from composer_replication.losses.dpo import dpo_loss, per_token_logprobs, sequence_logprobs

ATOL = 1e-6


def _rand(seed, *shape, scale=2.0):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).requires_grad_(True)


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_per_token_logprobs_aligned_convention(temperature):
    b, t, v = 2, 5, 9
    logits = _rand(0, b, t, v)
    ids = torch.randint(0, v, (b, t), generator=torch.Generator().manual_seed(1))
    out = per_token_logprobs(logits, ids, temperature=temperature)
    rows = []
    for i in range(b):
        row = [torch.zeros((), dtype=torch.float64)]
        for j in range(1, t):
            z = logits[i, j - 1] / temperature
            row.append(z[ids[i, j]] - torch.log(torch.exp(z).sum()))
        rows.append(torch.stack(row))
    ref = torch.stack(rows)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    assert torch.all(out[:, 0] == 0)
    w = torch.rand(b, t, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    (g1,) = torch.autograd.grad((out * w).sum(), logits)
    (g2,) = torch.autograd.grad((ref * w).sum(), logits)
    torch.testing.assert_close(g1, g2, atol=ATOL, rtol=0)
    assert torch.all(g1[:, -1] == 0)  # the last position predicts nothing inside the sequence


def test_sequence_logprobs_sums_the_response_only():
    lp = _rand(3, 3, 4)
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 1]])
    garbage = lp + torch.where(mask.bool(), 0.0, math.nan)
    out = sequence_logprobs(garbage, mask)
    ref = torch.stack([sum(lp[b, t] for t in range(4) if mask[b, t]) for b in range(3)])
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)
    (g,) = torch.autograd.grad(out.sum(), lp)
    assert torch.equal(g, mask.double())


@pytest.mark.parametrize("beta", [0.1, 0.5])
@pytest.mark.parametrize("eps", [0.0, 0.1, 0.3])
def test_dpo_loss_matches_formula(beta, eps):
    pc, pr, rc, rr = (_rand(s, 6, scale=5.0) for s in range(10, 14))
    loss, metrics = dpo_loss(pc, pr, rc.detach(), rr.detach(), beta=beta, label_smoothing=eps)

    def log_sigmoid(x):
        return -torch.log(1 + torch.exp(-x))

    terms = []
    for i in range(6):
        delta = (pc[i] - rc[i].detach()) - (pr[i] - rr[i].detach())
        terms.append(-(1 - eps) * log_sigmoid(beta * delta) - eps * log_sigmoid(-beta * delta))
    ref = torch.stack(terms).mean()
    torch.testing.assert_close(loss, ref, atol=ATOL, rtol=0)
    g1 = torch.autograd.grad(loss, (pc, pr))
    g2 = torch.autograd.grad(ref, (pc, pr))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    chosen = beta * (pc - rc).detach()
    rejected = beta * (pr - rr).detach()
    assert metrics["dpo/reward_margin"] == pytest.approx(float((chosen - rejected).mean()), abs=1e-12)
    assert metrics["dpo/reward_accuracy"] == pytest.approx(float((chosen > rejected).double().mean()))
    assert metrics["dpo/chosen_reward"] == pytest.approx(float(chosen.mean()), abs=1e-12)
    assert metrics["dpo/loss"] == pytest.approx(float(ref.detach()), abs=ATOL)


def test_dpo_at_zero_margin_is_log2():
    x = torch.tensor([-3.0, -1.0])
    loss, metrics = dpo_loss(x, x, x, x)
    assert float(loss) == pytest.approx(math.log(2))
    assert metrics["dpo/reward_accuracy"] == 0.0


def test_errors():
    x = torch.zeros(3)
    with pytest.raises(
        ValueError, match="ref_rejected_logps has shape \\(4,\\) but policy_chosen_logps has \\(3,\\)"
    ):
        dpo_loss(x, x, x, torch.zeros(4))
    with pytest.raises(ValueError, match="policy_rejected_logps must be a non-empty \\[P\\] tensor"):
        dpo_loss(x, torch.zeros(3, 1), x, x)
    with pytest.raises(ValueError, match="beta must be a number > 0"):
        dpo_loss(x, x, x, x, beta=0.0)
    for bad in (-0.1, 0.5):
        with pytest.raises(ValueError, match="label_smoothing must be in \\[0, 0.5\\)"):
            dpo_loss(x, x, x, x, label_smoothing=bad)
    logits = torch.zeros(2, 4, 5)
    with pytest.raises(ValueError, match="input_ids must have shape \\(2, 4\\)"):
        per_token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="input_ids must be an integer tensor"):
        per_token_logprobs(logits, torch.zeros(2, 4))
    with pytest.raises(ValueError, match="input_ids must lie in \\[0, V=5\\)"):
        per_token_logprobs(logits, torch.full((2, 4), 5))
    with pytest.raises(ValueError, match="logits must be a float \\[B, T, V\\] tensor"):
        per_token_logprobs(torch.zeros(4, 5), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        per_token_logprobs(logits, torch.zeros(2, 4, dtype=torch.long), temperature=-1.0)
    with pytest.raises(ValueError, match="response_mask must have per_token's shape"):
        sequence_logprobs(torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="per_token must be a \\[B, T\\] tensor"):
        sequence_logprobs(torch.zeros(4), torch.ones(4))

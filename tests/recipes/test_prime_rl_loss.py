"""recipes.prime_rl.composer_loss against PRIME-RL's default loss.

``_upstream_default_loss`` and ``_upstream_ref_kl_loss`` are transcriptions of ``default_loss_fn`` and
``ref_kl_loss_fn`` in PrimeIntellect-ai/prime-rl@559b44772e471d1538537b8805cc77f3824a5e64
``src/prime_rl/trainer/rl/loss.py`` (the config object replaced by keyword arguments, the defaults of
``DefaultLossConfig``). Ours must give the same loss, gradients and metrics bit for bit in float64.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import pytest
import torch

from recipes.prime_rl.composer_loss import (
    ComposerLossInputs,
    DPPOMaskWarning,
    LossInputs,
    LossOutputs,
    composer_loss,
    loss_fn,
)

DOCS = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


# ------------------------------------------------------------------------------------------------
# Transcription of PRIME-RL's published loss functions (prime-rl@559b447, loss.py)
# ------------------------------------------------------------------------------------------------
def _safe_mean(values, mask):
    denom = torch.clamp_min(mask.sum(), 1)
    return values[mask].sum() / denom


def _ratio_and_mismatch_kl(trainer_logprobs, inference_logprobs):
    log_importance_ratio = trainer_logprobs - inference_logprobs
    importance_ratio = torch.exp(log_importance_ratio)
    mismatch_kl = importance_ratio - log_importance_ratio - 1
    return log_importance_ratio, importance_ratio, mismatch_kl


def _upstream_default_loss(inputs, dppo_mask_low=0.2, dppo_mask_high=0.2, adv_tau=1.0, kl_tau=1e-3):
    trainer_logprobs = inputs.trainer_logprobs
    inference_logprobs = inputs.inference_logprobs
    advantages = inputs.advantages
    loss_mask = inputs.loss_mask
    log_importance_ratio, importance_ratio, mismatch_kl = _ratio_and_mismatch_kl(
        trainer_logprobs, inference_logprobs
    )
    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    dppo_invalid_mask_high = probs_diff > dppo_mask_high
    dppo_invalid_mask_low = probs_diff < -dppo_mask_low
    positive_advantages = advantages > 0
    negative_advantages = advantages < 0
    dppo_invalid_mask = torch.where(positive_advantages, dppo_invalid_mask_high, dppo_invalid_mask_low)
    is_masked = dppo_invalid_mask
    is_masked_high = positive_advantages & dppo_invalid_mask_high
    is_masked_low = negative_advantages & dppo_invalid_mask_low
    drop_mask = loss_mask & is_masked
    keep_mask = loss_mask & ~is_masked
    advantages = adv_tau * advantages
    pg_loss = keep_mask * advantages * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    per_token_loss = -pg_loss + kl_tau * kl_loss
    if inputs.loss_weights is not None:
        per_token_loss = per_token_loss * inputs.loss_weights
    loss = per_token_loss.sum()
    metrics = {
        "masked_mismatch_kl": _safe_mean(mismatch_kl, loss_mask & is_masked),
        "unmasked_mismatch_kl": _safe_mean(mismatch_kl, keep_mask),
        "is_masked": _safe_mean(is_masked, loss_mask),
        "is_masked_low": _safe_mean(is_masked_low, loss_mask),
        "is_masked_high": _safe_mean(is_masked_high, loss_mask),
        "masked_advantage_positive": _safe_mean(positive_advantages, drop_mask),
        "masked_advantage_negative": _safe_mean(negative_advantages, drop_mask),
    }
    return loss, metrics


def _upstream_ref_kl_loss(inputs):
    trainer_logprobs = inputs.trainer_logprobs
    inference_logprobs = inputs.inference_logprobs
    ref_logprobs = inputs.ref_logprobs
    loss_mask = inputs.loss_mask
    log_importance_ratio, importance_ratio, mismatch_kl = _ratio_and_mismatch_kl(
        trainer_logprobs, inference_logprobs
    )
    probs_diff = torch.exp(trainer_logprobs) - torch.exp(inference_logprobs)
    is_masked = probs_diff < -0.2
    keep_mask = loss_mask & ~is_masked
    ref_kl = ref_logprobs - trainer_logprobs
    pg_loss = keep_mask * ref_kl.detach() * importance_ratio
    kl_loss = loss_mask * log_importance_ratio**2
    per_token_loss = -pg_loss + 1e-3 * kl_loss
    if inputs.loss_weights is not None:
        per_token_loss = per_token_loss * inputs.loss_weights
    return per_token_loss.sum()


# ------------------------------------------------------------------------------------------------
# Helpers
# ------------------------------------------------------------------------------------------------
def _sample(seq: int = 61, *, seed: int = 0, weights: bool = False, ref: bool = False, spread: float = 0.8):
    """Random float64 ``[seq]`` inputs: advantages of both signs and zeros, a partial loss mask, and trainer /
    inference log-probs far enough apart that the DPPO mask drops some tokens on both sides."""
    g = torch.Generator().manual_seed(seed)
    lp_inf = torch.log(torch.rand(seq, generator=g, dtype=torch.float64).clamp_min(1e-3))
    lp = (lp_inf + spread * torch.randn(seq, generator=g, dtype=torch.float64)).clamp_max(0.0)
    adv = torch.randn(seq, generator=g, dtype=torch.float64)
    adv[::5] = 0.0
    mask = torch.rand(seq, generator=g) > 0.2
    w = torch.rand(seq, generator=g, dtype=torch.float64) + 0.5 if weights else None
    ref_lp = (
        (lp_inf + 0.5 * torch.randn(seq, generator=g, dtype=torch.float64)).clamp_max(0.0) if ref else None
    )
    return LossInputs(lp.requires_grad_(), lp_inf, ref_lp, adv, mask, w)  # PRIME-RL's field order


def _composer(x, **change) -> ComposerLossInputs:
    """``x``'s fields in a ``ComposerLossInputs``, with ``change`` applied."""
    return ComposerLossInputs(**({f.name: getattr(x, f.name) for f in dataclasses.fields(x)} | change))


def _loss_and_grad(fn, inputs):
    inputs.trainer_logprobs.grad = None
    out = fn(inputs)
    loss = out.loss if isinstance(out, LossOutputs) else out[0] if isinstance(out, tuple) else out
    (grad,) = torch.autograd.grad(loss, inputs.trainer_logprobs)
    return out, loss.detach(), grad


def _assert_same_as_upstream(inputs, **cfg):
    ours, loss, grad = _loss_and_grad(lambda x: composer_loss(x, **cfg), inputs)
    (_, ref_metrics), ref_loss, ref_grad = _loss_and_grad(lambda x: _upstream_default_loss(x, **cfg), inputs)
    assert torch.equal(loss, ref_loss), (loss, ref_loss)
    assert torch.equal(grad, ref_grad)
    for k, v in ref_metrics.items():
        assert torch.equal(ours.metrics[k].detach(), v.detach()), k
    return ours


# ------------------------------------------------------------------------------------------------
# PRIME-RL's default loss, exactly
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("weights", [False, True])
def test_defaults_equal_prime_rl_default_loss(seed, weights):
    inputs = _sample(seed=seed, weights=weights, ref=True)  # ref_logprobs: ignored by the default source
    out = _assert_same_as_upstream(inputs)
    assert 0 < float(out.metrics["is_masked"]) < 1  # the random draw exercises the mask
    assert float(out.metrics["is_masked_low"]) > 0 and float(out.metrics["is_masked_high"]) > 0
    assert float(out.metrics["composer/distill_tokens"]) == 0


@pytest.mark.parametrize(
    "cfg",
    [
        dict(dppo_mask_low=0.05, dppo_mask_high=0.3, adv_tau=0.5, kl_tau=0.1),
        dict(dppo_mask_low=0.0, dppo_mask_high=0.0, adv_tau=2.0, kl_tau=0.0),
        dict(dppo_mask_low=1e6, dppo_mask_high=1e6, adv_tau=1.0, kl_tau=1e-3),
    ],
)
def test_coefficients_equal_prime_rl(cfg):
    out = _assert_same_as_upstream(_sample(seq=53, seed=3, weights=True), **cfg)
    if cfg["dppo_mask_high"] == 1e6:
        assert float(out.metrics["is_masked"]) == 0  # bounds disabled: every token passes


def test_mask_follows_the_sign_of_the_advantage():
    # probs: trainer vs inference; advantages: +, +, -, -, 0
    p_train = torch.tensor([0.9, 0.1, 0.1, 0.9, 0.1], dtype=torch.float64)
    p_inf = torch.tensor([0.5, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 0.0], dtype=torch.float64)
    inputs = LossInputs(
        p_train.log().requires_grad_(), p_inf.log(), None, adv, torch.ones(5, dtype=torch.bool)
    )
    out, _, grad = _loss_and_grad(lambda x: composer_loss(x, kl_tau=0.0), inputs)
    # token 0: A > 0, dp = +0.4 > 0.2: dropped; 1: A > 0, dp = -0.4: kept (A > 0 checks only the upper bound);
    # 2: A < 0, dp = -0.4 < -0.2: dropped; 3: A < 0, dp = +0.4: kept; 4: A = 0, dp = -0.4: dropped (lower bound)
    ratio = p_train / p_inf
    expected = torch.tensor([0.0, -ratio[1], 0.0, ratio[3], 0.0], dtype=torch.float64)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-15)
    assert float(out.metrics["is_masked_high"]) == pytest.approx(1 / 5)
    assert float(out.metrics["is_masked_low"]) == pytest.approx(1 / 5)
    assert float(out.metrics["masked_advantage_positive"]) == pytest.approx(1 / 3)
    _assert_same_as_upstream(inputs, kl_tau=0.0)


def test_all_tokens_masked_warns_and_trains_only_the_kl_term():
    inputs = _sample(seq=11, seed=4)
    with torch.no_grad():  # every token far above its inference probability, every advantage positive
        inputs.trainer_logprobs.copy_(torch.full((11,), -0.01, dtype=torch.float64))
        inputs.inference_logprobs.copy_(torch.full((11,), -3.0, dtype=torch.float64))
    inputs.advantages.abs_().add_(0.1)
    with pytest.warns(DPPOMaskWarning, match=r"dropped all \d+ loss tokens.*TROUBLESHOOTING §10"):
        out = _assert_same_as_upstream(inputs)
    assert float(out.metrics["is_masked"]) == 1.0
    _, _, grad = _loss_and_grad(lambda x: composer_loss(x, kl_tau=0.0, warn_all_masked=False), inputs)
    assert torch.count_nonzero(grad) == 0  # no policy gradient left


def test_no_warning_when_tokens_survive_or_the_mask_is_empty():
    with warnings.catch_warnings():
        warnings.simplefilter("error", DPPOMaskWarning)
        composer_loss(_sample(seed=5))
        empty = _sample(seq=6, seed=6)
        empty.loss_mask[:] = False
        out = _assert_same_as_upstream(empty)
    assert float(out.loss.detach()) == 0.0


# ------------------------------------------------------------------------------------------------
# Input contract
# ------------------------------------------------------------------------------------------------
def test_batched_input_is_refused_with_the_fix():
    x = _sample(seq=8)
    rows = [
        t.detach().view(2, 4) for t in (x.trainer_logprobs, x.inference_logprobs, x.advantages, x.loss_mask)
    ]
    batched = LossInputs(rows[0], rows[1], None, rows[2], rows[3])
    with pytest.raises(
        ValueError, match=r"expected \(seq,\) shape, got \(B, T\) \(2, 4\).*one sample per call"
    ):
        composer_loss(batched)


def test_loss_fn_is_the_spec_name_and_runs_per_row_as_troubleshooting_7():
    """TROUBLESHOOTING §7's fix: slice a batch into per-sample ``[seq]`` inputs and call ``loss_fn`` per row."""
    assert loss_fn is composer_loss
    g = torch.Generator().manual_seed(3)
    B, T = 3, 7
    lp = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64)).requires_grad_()
    inf = lp.detach() + 0.05 * torch.randn(B, T, generator=g, dtype=torch.float64)
    teacher = torch.log(torch.rand(B, T, generator=g, dtype=torch.float64))
    adv, mask = torch.randn(B, T, generator=g, dtype=torch.float64), torch.ones(B, T, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"expected \(seq,\) shape, got \(B, T\)"):
        loss_fn(ComposerLossInputs(lp, inf, None, adv, mask, teacher_logprobs=teacher))
    total = sum(loss_fn(ComposerLossInputs(trainer_logprobs=lp[b], inference_logprobs=inf[b], ref_logprobs=None,
                                           advantages=adv[b], loss_mask=mask[b], teacher_logprobs=teacher[b]),
                        alpha_sdpo=0.1).loss for b in range(B))
    (grad,) = torch.autograd.grad(total, lp)
    ratio = torch.exp(lp.detach() - inf)
    dp = torch.exp(lp.detach()) - torch.exp(inf)
    keep, dkeep = torch.where(adv > 0, dp <= 0.2, dp >= -0.2), dp >= -0.2
    want = -keep.double() * adv * ratio + 2e-3 * (lp.detach() - inf) - 0.1 * dkeep.double() * (teacher - lp.detach()) * ratio
    torch.testing.assert_close(grad, want)  # d/dlp of the summed per-token loss, row by row


@pytest.mark.parametrize(
    "change, match",
    [
        (
            dict(advantages=torch.zeros(5, dtype=torch.float64)),
            r"length of trainer_logprobs \(8\).*advantages",
        ),
        (dict(loss_mask=torch.ones(8)), r"loss_mask must be a bool tensor.*mask.bool\(\)"),
        (dict(teacher_mask=torch.ones(8)), r"teacher_mask must be a bool tensor"),
        (dict(teacher_logprobs=torch.zeros(2, 4)), r"expected \(seq,\) shape.*teacher_logprobs"),
    ],
)
def test_bad_inputs(change, match):
    with pytest.raises(ValueError, match=match):
        composer_loss(_composer(_sample(seq=8), **change))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(dppo_mask_high=-0.1), "dppo_mask_high must be >= 0"),
        (dict(kl_tau=float("nan")), "kl_tau must be >= 0"),
        (dict(alpha_sdpo=-1.0), "alpha_sdpo must be >= 0"),
        (dict(teacher_source="teacher"), "teacher_source must be one of"),
    ],
)
def test_bad_kwargs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        composer_loss(_sample(), **kwargs)


def test_mirrored_dataclasses_have_prime_rls_fields():
    names = "trainer_logprobs inference_logprobs ref_logprobs advantages loss_mask loss_weights".split()
    assert [f.name for f in dataclasses.fields(LossInputs)] == names
    assert [f.name for f in dataclasses.fields(LossOutputs)] == ["loss", "metrics"]
    assert issubclass(ComposerLossInputs, LossInputs)


# ------------------------------------------------------------------------------------------------
# Channel 2: distillation toward the hint-conditioned teacher
# ------------------------------------------------------------------------------------------------
def test_channel_two_equals_prime_rls_ref_kl_form():
    """adv_tau = 0, kl_tau = 1e-3, alpha = 1: the loss is PRIME-RL's ref_kl loss with the teacher as reference."""
    inputs = _sample(seq=41, seed=7, weights=True, ref=True)
    kw = dict(adv_tau=0.0, kl_tau=1e-3, alpha_sdpo=1.0, teacher_source="ref_logprobs")
    ours, loss, grad = _loss_and_grad(lambda x: composer_loss(x, **kw), inputs)
    _, ref_loss, ref_grad = _loss_and_grad(_upstream_ref_kl_loss, inputs)
    assert torch.equal(loss, ref_loss) and torch.equal(grad, ref_grad)
    assert float(ours.metrics["composer/distill_tokens"]) > 0
    assert 0 < float(ours.metrics["composer/distill_is_masked"]) < 1


def test_channel_two_from_composer_inputs_is_weighted_and_masked():
    x = _sample(seq=29, seed=8, ref=True)
    inputs = _composer(
        x, ref_logprobs=None, teacher_logprobs=x.ref_logprobs, teacher_mask=torch.arange(29) < 20
    )
    losses = [composer_loss(inputs, alpha_sdpo=a).loss.detach() for a in (0.0, 1.0, 0.3)]
    torch.testing.assert_close(losses[2] - losses[0], 0.3 * (losses[1] - losses[0]), rtol=1e-12, atol=1e-12)
    assert torch.equal(losses[0], _upstream_default_loss(x)[0].detach())
    # tokens outside teacher_mask get only the policy gradient
    _, _, g_off = _loss_and_grad(lambda y: composer_loss(y, alpha_sdpo=0.0), inputs)
    _, _, g_on = _loss_and_grad(lambda y: composer_loss(y, alpha_sdpo=1.0), inputs)
    assert torch.equal(g_on[20:], g_off[20:]) and not torch.equal(g_on[:20], g_off[:20])


def test_channel_two_gradient_points_toward_the_teacher():
    lp = torch.log(torch.tensor([0.3, 0.3], dtype=torch.float64)).requires_grad_()
    teacher = torch.log(torch.tensor([0.6, 0.1], dtype=torch.float64))  # token 0 likelier under the teacher
    zeros, ones = torch.zeros(2, dtype=torch.float64), torch.ones(2, dtype=torch.bool)
    inputs = ComposerLossInputs(lp, lp.detach().clone(), None, zeros, ones, teacher_logprobs=teacher)
    _, _, grad = _loss_and_grad(lambda x: composer_loss(x, alpha_sdpo=1.0), inputs)
    assert grad[0] < 0 < grad[1]  # descent raises token 0 and lowers token 1


def test_ref_logprobs_zero_filler_means_no_teacher():
    x = _sample(seq=15, seed=9, ref=True)
    x.ref_logprobs = torch.zeros(
        15, dtype=torch.float64
    )  # PRIME-RL packs samples without a reference as zeros
    out = composer_loss(x, teacher_source="ref_logprobs", alpha_sdpo=1.0)
    assert torch.equal(out.loss.detach(), _upstream_default_loss(x)[0].detach())
    assert float(out.metrics["composer/distill_tokens"]) == 0


def test_channel_two_alone_reduces_the_reverse_kl_to_the_teacher():
    """A softmax policy over 6 tokens trained on its own samples with channel 2 only moves toward the teacher."""
    torch.manual_seed(0)
    teacher = torch.log_softmax(torch.tensor([2.0, 1.0, 0.0, -1.0, 0.5, -2.0], dtype=torch.float64), -1)
    logits = torch.zeros(6, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.SGD([logits], lr=0.5)

    def reverse_kl() -> float:
        p = torch.log_softmax(logits.detach(), -1)
        return float((p.exp() * (p - teacher)).sum())

    start = reverse_kl()
    for _ in range(60):
        logp = torch.log_softmax(logits, -1)
        tokens = torch.multinomial(logp.detach().exp(), 64, replacement=True)  # [seq] on-policy samples
        zeros, ones = torch.zeros(64, dtype=torch.float64), torch.ones(64, dtype=torch.bool)
        inputs = ComposerLossInputs(
            logp[tokens], logp.detach()[tokens], None, zeros, ones, teacher_logprobs=teacher[tokens]
        )
        opt.zero_grad()
        (composer_loss(inputs, alpha_sdpo=1.0).loss / 64).backward()
        opt.step()
    assert reverse_kl() < 0.1 * start


# ------------------------------------------------------------------------------------------------
# The real PRIME-RL, when installed; the docs snippet
# ------------------------------------------------------------------------------------------------
def test_parity_with_installed_prime_rl():
    loss_mod = pytest.importorskip(
        "prime_rl.trainer.rl.loss", reason="prime-rl is not installed (source only)"
    )
    configs = pytest.importorskip("prime_rl.configs.trainer")
    samples = [_sample(seq=n, seed=s, weights=False) for s, n in ((10, 23), (11, 31))]

    def run(loss_config):
        rl_fn = loss_mod.setup_rl_loss_fn(loss_config)
        for x in samples:
            x.trainer_logprobs.grad = None
        streams = {k: [getattr(x, k) for x in samples] for k in ("trainer_logprobs", "inference_logprobs")}
        loss, metrics = loss_mod.compute_loss(  # two packed samples; rl_scale plays the global token count
            **streams,
            ref_logprobs=None,
            advantages=[x.advantages for x in samples],
            loss_mask=[x.loss_mask for x in samples],
            rl_weights=None,
            ce_weights=None,
            ref_kl_weights=None,
            rl_loss_fn=rl_fn,
            rl_scale=40,
            ce_scale=1,
            ref_kl_scale=1,
        )
        loss.backward()
        return loss.detach(), [x.trainer_logprobs.grad.clone() for x in samples], metrics

    cfg = dict(dppo_mask_low=0.1, dppo_mask_high=0.3, adv_tau=0.7, kl_tau=0.01)
    ref_loss, ref_grads, ref_metrics = run(configs.DefaultLossConfig(**cfg))
    loss, grads, metrics = run(
        configs.CustomLossConfig(import_path="recipes.prime_rl.composer_loss.composer_loss", kwargs=cfg)
    )
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert all(torch.equal(metrics[k].detach(), v.detach()) for k, v in ref_metrics.items())


def _snippet(marker: str) -> str:
    """The python block right after ``<!-- runs: {marker} -->`` in docs/integrations.md."""
    text = DOCS.read_text(encoding="utf-8")
    m = re.search(rf"<!-- runs: {re.escape(marker)} -->\s*```python\n(.*?)```", text, re.S)
    assert m, f"docs/integrations.md has no runnable '{marker}' snippet"
    return m.group(1)


def test_docs_prime_rl_snippet_runs():
    exec(compile(_snippet("prime-rl"), str(DOCS), "exec"), {"__name__": "docs_snippet"})

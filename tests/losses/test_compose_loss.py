"""compose_loss: channel arithmetic, switching channels off, gradients, chunked == naive, errors."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from loss_batches import make_batch  # tests/losses/loss_batches.py (the test folder is on sys.path)

from composer_replication.losses import (
    GRPOLossConfig,
    LossComponents,
    compose_loss,
    dpo_loss,
    grpo_loss,
    self_distillation_loss,
    sequence_logprobs_for,
    simpo_loss,
    token_logprobs_for,
)
from composer_replication.losses.dpo import per_token_logprobs, sequence_logprobs
from composer_replication.losses.entropy_aware_opd import entropy_aware_opd_per_token
from composer_replication.losses.jsd import generalized_jsd_per_token
from composer_replication.losses.taid import taid_per_token


def _logits(model, ids, att):
    pos = (att.cumsum(-1) - 1).clamp(min=0)
    return model(input_ids=ids, attention_mask=att, position_ids=pos).logits.float()


def _distill_rows(model, b):
    s_logits = _logits(model, b["input_ids"], b["attention_mask"])
    with torch.no_grad():
        t_logits = _logits(model, b["ctx_teacher_input_ids"], b["ctx_teacher_attention_mask"])
    s, t = b["response_mask"].nonzero(), b["sdpo_loss_mask"].nonzero()
    return s_logits[s[:, 0], s[:, 1] - 1], t_logits[t[:, 0], t[:, 1] - 1]


def _pair_logprobs(model, b):
    seq = {}
    for side in ("chosen", "rejected"):
        ids, att = b[f"dpo_{side}_input_ids"], b[f"dpo_{side}_attention_mask"]
        seq[side] = sequence_logprobs(per_token_logprobs(_logits(model, ids, att), ids), b[f"dpo_{side}_response_mask"])
    return seq


def reference_channels(model, b):
    """Naive full-logits math written from the formulas: (lm_ce, jsd, dpo)."""
    logits = _logits(model, b["input_ids"], b["attention_mask"])
    rows, pos = b["response_mask"].nonzero(as_tuple=True)
    lm_ce = F.cross_entropy(logits[rows, pos - 1], b["input_ids"][rows, pos])
    jsd = generalized_jsd_per_token(*_distill_rows(model, b), beta=0.5, temperature=1.0).mean()
    seq = _pair_logprobs(model, b)
    dpo, _ = dpo_loss(seq["chosen"], seq["rejected"], b["dpo_chosen_ref_logprobs"], b["dpo_rejected_ref_logprobs"],
                      beta=0.1, label_smoothing=0.0)
    return lm_ce, jsd, dpo


@pytest.fixture
def model(tiny_model_and_tokenizer):
    return copy.deepcopy(tiny_model_and_tokenizer[0])


# ---------------------------------------------------------------------------- arithmetic and equivalence


@pytest.mark.parametrize("side", ["left", "right"])
def test_defaults_reproduce_spec_total_bit_exactly(model, side):
    b = make_batch(side)
    with torch.no_grad():
        lm_ce, jsd, dpo = reference_channels(model, b)
        naive = compose_loss(model, b, chunk_size=None)
        chunked = compose_loss(model, b)
    assert naive.policy_name == "lm_ce"
    assert torch.equal(naive.total, lm_ce + 0.1 * jsd + 0.05 * dpo)
    assert torch.equal(naive.lm_ce, lm_ce) and torch.equal(naive.sdpo_jsd, jsd)
    assert torch.equal(naive.trace_replay_dpo, dpo)
    for f in ("lm_ce", "sdpo_jsd", "trace_replay_dpo", "total"):
        torch.testing.assert_close(getattr(chunked, f), getattr(naive, f), rtol=0, atol=1e-5)
    assert jsd > 0 and dpo > 0


def _all_grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(("side", "chunk"), [("left", 7), ("right", 7), ("right", 3)])
@pytest.mark.parametrize("rollout", [False, True])
def test_chunked_and_naive_agree_on_values_and_parameter_grads(tiny_model_and_tokenizer, side, chunk, rollout):
    b = make_batch(side, seed=1)
    if rollout:
        base = tiny_model_and_tokenizer[0]
        with torch.no_grad():
            old = token_logprobs_for(base, b["input_ids"], b["attention_mask"], response_mask=b["response_mask"])
        b.update(old_logprobs=old + 0.05 * torch.randn(old.shape, generator=torch.Generator().manual_seed(0)),
                 advantages=torch.tensor([1.0, -0.5]))
    outs, grads = [], []
    for chunk_size in (None, chunk):
        m = copy.deepcopy(tiny_model_and_tokenizer[0])
        out = compose_loss(m, b, chunk_size=chunk_size, sdpo_top_k=50)
        out.total.backward()
        outs.append(out)
        grads.append(_all_grads(m))
    assert outs[1].policy_name == ("grpo" if rollout else "lm_ce")
    for f in ("lm_ce", "sdpo_jsd", "trace_replay_dpo", "total"):
        torch.testing.assert_close(getattr(outs[1], f), getattr(outs[0], f), rtol=0, atol=1e-5)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------------------- switching channels off


class _Counter:
    def __init__(self, model):
        self.shapes = []
        self.handle = model.get_decoder().register_forward_hook(lambda mod, args, kw, out: self.shapes.append(
            tuple(kw["input_ids"].shape)), with_kwargs=True)


@pytest.mark.parametrize(
    ("kwargs", "drop", "expected"),
    [
        ({}, (), 3),  # student, hinted teacher, chosen + rejected in one pass
        ({"alpha_sdpo": 0.0}, (), 2),
        ({}, ("ctx_teacher_input_ids",), 2),
        ({"beta_replay": 0.0}, (), 2),
        ({}, ("dpo_chosen_input_ids",), 2),
        ({"alpha_sdpo": 0.0, "beta_replay": 0.0}, (), 1),
    ],
)
def test_channels_switch_off_without_forward_passes(model, kwargs, drop, expected):
    b = make_batch()
    for key in drop:
        b.pop(key)
    counter = _Counter(model)
    with torch.no_grad():
        out = compose_loss(model, b, **kwargs)
    counter.handle.remove()
    assert len(counter.shapes) == expected
    assert counter.shapes[0] == tuple(b["input_ids"].shape)  # the student once, first
    assert len(set(counter.shapes)) == len(counter.shapes)  # no batch twice
    sdpo_on = "alpha_sdpo" not in kwargs and "ctx_teacher_input_ids" in b
    replay_on = "beta_replay" not in kwargs and "dpo_chosen_input_ids" in b
    assert (out.sdpo_jsd != 0) == sdpo_on and (out.trace_replay_dpo != 0) == replay_on
    expected_total = out.lm_ce + (0.1 * out.sdpo_jsd if sdpo_on else 0) + (0.05 * out.trace_replay_dpo if replay_on else 0)
    torch.testing.assert_close(out.total, expected_total)


@pytest.mark.parametrize("channel", ["lm_ce", "sdpo_jsd", "trace_replay_dpo", "grpo"])
def test_gradient_reaches_parameters_through_each_channel(model, channel):
    b = make_batch()
    if channel == "grpo":
        with torch.no_grad():
            b["old_logprobs"] = token_logprobs_for(model, b["input_ids"], b["attention_mask"],
                                                   response_mask=b["response_mask"])
        b["advantages"] = torch.tensor([1.0, -1.0])
    out = compose_loss(model, b, chunk_size=5)
    loss = out.lm_ce if channel == "grpo" else getattr(out, channel)
    loss.backward()
    for p in (model.model.layers[0].self_attn.q_proj.weight, model.model.embed_tokens.weight, model.model.norm.weight):
        assert p.grad is not None and p.grad.abs().sum() > 0


# ---------------------------------------------------------------------------- GRPO, wrappers, SimPO


def test_grpo_fires_with_rollout_keys_and_is_named_grpo(model):
    b = make_batch(sdpo=False, dpo=False)
    with torch.no_grad():
        lp = token_logprobs_for(model, b["input_ids"], b["attention_mask"], response_mask=b["response_mask"])
    b.update(old_logprobs=lp - 0.1, rewards=torch.tensor([1.0, 0.0]), group_ids=torch.tensor([0, 0]))
    cfg = GRPOLossConfig(loss_type="grpo", epsilon_high=0.28)
    out = compose_loss(model, b, loss_type="grpo", epsilon_high=0.28)
    assert out.policy_name == "grpo"
    assert set(out.detached()) == {"lm_ce", "sdpo_jsd", "trace_replay_dpo", "total"}  # the spec's keys
    m = out.metrics()
    assert m["loss/grpo"] == float(out.lm_ce.detach()) and "loss/lm_ce" not in m and "loss/grpo/clip_ratio" in m
    adv = torch.tensor([1.0, -1.0]) / (torch.tensor([1.0, 0.0]).std() + 1e-4)
    ref, _ = grpo_loss(lp, lp - 0.1, adv, b["response_mask"], config=cfg)
    torch.testing.assert_close(out.lm_ce.detach(), ref, rtol=1e-5, atol=1e-6)
    # rewards without old_logprobs stay the LM cross-entropy fallback, never labelled grpo
    b.pop("old_logprobs")
    out2 = compose_loss(model, b)
    assert out2.policy_name == "lm_ce" and not any(k.startswith("loss/grpo") for k in out2.metrics())


@pytest.mark.parametrize("wrapper", ["taid", "entropy_opd"])
def test_sdpo_wrappers(model, wrapper):
    b = make_batch(dpo=False)
    kw = {"taid_t": 0.3} if wrapper == "taid" else {"entropy_opd_h_max": 5.0, "sdpo_temperature": 1.3}
    with torch.no_grad():
        s, t = _distill_rows(model, b)
        if wrapper == "taid":
            ref = taid_per_token(s, t, t=0.3).mean()
        else:
            ref = entropy_aware_opd_per_token(s, t, h_max=5.0, temperature=1.3).mean()
    out = compose_loss(model, b, sdpo_wrapper=wrapper, chunk_size=3, **kw)
    torch.testing.assert_close(out.sdpo_jsd.detach(), ref, rtol=1e-5, atol=1e-6)
    out.total.backward()
    assert model.model.layers[1].mlp.up_proj.weight.grad.abs().sum() > 0


def test_simpo_needs_no_reference_logprobs(model):
    b = make_batch(sdpo=False)
    b.pop("dpo_chosen_ref_logprobs"), b.pop("dpo_rejected_ref_logprobs")
    with torch.no_grad():
        seq = _pair_logprobs(model, b)
        avg = {k: v / b[f"dpo_{k}_response_mask"].sum(-1) for k, v in seq.items()}
        ref = simpo_loss(avg["chosen"], avg["rejected"], beta=2.5, gamma=0.5)
        out = compose_loss(model, b, dpo_variant="simpo", simpo_beta=2.5, simpo_gamma=0.5)
    torch.testing.assert_close(out.trace_replay_dpo, ref, rtol=1e-5, atol=1e-6)


def test_index_keys_and_token_weights(model):
    b = make_batch("left", dpo=False)
    s, t = b["response_mask"].nonzero(), b["sdpo_loss_mask"].nonzero()
    with torch.no_grad():
        derived = compose_loss(model, b)
        explicit = compose_loss(model, {**b, "sdpo_student_index": s, "sdpo_teacher_index": t})
        torch.testing.assert_close(explicit.sdpo_jsd, derived.sdpo_jsd, rtol=0, atol=1e-6)
        w = torch.tensor([0.0, 1.0, 2.0, 0.0, 1.0, 1.0, 3.0])
        weighted = compose_loss(model, {**b, "sdpo_token_weight": w}, chunk_size=2)
        d = generalized_jsd_per_token(*_distill_rows(model, b), beta=0.5)
    torch.testing.assert_close(weighted.sdpo_jsd, (d * w).sum() / w.sum(), rtol=1e-5, atol=1e-6)
    # a subset of tokens, given by index, against a teacher batch of a different size (B2 != B)
    sub = compose_loss(model, {**b, "ctx_teacher_input_ids": b["ctx_teacher_input_ids"][1:],
                               "ctx_teacher_attention_mask": b["ctx_teacher_attention_mask"][1:],
                               "sdpo_student_index": s[4:], "sdpo_teacher_index": t[4:] - torch.tensor([1, 0])})
    torch.testing.assert_close(sub.sdpo_jsd.detach(), d[4:].mean(), rtol=1e-5, atol=1e-6)


def test_label_smoothing(model):
    b = make_batch(sdpo=False, dpo=False)
    with torch.no_grad():
        logits = _logits(model, b["input_ids"], b["attention_mask"])
        rows, pos = b["response_mask"].nonzero(as_tuple=True)
        ref = F.cross_entropy(logits[rows, pos - 1], b["input_ids"][rows, pos], label_smoothing=0.2)
        out = compose_loss(model, b, lm_ce_label_smoothing=0.2, chunk_size=3)
    torch.testing.assert_close(out.lm_ce, ref, rtol=0, atol=1e-5)


def test_logprob_helpers_match_per_token_logprobs(model):
    b = make_batch("left", sdpo=False, dpo=False)
    with torch.no_grad():
        ref = per_token_logprobs(_logits(model, b["input_ids"], b["attention_mask"]), b["input_ids"])
        lp = token_logprobs_for(model, b["input_ids"], b["attention_mask"], chunk_size=4)
        seq = sequence_logprobs_for(model, b["input_ids"], b["response_mask"], b["attention_mask"], chunk_size=4)
    valid = (b["attention_mask"][:, 1:] * b["attention_mask"][:, :-1]).bool()
    torch.testing.assert_close(lp[:, 1:][valid], ref[:, 1:][valid], rtol=0, atol=1e-5)
    torch.testing.assert_close(seq, sequence_logprobs(ref, b["response_mask"]), rtol=1e-6, atol=1e-4)


def test_detached_names_and_policy_alias():
    z = torch.tensor(0.5)
    c = LossComponents(lm_ce=z, sdpo_jsd=z, trace_replay_dpo=z, total=z)
    assert c.detached() == {"lm_ce": 0.5, "sdpo_jsd": 0.5, "trace_replay_dpo": 0.5, "total": 0.5}
    assert c.policy is c.lm_ce and c.channel_metrics == {}
    assert c.metrics() == {"loss/lm_ce": 0.5, "loss/total": 0.5}  # no channel 2/3 named: none reported
    g = LossComponents(lm_ce=z, sdpo_jsd=z, trace_replay_dpo=z, total=z, policy_name="grpo", distill_name="taid",
                       replay_name="simpo", channel_metrics={"taid": {"t": 0.3}})
    assert g.detached() == c.detached()
    assert g.metrics() == {"loss/grpo": 0.5, "loss/taid": 0.5, "loss/simpo": 0.5, "loss/total": 0.5, "loss/taid/t": 0.3}


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"dpo_variant": "ipo"}, "dpo_variant"),
        ({"sdpo_wrapper": "gkd"}, "sdpo_wrapper"),
        ({"sdpo_wrapper": "taid"}, "needs taid_t"),
        ({"sdpo_wrapper": "taid", "taid_t": 1.5}, r"taid_t must be in \[0, 1\]"),
        ({"alpha_sdpo": -1.0}, "alpha_sdpo"),
        ({"lm_ce_label_smoothing": 1.0}, "lm_ce_label_smoothing"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_option_errors(model, kwargs, match):
    with pytest.raises(ValueError, match=match):
        compose_loss(model, make_batch(), **kwargs)


def _drop(b, *keys):
    return {k: v for k, v in b.items() if k not in keys}


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda b: _drop(b, "response_mask"), "response_mask"),
        (lambda b: {**b, "response_mask": b["response_mask"][:, :-1]}, "response_mask.*shape"),
        (lambda b: _drop(b, "dpo_chosen_ref_logprobs"), "dpo_chosen_ref_logprobs"),
        (lambda b: _drop(b, "dpo_rejected_response_mask"), "dpo_rejected_response_mask"),
        (lambda b: _drop(b, "sdpo_loss_mask"), "sdpo_loss_mask"),
        (lambda b: {**b, "sdpo_loss_mask": b["sdpo_loss_mask"].roll(1, dims=1) | b["sdpo_loss_mask"]}, "counts"),
        (lambda b: {**b, "ctx_teacher_input_ids": b["ctx_teacher_input_ids"][:1]}, "B=2"),
        (lambda b: {**b, "sdpo_student_index": torch.tensor([[0, 6]]), "sdpo_teacher_index": torch.tensor([[0, 2]])},
         "differ between the student and teacher"),
        (lambda b: {**b, "sdpo_student_index": torch.tensor([[0, 6]])}, "sdpo_teacher_index"),
        (lambda b: {**b, "sdpo_student_index": torch.tensor([[0, 0]]), "sdpo_teacher_index": torch.tensor([[0, 0]])},
         "positions must be >= 1"),
        (lambda b: {**b, "old_logprobs": torch.zeros(2, 3), "advantages": torch.zeros(2)}, "old_logprobs"),
        (lambda b: {**b, "dpo_rejected_ref_logprobs": torch.zeros(3)}, "dpo_rejected_ref_logprobs"),
    ],
)
def test_batch_errors(model, mutate, match):
    with pytest.raises(ValueError, match=match):
        compose_loss(model, mutate(make_batch()))


@pytest.mark.parametrize("chunk", [None, 3])
def test_self_distillation_loss_is_channel_2_alone(model, chunk):
    b = make_batch(dpo=False)
    full = compose_loss(model, b, alpha_sdpo=1.0, beta_replay=0.0, sdpo_jsd_beta=0.3, chunk_size=chunk)
    full.sdpo_jsd.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    loss, metrics = self_distillation_loss(model, b, sdpo_jsd_beta=0.3, chunk_size=chunk)
    assert torch.equal(loss.detach(), full.sdpo_jsd.detach())
    assert metrics["loss/jsd/num_tokens"] == full.metrics()["loss/jsd/num_tokens"] > 0
    assert metrics["loss/jsd"] == full.metrics()["loss/jsd"]
    loss.backward()
    for n, p in model.named_parameters():
        if n in want:
            torch.testing.assert_close(p.grad, want[n], rtol=1e-6, atol=1e-7, msg=n)
    with pytest.raises(ValueError, match="ctx_teacher_input_ids"):
        self_distillation_loss(model, _drop(b, "ctx_teacher_input_ids"))
    with pytest.raises(ValueError, match="sdpo_wrapper"):
        self_distillation_loss(model, b, sdpo_wrapper="bogus")

"""Losses as components: true channel names in the metrics, one typed LossConfig, the spec's paths."""

from __future__ import annotations

import ast
import copy
import dataclasses
import importlib
import inspect

import pytest
import torch
from loss_batches import make_batch  # tests/losses/loss_batches.py

from composer_replication import losses
from composer_replication.losses import (
    GRPOLossConfig,
    LossConfig,
    compose_loss,
    grpo_loss,
    self_distillation_loss,
    token_logprobs_for,
)
from composer_replication.losses.components import DISTILL_COMPONENTS, GRPO, REPLAY_COMPONENTS, LMCrossEntropy

VARIANTS = [(v, w) for v in ("dpo", "simpo") for w in ("none", "taid", "entropy_opd")]
DISTILL_NAME = {"none": "jsd", "taid": "taid", "entropy_opd": "entropy_opd"}


@pytest.fixture
def model(tiny_model_and_tokenizer):
    return copy.deepcopy(tiny_model_and_tokenizer[0])


def _rollout_batch(model, seed: int = 0) -> dict:
    b = make_batch(seed=seed)
    with torch.no_grad():
        old = token_logprobs_for(model, b["input_ids"], b["attention_mask"], response_mask=b["response_mask"])
    b.update(old_logprobs=old - 0.05, advantages=torch.tensor([1.0, -0.5]))
    return b


# ---------------------------------------------------------------------------- metric names


@pytest.mark.parametrize(("variant", "wrapper"), VARIANTS)
@pytest.mark.parametrize("rollout", [False, True])
def test_metrics_name_the_loss_that_ran(model, variant, wrapper, rollout):
    b = _rollout_batch(model) if rollout else make_batch()
    with torch.no_grad():
        out = compose_loss(model, b, dpo_variant=variant, sdpo_wrapper=wrapper, taid_t=0.3, chunk_size=5)
    policy, distill = ("grpo" if rollout else "lm_ce"), DISTILL_NAME[wrapper]
    assert (out.policy_name, out.distill_name, out.replay_name) == (policy, distill, variant)
    m = out.metrics()
    losses_reported = {k for k in m if k.count("/") == 1}
    assert losses_reported == {f"loss/{policy}", f"loss/{distill}", f"loss/{variant}", "loss/total"}
    assert m[f"loss/{policy}"] == float(out.lm_ce) and m[f"loss/{distill}"] == float(out.sdpo_jsd)
    assert m[f"loss/{variant}"] == float(out.trace_replay_dpo) and m["loss/total"] == float(out.total)
    assert not any("sdpo_jsd" in k or "trace_replay_dpo" in k for k in m)  # the spec's names never leak
    # every channel's own metrics, and only the names its component declares
    components = {
        "grpo": GRPO,
        "lm_ce": LMCrossEntropy,
        **{c.name: c for c in DISTILL_COMPONENTS.values()},
        **{c.name: c for c in REPLAY_COMPONENTS.values()},
    }
    for name in (policy, distill, variant):
        own = {k.split("/", 2)[2] for k in m if k.startswith(f"loss/{name}/")}
        assert own and own <= set(components[name].metric_names), (name, own)
    assert m[f"loss/{distill}/num_tokens"] == 7.0 and m[f"loss/{variant}/num_pairs"] == 2.0
    if wrapper == "taid":
        assert m["loss/taid/t"] == 0.3
    if variant == "dpo":
        assert 0.0 <= m["loss/dpo/reward_accuracy"] <= 1.0 and "loss/dpo/chosen_reward" in m
    if rollout:
        assert {"loss/grpo/clip_ratio", "loss/grpo/ratio_mean"} <= m.keys() and "loss/grpo/loss" not in m


def test_channels_that_did_not_run_are_not_reported(model):
    with torch.no_grad():
        out = compose_loss(model, make_batch(), alpha_sdpo=0.0, sdpo_wrapper="taid", taid_t=0.5)
    assert out.distill_name is None and out.replay_name == "dpo"
    assert set(out.channels()) == {"lm_ce", "dpo"}
    assert not any(k.startswith("loss/taid") for k in out.metrics())
    b = make_batch(dpo=False)
    with torch.no_grad():
        out = compose_loss(model, b, dpo_variant="simpo")
    assert out.replay_name is None and "loss/simpo" not in out.metrics() and "loss/jsd" in out.metrics()


def test_self_distillation_loss_reports_its_component(model):
    b = make_batch(dpo=False)
    with torch.no_grad():
        loss, m = self_distillation_loss(model, b, sdpo_wrapper="taid", taid_t=0.25)
    assert m == {"loss/taid": float(loss), "loss/taid/num_tokens": 7.0, "loss/taid/t": 0.25}


# ---------------------------------------------------------------------------- typed config


def _same(a, b) -> None:
    for f in ("lm_ce", "sdpo_jsd", "trace_replay_dpo", "total"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert (a.policy_name, a.distill_name, a.replay_name) == (b.policy_name, b.distill_name, b.replay_name)
    assert a.metrics() == b.metrics()


@pytest.mark.parametrize(
    "spec_kwargs",
    [
        {},
        {
            "alpha_sdpo": 0.3,
            "beta_replay": 0.2,
            "sdpo_jsd_beta": 0.1,
            "sdpo_temperature": 1.5,
            "sdpo_token_clip": 2.0,
            "replay_dpo_beta": 0.2,
            "lm_ce_label_smoothing": 0.1,
        },
        {
            "dpo_variant": "simpo",
            "simpo_beta": 2.5,
            "simpo_gamma": 0.5,
            "sdpo_wrapper": "entropy_opd",
            "entropy_opd_h_max": 4.0,
        },
        {"sdpo_wrapper": "taid", "chunk_size": None},
    ],
)
def test_config_equals_spec_keywords(model, spec_kwargs):
    b = make_batch("left")
    with torch.no_grad():
        keywords = compose_loss(model, b, taid_t=0.4, **spec_kwargs)
        typed = compose_loss(model, b, LossConfig(**{"chunk_size": 256, **spec_kwargs}), taid_t=0.4)
    _same(keywords, typed)
    assert keywords.metrics()["loss/total"] == float(keywords.total)


def test_grpo_fields_come_from_the_one_config(model):
    b = _rollout_batch(model, seed=2)
    cfg = LossConfig(loss_type="dr_grpo", epsilon_high=0.28, kl_beta=0.0, chunk_size=4)
    with torch.no_grad():
        out = compose_loss(model, b, cfg, max_completion_length=9)
        kw = compose_loss(
            model, b, loss_type="dr_grpo", epsilon_high=0.28, chunk_size=4, max_completion_length=9
        )
        lp = token_logprobs_for(model, b["input_ids"], b["attention_mask"], response_mask=b["response_mask"])
    _same(out, kw)
    grpo_only = GRPOLossConfig(loss_type="dr_grpo", epsilon_high=0.28)
    ref, _ = grpo_loss(
        lp, b["old_logprobs"], b["advantages"], b["response_mask"], config=grpo_only, max_completion_length=9
    )
    torch.testing.assert_close(out.lm_ce, ref, rtol=1e-5, atol=1e-6)
    assert isinstance(cfg, GRPOLossConfig) and not hasattr(cfg, "grpo_config")  # one GRPO config, no copy
    assert {f.name for f in dataclasses.fields(GRPOLossConfig)} <= {
        f.name for f in dataclasses.fields(LossConfig)
    }


def test_config_and_keywords_together_is_a_type_error(model):
    b = make_batch()
    with pytest.raises(TypeError, match=r"not both.*\['alpha_sdpo'\]"):
        compose_loss(model, b, LossConfig(), alpha_sdpo=0.2)
    with pytest.raises(TypeError, match="not both"):
        self_distillation_loss(model, b, LossConfig(), sdpo_jsd_beta=0.2)
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['alhpa_sdpo'\]"):
        compose_loss(model, b, alhpa_sdpo=0.2)
    with pytest.raises(TypeError, match="unknown option"):
        compose_loss(model, b, grpo=GRPOLossConfig())  # the GRPO fields are LossConfig keywords now
    with pytest.raises(TypeError, match="config must be a LossConfig, got dict"):
        compose_loss(model, b, {"alpha_sdpo": 0.2})
    with pytest.raises(ValueError, match=r"'loss.sdpo_jsd_beta' must be a number in \[0, 1\]"):
        compose_loss(model, b, sdpo_jsd_beta=2.0)


def test_config_fields_keep_their_defaults_and_docstrings():
    cfg = LossConfig()
    assert (cfg.alpha_sdpo, cfg.beta_replay, cfg.chunk_size, cfg.loss_type, cfg.kl_beta) == (
        0.1,
        0.05,
        1024,
        "dapo",
        0.0,
    )
    assert all(f.kw_only for f in dataclasses.fields(LossConfig))
    tree = ast.parse(inspect.getsource(importlib.import_module("composer_replication.losses.config")))
    for node in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for i, stmt in enumerate(node.body):
            if isinstance(stmt, ast.AnnAssign):
                nxt = node.body[i + 1] if i + 1 < len(node.body) else None
                assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), (
                    f"{node.name}.{stmt.target.id}"
                )
    with pytest.raises(ValueError, match="'loss.kl_beta' must be a number in .0, 100."):
        LossConfig(kl_beta=-1.0)
    from composer_replication.engine import LossConfig as EngineLossConfig
    from composer_replication.engine.config import StudentConfig, from_dict

    assert EngineLossConfig is LossConfig
    loaded = from_dict(StudentConfig, {"loss": {"loss_type": "grpo", "sdpo_wrapper": "taid"}}).loss
    assert isinstance(loaded, LossConfig) and loaded.loss_type == "grpo" and loaded.sdpo_wrapper == "taid"


# ---------------------------------------------------------------------------- spec import paths


@pytest.mark.parametrize(
    ("module", "names"),
    [
        ("composer_replication.loss", ["compose_loss", "LossComponents", "LossConfig", "self_distillation_loss",
                                       "token_logprobs_for", "sequence_logprobs_for"]),
        ("composer_replication.opsd", ["generalized_jsd_loss"]),
        ("composer_replication.distillation", ["simpo_loss", "avg_sequence_logprob", "taid_loss", "TAIDScheduler",
                                               "entropy_aware_opd_loss", "teacher_entropy"]),
        ("composer_replication.distillation.simpo", ["simpo_loss", "avg_sequence_logprob"]),
        ("composer_replication.distillation.taid", ["taid_loss", "TAIDScheduler"]),
        ("composer_replication.distillation.entropy_aware_opd", ["teacher_entropy", "entropy_aware_opd_loss"]),
        ("composer_replication", ["compose_loss", "LossComponents", "generalized_jsd_loss", "LossConfig"]),
    ],
)
def test_spec_paths_re_export_the_library(module, names):
    """The spec's import paths hold the library's own objects (one definition each)."""
    mod = importlib.import_module(module)
    for name in names:
        assert getattr(mod, name) is getattr(losses, name), f"{module}.{name}"


def test_grpo_without_old_logprobs_is_on_policy(tiny_model_and_tokenizer):
    """No ``old_logprobs``, only ``advantages``: old = current log-probs detached (TRL's num_iterations=1)."""
    import copy

    from composer_replication.losses import compose_loss, token_logprobs_for

    model, _ = tiny_model_and_tokenizer
    torch.manual_seed(0)
    ids = torch.randint(3, 100, (4, 12))
    resp = torch.zeros_like(ids)
    resp[:, 6:] = 1
    base = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "response_mask": resp,
            "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])}
    with torch.no_grad():
        old = token_logprobs_for(model, ids, base["attention_mask"], response_mask=resp, chunk_size=None)
    grads = []
    for batch in (base, {**base, "old_logprobs": old.float()}):
        m = copy.deepcopy(model)
        comps = compose_loss(m, batch, alpha_sdpo=0.0, beta_replay=0.0)
        assert comps.policy_name == "grpo"
        comps.total.backward()
        grads.append([p.grad.clone() for p in m.parameters() if p.grad is not None])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("variant", ["dpo", "simpo"])
def test_rpo_adds_the_chosen_token_mean_nll_to_channel_three(model, variant):
    """``rpo_alpha``: channel 3 = preference loss + alpha * NLL(chosen), the NLL a token mean (TRL's RPO)."""
    batch = _rollout_batch(model)
    base = compose_loss(model, batch, LossConfig(dpo_variant=variant, beta_replay=1.0))
    rpo = compose_loss(model, batch, LossConfig(dpo_variant=variant, beta_replay=1.0, rpo_alpha=0.5))
    ids, mask = batch["dpo_chosen_input_ids"], batch["dpo_chosen_response_mask"]
    with torch.no_grad():
        lp = token_logprobs_for(model, ids, batch["dpo_chosen_attention_mask"], response_mask=mask)
    nll = -(lp * mask).sum() / mask.sum()  # aligned log-probs: 0 off the response
    got = rpo.metrics()
    assert got[f"loss/{variant}/chosen_nll"] == pytest.approx(float(nll), rel=1e-4)
    assert float(rpo.trace_replay_dpo) == pytest.approx(float(base.trace_replay_dpo) + 0.5 * float(nll), rel=1e-5)
    assert f"loss/{variant}/chosen_nll" not in base.metrics()
    with pytest.raises(ValueError, match="loss.rpo_alpha"):
        LossConfig(rpo_alpha=-1.0)

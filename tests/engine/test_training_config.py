"""Config trees: from_dict nesting, unknown keys and wrong types named, overrides, device resolution."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import yaml

from composer_replication.engine.config import (
    LossConfig,
    OptimConfig,
    RolloutConfig,
    StudentConfig,
    apply_overrides,
    from_dict,
    resolve_device,
    resolve_dtype,
    to_dict,
)


def test_from_dict_builds_nested_trees_and_keeps_defaults():
    cfg = from_dict(
        StudentConfig,
        {"model": "tiny", "optim": {"lr": 3e-4, "betas": [0.9, 0.95]}, "loss": {"alpha_sdpo": 1}},
    )
    assert cfg.model == "tiny"
    assert isinstance(cfg.optim, OptimConfig) and cfg.optim.lr == 3e-4
    assert cfg.optim.betas == (0.9, 0.95)
    assert isinstance(cfg.loss.alpha_sdpo, float) and cfg.loss.alpha_sdpo == 1.0
    assert cfg.rollout == RolloutConfig()  # untouched subtree keeps its defaults
    assert cfg.loss.beta_replay == LossConfig().beta_replay


def test_from_dict_accepts_yaml_exponent_strings_for_floats():
    raw = yaml.safe_load("optim:\n  lr: 1e-5\n")  # YAML 1.1 reads this as a string
    assert raw["optim"]["lr"] == "1e-5"
    assert from_dict(StudentConfig, raw).optim.lr == pytest.approx(1e-5)


def test_round_trip_through_yaml():
    cfg = StudentConfig(model="tiny", optim=OptimConfig(lr=2e-4, scheduler="cosine", warmup_steps=3))
    again = from_dict(StudentConfig, yaml.safe_load(yaml.safe_dump(to_dict(cfg))))
    assert again == cfg


def test_unknown_key_is_named_with_its_path_and_the_allowed_keys():
    with pytest.raises(ValueError, match=r"unknown key 'loss\.alhpa_sdpo'; allowed: .*alpha_sdpo"):
        from_dict(StudentConfig, {"loss": {"alhpa_sdpo": 0.1}})
    with pytest.raises(ValueError, match=r"unknown key 'modle'"):
        from_dict(StudentConfig, {"modle": "tiny"})


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        ({"optim": {"lr": "abc"}}, r"'optim\.lr' must be a float, got 'abc'"),
        ({"num_steps": 2.5}, r"'num_steps' must be an integer, got 2\.5"),
        ({"num_steps": True}, r"'num_steps' must be an integer"),
        ({"optim": {"scheduler": "step"}}, r"'optim\.scheduler' must be one of 'constant', 'linear', 'cosine'"),
        ({"optim": {"betas": [0.9]}}, r"'optim\.betas' must have 2 items"),
        ({"loss": {"sdpo_top_k": "ten"}}, r"'loss\.sdpo_top_k' must be an integer"),
        ({"optim": 3}, r"'optim' must be a mapping"),
        ({"model": 7}, r"'model' must be a string"),
    ],
)
def test_wrong_types_name_the_key(data, pattern):
    with pytest.raises(ValueError, match=pattern):
        from_dict(StudentConfig, data)


@pytest.mark.parametrize(
    ("build", "pattern"),
    [
        (lambda: OptimConfig(lr=0.0), r"'optim\.lr' must be a number in \(0, 10\]"),
        (lambda: LossConfig(sdpo_jsd_beta=1.5), r"'loss\.sdpo_jsd_beta' must be a number in \[0, 1\]"),
        (lambda: LossConfig(taid_t_start=0.9, taid_t_end=0.5), r"'loss\.taid_t_start'"),
        (lambda: RolloutConfig(num_generations=0), r"'rollout\.num_generations' must be an integer in \[1, 4096\]"),
        (lambda: RolloutConfig(top_p=0.0), r"'rollout\.top_p'"),
        (lambda: StudentConfig(device="gpu"), r"'device' must be 'auto', 'cpu', 'cuda' or 'cuda:N'"),
        (lambda: StudentConfig(num_steps=2, optim=OptimConfig(warmup_steps=5)), r"'optim\.warmup_steps' must be <="),
    ],
)
def test_post_init_checks_name_the_key(build, pattern):
    with pytest.raises(ValueError, match=pattern):
        build()


def test_apply_overrides_parses_yaml_values_and_does_not_mutate_input():
    base = {"loss": {"alpha_sdpo": 0.5}, "model": "tiny"}
    out = apply_overrides(
        base, ["loss.alpha_sdpo=0.2", "optim.betas=[0.9, 0.95]", "loss.sdpo_top_k=null", "optim.lr=3e-5"]
    )
    assert base == {"loss": {"alpha_sdpo": 0.5}, "model": "tiny"}
    assert out["loss"] == {"alpha_sdpo": 0.2, "sdpo_top_k": None}
    cfg = from_dict(StudentConfig, out)
    assert cfg.loss.alpha_sdpo == 0.2 and cfg.optim.betas == (0.9, 0.95) and cfg.optim.lr == pytest.approx(3e-5)


def test_apply_overrides_errors():
    with pytest.raises(ValueError, match="must look like 'key.sub=value'"):
        apply_overrides({}, ["loss.alpha_sdpo"])
    with pytest.raises(ValueError, match="must look like"):
        apply_overrides({}, ["loss..x=1"])
    with pytest.raises(ValueError, match="'model' is 'tiny', not a mapping"):
        apply_overrides({"model": "tiny"}, ["model.name=x"])
    with pytest.raises(ValueError, match=r"unknown key 'loss\.nope'"):
        from_dict(StudentConfig, apply_overrides({}, ["loss.nope=1"]))


def test_every_field_has_a_docstring():
    import ast
    import inspect

    from composer_replication.engine import config as mod

    tree = ast.parse(inspect.getsource(mod))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
            body = node.body
            for i, stmt in enumerate(body):
                if isinstance(stmt, ast.AnnAssign):
                    nxt = body[i + 1] if i + 1 < len(body) else None
                    assert isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant), (
                        f"{node.name}.{stmt.target.id} has no docstring"
                    )


def test_loss_config_is_the_grpo_config():
    from composer_replication.losses import GRPOLossConfig

    g = LossConfig(loss_type="dr_grpo", kl_beta=0.04, epsilon_high=0.3)  # the GRPO fields, read by grpo_loss itself
    assert isinstance(g, GRPOLossConfig) and g.loss_type == "dr_grpo" and g.kl_beta == 0.04 and g.epsilon_high == 0.3


def test_auto_device_on_cpu_and_cuda_request_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device("cuda:0")


def test_auto_device_picks_the_local_rank_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert resolve_device("auto", local_rank=1) == torch.device("cuda", 1)
    assert resolve_device("auto", local_rank=3) == torch.device("cuda", 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert resolve_device("auto") == torch.device("cuda", 1)


def test_resolve_dtype():
    assert resolve_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(ValueError, match="'dtype' must be one of"):
        resolve_dtype("fp8")


def test_configs_are_kw_only():
    for cls in (OptimConfig, LossConfig, RolloutConfig, StudentConfig):
        assert all(f.kw_only for f in dataclasses.fields(cls))

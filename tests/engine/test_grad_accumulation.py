"""Gradient accumulation: 1 micro-batch x N equals N micro-batches x 1 (TRL's invariance), on every channel."""

from __future__ import annotations

import pytest
import torch
from test_training_engine import PAIRS, STATES, ForcedErrors

from composer_replication.engine import (
    LossConfig,
    OptimConfig,
    RolloutConfig,
    StudentConfig,
    StudentTrainerCore,
)
from composer_replication.engine.accumulate import channel_sizes, split_batch
from composer_replication.engine.data import build_training_data


def make_core(accum: int, **loss) -> StudentTrainerCore:
    data = build_training_data("next_action", states=STATES, pairs=PAIRS * 2)
    data.environment = ForcedErrors(data.environment)
    cfg = StudentConfig(
        model="tiny", device="cpu", seed=5, num_steps=2,
        optim=OptimConfig(lr=1e-3, max_grad_norm=0.0, grad_accum_steps=accum),
        loss=LossConfig(alpha_sdpo=1.0, beta_replay=1.0, **loss),
        rollout=RolloutConfig(prompts_per_step=4, num_generations=2, max_new_tokens=6, pairs_per_step=2),
    )
    return StudentTrainerCore(cfg, data=data)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_one_by_n_equals_n_by_one(loss_type):
    whole, split = make_core(1, loss_type=loss_type), make_core(4, loss_type=loss_type)
    m1, m4 = whole.train_step(0), split.train_step(0)
    for key in ("loss/total", "loss/grpo", "loss/jsd", "loss/dpo"):
        assert m1[key] != 0.0, key  # every channel took part
        assert m4[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-6), key
    assert m4["loss/grad_norm"] == pytest.approx(m1["loss/grad_norm"], rel=1e-4)
    # the gradient the optimizer stepped with (AdamW's first step is ~lr * sign(grad), so compare gradients:
    # parameters would amplify float rounding on near-zero entries into whole lr-sized steps)
    for (n, a), b in zip(whole.model.named_parameters(), split.model.parameters()):
        assert a.grad is not None and b.grad is not None, n
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-7, msg=n)


@pytest.mark.slow
def test_split_batch_keeps_groups_whole_and_channel_two_aligned():
    core = make_core(1)
    batch, _ = core._build_batch(0)
    parts = split_batch(batch, 4)
    assert [int(p["input_ids"].shape[0]) for p in parts] == [2, 2, 2, 2]  # one group (G=2) each
    assert sum(channel_sizes(p, loss_type="dapo")[2] for p in parts) == batch["dpo_chosen_input_ids"].shape[0]
    n_aligned = 0
    for p in parts:
        assert len(set(p["group_ids"].tolist())) == 1
        if "sdpo_student_index" in p:
            s, t = p["sdpo_student_index"], p["sdpo_teacher_index"]
            assert torch.equal(p["input_ids"][s[:, 0], s[:, 1]], p["ctx_teacher_input_ids"][t[:, 0], t[:, 1]])
            n_aligned += s.shape[0]
    assert n_aligned == batch["sdpo_student_index"].shape[0] > 0  # every aligned token kept exactly once
    assert split_batch(batch, 1) == [batch]


def test_bad_accumulation_is_named():
    with pytest.raises(ValueError, match="optim.grad_accum_steps"):
        OptimConfig(grad_accum_steps=0)
    with pytest.raises(ValueError, match="must be <= 'rollout.prompts_per_step'"):
        StudentConfig(optim=OptimConfig(grad_accum_steps=8), rollout=RolloutConfig(prompts_per_step=4))
    with pytest.raises(ValueError, match="larger than the 2 prompt groups"):
        split_batch({"input_ids": torch.zeros(4, 3), "group_ids": torch.tensor([0, 0, 1, 1])}, 3)

"""assemble_batch: channel-1 keys, group-normalized advantages, channel-2 indices at error sites."""

from __future__ import annotations

import pytest
import torch

from composer_replication.chat_format import build_prompt_ids
from composer_replication.losses import group_advantages
from composer_replication.rollout.assemble import assemble_batch, rollout_stats
from composer_replication.rollout.environment import Prompt, Score, score_texts
from composer_replication.rollout.next_action import NextActionEnvironment
from composer_replication.rollout.sampling import sample_rollouts

PROMPTS = [
    Prompt(prompt_id="a", messages=[{"role": "user", "content": "Read a.py"}], tools=["Read"]),
    Prompt(prompt_id="b", messages=[{"role": "system", "content": "sys"}, {"role": "user", "content": "List files"}]),
]
REWARDS = [1.0, 0.0, 0.5, 0.2, 0.2, 0.8]
NOT_FOUND = {"tool_name": "Reed", "available_tools": ["Read"], "error_message": "Tool 'Reed' is not available."}


def fixed_hint(kind, meta):
    return f"HINT for {kind}: use {meta['available_tools'][0]}" if kind == "tool_not_found" else None


@pytest.fixture(scope="module")
def rollouts(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    return sample_rollouts(model, tok, PROMPTS, num_generations=3, max_new_tokens=6, seed=1)


@pytest.fixture
def scores():
    out = [Score(r) for r in REWARDS]
    out[1] = Score(0.0, error_kind="tool_not_found", error_meta=dict(NOT_FOUND))
    out[4] = Score(0.2, error_kind="tool_not_found", error_meta=dict(NOT_FOUND))
    out[5] = Score(0.8, error_kind="runtime_error", error_meta={"error_message": "boom"})  # no hint -> skipped
    return out


def test_channel1_keys_and_group_advantages(rollouts, scores, tokenizer):
    batch = assemble_batch(tokenizer, rollouts, scores, prompts=PROMPTS, hint_fn=fixed_hint)
    for key in ("input_ids", "attention_mask", "response_mask", "old_logprobs"):
        assert batch[key] is getattr(rollouts, key)
    assert batch["rewards"].tolist() == pytest.approx([0.0 if i == 1 else r for i, r in enumerate(REWARDS)])
    assert batch["rewards"].dtype == torch.float32 and batch["group_ids"].tolist() == [0, 0, 0, 1, 1, 1]
    adv = batch["advantages"]
    torch.testing.assert_close(adv, group_advantages(batch["rewards"], batch["group_ids"], scale_rewards="group"))
    for g in (0, 1):
        assert float(adv[batch["group_ids"] == g].mean()) == pytest.approx(0.0, abs=1e-6)
    r = batch["rewards"][:3]
    torch.testing.assert_close(adv[:3], (r - r.mean()) / (r.std() + 1e-4))
    none = assemble_batch(tokenizer, rollouts, scores, prompts=PROMPTS, hint_fn=fixed_hint, scale_rewards="none")
    torch.testing.assert_close(none["advantages"][:3], r - r.mean())


def test_channel2_indices_point_to_identical_tokens(rollouts, scores, tokenizer):
    batch = assemble_batch(tokenizer, rollouts, scores, prompts=PROMPTS, hint_fn=fixed_hint)
    teacher, s_idx, t_idx = batch["ctx_teacher_input_ids"], batch["sdpo_student_index"], batch["sdpo_teacher_index"]
    assert teacher.shape[0] == 2  # rollouts 1 and 4 (rollout 5 has no hint)
    assert s_idx.dtype == t_idx.dtype == torch.long and s_idx.shape == t_idx.shape
    assert s_idx.shape[0] == len(rollouts.response_ids[1]) + len(rollouts.response_ids[4])
    assert sorted(set(s_idx[:, 0].tolist())) == [1, 4]
    assert torch.equal(batch["input_ids"][s_idx[:, 0], s_idx[:, 1]], teacher[t_idx[:, 0], t_idx[:, 1]])
    assert (batch["response_mask"][s_idx[:, 0], s_idx[:, 1]] == 1).all()
    assert int(batch["sdpo_loss_mask"].sum()) == s_idx.shape[0]
    assert (batch["sdpo_loss_mask"][t_idx[:, 0], t_idx[:, 1]] == 1).all()
    # teacher row = prompt(history + [hint as user]) + exactly the student's response ids
    for row, b in enumerate((1, 4)):
        history = PROMPTS[rollouts.prompt_index[b]].messages
        hinted = build_prompt_ids(tokenizer, [*history, {"role": "user", "content": "HINT for tool_not_found: use Read"}])
        expected = hinted + rollouts.response_ids[b]
        n = int(batch["ctx_teacher_attention_mask"][row].sum())
        assert teacher[row, :n].tolist() == expected
        assert (batch["ctx_teacher_attention_mask"][row, n:] == 0).all()


def test_default_hint_generator(rollouts, scores, tokenizer):
    batch = assemble_batch(tokenizer, rollouts, scores, prompts=PROMPTS)  # hint_generator.dispatch
    assert batch["ctx_teacher_input_ids"].shape[0] >= 2
    text = tokenizer.decode(batch["ctx_teacher_input_ids"][0])
    assert "Reed" in text


def test_no_error_sites_or_sdpo_disabled_gives_channel1_only(rollouts, scores, tokenizer):
    clean = [Score(r) for r in REWARDS]
    batch = assemble_batch(tokenizer, rollouts, clean, prompts=PROMPTS)
    assert not any(k.startswith(("ctx_", "sdpo_")) for k in batch)
    batch = assemble_batch(tokenizer, rollouts, scores, prompts=PROMPTS, enable_sdpo=False)
    assert not any(k.startswith(("ctx_", "sdpo_")) for k in batch)


def test_rollout_stats(rollouts, scores, tokenizer):
    batch = assemble_batch(tokenizer, rollouts, scores, prompts=PROMPTS, hint_fn=fixed_hint)
    stats = rollout_stats(rollouts, scores, batch)
    assert stats["rollout/num_samples"] == 6 and stats["rollout/num_error_sites"] == 3
    assert stats["rollout/num_hinted"] == 2 and stats["rollout/errors/tool_not_found"] == 2
    assert stats["rollout/errors/runtime_error"] == 1
    assert stats["rollout/reward_max"] == max(s.reward for s in scores)
    assert "rollout/reward_mean" not in stats and "rollout/reward_std" not in stats  # reward/* is defined once


def test_bad_inputs(rollouts, scores, tokenizer):
    with pytest.raises(ValueError, match="6 rollouts"):
        assemble_batch(tokenizer, rollouts, scores[:5], prompts=PROMPTS)
    with pytest.raises(ValueError, match="prompt 1"):
        assemble_batch(tokenizer, rollouts, scores, prompts=PROMPTS[:1])
    with pytest.raises(ValueError, match="scale_rewards"):
        assemble_batch(tokenizer, rollouts, scores, prompts=PROMPTS, scale_rewards="bogus")


def test_end_to_end_next_action(tiny_model_and_tokenizer):
    """Trace states -> prompts -> G samples -> scores -> batch (the tiny model writes noise: rewards 0)."""
    model, tok = tiny_model_and_tokenizer
    states = [{"state_id": "t::0000", "messages": [{"role": "user", "content": "Read a.py"}],
               "student_action": '[TOOL_USE] name=Read input={"file_path": "a.py"}', "tools": ["Read"]}]
    env = NextActionEnvironment(states)
    prompts = env.prompts()
    r = sample_rollouts(model, tok, prompts, num_generations=2, max_new_tokens=4, seed=0)
    scored = score_texts(env, prompts, r.prompt_index, r.texts)
    batch = assemble_batch(tok, r, scored, prompts=prompts)
    assert batch["rewards"].shape == (2,) and batch["advantages"].shape == (2,)


def test_batch_trains_with_compose_loss(rollouts, scores, tiny_model_and_tokenizer):
    """The assembled batch is a valid compose_loss input: GRPO fires and channel 2 runs."""
    import copy

    from composer_replication.loss import compose_loss

    model, tok = tiny_model_and_tokenizer
    model = copy.deepcopy(model).train()
    batch = assemble_batch(tok, rollouts, scores, prompts=PROMPTS, hint_fn=fixed_hint)
    out = compose_loss(model, batch, alpha_sdpo=1.0, beta_replay=0.0, chunk_size=16)
    assert out.policy_name == "grpo"
    assert torch.isfinite(out.total.detach()) and float(out.sdpo_jsd.detach()) > 0
    out.total.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)

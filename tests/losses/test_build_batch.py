"""build_batch: a real three-channel batch from the SmolLM2 chat template."""

from __future__ import annotations

import pytest
import torch

from composer_replication.batch import VARIANTS, build_batch
from composer_replication.loss import compose_loss, sequence_logprobs_for

STUDENT = ("input_ids", "attention_mask", "response_mask")
TEACHER = ("ctx_teacher_input_ids", "ctx_teacher_attention_mask", "sdpo_loss_mask")


@pytest.mark.parametrize("variant", VARIANTS)
def test_keys_shapes_and_chat_format(tokenizer, variant):
    b = build_batch(tokenizer, variant=variant)
    for group in (STUDENT, TEACHER, *[tuple(f"dpo_{s}_{k}" for k in ("input_ids", "attention_mask", "response_mask"))
                                      for s in ("chosen", "rejected")]):
        shapes = {tuple(b[k].shape) for k in group}
        assert len(shapes) == 1 and next(iter(shapes))[0] == 2, group
        assert all(b[k].dtype == torch.long for k in group)
    assert b["dpo_chosen_ref_logprobs"].shape == b["dpo_rejected_ref_logprobs"].shape == (2,)
    # prompt + response == chat template of messages + assistant, up to the trailing newline
    row = b["input_ids"][0][b["attention_mask"][0].bool()].tolist()
    text = tokenizer.decode(row)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_end|>")
    assert b["input_ids"][0][b["response_mask"][0].bool()].tolist()[-1] == tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("align", [False, True])
def test_teacher_ends_with_exactly_the_student_response(tokenizer, align):
    b = build_batch(tokenizer, variant="binary_search", align_sdpo_shapes=align)
    for i in range(2):
        response = b["input_ids"][i][b["response_mask"][i].bool()]
        teacher = b["ctx_teacher_input_ids"][i][b["ctx_teacher_attention_mask"][i].bool()]
        assert torch.equal(teacher[-len(response):], response)
        assert torch.equal(b["ctx_teacher_input_ids"][i][b["sdpo_loss_mask"][i].bool()], response)
        if not align:
            assert "Hint:" in tokenizer.decode(teacher[: -len(response)])
    if align:
        assert b["ctx_teacher_input_ids"].shape == b["input_ids"].shape


def test_all_three_channels_fire_on_it(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    with torch.no_grad():
        out = compose_loss(model, build_batch(tok))
    d = out.detached()
    assert d["lm_ce"] > 0 and d["sdpo_jsd"] > 0 and d["trace_replay_dpo"] > 0
    assert out.metrics()["loss/jsd/num_tokens"] > 10


def test_ref_model_gives_real_reference_logprobs(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    placeholder = build_batch(tok)
    assert torch.all(placeholder["dpo_chosen_ref_logprobs"] == 0)
    b = build_batch(tok, ref_model=model)
    with torch.no_grad():
        expect = sequence_logprobs_for(model, b["dpo_chosen_input_ids"], b["dpo_chosen_response_mask"],
                                       b["dpo_chosen_attention_mask"], chunk_size=None)
    torch.testing.assert_close(b["dpo_chosen_ref_logprobs"], expect, rtol=1e-5, atol=1e-4)
    for key in ("dpo_chosen_ref_logprobs", "dpo_rejected_ref_logprobs"):
        assert torch.isfinite(b[key]).all() and (b[key] < -10).all()  # ~10 nats per token for a random model
    # the policy equals the reference here, so DPO's implicit reward margin is 0 and the loss is log 2
    with torch.no_grad():
        out = compose_loss(model, b, alpha_sdpo=0.0)
    torch.testing.assert_close(out.trace_replay_dpo, torch.tensor(0.6931472), rtol=0, atol=1e-4)


def test_seeded_and_validated(tokenizer):
    a, b = build_batch(tokenizer, seed=3), build_batch(tokenizer, seed=3)
    assert all(torch.equal(a[k], b[k]) for k in a)
    others = [build_batch(tokenizer, seed=s)["input_ids"] for s in range(6)]
    assert any(o.shape != others[0].shape or not torch.equal(o, others[0]) for o in others)
    with pytest.raises(ValueError, match="variant must be one of"):
        build_batch(tokenizer, variant="fizzbuzz")

"""Sampling: G samples per prompt, group ids, old log-probs equal a teacher-forced recomputation."""

from __future__ import annotations

import copy

import pytest
import torch

from composer_replication.chat_format import build_prompt_ids, end_of_turn_id
from composer_replication.rollout.environment import Prompt
from composer_replication.rollout.generate import cut_at_end_of_turn
from composer_replication.rollout.sampling import sample_rollouts

PROMPTS = [
    Prompt(prompt_id="a", messages=[{"role": "user", "content": "hi"}]),
    Prompt(prompt_id="b", messages=[{"role": "system", "content": "You list files."},
                                    {"role": "user", "content": "What is in the repo?"}]),
]


def reference_logprobs(model, input_ids, attention_mask, response_mask):
    """Plain teacher-forced forward, aligned convention, float64 log-softmax."""
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=pos).logits
    lp = torch.log_softmax(logits.double(), -1)[:, :-1].gather(-1, input_ids[:, 1:, None])[..., 0]
    out = torch.zeros(input_ids.shape, dtype=torch.float64)
    out[:, 1:] = lp
    return out * response_mask


@pytest.fixture(scope="module")
def rollouts(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    return sample_rollouts(model, tok, PROMPTS, num_generations=3, max_new_tokens=8, seed=7, chunk_size=5)


def test_groups_and_layout(rollouts, tiny_model_and_tokenizer):
    _, tok = tiny_model_and_tokenizer
    B = len(PROMPTS) * 3
    assert len(rollouts) == B and rollouts.num_generations == 3
    assert rollouts.prompt_index == [0, 0, 0, 1, 1, 1]
    assert rollouts.group_ids.tolist() == [0, 0, 0, 1, 1, 1] and rollouts.group_ids.dtype == torch.long
    P = rollouts.prompt_length
    for b in range(B):
        ids = build_prompt_ids(tok, PROMPTS[rollouts.prompt_index[b]].messages)
        assert rollouts.prompt_ids[b] == ids
        n = len(rollouts.response_ids[b])
        assert 1 <= n <= 8
        assert rollouts.input_ids[b, P - len(ids) : P].tolist() == ids
        assert rollouts.input_ids[b, P : P + n].tolist() == rollouts.response_ids[b]
        assert rollouts.response_mask[b].nonzero()[:, 0].tolist() == list(range(P, P + n))
        assert int(rollouts.attention_mask[b].sum()) == len(ids) + n
        assert rollouts.texts[b] == tok.decode(rollouts.response_ids[b], skip_special_tokens=True)
    for t in (rollouts.input_ids, rollouts.attention_mask, rollouts.response_mask, rollouts.old_logprobs):
        assert t.shape == rollouts.input_ids.shape


def test_samples_differ_within_a_group(rollouts):
    assert len({tuple(r) for r in rollouts.response_ids[:3]}) > 1


def test_old_logprobs_equal_teacher_forced_recomputation(rollouts, tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    ref = reference_logprobs(model, rollouts.input_ids, rollouts.attention_mask, rollouts.response_mask)
    assert rollouts.old_logprobs.dtype == torch.float32
    assert not rollouts.old_logprobs.requires_grad
    torch.testing.assert_close(rollouts.old_logprobs.double(), ref, atol=1e-5, rtol=0)
    assert (rollouts.old_logprobs[rollouts.response_mask == 0] == 0).all()
    assert (rollouts.old_logprobs[rollouts.response_mask == 1] < 0).all()


def test_old_logprobs_match_the_sampling_distribution(rollouts, tiny_model_and_tokenizer):
    """The recorded log-probs are those of the distribution generate sampled from (same seed)."""
    model, tok = tiny_model_and_tokenizer
    P = rollouts.prompt_length
    prompt = rollouts.input_ids[:, :P]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        out = model.generate(input_ids=prompt, attention_mask=rollouts.attention_mask[:, :P], do_sample=True,
                             top_k=0, top_p=1.0, temperature=1.0, max_new_tokens=8, eos_token_id=end_of_turn_id(tok),
                             pad_token_id=tok.pad_token_id, output_logits=True, return_dict_in_generate=True)
    for b, resp in enumerate(rollouts.response_ids):
        assert out.sequences[b, P : P + len(resp)].tolist() == resp
        for k, tok_id in enumerate(resp):
            lp = torch.log_softmax(out.logits[k][b].double(), -1)[tok_id]
            assert abs(float(lp) - float(rollouts.old_logprobs[b, P + k])) < 1e-4


def test_deterministic_from_seed_without_touching_the_global_rng(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    state = torch.get_rng_state()
    a = sample_rollouts(model, tok, PROMPTS[:1], num_generations=2, max_new_tokens=6, seed=3)
    b = sample_rollouts(model, tok, PROMPTS[:1], num_generations=2, max_new_tokens=6, seed=3)
    c = sample_rollouts(model, tok, PROMPTS[:1], num_generations=2, max_new_tokens=6, seed=4)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.old_logprobs, b.old_logprobs)
    assert not torch.equal(a.input_ids, c.input_ids)


def test_plain_message_lists_and_group_offset(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    r = sample_rollouts(model, tok, [PROMPTS[0].messages], num_generations=2, max_new_tokens=3, seed=0,
                        group_offset=10)
    assert r.group_ids.tolist() == [10, 10]


def test_responses_end_at_the_end_of_turn_token(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    model = copy.deepcopy(model)
    model.train()
    eot = end_of_turn_id(tok)
    boost = torch.zeros(model.config.vocab_size)
    boost[eot] = 11.0  # p(end of turn) ~ 0.5 per step for the random tiny model
    model.lm_head.register_forward_hook(lambda mod, inp, out: out + boost)
    r = sample_rollouts(model, tok, PROMPTS, num_generations=4, max_new_tokens=12, seed=0)
    assert model.training  # mode restored
    ended = [b for b, t in enumerate(r.truncated) if not t]
    assert ended, "expected some responses to end early"
    for b in range(len(r)):
        resp = r.response_ids[b]
        assert resp.count(eot) == (0 if r.truncated[b] else 1)
        if not r.truncated[b]:
            assert resp[-1] == eot
        else:
            assert len(resp) == 12
    assert any(len(r.response_ids[b]) < 12 for b in ended)


def test_cut_at_end_of_turn():
    assert cut_at_end_of_turn([[5, 2, 0, 0], [5, 6, 7]], 2) == ([[5, 2], [5, 6, 7]], [False, True])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_generations": 0}, "num_generations"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
    ],
)
def test_bad_arguments(tiny_model_and_tokenizer, kwargs, match):
    model, tok = tiny_model_and_tokenizer
    args = {"num_generations": 2, "max_new_tokens": 4} | kwargs
    with pytest.raises(ValueError, match=match):
        sample_rollouts(model, tok, PROMPTS, **args)
    with pytest.raises(ValueError, match="prompts is empty"):
        sample_rollouts(model, tok, [], num_generations=2, max_new_tokens=4)

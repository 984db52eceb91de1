"""``rollout.generate``: shared-prefix prefill and the static cache give the plain answers."""

from __future__ import annotations

import copy

import pytest
import torch

from composer_replication.batching import pad_id
from composer_replication.chat_format import end_of_turn_id
from composer_replication.rollout.generate import (
    generate_in_length_order,
    generate_responses,
    left_padded_prompts,
    length_order,
    shared_prefix_cache,
    static_cache,
)

SYSTEM = "You are a careful coding agent. Read files before editing them, run the tests, and answer concisely. " * 3


def _prompts(n: int) -> list[list[dict[str, str]]]:
    tasks = ["fix the failing test", "rename the config key `retries` to `max_retries` everywhere", "why does it crash?",
             "add a --verbose flag to the CLI and document it in the README file", "ok"]
    return [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": tasks[i % len(tasks)] + " " * (i // 5)}]
            for i in range(n)]


@pytest.fixture(scope="module")
def model64(tiny_model_and_tokenizer):
    """The tiny model in float64: greedy and sampled tokens compare exactly, without float32 near-ties."""
    model, tok = tiny_model_and_tokenizer
    return copy.deepcopy(model).double().eval(), tok


def _plain(model, tok, prompts, *, max_new_tokens, repeat=1, **sampling):
    """``model.generate`` on the left-padded prompts with its default (growing) cache: the reference."""
    ids, mask, _ = left_padded_prompts(tok, prompts, repeat=repeat)
    torch.manual_seed(sampling.pop("seed", 0))
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, top_k=0,
                         eos_token_id=end_of_turn_id(tok), pad_token_id=pad_id(tok), **sampling)
    return out[:, ids.shape[1]:].tolist()


def _cut(rows, eot):
    return [r[: r.index(eot) + 1] if eot in r else r for r in rows]


@pytest.mark.parametrize(("n", "repeat"), [(5, 1), (5, 3), (2, 4), (1, 4)])
def test_greedy_answers_equal_the_plain_generate(model64, n, repeat):
    """Shared system prompt only (5 x 1), or whole prompts of a group, padding inside the prefix (2 x 4)."""
    model, tok = model64
    prompts = _prompts(n)
    got = generate_responses(model, tok, prompts, max_new_tokens=12, repeat=repeat)
    off = generate_responses(model, tok, prompts, max_new_tokens=12, repeat=repeat, share_prefix=False)
    want = _cut(_plain(model, tok, prompts, max_new_tokens=12, repeat=repeat, do_sample=False), end_of_turn_id(tok))
    assert got.responses == want
    assert off.responses == want
    assert got.prompt_ids.shape == off.prompt_ids.shape  # callers still get the left-padded prompts
    assert torch.equal(got.prompt_mask, off.prompt_mask)


def test_sampled_answers_equal_the_plain_generate_for_a_seed(model64):
    model, tok = model64
    prompts = _prompts(4)
    got = generate_responses(model, tok, prompts, max_new_tokens=10, repeat=2, do_sample=True, temperature=0.9,
                             seed=7)
    want = _plain(model, tok, prompts, max_new_tokens=10, repeat=2, do_sample=True, temperature=0.9, seed=7)
    assert got.responses == _cut(want, end_of_turn_id(tok))


def test_a_prompt_that_is_the_beginning_of_another(model64):
    """The shared part stops one token short of the shortest prompt: every row predicts from its own token."""
    model, tok = model64
    short = [{"role": "system", "content": SYSTEM}]
    prompts = [short, short + [{"role": "user", "content": "and now the tests"}]]
    got = generate_responses(model, tok, prompts, max_new_tokens=8)
    assert got.responses == _cut(_plain(model, tok, prompts, max_new_tokens=8, do_sample=False), end_of_turn_id(tok))


def test_shared_prefix_layout_and_cache(model64):
    model, tok = model64
    prompts = _prompts(3)
    _, _, rendered = left_padded_prompts(tok, prompts)
    with torch.no_grad():
        ids, mask, cache = shared_prefix_cache(model, rendered, repeat=2, fill=pad_id(tok))
    width = max(len(r) for r in rendered)
    assert ids.shape == mask.shape == (6, width)
    for n, r in enumerate(rendered):
        for row in (2 * n, 2 * n + 1):  # each prompt's tokens in order, padding only in the middle
            assert ids[row][mask[row].bool()].tolist() == r
            assert mask[row, -1] == 1 and mask[row, 0] == 1
    assert 0 < cache.get_seq_length() < width
    assert cache.layers[0].keys.shape[0] == 6


def test_a_group_prefills_its_whole_prompt_once(model64):
    """Few prompts, many samples each: the split goes past the common beginning, through the padding."""
    model, tok = model64
    _, _, rendered = left_padded_prompts(tok, _prompts(2))
    with torch.no_grad():
        ids, mask, cache = shared_prefix_cache(model, rendered, repeat=4, fill=pad_id(tok))
    assert cache.get_seq_length() == ids.shape[1] - 1
    assert (mask[:, : ids.shape[1] - 1] == 0).any()


@pytest.mark.parametrize(("n", "repeat"), [(5, 1), (2, 4)])
def test_next_token_logits_equal_the_whole_prompt_pass(model64, n, repeat):
    """The prefilled cache plus the rest of each row predicts what the whole left-padded prompt predicts."""
    model, tok = model64
    left_ids, left_mask, rendered = left_padded_prompts(tok, _prompts(n), repeat=repeat)
    with torch.no_grad():
        ids, mask, cache = shared_prefix_cache(model, rendered, repeat=repeat, fill=pad_id(tok))
        s = int(cache.get_seq_length())
        positions = (mask.cumsum(-1) - 1).clamp_min(0)
        got = model(input_ids=ids[:, s:], attention_mask=mask, position_ids=positions[:, s:],
                    past_key_values=cache).logits[:, -1]
        left_pos = (left_mask.cumsum(-1) - 1).clamp_min(0)
        want = model(input_ids=left_ids, attention_mask=left_mask, position_ids=left_pos).logits[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)


def test_nothing_to_share_falls_back_to_the_plain_prompts(model64):
    model, tok = model64
    with torch.no_grad():
        assert shared_prefix_cache(model, [[5, 6, 7], [8, 9, 10]], fill=0) is None  # no common beginning
        assert shared_prefix_cache(model, [[5, 6, 7]], fill=0) is None  # one row
        assert shared_prefix_cache(model, [], fill=0) is None
        assert shared_prefix_cache(model, [[5, 6], []], fill=0) is None  # an empty prompt


def test_static_cache_keeps_the_dynamic_cache_for_a_config_it_cannot_read():
    class NoConfig(torch.nn.Module):
        config = object()

    sentinel = object()
    assert static_cache(NoConfig(), sentinel, max_cache_len=8) is sentinel
    assert static_cache(NoConfig(), None, max_cache_len=8) is None


def test_length_order():
    prompts = [[{"role": "user", "content": "x" * n}] for n in (5, 1, 9, 1)]
    assert length_order(prompts) == [1, 3, 0, 2]
    assert length_order([]) == []


def test_generate_in_length_order_answers_each_prompt_in_prompt_order(model64):
    model, tok = model64
    prompts = _prompts(5)
    got = generate_in_length_order(model, tok, prompts, max_new_tokens=6, batch_size=2)
    alone = [generate_responses(model, tok, [p], max_new_tokens=6).responses[0] for p in prompts]
    assert got == alone
    seeds = []
    generate_in_length_order(model, tok, prompts, max_new_tokens=2, batch_size=2, do_sample=True,
                             batch_seed=lambda k: seeds.append(k) or k)
    assert seeds == [0, 1, 2]  # one seed per batch of 2
    with pytest.raises(ValueError, match="'batch_size' must be >= 1"):
        generate_in_length_order(model, tok, prompts, max_new_tokens=2, batch_size=0)

"""Channel-3 tensors: both pair formats, the contract layout, skipping long pairs, reference log-probs."""

from __future__ import annotations

import copy

import pytest
import torch

from composer_replication.engine.replay import (
    ReferenceLogprobCache,
    add_reference_logprobs,
    build_replay_batch,
    pair_texts,
)

STATE = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Show a.py"}]
CHOSEN = '[TOOL_USE] name=Read input={"file_path": "a.py"}'
REJECTED = "I will not."
DICT_PAIR = {"state_id": "s1", "state_messages": STATE, "chosen": CHOSEN, "rejected": REJECTED,
             "n_teachers_agreeing": 2}


def normalized_pair():
    from composer_replication.replaysim.normalize import NormalizedDPOPair

    return NormalizedDPOPair(
        state_id="s1", state_messages=STATE,
        chosen_messages=[{"role": "assistant", "content": None,
                          "tool_calls": [{"function": {"name": "Read", "arguments": '{"file_path": "a.py"}'}}]}],
        rejected_messages=[{"role": "assistant", "content": REJECTED}], n_teachers_agreeing=2, metadata={},
    )


def test_pair_texts_accepts_both_formats():
    assert pair_texts(DICT_PAIR) == (STATE, CHOSEN, REJECTED)
    pytest.importorskip("composer_replication.replaysim.normalize")
    state, chosen, rejected = pair_texts(normalized_pair())
    assert state == STATE and chosen == CHOSEN and rejected == REJECTED


def test_pair_texts_errors():
    with pytest.raises(ValueError, match="empty chosen or rejected"):
        pair_texts({**DICT_PAIR, "chosen": ""})
    with pytest.raises(ValueError, match="'state_messages' must be a list"):
        pair_texts({"state_id": "x", "chosen": "a", "rejected": "b"})
    with pytest.raises(ValueError, match="must be a DPOPair dict"):
        pair_texts(42)


def test_replay_batch_layout_matches_the_contract(tokenizer):
    from composer_replication.chat_format import build_prompt_ids, build_response_ids

    batch, skipped = build_replay_batch(tokenizer, [DICT_PAIR, DICT_PAIR])
    assert skipped == 0
    prompt = build_prompt_ids(tokenizer, STATE)
    chosen = prompt + build_response_ids(tokenizer, CHOSEN)
    rejected = prompt + build_response_ids(tokenizer, REJECTED)
    assert batch["dpo_chosen_input_ids"].shape == (2, len(chosen))
    assert batch["dpo_rejected_input_ids"].shape == (2, len(rejected))
    assert batch["dpo_chosen_input_ids"][0].tolist() == chosen
    resp = batch["dpo_rejected_response_mask"][0]
    assert resp[: len(prompt)].sum() == 0 and resp[len(prompt):].all()
    assert batch["dpo_rejected_attention_mask"].all()


def test_long_pairs_are_skipped_never_truncated(tokenizer):
    long_pair = {**DICT_PAIR, "chosen": "word " * 200}
    batch, skipped = build_replay_batch(tokenizer, [long_pair, DICT_PAIR], max_seq_len=64)
    assert skipped == 1 and batch["dpo_chosen_input_ids"].shape[0] == 1
    batch, skipped = build_replay_batch(tokenizer, [long_pair], max_seq_len=64)
    assert batch == {} and skipped == 1


def test_reference_logprobs_match_a_per_row_naive_pass(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    ref = copy.deepcopy(model).eval()
    batch, _ = build_replay_batch(tok, [DICT_PAIR, {**DICT_PAIR, "rejected": "no " * 7}])
    add_reference_logprobs(batch, ref, chunk_size=16)
    for side in ("chosen", "rejected"):
        ids, resp = batch[f"dpo_{side}_input_ids"], batch[f"dpo_{side}_response_mask"]
        with torch.no_grad():
            logits = ref(input_ids=ids, attention_mask=batch[f"dpo_{side}_attention_mask"]).logits.double()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None]).squeeze(-1)  # [P, T-1]
        expected = (lp * resp[:, 1:]).sum(-1)
        got = batch[f"dpo_{side}_ref_logprobs"]
        assert got.shape == (2,) and not got.requires_grad
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-4)


def test_reference_cache_scores_each_distinct_sequence_once_whatever_its_batch(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    ref = copy.deepcopy(model).eval()
    other = {**DICT_PAIR, "rejected": "no " * 7}
    cache = ReferenceLogprobCache(ref, chunk_size=16)
    both, _ = build_replay_batch(tok, [DICT_PAIR, other])
    cache.fill(both)
    assert len(cache) == 3  # the two pairs share their chosen sequence
    expected = dict(both)
    add_reference_logprobs(expected, ref, chunk_size=16)  # one batched pass, padded
    for side in ("chosen", "rejected"):
        got = both[f"dpo_{side}_ref_logprobs"]
        assert got.shape == (2,) and got.dtype == torch.float32 and not got.requires_grad
        torch.testing.assert_close(got, expected[f"dpo_{side}_ref_logprobs"], rtol=1e-4, atol=1e-4)

    calls = []
    handle = ref.register_forward_hook(lambda *a: calls.append(1))
    alone, _ = build_replay_batch(tok, [other])  # same pair, another batch (less padding)
    cache.fill(alone)
    handle.remove()
    assert calls == [] and len(cache) == 3  # no reference pass for a sequence seen before
    for side in ("chosen", "rejected"):  # bit-identical: the value never depends on its batch
        assert torch.equal(alone[f"dpo_{side}_ref_logprobs"][0], both[f"dpo_{side}_ref_logprobs"][1])

    fresh = ReferenceLogprobCache(ref, chunk_size=16)  # a resumed run starts with an empty cache
    again, _ = build_replay_batch(tok, [other])
    fresh.fill(again)
    for side in ("chosen", "rejected"):
        assert torch.equal(again[f"dpo_{side}_ref_logprobs"][0], both[f"dpo_{side}_ref_logprobs"][1])

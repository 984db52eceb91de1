"""The batching module and the pair record: both pair forms, the contract layout, the over-length policy,
the hinted-row alignment, and the engine's channel-3 reference log-probs."""

from __future__ import annotations

import copy

import pytest
import torch

from composer_replication.batching import (
    BatchingStats,
    HintedRow,
    fit_prompt,
    hinted_batch,
    pad_rows,
    preference_batch,
    tokenize_pairs,
)
from composer_replication.engine.pairs import ReferenceLogprobCache
from composer_replication.loss import sequence_logprobs_for
from composer_replication.types import PreferencePair

STATE = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": "Show a.py"}]
CHOSEN = '[TOOL_USE] name=Read input={"file_path": "a.py"}'
REJECTED = "I will not."
DICT_PAIR = {"state_id": "s1", "state_messages": STATE, "chosen": CHOSEN, "rejected": REJECTED,
             "n_teachers_agreeing": 2}


def message_pair() -> PreferencePair:
    return PreferencePair(
        state_id="s1", state_messages=STATE,
        chosen_messages=[{"role": "assistant", "content": None,
                          "tool_calls": [{"function": {"name": "Read", "arguments": '{"file_path": "a.py"}'}}]}],
        rejected_messages=[{"role": "assistant", "content": REJECTED}], n_teachers_agreeing=2, metadata={},
    )


def build_replay_batch(tokenizer, pairs, *, max_seq_len=None, over_length="truncate_left"):
    stats = BatchingStats()
    kept = [t for t in tokenize_pairs(tokenizer, pairs, max_seq_len=max_seq_len, over_length=over_length,
                                      stats=stats) if t is not None]
    return preference_batch(kept, tokenizer.pad_token_id), stats


def add_reference_logprobs(batch, ref, *, chunk_size):  # the naive batched pass the cache must equal
    with torch.no_grad():
        for side in ("chosen", "rejected"):
            batch[f"dpo_{side}_ref_logprobs"] = sequence_logprobs_for(
                ref, batch[f"dpo_{side}_input_ids"], batch[f"dpo_{side}_response_mask"],
                batch[f"dpo_{side}_attention_mask"], chunk_size=chunk_size).float()


def test_the_pair_record_reads_both_forms_and_round_trips():
    from_dict = PreferencePair.from_mapping(DICT_PAIR)
    assert (from_dict.state_messages, from_dict.chosen, from_dict.rejected) == (STATE, CHOSEN, REJECTED)
    assert from_dict["chosen"] == CHOSEN and dict(from_dict)["rejected"] == REJECTED  # the spec's keys
    msg = message_pair()
    assert msg.chosen == CHOSEN and msg.rejected == REJECTED
    assert PreferencePair.from_mapping(msg.to_json()) == msg
    assert PreferencePair.from_mapping(from_dict.to_json()) == from_dict


def test_the_pair_record_names_what_is_wrong():
    assert PreferencePair.from_mapping({**DICT_PAIR, "chosen": ""}).chosen == ""  # representable, never trained:
    stats = BatchingStats()
    assert tokenize_pairs(None, [{**DICT_PAIR, "chosen": " "}], stats=stats) == [None]
    assert stats.skipped == {"empty_action": 1}
    with pytest.raises(ValueError, match="needs 'state_messages'"):
        PreferencePair.from_mapping({"state_id": "x", "chosen": "a", "rejected": "b"})
    with pytest.raises(ValueError, match="must be a mapping"):
        PreferencePair.from_mapping(42)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="'chosen' and 'chosen_messages' disagree"):
        PreferencePair.from_mapping({**message_pair().to_json(), "chosen": "edited by hand"})
    with pytest.raises(ValueError, match="n_teachers_agreeing must be >= 1"):
        PreferencePair.from_mapping({**DICT_PAIR, "n_teachers_agreeing": 0})


def test_replay_batch_layout_matches_the_contract(tokenizer):
    from composer_replication.chat_format import build_prompt_ids, build_response_ids

    batch, stats = build_replay_batch(tokenizer, [DICT_PAIR, message_pair()])
    assert stats.truncated == 0 and not stats.skipped
    prompt = build_prompt_ids(tokenizer, STATE)
    chosen = prompt + build_response_ids(tokenizer, CHOSEN)
    rejected = prompt + build_response_ids(tokenizer, REJECTED)
    assert batch["dpo_chosen_input_ids"].shape == (2, len(chosen))
    assert batch["dpo_rejected_input_ids"].shape == (2, len(rejected))
    assert batch["dpo_chosen_input_ids"][0].tolist() == chosen == batch["dpo_chosen_input_ids"][1].tolist()
    resp = batch["dpo_rejected_response_mask"][0]
    assert resp[: len(prompt)].sum() == 0 and resp[len(prompt):].all()
    assert batch["dpo_rejected_attention_mask"].all()


def test_over_length_policy_cuts_history_from_the_left_or_skips_with_a_reason(tokenizer):
    from composer_replication.chat_format import build_response_ids

    long_history = {**DICT_PAIR, "state_messages": [{"role": "user", "content": "context " * 200}]}
    batch, stats = build_replay_batch(tokenizer, [long_history, DICT_PAIR], max_seq_len=64)
    assert stats.truncated == 1 and batch["dpo_chosen_input_ids"].shape[0] == 2
    row = batch["dpo_chosen_input_ids"][0][batch["dpo_chosen_attention_mask"][0].bool()].tolist()
    assert len(row) <= 64 and row[-len(build_response_ids(tokenizer, CHOSEN)):] == build_response_ids(tokenizer, CHOSEN)
    batch, stats = build_replay_batch(tokenizer, [long_history, DICT_PAIR], max_seq_len=64, over_length="skip")
    assert stats.skipped == {"over_length": 1} and batch["dpo_chosen_input_ids"].shape[0] == 1
    long_response = {**DICT_PAIR, "chosen": "word " * 200}  # the response alone is over the cap: never cut
    batch, stats = build_replay_batch(tokenizer, [long_response], max_seq_len=64)
    assert batch == {} and stats.skipped == {"response_over_length": 1}
    assert stats.as_metrics() == {"batching/truncated": 0.0, "batching/skipped/response_over_length": 1.0}
    with pytest.raises(ValueError, match="over_length must be one of"):
        fit_prompt([1, 2], 1, max_seq_len=2, over_length="drop")


def test_pad_rows_both_sides_and_bad_input():
    ids, offsets = pad_rows([[1, 2, 3], [4]], 0, side="left")
    assert ids.tolist() == [[1, 2, 3], [0, 0, 4]] and offsets == [0, 2]
    ids, offsets = pad_rows([[], [5]], 9)
    assert ids.tolist() == [[9], [5]] and offsets == [0, 0]
    with pytest.raises(ValueError, match="at least one row"):
        pad_rows([], 0)
    with pytest.raises(ValueError, match="side must be"):
        pad_rows([[1]], 0, side="middle")


@pytest.mark.parametrize("side", ["left", "right"])
def test_hinted_rows_index_align_every_response_token(side):
    rows = [HintedRow((7, 8, 9, 1, 2), 3, student_row=1, student_col=4), HintedRow((5, 3), 1, 0, 2)]
    student = torch.zeros(2, 8, dtype=torch.long)
    student[1, 4:6] = torch.tensor([1, 2])
    student[0, 2] = 3
    out = hinted_batch(rows, 0, side=side)
    s_idx, t_idx = out["sdpo_student_index"], out["sdpo_teacher_index"]
    assert s_idx.shape == t_idx.shape == (3, 2)
    teacher_tokens = out["ctx_teacher_input_ids"][t_idx[:, 0], t_idx[:, 1]]
    assert torch.equal(teacher_tokens, student[s_idx[:, 0], s_idx[:, 1]])  # the same token, index for index
    assert int(out["sdpo_loss_mask"].sum()) == 3 and hinted_batch([], 0) == {}


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


def _decoder_tokens(ref):
    """A list that collects the number of tokens of every decoder call, and the hook's handle."""
    seen: list[int] = []
    handle = ref.get_decoder().register_forward_pre_hook(
        lambda _m, _a, kw: seen.append(int(kw["input_ids"].shape[1])), with_kwargs=True)
    return seen, handle


def test_reference_cache_decodes_a_prompt_once_for_every_response_to_it(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    ref = copy.deepcopy(model).eval()
    cache = ReferenceLogprobCache(ref, chunk_size=16)
    first, _ = build_replay_batch(tok, [DICT_PAIR])
    seen, handle = _decoder_tokens(ref)
    cache.fill(first)
    prompt_len = int(first["dpo_chosen_response_mask"][0].nonzero()[0])
    assert cache.num_prompts == 1 and seen[0] == prompt_len  # chosen and rejected share one prompt pass
    seen.clear()
    resampled = {**DICT_PAIR, "rejected": "no " * 7}  # a refreshed rejected side: same prompt, new response
    later, _ = build_replay_batch(tok, [resampled])
    cache.fill(later)
    handle.remove()
    rest = int(later["dpo_rejected_attention_mask"].sum()) - prompt_len
    assert seen == [rest]  # only the new response's tokens went through the decoder
    expected = dict(later)
    add_reference_logprobs(expected, ref, chunk_size=16)
    torch.testing.assert_close(later["dpo_rejected_ref_logprobs"], expected["dpo_rejected_ref_logprobs"],
                               rtol=1e-4, atol=1e-4)


def test_reference_cache_values_do_not_depend_on_the_prompt_budget(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    ref = copy.deepcopy(model).eval()
    other_state = [STATE[0], {"role": "user", "content": "Show b.py and run the tests"}]
    pairs = [DICT_PAIR, {**DICT_PAIR, "state_id": "s2", "state_messages": other_state}]
    kept = ReferenceLogprobCache(ref, chunk_size=16)
    none = ReferenceLogprobCache(ref, chunk_size=16, prompt_cache_bytes=0)
    one = ReferenceLogprobCache(ref, chunk_size=16, prompt_cache_bytes=1)
    batches = []
    for cache in (kept, none, one):
        batch, _ = build_replay_batch(tok, pairs)
        cache.fill(batch)
        batches.append(batch)
    assert (kept.num_prompts, none.num_prompts, one.num_prompts) == (2, 0, 0)
    for side in ("chosen", "rejected"):  # bit-identical: keeping a prompt's cache changes no number
        assert torch.equal(batches[0][f"dpo_{side}_ref_logprobs"], batches[1][f"dpo_{side}_ref_logprobs"])
        assert torch.equal(batches[0][f"dpo_{side}_ref_logprobs"], batches[2][f"dpo_{side}_ref_logprobs"])

    one_prompt = kept._prompts[next(iter(kept._prompts))].nbytes
    lru = ReferenceLogprobCache(ref, chunk_size=16, prompt_cache_bytes=one_prompt)
    batch, _ = build_replay_batch(tok, pairs)
    lru.fill(batch)
    assert lru.num_prompts == 1  # the least recently used prompt was dropped to stay within the budget


def test_reference_cache_rejects_a_negative_budget_and_scores_an_empty_response_zero(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    ref = copy.deepcopy(model).eval()
    with pytest.raises(ValueError, match="prompt_cache_bytes must be >= 0"):
        ReferenceLogprobCache(ref, chunk_size=16, prompt_cache_bytes=-1)
    batch, _ = build_replay_batch(tok, [DICT_PAIR])
    batch["dpo_rejected_response_mask"] = torch.zeros_like(batch["dpo_rejected_response_mask"])
    ReferenceLogprobCache(ref, chunk_size=16).fill(batch)
    assert batch["dpo_rejected_ref_logprobs"].tolist() == [0.0]


class _NoCacheDecoder(torch.nn.Module):
    """A decoder that returns no KV cache (as some remote-code models do)."""

    def __init__(self, decoder):
        super().__init__()
        self.inner = decoder

    def forward(self, **kwargs):
        out = self.inner(**kwargs)
        out.past_key_values = None
        return out


class _NoCacheLM(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.lm, self.decoder, self.config = model, _NoCacheDecoder(model.get_decoder()), model.config

    def get_decoder(self):
        return self.decoder

    def get_output_embeddings(self):
        return self.lm.get_output_embeddings()


def test_reference_cache_scores_whole_sequences_when_the_decoder_keeps_no_kv_cache(tiny_model_and_tokenizer):
    model, tok = tiny_model_and_tokenizer
    ref = _NoCacheLM(copy.deepcopy(model).eval())
    cache = ReferenceLogprobCache(ref, chunk_size=16)
    batch, _ = build_replay_batch(tok, [DICT_PAIR, {**DICT_PAIR, "rejected": "no " * 7}])
    seen: list[int] = []
    ref.decoder.register_forward_pre_hook(lambda _m, _a, kw: seen.append(int(kw["input_ids"].shape[1])),
                                          with_kwargs=True)
    cache.fill(batch)
    assert cache.num_prompts == 0 and len(cache) == 3
    assert len(seen) == 1 + 3  # one prompt pass finds no cache; then each distinct sequence whole, no prompt pass
    expected = dict(batch)
    add_reference_logprobs(expected, ref.lm, chunk_size=16)
    for side in ("chosen", "rejected"):
        torch.testing.assert_close(batch[f"dpo_{side}_ref_logprobs"], expected[f"dpo_{side}_ref_logprobs"],
                                   rtol=1e-4, atol=1e-4)

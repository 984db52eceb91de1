"""Shared-prefix decoding (losses.prefix): rows packed into their prefix tree equal the whole-row pass, with gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from composer_replication.losses import LossConfig, compose_loss
from composer_replication.losses import prefix as prefix_module
from composer_replication.losses.logprobs import hidden_states
from composer_replication.losses.prefix import pack_rows, packed_hidden_states


def _grouped_rows(vocab: int, *, prompts=(30, 22), g=3, response=(9, 6, 4), seed=0):
    """GRPO layout: ``[left pad | prompt | response | right pad]``, every prompt ending at one column."""
    gen = torch.Generator().manual_seed(seed)
    P, L = max(prompts), max(response)
    ids, att, resp = (torch.zeros(len(prompts) * g, P + L, dtype=torch.long) for _ in range(3))
    for i, plen in enumerate(prompts):
        prompt = torch.randint(0, vocab, (plen,), generator=gen)
        for k in range(g):
            row, rlen = i * g + k, response[k % len(response)]
            ids[row, P - plen:P] = prompt
            ids[row, P:P + rlen] = torch.randint(0, vocab, (rlen,), generator=gen)
            att[row, P - plen:P + rlen] = 1
            resp[row, P:P + rlen] = 1
    return ids, att, resp


def test_identical_rows_share_everything(tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    ids = torch.randint(0, model.config.vocab_size, (1, 16)).repeat(3, 1)
    att = torch.ones_like(ids)
    assert pack_rows(ids, att).tokens == 16  # one copy
    with torch.no_grad():
        torch.testing.assert_close(hidden_states(model, ids, att), hidden_states(model, ids, att, share_prefix=False))


def _nested_pairs(vocab: int, *, common=20, prompts=(30, 30, 30), responses=(10, 10), seed=0):
    """Preference layout: ``[system prompt shared by all | the pair's prompt | response]`` per row, right
    padding; rows ``2p`` and ``2p + 1`` are pair ``p``'s chosen and rejected."""
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, vocab, (common,), generator=gen)
    rows = []
    for plen in prompts:
        prompt = torch.cat([system, torch.randint(0, vocab, (plen,), generator=gen)])
        rows += [torch.cat([prompt, torch.randint(0, vocab, (r,), generator=gen)]) for r in responses]
    T = max(len(r) for r in rows)
    ids, att = torch.zeros(len(rows), T, dtype=torch.long), torch.zeros(len(rows), T, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)], att[i, : len(r)] = r, 1
    return ids, att


def _ragged_pairs(vocab: int, seed=4):
    """Right-padded pairs whose lengths differ widely: one long pair, three short ones (the default run's shape),
    so the short rows end before the long pair's prompt does."""
    return _nested_pairs(vocab, common=12, prompts=(60, 8, 10, 9), responses=(14, 5), seed=seed)


def _left_padded_group(vocab: int, seed=6):
    """Rows with the same real prompt behind different amounts of left padding (columns do not line up)."""
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (15,), generator=gen)
    ids, att = torch.zeros(3, 26, dtype=torch.long), torch.zeros(3, 26, dtype=torch.long)
    for row, (pad, resp) in enumerate([(0, 11), (3, 8), (6, 5)]):
        ids[row, pad:pad + 15 + resp] = torch.cat([prompt, torch.randint(0, vocab, (resp,), generator=gen)])
        att[row, pad:pad + 15 + resp] = 1
    return ids, att


def _layout(name: str, V: int):
    if name == "grouped":
        return _grouped_rows(V)[:2]
    if name == "nested_pairs":  # pairs of unequal prompts and responses: a system prompt, then each pair's
        return _nested_pairs(V, prompts=(30, 12, 41), responses=(9, 4))
    if name == "ragged_pairs":
        return _ragged_pairs(V)
    if name == "left_padded":
        return _left_padded_group(V)
    # a pair's chosen and rejected rows: the same prompt from column 0, right padding
    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, V, (25,), generator=gen)
    ids = torch.zeros(2, 34, dtype=torch.long)
    att = torch.zeros_like(ids)
    ids[0, :34] = torch.cat([prompt, torch.randint(0, V, (9,), generator=gen)])
    ids[1, :29] = torch.cat([prompt, torch.randint(0, V, (4,), generator=gen)])
    att[0, :34], att[1, :29] = 1, 1
    return ids, att


# cut: max_tokens = the longest row, so the tree is cut into several packed rows (as large batches are)
@pytest.mark.parametrize(("cut", "attention"), [(False, "sdpa"), (False, "eager"), (True, "sdpa"), (True, "eager")])
@pytest.mark.parametrize("layout", ["grouped", "right_padded_pairs", "nested_pairs", "ragged_pairs", "left_padded"])
def test_hidden_states_and_gradients_match_the_whole_row_pass(tiny_model_and_tokenizer, layout, cut, attention):
    model = copy.deepcopy(tiny_model_and_tokenizer[0]).double()
    ids, att = _layout(layout, model.config.vocab_size)
    decoder = model.get_decoder()
    longest = int(att.sum(-1).max())
    packed = pack_rows(ids, att, max_tokens=longest if cut else 8192, min_saving=0.0)
    assert packed is not None
    if cut:
        assert packed.input_ids.shape[0] > 1 and packed.input_ids.shape[1] <= longest
    else:
        assert packed.input_ids.shape[0] == 1 and packed.tokens < int(att.sum())  # shared tokens once, no padding
    weights = torch.randn(*ids.shape, model.config.hidden_size, dtype=torch.float64) * att[..., None]
    results = []
    for share in (False, True):
        model.zero_grad()
        # the reference is SDPA's whole-row pass (eager's turns the fully masked rows of left padding into NaN)
        model.config._attn_implementation = attention if share else "sdpa"
        h = packed_hidden_states(decoder, packed) if share else hidden_states(model, ids, att, share_prefix=False)
        (h * weights).sum().backward()
        results.append((h.detach(), [p.grad.clone() for p in model.parameters()]))
    (h0, g0), (h1, g1) = results
    m = att.bool()
    torch.testing.assert_close(h1[m], h0[m], rtol=1e-6, atol=1e-6)
    assert not h1[~m].any()  # padding: zeros, never decoded
    _assert_grads_close(g1, g0)


def test_pack_rows_holds_each_distinct_token_once():
    ids, att = _nested_pairs(50, common=20, prompts=(30, 12), responses=(10, 4))
    packed = pack_rows(ids, att)
    assert packed.tokens == 20 + (30 + 10 + 4) + (12 + 10 + 4)  # system prompt once, each pair's prompt once
    assert packed.whole_tokens == ids.numel()
    for row in range(ids.shape[0]):
        real = att[row].bool()
        path = packed.index[row, real]
        assert packed.input_ids[0, path].tolist() == ids[row, real].tolist()  # the row's tokens, in order
        assert packed.position_ids[0, path].tolist() == list(range(int(real.sum())))
        # each token reads exactly the tokens before it in its own row
        assert packed.attention[0, path[:, None], path[None, :]].equal(torch.ones(len(path), len(path)).tril().bool())
        assert int(packed.attention[0, path].sum()) == len(path) * (len(path) + 1) // 2
    assert (packed.index[~att.bool()] == packed.tokens).all()  # padding reads the zero row


def test_a_tree_over_max_tokens_is_cut_into_packed_rows_in_sorted_order():
    ids, att = _nested_pairs(50, common=20, prompts=(30, 12), responses=(10, 4))  # pairs of 64 and 46 tokens
    packed = pack_rows(ids, att, max_tokens=70, min_saving=0.0)
    assert packed.input_ids.shape == (2, 20 + 30 + 10 + 4)  # one pair per packed row, the shorter one padded
    assert packed.tokens == 2 * 64 < packed.whole_tokens
    n = packed.input_ids.shape[1]
    for row in range(ids.shape[0]):
        real = att[row].bool()
        flat = packed.index[row, real]
        assert packed.input_ids.flatten()[flat].tolist() == ids[row, real].tolist()
        assert len(set((flat // n).tolist())) == 1  # a row lives in one packed row
    short = int(packed.index[2, 0]) // n  # the packed row of the short pair (46 tokens)
    padding = packed.attention[short, 46:, :]
    assert padding.sum() == n - 46 and padding[:, 46:].diagonal().all()  # padding reads only itself
    assert pack_rows(ids, att, max_tokens=59) is None  # a row of 60 tokens fits no packed row


def test_pack_rows_shares_a_prompt_behind_different_padding():
    ids, att = _left_padded_group(50)  # no column holds the same token in every row
    assert pack_rows(ids, att).tokens == 15 + 11 + 8 + 5


def test_pack_rows_declines_and_names_bad_input():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 1000, (4, 20), generator=gen)
    assert pack_rows(ids, torch.ones_like(ids)) is None  # nothing in common, no padding
    assert pack_rows(ids[:1], torch.ones_like(ids[:1])) is None  # one row
    same = torch.arange(40).repeat(3, 1)
    assert pack_rows(same, torch.ones_like(same)).tokens == 40  # identical rows: one copy
    assert pack_rows(same, torch.ones_like(same), max_tokens=39) is None  # over the packed row's budget
    with pytest.raises(ValueError, match=r"min_saving must be in \[0, 1\)"):
        pack_rows(same, torch.ones_like(same), min_saving=-0.1)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        pack_rows(same, torch.ones_like(same), max_tokens=0)
    with pytest.raises(ValueError, match="attention_mask .* must match input_ids"):
        pack_rows(same, torch.ones(3, 39, dtype=torch.long))


def test_hidden_states_packs_only_for_attention_that_reads_a_custom_mask(tiny_model_and_tokenizer, monkeypatch):
    from types import SimpleNamespace

    import composer_replication.losses.logprobs as logprobs_module

    def decoder(impl):
        return SimpleNamespace(config=SimpleNamespace(_attn_implementation=impl))

    assert prefix_module.can_pack(decoder("sdpa")) and prefix_module.can_pack(decoder("eager"))
    assert not prefix_module.can_pack(decoder("flash_attention_2"))  # varlen kernels take no custom mask
    assert not prefix_module.can_pack(SimpleNamespace())
    model = copy.deepcopy(tiny_model_and_tokenizer[0]).double()
    ids, att = _nested_pairs(model.config.vocab_size)
    packed_calls = []
    real_packed = logprobs_module.packed_hidden_states
    monkeypatch.setattr(logprobs_module, "packed_hidden_states", lambda *a: packed_calls.append(1) or real_packed(*a))
    with torch.no_grad():
        whole = hidden_states(model, ids, att, share_prefix=False)
        hidden_states(model, ids, att)
        assert packed_calls == [1]
        monkeypatch.setattr(logprobs_module, "can_pack", lambda d: False)
        unpacked = hidden_states(model, ids, att)  # the whole-row pass instead
    assert packed_calls == [1]
    assert torch.equal(unpacked, whole)


def _assert_grads_close(got, want):
    """Equal up to float32 rounding of each tensor's scale (Llama's RMSNorm computes in float32 even in float64)."""
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(b.abs().max()) + 1e-12)


def test_compose_loss_is_the_same_with_and_without_prefix_sharing(tiny_model_and_tokenizer):
    """GRPO + DPO channels: loss values and gradients equal (float64), whichever pass decodes the rows."""
    model = copy.deepcopy(tiny_model_and_tokenizer[0]).double()
    V = model.config.vocab_size
    ids, att, resp = _grouped_rows(V)
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, V, (20,), generator=gen)
    chosen = torch.cat([prompt, torch.randint(0, V, (7,), generator=gen)])[None]
    rejected = torch.cat([prompt, torch.randint(0, V, (3,), generator=gen)])[None]
    batch = {
        "input_ids": ids, "attention_mask": att, "response_mask": resp,
        "rewards": torch.tensor([1.0, 0.0, 0.5, 0.0, 1.0, 1.0], dtype=torch.float64),
        "group_ids": torch.tensor([0, 0, 0, 1, 1, 1]),
        "dpo_chosen_input_ids": chosen, "dpo_chosen_attention_mask": torch.ones_like(chosen),
        "dpo_chosen_response_mask": torch.cat([torch.zeros(20), torch.ones(7)]).long()[None],
        "dpo_rejected_input_ids": rejected, "dpo_rejected_attention_mask": torch.ones_like(rejected),
        "dpo_rejected_response_mask": torch.cat([torch.zeros(20), torch.ones(3)]).long()[None],
        "dpo_chosen_ref_logprobs": torch.tensor([-30.0], dtype=torch.float64),
        "dpo_rejected_ref_logprobs": torch.tensor([-12.0], dtype=torch.float64),
    }
    out = []
    for share in (False, True):
        model.zero_grad()
        comps = compose_loss(model, batch, LossConfig(alpha_sdpo=0.0, beta_replay=1.0, rpo_alpha=0.5,
                                                      share_prefix=share, chunk_size=16))
        comps.total.backward()
        out.append((comps.metrics(), [p.grad.clone() for p in model.parameters()]))
    (m0, g0), (m1, g1) = out
    assert m0.keys() == m1.keys()
    for key in m0:
        assert m1[key] == pytest.approx(m0[key], rel=1e-6, abs=1e-9), key
    _assert_grads_close(g1, g0)

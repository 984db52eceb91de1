"""Shared-prefix decoding (losses.prefix): the plan, and equality with the whole-row pass, with gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from composer_replication.losses import LossConfig, compose_loss
from composer_replication.losses.logprobs import hidden_states
from composer_replication.losses.prefix import plan_prefix_split


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


def test_plan_finds_the_prompt_of_each_group():
    ids, att, _ = _grouped_rows(50, prompts=(30, 22), g=3)
    plan = plan_prefix_split(ids, att)
    assert plan is not None
    assert plan.split >= 30  # at least the prompt column (responses may begin alike by chance)
    g = plan.inverse.tolist()
    assert g[0] == g[1] == g[2] != g[3] == g[4] == g[5]  # one prefix per group
    assert plan.unique_rows[plan.inverse].tolist() == [0, 0, 0, 3, 3, 3]  # read from the group's first row
    B, T = ids.shape
    assert plan.tokens == 2 * plan.split + B * (T - plan.split) < plan.whole_tokens == B * T


def test_plan_declines_rows_with_nothing_in_common():
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 1000, (4, 20), generator=gen)
    assert plan_prefix_split(ids, torch.ones_like(ids)) is None
    assert plan_prefix_split(ids[:1], torch.ones_like(ids[:1])) is None  # one row


def test_plan_declines_a_saving_under_the_threshold():
    ids = torch.arange(40).repeat(2, 1)
    ids[1, 4:] += 100  # the rows share 4 of 40 columns: 10 % saved at best
    assert plan_prefix_split(ids, torch.ones_like(ids)) is None
    assert plan_prefix_split(ids, torch.ones_like(ids), min_saving=0.0).split == 4


def test_plan_bad_input_errors_name_the_problem():
    ids = torch.arange(40).repeat(2, 1)
    with pytest.raises(ValueError, match=r"min_saving must be in \[0, 1\)"):
        plan_prefix_split(ids, torch.ones_like(ids), min_saving=1.0)
    with pytest.raises(ValueError, match="attention_mask .* must match input_ids"):
        plan_prefix_split(ids, torch.ones(2, 39, dtype=torch.long))


def test_plan_separates_rows_that_differ_only_in_their_mask():
    ids = torch.arange(30).repeat(2, 1)
    att = torch.ones_like(ids)
    att[1, :5] = 0  # same ids, but row 1's first 5 tokens are padding: different positions
    plan = plan_prefix_split(ids, att, min_saving=0.0)
    assert plan is None  # the rows differ from column 0 on: nothing to share


def test_plan_reads_rows_in_any_order():
    ids, att, _ = _grouped_rows(50, prompts=(30, 22), g=3)
    order = torch.tensor([4, 0, 5, 2, 3, 1])
    plan = plan_prefix_split(ids[order], att[order])
    assert plan.unique_rows.numel() == 2 and plan.split >= 30
    groups = [o // 3 for o in order.tolist()]  # the group each shuffled row came from
    assert all((plan.inverse[i] == plan.inverse[j]) == (groups[i] == groups[j]) for i in range(6) for j in range(6))
    reps = plan.unique_rows[plan.inverse]
    assert all(groups[int(r)] == groups[i] for i, r in enumerate(reps))  # each row reads a row of its own group


def test_identical_rows_share_everything(tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    ids = torch.randint(0, model.config.vocab_size, (1, 16)).repeat(3, 1)
    att = torch.ones_like(ids)
    plan = plan_prefix_split(ids, att)
    assert plan.split == 16 and plan.unique_rows.tolist() == [0]
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


def test_plan_cuts_nested_prefixes_into_levels():
    ids, att = _nested_pairs(50)
    plan = plan_prefix_split(ids, att)
    assert [lv.split for lv in plan.levels] == [20] and plan.levels[0].unique_rows.tolist() == [0]
    g = plan.inverse.tolist()
    assert plan.split == 50 and g[0] == g[1] and g[2] == g[3] and g[4] == g[5] and len(set(g)) == 3  # per pair
    assert plan.tokens == 20 * 1 + 30 * 3 + 6 * 10  # < the best single cut: 3 * 50 + 6 * 10
    assert [lv.split for lv in plan.all_levels()] == [20, 50]
    single = plan_prefix_split(ids, att, level_tokens=1000)  # levels too dear: one cut
    assert single.levels == () and single.split == 50 and single.tokens == 3 * 50 + 6 * 10
    with pytest.raises(ValueError, match="level_tokens must be >= 0"):
        plan_prefix_split(ids, att, level_tokens=-1)


@pytest.mark.parametrize("layout", ["grouped", "right_padded_pairs", "nested_pairs"])
def test_hidden_states_and_gradients_match_the_whole_row_pass(tiny_model_and_tokenizer, layout):
    model = copy.deepcopy(tiny_model_and_tokenizer[0]).double()
    V = model.config.vocab_size
    if layout == "grouped":
        ids, att, _ = _grouped_rows(V)
    elif layout == "nested_pairs":  # pairs of unequal prompts and responses: three levels
        ids, att = _nested_pairs(V, prompts=(30, 12, 41), responses=(9, 4))
        assert len(plan_prefix_split(ids, att).levels) >= 1
    else:  # a pair's chosen and rejected rows: the same prompt from column 0, right padding
        gen = torch.Generator().manual_seed(3)
        prompt = torch.randint(0, V, (25,), generator=gen)
        ids = torch.zeros(2, 34, dtype=torch.long)
        att = torch.zeros_like(ids)
        ids[0, :34] = torch.cat([prompt, torch.randint(0, V, (9,), generator=gen)])
        ids[1, :29] = torch.cat([prompt, torch.randint(0, V, (4,), generator=gen)])
        att[0, :34], att[1, :29] = 1, 1
    assert plan_prefix_split(ids, att) is not None
    weights = torch.randn(*ids.shape, model.config.hidden_size, dtype=torch.float64) * att[..., None]
    results = []
    for share in (False, True):
        model.zero_grad()
        h = hidden_states(model, ids, att, share_prefix=share)
        (h * weights).sum().backward()
        results.append((h.detach(), [p.grad.clone() for p in model.parameters()]))
    (h0, g0), (h1, g1) = results
    m = att.bool()
    torch.testing.assert_close(h1[m], h0[m], rtol=1e-6, atol=1e-6)
    _assert_grads_close(g1, g0)


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

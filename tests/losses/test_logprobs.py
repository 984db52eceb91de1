"""Chunked kernels of composer_replication.losses.logprobs against naive full-logits references (float64)."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.nn.functional as F

from composer_replication.losses.logprobs import (
    chunked_cross_entropy,
    chunked_distillation_loss,
    chunked_row_logprobs,
    chunked_token_logprobs,
    decoder_of,
    hidden_states,
    output_head,
    predicted_positions,
)

N, H, V = 11, 5, 13


def _leaves(seed: int = 0, bias: bool = True, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(V, H, generator=g, dtype=dtype, requires_grad=True)
    b = torch.randn(V, generator=g, dtype=dtype, requires_grad=True) if bias else None
    y = torch.randint(0, V, (N,), generator=g)
    return h, w, b, y


def _grads(out: torch.Tensor, leaves, weights: torch.Tensor | None = None):
    loss = out if out.dim() == 0 else (out * weights).sum()
    return torch.autograd.grad(loss, [x for x in leaves if x is not None])


def _fkl(s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """Forward KL(T || S) per row, a row-wise test distillation function."""
    tl = F.log_softmax(t, -1)
    return (tl.exp() * (tl - F.log_softmax(s, -1))).sum(-1)


@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_row_logprobs_match_naive_values_and_grads(chunk, temperature):
    h, w, b, y = _leaves()
    ref = F.log_softmax(F.linear(h, w, b) / temperature, -1).gather(-1, y[:, None]).squeeze(-1)
    out = chunked_row_logprobs(h, w, y, chunk_size=chunk, temperature=temperature, bias=b)
    assert out.dtype == torch.float64 or out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-6)
    gw = torch.randn(N, dtype=torch.float64)
    for a, r in zip(_grads(out.double(), (h, w, b), gw), _grads(ref, (h, w, b), gw)):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_matches_torch(smoothing):
    h, w, b, y = _leaves(1)
    ref = F.cross_entropy(F.linear(h, w, b), y, label_smoothing=smoothing)
    out = chunked_cross_entropy(h, w, y, chunk_size=4, label_smoothing=smoothing, bias=b)
    torch.testing.assert_close(out.double(), ref, rtol=0, atol=1e-6)
    for a, r in zip(_grads(out, (h, w, b)), _grads(ref, (h, w, b))):
        torch.testing.assert_close(a.double(), r, rtol=1e-6, atol=1e-6)
    # the naive path is F.cross_entropy itself
    naive = chunked_cross_entropy(h, w, y, chunk_size=None, label_smoothing=smoothing, bias=b)
    assert torch.equal(naive, ref)


def test_cross_entropy_scales_with_upstream_grad():
    h, w, b, y = _leaves(2)
    (g1,) = torch.autograd.grad(3.0 * chunked_cross_entropy(h, w, y, chunk_size=5), [w])
    (g0,) = torch.autograd.grad(3.0 * F.cross_entropy(F.linear(h, w), y), [w])
    torch.testing.assert_close(g1.double(), g0, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("chunk", [2, 7, None])
def test_distillation_values_and_token_mean_match_naive(chunk):
    h, w, b, _ = _leaves(3)
    teacher = torch.randn(N, H, dtype=torch.float64)
    ref = _fkl(F.linear(h, w, b), F.linear(teacher, w, b).detach())
    loss, values = chunked_distillation_loss(h, teacher, w, _fkl, chunk_size=chunk, bias=b)
    torch.testing.assert_close(values.double(), ref.detach(), rtol=0, atol=1e-6)
    torch.testing.assert_close(loss.double(), ref.mean(), rtol=0, atol=1e-6)
    for a, r in zip(_grads(loss.double(), (h, w, b)), _grads(ref.mean(), (h, w, b))):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


def test_distillation_loss_fused_weighted_mean():
    h, w, b, _ = _leaves(4)
    teacher = torch.randn(N, H, dtype=torch.float64)
    weights = torch.rand(N, dtype=torch.float64) + 0.1
    d = _fkl(F.linear(h, w, b), F.linear(teacher, w, b).detach())
    ref = (d * weights).sum() / weights.sum()
    loss, values = chunked_distillation_loss(h, teacher, w, _fkl, weights=weights, chunk_size=3, bias=b)
    assert not values.requires_grad and values.shape == (N,)
    torch.testing.assert_close(loss.double(), ref, rtol=0, atol=1e-6)
    for a, r in zip(_grads(2.0 * loss, (h, w, b)), _grads(2.0 * ref, (h, w, b))):
        torch.testing.assert_close(a.double(), r, rtol=1e-6, atol=1e-6)
    naive, _ = chunked_distillation_loss(h, teacher, w, _fkl, weights=weights, chunk_size=None, bias=b)
    torch.testing.assert_close(naive, ref)


def test_no_grad_mode_builds_no_graph():
    h, w, b, y = _leaves(5)
    with torch.no_grad():
        lp = chunked_row_logprobs(h, w, y, chunk_size=3)
        ce = chunked_cross_entropy(h, w, y, chunk_size=3)
    assert not lp.requires_grad and not ce.requires_grad


def test_predicted_positions_skip_position_zero_and_padding():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1]])
    att = torch.tensor([[1, 1, 1, 0], [0, 0, 1, 1]])  # right-padded, left-padded
    rows, pos = predicted_positions(mask, att)
    assert list(zip(rows.tolist(), pos.tolist())) == [(0, 1), (0, 2), (1, 3)]


@pytest.mark.parametrize("side", ["left", "right"])
def test_token_logprobs_aligned_with_model_logits(tiny_model_and_tokenizer, side):
    model, _ = tiny_model_and_tokenizer
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 500, (2, 9), generator=g)
    att = torch.ones_like(ids)
    if side == "left":
        att[1, :3] = 0
    else:
        att[1, -3:] = 0
    w, bias = output_head(model)
    with torch.no_grad():
        hid = hidden_states(model, ids, att)
        pos_ids = (att.cumsum(-1) - 1).clamp(min=0)
        logits = model(input_ids=ids, attention_mask=att, position_ids=pos_ids).logits
        torch.testing.assert_close(F.linear(hid, w, bias), logits)
        lp = chunked_token_logprobs(hid, w, ids, chunk_size=4, attention_mask=att, bias=bias)
    full = F.log_softmax(logits.float(), -1)[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)
    valid = (att[:, 1:] * att[:, :-1]).bool()
    assert torch.all(lp[:, 0] == 0)
    torch.testing.assert_close(lp[:, 1:][valid], full[valid], rtol=0, atol=1e-5)
    assert torch.all(lp[:, 1:][~valid] == 0)


def test_gradients_reach_tied_embedding_and_decoder(tiny_model_and_tokenizer):
    model = copy.deepcopy(tiny_model_and_tokenizer[0])
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied in the tiny preset
    ids = torch.randint(3, 500, (2, 7), generator=torch.Generator().manual_seed(1))
    w, bias = output_head(model)
    lp = chunked_token_logprobs(hidden_states(model, ids), w, ids, chunk_size=3, bias=bias)
    lp.sum().backward()
    emb = model.model.embed_tokens.weight.grad
    # rows of tokens that are never inputs still get a gradient: only through the lm_head side
    unused = torch.tensor([v for v in range(600, 610) if v not in ids])
    assert emb[unused].abs().sum() > 0
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0


def test_bad_arguments_raise():
    h, w, _, y = _leaves()
    with pytest.raises(ValueError, match="chunk_size"):
        chunked_row_logprobs(h, w, y, chunk_size=0)
    with pytest.raises(ValueError, match=r"\[N, H\]"):
        chunked_row_logprobs(h, w[:, :3], y)
    with pytest.raises(ValueError, match="teacher_hidden"):
        chunked_distillation_loss(h, h[:3].detach(), w, _fkl)
    with pytest.raises(ValueError, match="label_smoothing"):
        chunked_cross_entropy(h, w, y, label_smoothing=1.0)
    with pytest.raises(ValueError, match="weights"):
        chunked_distillation_loss(h, h.detach(), w, _fkl, weights=torch.ones(3))


def test_output_head_rejects_logit_post_processing():
    fake = types.SimpleNamespace(config=types.SimpleNamespace(final_logit_softcapping=30.0))
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        output_head(fake)


def test_decoder_of_finds_the_decoder_of_each_model_shape(tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    assert decoder_of(model) is model.get_decoder() is model.model  # a Hugging Face causal LM
    bare = torch.nn.Module()
    bare.model = model.model
    assert decoder_of(bare) is model.model  # no get_decoder: its .model
    assert decoder_of(model.model) is model.model  # already a decoder


def test_fused_loss_supports_retain_graph():
    h, w, b, y = _leaves(6)
    loss = chunked_cross_entropy(h, w, y, chunk_size=4, bias=b)
    loss.backward(retain_graph=True)
    first = w.grad.clone()
    loss.backward()
    torch.testing.assert_close(w.grad, 2 * first)


def test_bfloat16_hidden_with_a_float32_head():
    """TRL's ``cast_lm_head_to_fp32``: a bf16 decoder in front of a float32 lm_head."""
    h64, w, _, y = _leaves(8, bias=False, dtype=torch.float32)
    h = h64.detach().bfloat16().requires_grad_(True)
    lp = chunked_row_logprobs(h, w, y, chunk_size=4)
    ref = F.log_softmax(F.linear(h.float(), w), -1).gather(-1, y[:, None]).squeeze(-1)
    torch.testing.assert_close(lp, ref)
    lp.sum().backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32


def test_bfloat16_inputs_use_float32_math():
    h64, w64, _, y = _leaves(7, bias=False)
    h = h64.detach().bfloat16().requires_grad_(True)
    w = w64.detach().bfloat16().requires_grad_(True)
    lp = chunked_row_logprobs(h, w, y, chunk_size=4)
    loss = chunked_cross_entropy(h, w, y, chunk_size=4)
    assert lp.dtype == torch.float32 and loss.dtype == torch.float32
    ref = F.log_softmax(F.linear(h.double(), w.double()), -1).gather(-1, y[:, None]).squeeze(-1)
    torch.testing.assert_close(lp.double(), ref, rtol=0, atol=2e-2)
    (lp.sum() + loss).backward()
    assert h.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16 and w.grad.abs().sum() > 0
